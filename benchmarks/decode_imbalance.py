"""Decode batches of the same total context in different orders of their rows' contexts: how evenly the
paged decode attention kernel spreads a batch over the torch threads.

A running engine lists its oldest requests first, and those have the longest contexts; a kernel that splits
the batch into consecutive ranges gives one thread most of the KV reads. Every variant below has ``--rows``
decode rows on the real model's executor (blocks in the profiler's shuffled order) and the same total
context; the steps are timed in shuffled passes and each variant's median is printed beside the uniform one's.

    python benchmarks/decode_imbalance.py [--rows 48] [--context 160] [--passes 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.core.sampling_params import SamplingParams  # noqa: E402
from engines.core.scheduler import ScheduledSeq, SchedulerOutput  # noqa: E402
from engines.real.model import LlamaModel  # noqa: E402
from engines.real.model_runner import ModelExecutor  # noqa: E402
from engines.real.model_store import resolve_model  # noqa: E402
from engines.real.cpu_features import cpu_name  # noqa: E402


def variants(rows: int, mean: int) -> dict[str, list[int]]:
    """Per-row contexts (tokens) of each variant, every one summing to about ``rows * mean``."""
    half = rows // 2
    long, short = int(mean * 1.75), int(mean * 0.25)
    rng = random.Random(1)
    raw = [rng.randint(20, 400) for _ in range(rows)]
    total = sum(raw)
    return {"uniform": [mean] * rows,
            "long first": [long] * half + [short] * (rows - half),
            "long last": [short] * (rows - half) + [long] * half,
            "alternating": [long if i % 2 == 0 else short for i in range(rows)],
            "random": [max(2, round(c * mean * rows / total)) for c in raw]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--context", type=int, default=160, help="mean context per row (tokens)")
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = LlamaModel.from_dir(resolve_model("smollm2-135m"), torch.float32, "auto")
    num_blocks, bs = 8192 // 16, 16
    ex = ModelExecutor(model, num_blocks, bs)
    sp = SamplingParams(max_tokens=1, temperature=0)
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)

    def batch(ctxs: list[int]) -> SchedulerOutput:
        seqs, nxt = [], 0
        for i, c in enumerate(ctxs):
            n = -(-c // bs)
            seqs.append(ScheduledSeq(f"d{i}", [100 + i], c - 1, [order[(nxt + j) % num_blocks] for j in range(n)],
                                     True, sp))
            nxt += n
        return SchedulerOutput(seqs)

    ctxs = variants(a.rows, a.context)
    batches = {k: batch(v) for k, v in ctxs.items()}
    for b in batches.values():
        ex.execute(b)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in batches}
    for p in range(a.passes):
        keys = list(batches)
        random.Random(p).shuffle(keys)
        for k in keys:
            t0 = time.perf_counter()
            ex.execute(batches[k])
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["uniform"])
    print(f"{cpu_name()}, {a.threads} torch threads, attention kernels {model.attention.name}, "
          f"{a.rows} decode rows, mean context {a.context}, {a.passes} passes")
    for k, ts in times.items():
        m = statistics.median(ts)
        print(f"{k:12s} total context {sum(ctxs[k]):6d}  median {1000 * m:7.1f} ms  x uniform {m / base:.3f}")


if __name__ == "__main__":
    main()
