"""Tensor parallelism on this machine: one executor step at tp 1 and tp 2 on SmolLM2-135M, and the part
of it rank 0 spends in all-reduces (``TPModelExecutor.last_comm_time``, waiting for the slower rank
included) and sending the step to the worker (``last_broadcast_time``).

Steps: decode batches of 1, 8 and 32 rows at context 256, and one 512-token prefill (each row sampled).
tp 1 runs ``cores`` torch threads; tp N runs ``max(1, cores // N)`` per rank (on 2 cores: one each, and the
two ranks compete for the same cores with anything else running).

    python benchmarks/tp_step.py [--repeats 7] [--json out.json]

What-if beside the measurement: the analytic cost model's tensor-parallel step with this machine's own numbers,
``t(tp 2) = t(tp 1) + 2 x layers x t_ar(rows)``: the compute of tp 1 on 2 cores equals that of 2 ranks of half
the work on 1 core each (perfect split), plus two all-reduces of ``[rows, hidden]`` float32 per layer, each
timed bare between two gloo processes (``t_ar``, median; the analytic model's ``latency + bytes / link``, here
measured, not priced). The difference to the measured tp 2 is what the split loses beyond communication: the
uneven 6/3 query-head split (rank 0 does two thirds of the attention), one thread per rank, the worker message.

Prints a markdown table, then the same numbers as JSON (with the CPU model and torch's CPU capability).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engines import LLM, SamplingParams  # noqa: E402
from engines.core.scheduler import ScheduledSeq, SchedulerOutput  # noqa: E402

BLOCK = 16
CONTEXT = 256
DECODE_ROWS = (1, 8, 32)
PREFILL = 512


def cpu_model() -> str:
    """``lscpu``'s Model name (or the platform's processor string)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    import platform

    return platform.processor() or "unknown"


def cases() -> list[tuple[str, SchedulerOutput]]:
    """``(name, step)``: every sequence on its own blocks (ids from 0)."""
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    nb = -(-CONTEXT // BLOCK)
    out = []
    for b in DECODE_ROWS:
        seqs = [ScheduledSeq(f"d{i}", [100 + i], CONTEXT - 1, list(range(i * nb, (i + 1) * nb)), True, sp)
                for i in range(b)]
        out.append((f"decode {b} x ctx {CONTEXT}", SchedulerOutput(seqs)))
    npb = -(-PREFILL // BLOCK)
    seq = ScheduledSeq("p", [(7 * i) % 40000 + 50 for i in range(PREFILL)], 0, list(range(npb)), True, sp)
    out.append((f"prefill {PREFILL}", SchedulerOutput([seq])))
    return out


def measure(tp: int, repeats: int) -> dict[str, dict]:
    """Median step time and rank 0's communication per case at ``tp``."""
    cores = len(os.sched_getaffinity(0))
    if tp == 1:
        torch.set_num_threads(cores)
    nb = -(-CONTEXT // BLOCK)
    llm = LLM("smollm2-135m", tp=tp, dtype="float32", device="cpu",
              kv_cache_tokens=(max(DECODE_ROWS) * nb + 1) * BLOCK, max_model_len=2048)
    ex = llm.engine.executor
    res = {}
    try:
        for name, out in cases():
            steps, comm, bcast, ars = [], [], [], 0
            for i in range(repeats + 1):  # the first run warms oneDNN's primitives for these row counts
                t0 = time.perf_counter()
                ex.execute(out)
                dt = time.perf_counter() - t0
                if i:
                    steps.append(dt)
                    comm.append(getattr(ex, "last_comm_time", 0.0))
                    bcast.append(getattr(ex, "last_broadcast_time", 0.0))
                    ars = getattr(ex, "last_all_reduces", 0)
            step_ms, comm_ms = statistics.median(steps) * 1e3, statistics.median(comm) * 1e3
            res[name] = {"step_ms": round(step_ms, 2), "all_reduce_ms": round(comm_ms, 2),
                         "all_reduce_share": round(comm_ms / step_ms, 3), "all_reduces_per_step": ars,
                         "broadcast_ms": round(statistics.median(bcast) * 1e3, 3),
                         "threads_per_rank": torch.get_num_threads()}
    finally:
        llm.close()
    return res


def _allreduce_worker(rank: int, port: int, sizes: list[int], hidden: int, repeats: int, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    pg = dist.ProcessGroupGloo(store, rank, 2, __import__("datetime").timedelta(seconds=60))
    out = {}
    for rows in sizes:
        x = torch.randn(rows, hidden)
        ts = []
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            pg.allreduce([x]).wait()
            if i >= 3:
                ts.append(time.perf_counter() - t0)
        out[rows] = statistics.median(ts)
    if rank == 0:
        q.put(out)


def bare_allreduce_s(sizes: list[int], hidden: int, repeats: int = 50) -> dict[int, float]:
    """Median seconds of one gloo all-reduce of ``[rows, hidden]`` float32 between two processes, per row count."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, sizes, hidden, repeats, q)) for r in (0, 1)]
    for pr in procs:
        pr.start()
    res = q.get(timeout=300)
    for pr in procs:
        pr.join(60)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    results = {tp: measure(tp, a.repeats) for tp in (1, 2)}
    from engines.core.config import ModelConfig
    from engines.real.model_store import resolve_model

    mc = ModelConfig.from_dir(resolve_model("smollm2-135m"))
    rows_of = {name: (out.num_batched_tokens) for name, out in cases()}
    t_ar = bare_allreduce_s(sorted(set(rows_of.values())), mc.hidden_size)
    for name, r2 in results[2].items():
        ar = 2 * mc.num_hidden_layers * t_ar[rows_of[name]] * 1e3
        r2["whatif_all_reduce_ms"] = round(ar, 2)
        r2["whatif_step_ms"] = round(results[1][name]["step_ms"] + ar, 2)
    meta = {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__, "model": "smollm2-135m",
            "dtype": "float32", "repeats": a.repeats}
    print(f"CPU: {meta['cpu']} ({meta['cores']} cores, torch {meta['torch']}, capability {meta['cpu_capability']})")
    print()
    print("| step | tp 1 ms | tp 2 ms | tp 2 / tp 1 | tp 2 all-reduce ms (share) | all-reduces | broadcast ms | "
          "what-if tp 2 ms | what-if all-reduce ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in results[1]:
        r1, r2 = results[1][name], results[2][name]
        print(f"| {name} | {r1['step_ms']:.1f} | {r2['step_ms']:.1f} | {r2['step_ms'] / r1['step_ms']:.2f} | "
              f"{r2['all_reduce_ms']:.1f} ({r2['all_reduce_share']:.0%}) | {r2['all_reduces_per_step']} | "
              f"{r2['broadcast_ms']:.2f} | {r2['whatif_step_ms']:.1f} | {r2['whatif_all_reduce_ms']:.1f} |")
    payload = {"meta": meta, "tp1": results[1], "tp2": results[2]}
    print()
    print(json.dumps(payload, indent=1))
    if a.json:
        a.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
