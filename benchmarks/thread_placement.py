"""Does OpenMP thread placement change the real engine's repeat-to-repeat spread? (a benchmark, not a test)

    python benchmarks/thread_placement.py [--rounds 4] [--batches 3] [--settings default,bind,bind-active]

Each round starts one fresh process per setting, in turn (A B C A B C ...: the machine's drift falls on every
setting alike). A process sets its OpenMP environment before torch loads, then times, ``--batches`` times each:

* the GEMM probe (``engines.sim.profiler.gemm_probe``: a [64, 576] x [576, 1536] float32 GEMM, GFLOP/s), the
  machine's own speed;
* one static batch and one paged run of the real SmolLM2-135M engine (8 prompts of 128 tokens, 32 output
  tokens each, ``ignore_eos``): output tokens per second.

Settings (libgomp's standard variables; torch's CPU wheels ship libgomp, and the compiled CPU kernel binds to the
same copy):

* ``default``: nothing set (threads may migrate between cores; idle threads spin a while, then sleep);
* ``bind``: ``OMP_PROC_BIND=close OMP_PLACES=cores`` (one thread per core, pinned, as vLLM's CPU backend pins
  them with ``VLLM_CPU_OMP_THREADS_BIND``);
* ``bind-active``: ``bind`` and ``OMP_WAIT_POLICY=active`` (idle threads keep spinning: no wake-up latency);
* ``passive``: ``OMP_WAIT_POLICY=passive`` (idle threads sleep at once).

Prints one JSON line per process and, per setting, each figure's mean and spread over processes
(spread = (max - min) / mean, as ``workbench run --repeat``), and the within-process spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "default": {},
    "bind": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "bind-active": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores", "OMP_WAIT_POLICY": "active"},
    "passive": {"OMP_WAIT_POLICY": "passive"},
}
OMP_VARS = ("OMP_PROC_BIND", "OMP_PLACES", "OMP_WAIT_POLICY", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def pick_settings(arg: str, known) -> list[str]:
    """The comma-separated setting names of ``arg``; exits with a one-line error naming any not in ``known``."""
    names = arg.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"error: --settings: unknown {unknown}; choose from {sorted(known)}")
    return names


def child_output(argv: list[str], extra_env: dict, what: str) -> str:
    """Run ``argv`` (this interpreter's child process) with the OpenMP variables of this process dropped and
    ``extra_env`` added; its standard output. Exits with a one-line error naming ``what`` when it fails."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS} | extra_env
    p = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=False)
    if p.returncode:
        sys.exit(f"error: {what}: child exited {p.returncode}:\n{p.stderr[-2000:]}")
    return p.stdout


def spread(xs: list[float]) -> float:
    """(max - min) / mean; 0 for fewer than two values."""
    return (max(xs) - min(xs)) / statistics.fmean(xs) if len(xs) > 1 else 0.0


def child(batches: int) -> None:
    """One process: GEMM probe and real-engine throughput, ``batches`` times each."""
    sys.path.insert(0, str(ROOT))
    import torch

    from engines.core.sampling_params import SamplingParams
    from engines.llm import LLM
    from engines.sim.profiler import gemm_probe

    prompts = [[100 + (i * 131 + k) % 40000 for k in range(128)] for i in range(8)]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    out: dict[str, list[float]] = {"gemm_gflops": [], "static_tok_s": [], "paged_tok_s": []}
    engines = {"static": LLM(engine="static", max_num_seqs=8), "paged": LLM(engine="paged", max_num_seqs=8)}
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    for _ in range(batches):
        out["gemm_gflops"].append(gemm_probe())
        for name, llm in engines.items():
            t = time.perf_counter()
            res = llm.generate(prompts, sp)
            dt = time.perf_counter() - t
            out[f"{name}_tok_s"].append(sum(len(r.token_ids) for r in res) / dt)
    print(json.dumps({"threads": torch.get_num_threads(), **out}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--settings", default="default,bind,bind-active")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.batches)
        return
    names = pick_settings(a.settings, SETTINGS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(a.rounds):
        for n in names:
            out = child_output([__file__, "--child", "--batches", str(a.batches)], SETTINGS[n],
                               f"setting {n}, round {rnd}")
            r = json.loads(out.strip().splitlines()[-1])
            runs[n].append(r)
            print(json.dumps({"round": rnd, "setting": n, **{k: [round(x, 1) for x in v] if isinstance(v, list)
                                                             else v for k, v in r.items()}}), flush=True)
    summary = {}
    for n, rs in runs.items():
        s = {}
        for key in ("gemm_gflops", "static_tok_s", "paged_tok_s"):
            per_proc = [statistics.median(r[key]) for r in rs]
            s[key] = {"mean": round(statistics.fmean(per_proc), 1), "spread_across": round(spread(per_proc), 3),
                      "spread_within_mean": round(statistics.fmean(spread(r[key]) for r in rs), 3)}
        summary[n] = s
    print(json.dumps({"summary": summary}, indent=1))


if __name__ == "__main__":
    main()
