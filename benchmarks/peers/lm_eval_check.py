"""lm-eval 0.4.13 on the same SmolLM2 weights two ways, compared: its ``hf`` model (transformers, float32,
CPU) and its ``local-completions`` model against ``workbench serve`` (float32, greedy). Two small task files
of ``tests/data/lm_eval``: a loglikelihood multiple-choice task (``acc``, ``acc_norm``) and a greedy
``generate_until`` task (``exact_match``). Prints both runs' scores, every per-request loglikelihood
difference, the ``is_greedy`` flags and the generations that differ; exits 1 when they disagree.
``tests/test_lm_eval.py`` runs the same comparison and asserts it.

    .venv/bin/python benchmarks/peers/lm_eval_check.py [--model smollm2-135m] [--out DIR]

lm-eval runs in its own venv, made once and cached (``$WORKBENCH_CACHE/venvs/lm-eval-0.4.13-<key>``, the
key hashing this interpreter's site-packages and its torch/transformers versions): a venv whose
``.pth`` file puts the project venv's site-packages on its path, so the project's torch (CPU build) and
transformers are the ones lm-eval imports, and pip installs ``lm-eval[api,hf]`` under a constraints file
pinning them at the project's versions (pip never pulls another torch; the venv is checked after the
build). Nothing loads from the Hugging Face hub (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``,
``TRANSFORMERS_OFFLINE``; the tasks read local JSON lines).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LM_EVAL_VERSION = "0.4.13"
LM_EVAL_REQUIREMENT = f"lm-eval[api,hf]=={LM_EVAL_VERSION}"
# pinned at the project's installed versions in the lm-eval venv: the numerics stack both runs share
PINNED = ("torch", "transformers", "tokenizers", "safetensors", "numpy")
TASKS_DIR = ROOT / "tests" / "data" / "lm_eval"
TASKS = ("workbench_mc", "workbench_gen")
MC_TASK, GEN_TASK = TASKS
# metric keys of lm-eval's results.json ("<metric>,<filter>")
METRICS = {MC_TASK: ("acc,none", "acc_norm,none"), GEN_TASK: ("exact_match,strip",)}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
LOGLIK_TOL = 1e-3
_DONE = ".workbench-complete"


class LmEvalError(RuntimeError):
    """lm-eval, its venv or the server failed; the message holds the command's output tail."""


def _tail(text: str, n: int = 60) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


# ---------------------------------------------------------------- the lm-eval venv

def _cache_root() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench")).expanduser()


def _project_paths() -> list[str]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return sorted(paths)


def _pins() -> dict[str, str]:
    return {name: metadata.version(name) for name in PINNED}


def venv_dir() -> Path:
    """Where the lm-eval venv for this interpreter lives: keyed by lm-eval's version, the project
    site-packages it stacks on and the pinned versions (a new torch gets a new venv)."""
    key = json.dumps([sys.version_info[:2], _project_paths(), _pins()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return _cache_root() / "venvs" / f"lm-eval-{LM_EVAL_VERSION}-{digest}"


def _python(d: Path) -> Path:
    return d / "bin" / "python"


def _check_venv(d: Path) -> dict:
    """Import torch, transformers and lm_eval in the venv; torch and transformers must be the project's
    (same files, same versions) and the venv must hold no torch of its own."""
    probe = ("import json, torch, transformers, lm_eval, importlib.metadata as m; print(json.dumps("
             "{'torch': torch.__version__, 'torch_file': torch.__file__, 'transformers': transformers.__version__,"
             " 'transformers_file': transformers.__file__, 'lm_eval': m.version('lm_eval')}))")
    p = subprocess.run([str(_python(d)), "-c", probe], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **OFFLINE_ENV})
    if p.returncode != 0:
        raise LmEvalError(f"the lm-eval venv {d} cannot import torch/transformers/lm_eval:\n{_tail(p.stderr)}")
    got = json.loads(p.stdout.strip().splitlines()[-1])
    project = tuple(_project_paths())
    problems = []
    if not got["torch_file"].startswith(project):
        problems.append(f"torch comes from {got['torch_file']}, not the project venv {project}")
    if not got["transformers_file"].startswith(project):
        problems.append(f"transformers comes from {got['transformers_file']}, not the project venv")
    if got["torch"] != metadata.version("torch"):
        problems.append(f"torch {got['torch']} != the project's {metadata.version('torch')}")
    if got["lm_eval"] != LM_EVAL_VERSION:
        problems.append(f"lm_eval {got['lm_eval']} != {LM_EVAL_VERSION}")
    own = list((d / "lib").glob("python*/site-packages/torch"))
    if own:
        problems.append(f"pip installed a torch of its own: {own[0]}")
    if problems:
        raise LmEvalError(f"the lm-eval venv {d} is wrong: " + "; ".join(problems))
    return got


def ensure_lm_eval_venv(log=print) -> tuple[Path, dict]:
    """The python of the cached lm-eval venv, built first when missing, and its build record
    (``seconds``: how long the build took, ``built_now``).

    Safe when two processes race: the build runs under an exclusive lock on ``<dir>.lock``, and the
    venv counts as there only once its completion marker is written (a half-built one is rebuilt).
    Raises :class:`LmEvalError` (with pip's output) when the build fails."""
    d = venv_dir()
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / f"{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = d / _DONE
        if marker.exists():
            return _python(d), {**json.loads(marker.read_text()), "built_now": False}
        if d.exists():
            shutil.rmtree(d)
        log(f"building the lm-eval venv {d} ({LM_EVAL_REQUIREMENT}, pinned {_pins()})")
        t0 = time.perf_counter()
        steps = []
        p = subprocess.run([sys.executable, "-m", "venv", str(d)], capture_output=True, text=True, timeout=600)
        steps.append(p)
        if p.returncode == 0:
            site = Path(sysconfig.get_path("purelib", vars={"base": str(d), "platbase": str(d)}))
            site.mkdir(parents=True, exist_ok=True)
            # the project's site-packages after the venv's own (the venv's packages win, pip sees the
            # project's as installed); addsitedir also runs the project's own .pth files
            (site / "_workbench_project.pth").write_text(
                "".join(f"import site; site.addsitedir({x!r})\n" for x in _project_paths()))
            constraints = d / "constraints.txt"
            constraints.write_text("".join(f"{k}=={v}\n" for k, v in _pins().items()))
            env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
            p = subprocess.run([str(_python(d)), "-m", "pip", "install", "-c", str(constraints),
                                LM_EVAL_REQUIREMENT], capture_output=True, text=True, timeout=1800, env=env)
            steps.append(p)
            (d / "pip-install.log").write_text(p.stdout + p.stderr)
        if p.returncode != 0:
            raise LmEvalError(f"`{' '.join(map(str, p.args))}` failed (exit {p.returncode}):\n"
                              f"{_tail(p.stdout + p.stderr)}")
        got = _check_venv(d)
        record = {"seconds": round(time.perf_counter() - t0, 1), "lm_eval": LM_EVAL_VERSION, **_pins(),
                  "torch_file": got["torch_file"]}
        marker.write_text(json.dumps(record, indent=1) + "\n")
        log(f"lm-eval venv built in {record['seconds']} s")
        return _python(d), {**record, "built_now": True}


# ---------------------------------------------------------------- tasks, server, runs

def write_tasks(dest: Path) -> Path:
    """Copy the task files of ``tests/data/lm_eval`` into ``dest`` with ``@DATA_DIR@`` filled in (the
    data files' folder, absolute); the folder to pass as ``--include_path``."""
    dest.mkdir(parents=True, exist_ok=True)
    for task in TASKS:
        text = (TASKS_DIR / f"{task}.yaml").read_text()
        (dest / f"{task}.yaml").write_text(text.replace("@DATA_DIR@", str(TASKS_DIR.resolve())))
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(model_dir: Path, name: str, log_path: Path, threads: int = 1, timeout: float = 300):
    """``workbench serve`` (float32, CPU, paged engine) in its own process group on a free port
    (``workbench.launch``); yields the base URL (``http://127.0.0.1:PORT``) once ``/health`` answers, stops the
    server afterwards. Raises ``workbench.launch.LaunchError`` (with the log's last line) when it cannot start."""
    from workbench.launch import LaunchedServer, LaunchPlan

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "workbench", "serve", "--model", str(model_dir), "--served-model-name", name,
           "--port", str(port), "--dtype", "float32", "--device", "cpu"]
    plan = LaunchPlan("workbench-serve", cmd, {"WORKBENCH_THREADS": str(threads), **OFFLINE_ENV}, url + "/health",
                      timeout, 20.0, log_path)
    with LaunchedServer(plan):
        yield url


def lm_eval_env(work: Path, threads: int = 1) -> dict[str, str]:
    return {**os.environ, **OFFLINE_ENV, "HF_DATASETS_CACHE": str(work / "hf-datasets"),
            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def hf_args(model_dir: Path) -> tuple[str, str]:
    # ``device`` goes on the command line: in model_args as well, HFLM gets it twice (a TypeError)
    return "hf", f"pretrained={model_dir},dtype=float32"


def server_args(model_dir: Path, name: str, url: str) -> tuple[str, str]:
    return "local-completions", (f"model={name},base_url={url}/v1/completions,tokenizer={model_dir},"
                                 "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,"
                                 "max_retries=1")


@dataclass
class Run:
    """One lm-eval run: its results.json and per-task samples (``--log_samples``), sorted by doc_id."""
    label: str
    results: dict
    samples: dict[str, list[dict]]
    seconds: float

    def metric(self, task: str, key: str) -> float:
        return self.results["results"][task][key]


def run_lm_eval(python: Path, label: str, model: str, model_args: str, include: Path, out: Path,
                work: Path, threads: int = 1, timeout: float = 1800) -> Run:
    """``python -m lm_eval`` on both tasks (batch size 1, CPU, ``--log_samples``) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS),
           "--include_path", str(include), "--batch_size", "1", "--device", "cpu", "--log_samples",
           "--output_path", str(out)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=lm_eval_env(work, threads),
                       cwd=str(out))
    seconds = time.perf_counter() - t0
    (out / "lm_eval.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise LmEvalError(f"lm-eval ({label}) failed (exit {p.returncode}): {' '.join(cmd)}\n"
                          f"{_tail(p.stdout + p.stderr)}")
    results_files = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    if not results_files:
        raise LmEvalError(f"lm-eval ({label}) wrote no results_*.json under {out}")
    samples = {}
    for task in TASKS:
        files = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
        if not files:
            raise LmEvalError(f"lm-eval ({label}) wrote no samples for {task} under {out}")
        rows = [json.loads(line) for line in Path(files[-1]).read_text().splitlines() if line.strip()]
        samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return Run(label, json.loads(Path(results_files[-1]).read_text()), samples, seconds)


# ---------------------------------------------------------------- comparison

@dataclass
class Comparison:
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)  # "task acc,none" -> (hf, server)
    loglik_pairs: int = 0
    max_loglik_diff: float = 0.0
    worst: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def lls(sample: dict) -> list[tuple[float, bool]]:
    """(loglikelihood, is_greedy) of each choice of a multiple-choice sample (lm-eval logs them as strings)."""
    out = []
    for resp in sample["resps"]:
        ll, greedy = resp[0]
        out.append((float(ll), str(greedy) == "True"))
    return out


def compare(hf: Run, srv: Run, tol: float = LOGLIK_TOL) -> Comparison:
    c = Comparison()
    for task, keys in METRICS.items():
        for key in keys:
            a, b = hf.metric(task, key), srv.metric(task, key)
            c.metrics[f"{task} {key}"] = (a, b)
            if a != b:
                c.problems.append(f"{task} {key}: hf {a} != server {b}")
    a_mc, b_mc = hf.samples[MC_TASK], srv.samples[MC_TASK]
    if [s["doc_id"] for s in a_mc] != [s["doc_id"] for s in b_mc]:
        c.problems.append(f"{MC_TASK}: the runs logged different documents")
    for sa, sb in zip(a_mc, b_mc):
        la, lb = lls(sa), lls(sb)
        if len(la) != len(lb):
            c.problems.append(f"{MC_TASK} doc {sa['doc_id']}: {len(la)} vs {len(lb)} choices")
            continue
        for i, ((lla, ga), (llb, gb)) in enumerate(zip(la, lb)):
            c.loglik_pairs += 1
            d = abs(lla - llb)
            where = f"{MC_TASK} doc {sa['doc_id']} choice {i} ({sa['doc']['choices'][i]!r}): hf {lla:.6f} server {llb:.6f}"
            if not c.worst or d > c.max_loglik_diff:
                c.max_loglik_diff, c.worst = d, where
            if not d <= tol:  # also catches NaN
                c.problems.append(f"{where}: |diff| {d:.2e} > {tol:g}")
            if ga != gb:
                c.problems.append(f"{where}: is_greedy hf {ga} server {gb}")
        for key in ("acc", "acc_norm"):
            if sa.get(key) != sb.get(key):
                c.problems.append(f"{MC_TASK} doc {sa['doc_id']} {key}: hf {sa.get(key)} server {sb.get(key)}")
    for sa, sb in zip(hf.samples[GEN_TASK], srv.samples[GEN_TASK]):
        if sa["resps"] != sb["resps"]:
            c.problems.append(f"{GEN_TASK} doc {sa['doc_id']}: hf generated {sa['resps'][0][0]!r}, "
                              f"server {sb['resps'][0][0]!r}")
    if len(hf.samples[GEN_TASK]) != len(srv.samples[GEN_TASK]):
        c.problems.append(f"{GEN_TASK}: {len(hf.samples[GEN_TASK])} vs {len(srv.samples[GEN_TASK])} samples")
    return c


def report(c: Comparison, hf: Run, srv: Run) -> str:
    lines = [f"{'metric':<32} {'hf':>8} {'server':>8}"]
    for k, (a, b) in c.metrics.items():
        lines.append(f"{k:<32} {a:>8.4f} {b:>8.4f}{'' if a == b else '   <- differs'}")
    lines.append(f"loglikelihoods compared: {c.loglik_pairs}, max |hf - server| = {c.max_loglik_diff:.3e}"
                 f" (tolerance {LOGLIK_TOL:g}); worst: {c.worst}")
    greedy = [sum(g for s in run.samples[MC_TASK] for g in (x[1] for x in lls(s))) for run in (hf, srv)]
    lines.append(f"is_greedy true: hf {greedy[0]}, server {greedy[1]} of {c.loglik_pairs}")
    lines.append(f"lm-eval wall time: hf {hf.seconds:.1f} s, local-completions {srv.seconds:.1f} s")
    lines.append("agree" if c.ok else f"DISAGREE ({len(c.problems)}):\n  " + "\n  ".join(c.problems[:40]))
    return "\n".join(lines)


def check(model_dir: Path, work: Path, served_name: str = "smollm2-135m", log=print,
          venv: tuple[Path, dict] | None = None) -> tuple[Comparison, Run, Run, dict]:
    """The whole comparison in ``work``: the venv (``venv``: what :func:`ensure_lm_eval_venv` returned, when
    already called), the task files, the hf run, the server and the local-completions run. Returns the
    comparison, both runs and the venv's build record."""
    python, venv = venv or ensure_lm_eval_venv(log)
    include = write_tasks(work / "tasks")
    log(f"lm-eval hf on {model_dir}")
    hf = run_lm_eval(python, "hf", *hf_args(model_dir), include, work / "out-hf", work)
    with served(model_dir, served_name, work / "serve.log") as url:
        log(f"lm-eval local-completions against {url}")
        srv = run_lm_eval(python, "local-completions", *server_args(model_dir, served_name, url), include,
                          work / "out-server", work)
    return compare(hf, srv), hf, srv, venv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model name or local Llama-family folder")
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    a = ap.parse_args(argv)
    from engines.real.model_store import resolve_model

    model_dir = resolve_model(a.model)
    with contextlib.ExitStack() as stack:
        work = a.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lm-eval-check-")))
        work.mkdir(parents=True, exist_ok=True)
        c, hf, srv, venv = check(Path(model_dir), work, log=lambda m: print(m, flush=True))
        print(f"lm-eval venv: {venv_dir()} ({'built now in ' if venv['built_now'] else 'cached, built in '}"
              f"{venv['seconds']} s)")
        print(report(c, hf, srv))
    return 0 if c.ok else 1


if __name__ == "__main__":
    sys.exit(main())
