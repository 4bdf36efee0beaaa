"""Measure real step times over a grid of batches and fit the simulator's cost model.

Each grid point is a synthetic ``SchedulerOutput`` (decode rows at a context length, a prefill chunk,
or both) run through the real ``ModelExecutor``; the median of ``repeats`` timed runs (after one
warm-up) is recorded with the step's features (``engines.cost_model.step_features``).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable

from engines.cost_model import CostModel, step_features
from engines.sampling_params import SamplingParams
from engines.scheduler import ScheduledSeq, SchedulerOutput

DEFAULT_GRID = {
    "decode": [(b, c) for b in (1, 4, 16, 32, 64) for c in (64, 256, 768)],
    "prefill": [16, 64, 256, 512, 1024],
    "mixed": [(16, 128, 256), (32, 256, 128), (8, 512, 512)],  # (decode rows, their context, prefill tokens)
}
QUICK_GRID = {
    "decode": [(b, c) for b in (1, 8, 32) for c in (64, 512)],
    "prefill": [32, 256],
    "mixed": [(8, 128, 128)],
}


def _batch(decode_rows: int, ctx: int, prefill: int, block_size: int, num_blocks: int) -> SchedulerOutput:
    sp = SamplingParams(max_tokens=1, temperature=0)
    seqs, nxt = [], 0

    def blocks(n_tokens):
        nonlocal nxt
        nb = -(-n_tokens // block_size)
        ids = [(nxt + i) % num_blocks for i in range(nb)]
        nxt += nb
        return ids

    for i in range(decode_rows):
        seqs.append(ScheduledSeq(f"d{i}", [100], ctx - 1, blocks(ctx), True, sp))
    if prefill:
        seqs.append(ScheduledSeq("p", [100 + (j % 1000) for j in range(prefill)], 0, blocks(prefill), True, sp))
    return SchedulerOutput(seqs)


def profile_steps(executor, grid: dict | None = None, repeats: int = 3,
                  progress: Callable[[int, int], None] | None = None) -> list[tuple[dict, float]]:
    """Time ``executor`` on every grid point; returns ``(features, median seconds)`` rows.

    Raises:
        ValueError: the KV pool is too small for the largest grid point.
    """
    grid = grid or DEFAULT_GRID
    bs, nb = executor.kv.block_size, executor.kv.num_blocks
    points = [(b, c, 0) for b, c in grid["decode"]] + [(0, 0, p) for p in grid["prefill"]] + list(grid["mixed"])
    need = max(-(-c // bs) * b + -(-p // bs) for b, c, p in points)
    if need > nb:
        raise ValueError(f"profile grid needs {need} KV blocks, the pool has {nb}")
    rows = []
    for i, (b, c, p) in enumerate(points):
        out = _batch(b, c, p, bs, nb)
        executor.execute(out)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            executor.execute(out)
            times.append(time.perf_counter() - t0)
        rows.append((step_features(out.seqs), statistics.median(times)))
        if progress:
            progress(i + 1, len(points))
    return rows


def fit_with_holdout(rows: list[tuple[dict, float]], holdout_frac: float = 0.25, seed: int = 0,
                     source: str = "") -> CostModel:
    """Fit on a random ``1 - holdout_frac`` of the rows, report relative error on the rest, then refit
    on all rows. ``fit_error`` holds ``holdout_mean_abs_rel``, ``holdout_max_abs_rel`` and ``n_holdout``."""
    idx = list(range(len(rows)))
    random.Random(seed).shuffle(idx)
    k = max(1, int(len(rows) * holdout_frac))
    held, train = [rows[i] for i in idx[:k]], [rows[i] for i in idx[k:]]
    model = CostModel.fit(train, source)
    errs = [abs(model.predict_features(f) - t) / t for f, t in held if t > 0]
    final = CostModel.fit(rows, source)
    final.fit_error = {"holdout_mean_abs_rel": sum(errs) / len(errs) if errs else 0.0,
                       "holdout_max_abs_rel": max(errs) if errs else 0.0, "n_holdout": len(held),
                       "n_points": len(rows)}
    return final
