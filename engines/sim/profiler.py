"""Measure real step times over a grid of batches and fit the simulator's cost model.

Each grid point is a synthetic ``SchedulerOutput`` (decode rows at a context length, a prefill chunk,
or both) run through the real ``ModelExecutor``; the median of ``repeats`` timed runs (after one
warm-up) is recorded with the step's features (``engines.sim.cost_model.step_features``).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable

from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import ScheduledSeq, SchedulerOutput
from engines.sim.cost_model import CostModel, step_features

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


def median_time(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one untimed warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _batch(decode_rows: int, ctx: int, prefill: int, block_size: int, num_blocks: int,
           prefill_start: int = 0) -> SchedulerOutput:
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
        seqs.append(ScheduledSeq("p", [100 + (j % 1000) for j in range(prefill)], prefill_start,
                                 blocks(prefill_start + prefill), True, sp))
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


BODY_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
CTX_POINTS = [(4, 512), (8, 768), (16, 512), (32, 384), (64, 256), (64, 512), (8, 1536), (16, 1024), (32, 1024)]
# (chunk tokens, cached tokens before it): later chunks of a chunked prefill, prefills after a prefix hit
PREFILL_CTX_POINTS = [(32, 1024), (64, 512), (128, 1024), (256, 256), (256, 768), (512, 1024)]


def profile_tables(executor, repeats: int = 3, progress: Callable[[int, int], None] | None = None,
                   body_tokens: list[int] | None = None, ctx_points: list[tuple[int, int]] | None = None) -> CostModel:
    """Measure the model body's time per token count (one prefill chunk, no cached context), the LM
    head's per sampled rows, then fit the seconds per decode-context token on decode batches with long
    contexts and the seconds per query x cached-key pair on prefill chunks that start after cached
    tokens (each a least-squares fit of the residual after the tables). Returns a table-based ``CostModel``; ``fit_error`` is its
    relative error on the decode batches and on mixed batches it was not fitted on."""
    import torch

    body_tokens = body_tokens or BODY_TOKENS
    ctx_points = ctx_points or CTX_POINTS
    bs, nb = executor.kv.block_size, executor.kv.num_blocks
    model = executor.model
    total = len(body_tokens) * 2 + len(ctx_points) + len(PREFILL_CTX_POINTS) + len(DEFAULT_GRID["mixed"])
    done = 0

    def tick():
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    def timed(fn):
        return median_time(fn, repeats)

    lm, body = [], []
    hidden = torch.randn(max(body_tokens), model.cfg.hidden_size, dtype=model.dtype)
    for m in body_tokens:
        lm.append([m, timed(lambda: model.compute_logits(hidden[:m]))])
        tick()
    lm_of = dict((int(a), b) for a, b in lm)
    for m in body_tokens:
        out = _batch(0, 0, m, bs, nb)
        body.append([m, max(0.0, timed(lambda: executor.execute(out)) - lm_of[1])])
        tick()
    cm = CostModel({k: 0.0 for k in ("const", "tokens", "decode_ctx", "prefill_attn", "sampled")},
                   body_table=body, lm_table=lm)
    rows = []
    for b, c in ctx_points:
        out = _batch(b, c, 0, bs, nb)
        rows.append((step_features(out.seqs), timed(lambda: executor.execute(out))))
        tick()
    num = sum((t - cm.predict_features(f)) * f["decode_ctx"] for f, t in rows)
    den = sum(f["decode_ctx"] ** 2 for f, t in rows)
    cm.coef["decode_ctx"] = max(0.0, num / den) if den else 0.0
    prows = []
    for p, start in PREFILL_CTX_POINTS:
        out = _batch(0, 0, p, bs, nb, prefill_start=start)
        prows.append((step_features(out.seqs), timed(lambda: executor.execute(out))))
        tick()
    num = sum((t - cm.predict_features(f)) * f["prefill_ctx"] for f, t in prows)
    den = sum(f["prefill_ctx"] ** 2 for f, t in prows)
    cm.coef["prefill_ctx"] = max(0.0, num / den) if den else 0.0
    rows += prows
    held = []
    for b, c, p in DEFAULT_GRID["mixed"]:
        out = _batch(b, c, p, bs, nb)
        held.append((step_features(out.seqs), timed(lambda: executor.execute(out))))
        tick()
    fit_errs = [abs(cm.predict_features(f) - t) / t for f, t in rows]
    held_errs = [abs(cm.predict_features(f) - t) / t for f, t in held]
    cm.fit_error = {"fit_mean_abs_rel": sum(fit_errs) / len(fit_errs), "holdout_mean_abs_rel": sum(held_errs) / len(held_errs),
                    "holdout_max_abs_rel": max(held_errs), "n_holdout": len(held), "n_points": total}
    return cm
