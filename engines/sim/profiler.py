"""Measure real steps over a grid of batch shapes and fit the simulator's cost model (``engines.sim.cost_model``).

Each grid point is a synthetic ``SchedulerOutput`` of the shapes the engines produce (single and
multi-prompt prefills, chunks after cached context, decode batches over rows x context, mixed
prefill + decode steps, static batches with padding rows) run through the real ``ModelExecutor``: ``repeats``
timed runs (after an untimed warm-up for steps under ``CHEAP_STEP_S``; steps of at least ``LARGE_STEP_S`` skip the
last run where their first two agree), of which the median is kept and the relative spread recorded.
The LM head is timed on its own per row count, and the engine's CPU work around the executor (scheduling,
updates) by running the real paged scheduler with a null executor.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import ScheduledSeq, SchedulerOutput, StepResult
from engines.core.static_scheduler import PAD_BLOCK
from engines.core.step_shape import StepShape
from engines.sim.cost_model import (PILOT_LARGE_TOKENS, TABLE_FEATURES, CostModel, class_mix, hat_weights,
                                    noise_table_of, relative_nnls, step_features)


@dataclass(frozen=True)
class GridStep:
    """One profiled step: ``decode_rows`` live decode rows and ``padding_rows`` static padding rows at
    context ``ctx`` (tokens), plus prefill chunks ``(tokens, cached tokens before it)``; blocks scattered over the
    pool, or each sequence's blocks consecutive (``contiguous``), or every block the KV cache's scratch block
    (``scratch``: a step that can run while requests hold the pool's blocks, as a pilot probe does).
    ``padding_ctx``: each padding row's context (0: ``ctx``)."""

    decode_rows: int = 0
    ctx: int = 0
    prefills: tuple[tuple[int, int], ...] = ()
    padding_rows: int = 0
    contiguous: bool = False
    scratch: bool = False
    padding_ctx: int = 0

    @property
    def kv_tokens(self) -> int:
        return (self.decode_rows + self.padding_rows) * self.ctx + sum(n + s for n, s in self.prefills)


def _grid(prefill_sizes, multi, cached, body_rows, ctx_rows, decode_ctx, mixed, padded,
          body_ctx: int = 64) -> list[GridStep]:
    g = [GridStep(prefills=((n, 0),)) for n in prefill_sizes]
    g += [GridStep(prefills=((n, 0),) * k) for k, n in multi]
    g += [GridStep(prefills=((n, s),)) for n, s in cached]
    g += [GridStep(r, body_ctx) for r in body_rows]  # the body's time per row count, at a short context
    g += [GridStep(r, c) for r in ctx_rows for c in decode_ctx if r * c <= 40960]  # KV read; fits the pool
    g += [GridStep(r, c, contiguous=True) for r in ctx_rows[::2] for c in decode_ctx if r * c <= 40960]
    g += [GridStep(r, c, tuple(p)) for r, c, p in mixed]
    g += [GridStep(r, c, (), p) for r, p, c in padded]
    return g


# Multi-prompt prefills reach 3,072 tokens (8 prompts of 384), the body table's last knot: a static batch of 8
# users' prompts prefills 2,300-3,400 tokens at once, and past 2,048 tokens a step costs more per token than below
# (2-core Intel Xeon: 8 prompts of 333 tokens ran 1.27-1.29x a profile whose grid ended at 2,048 and extrapolated
# its last segment, in each of three runs, while decodes of the same runs ran 1.00x)
# CPU GEMM time is jagged at small row counts (on a 2-core AVX-512 CPU a decode step of 3 rows took 67 ms,
# of 4 rows 50 ms, of 8 rows 47 ms, of 9 rows 60 ms: odd row counts take another kernel path) and smooth past
# about 20 rows, so the body is measured at every row count up to 20 and its table has a knot at each
FULL_GRID = _grid(
    prefill_sizes=(4, 8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048),
    multi=((4, 16), (8, 32), (16, 64), (4, 128), (8, 128), (3, 384), (2, 512), (4, 512), (8, 384)),
    cached=((32, 1024), (128, 512), (256, 1024), (512, 512), (64, 256), (1024, 1024)),
    body_rows=tuple(range(1, 21)) + (24, 28, 32, 40, 48, 56, 64),
    ctx_rows=(1, 2, 4, 8, 16, 32, 64),
    decode_ctx=(320, 1024),
    mixed=((8, 256, [(128, 0)]), (32, 384, [(256, 0)]), (16, 512, [(512, 0)]), (4, 128, [(896, 0)]),
           (48, 256, [(64, 0)]), (16, 256, [(256, 512)]), (24, 200, [(32, 0), (32, 0)]),
           (64, 300, [(128, 0), (64, 0)]), (2, 300, [(23, 0)]), (4, 200, [(32, 0)]), (1, 400, [(64, 0)]),
           (8, 150, [(8, 0)]), (12, 300, [(200, 0), (100, 0), (50, 0)])),
    padded=((8, 24, 256), (1, 31, 128), (32, 32, 400), (4, 4, 64), (16, 16, 160), (3, 5, 300)),
)
QUICK_GRID = _grid(
    prefill_sizes=(8, 32, 128, 512, 1024),
    multi=((4, 32), (4, 128), (4, 512), (8, 384)),  # a static batch's prefill of several long prompts
    cached=((64, 512), (256, 256)),
    body_rows=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64),
    ctx_rows=(4, 32),
    decode_ctx=(512,),
    mixed=((8, 256, [(128, 0)]), (32, 256, [(256, 0)]), (2, 300, [(23, 0)])),
    padded=((8, 24, 256), (1, 31, 128), (16, 16, 160)),  # padding ctx apart from live ctx: 3 mixes of the two
)
KNOTS = tuple(range(1, 21)) + (24, 28, 32, 40, 48, 56, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# the LM head's GEMM ([rows, hidden] x [hidden, vocab]) is jagged by row count: on a 2-core AVX-512 CPU 3 or 7
# sampled rows took 6-9 ms more than 2, 4 or 8 (a static batch of 8 rows with 3 live ones ran 64 ms, with 4 live
# ones 56 ms), so it is measured at every row count up to 20
LM_ROWS = tuple(range(1, 21)) + (24, 28, 32, 40, 48, 56, 64, 96, 128)


def median_time(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one untimed warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def grid_batch(step: GridStep, block_size: int, num_blocks: int) -> SchedulerOutput:
    """The ``SchedulerOutput`` of ``step``: every sequence on its own blocks, decode rows and prefill chunks
    sampled, padding rows on ``PAD_BLOCK`` (the executor's scratch block). Blocks are taken in a fixed shuffled
    order of the pool (seed 0), as a running engine's free queue hands them out once requests have come and
    gone: scattered KV reads cost measurably more than contiguous ones (5-10% on a decode batch of 8-32 rows,
    measured on a 2-core AVX-512 CPU). ``step.contiguous``: the pool in order (a fresh engine's first requests).
    ``step.scratch``: every block is the scratch block after the pool (id ``num_blocks``:
    ``engines.real.kv_cache.KVCache.scratch_block``, where padding rows write), so the step writes no block of the
    pool; its attention then reads one block over and over, which costs little next to the GEMMs at the pilot
    probes' short contexts."""
    import random

    sp = SamplingParams(max_tokens=1, temperature=0)
    seqs, nxt = [], 0
    order = list(range(num_blocks))
    if not step.contiguous:
        random.Random(0).shuffle(order)

    def blocks(n_tokens):
        nonlocal nxt
        nb = -(-n_tokens // block_size)
        if step.scratch:
            return [num_blocks] * nb
        ids = [order[(nxt + i) % num_blocks] for i in range(nb)]
        nxt += nb
        return ids

    for i in range(step.decode_rows):
        seqs.append(ScheduledSeq(f"d{i}", [100 + i], step.ctx - 1, blocks(step.ctx), True, sp))
    pad_ctx = step.padding_ctx or step.ctx
    for i in range(step.padding_rows):
        seqs.append(ScheduledSeq(f"pad{i}", [0], pad_ctx - 1, [PAD_BLOCK] * -(-pad_ctx // block_size), False, sp,
                                 is_padding=True))
    for j, (n, start) in enumerate(step.prefills):
        # ids in [100, 356): the time does not depend on them, and a test model's small vocabulary holds them
        seqs.append(ScheduledSeq(f"p{j}", [100 + ((j * 7 + k) % 256) for k in range(n)], start,
                                 blocks(start + n), True, sp))
    return SchedulerOutput(seqs)


def grid_step_of(shape: StepShape) -> GridStep:
    """A grid step of about ``shape``'s work, to time a recorded step's shape on the real executor again
    (``benchmarks/step_replay.py``): its live decode rows at their mean context, its padding rows at theirs, and
    its prefill tokens split as evenly as they go over its chunks, each after the mean cached context per prefill
    token; blocks consecutive where the recorded rows' were (``scattered_ctx`` 0), else scattered. A recorded
    shape keeps sums only, so the grid step has the same tokens, rows, chunks and sampled rows, and about the same
    sums of context, while ``prefill_attn`` (each chunk's n * (start + n)) comes out of the even split: a step of
    chunks of unequal length is replayed with less prefill attention work than it had."""
    rows, pads, k = shape.decode_rows, shape.padding_rows, shape.prefill_seqs
    live_ctx = shape.decode_ctx - shape.padding_ctx
    start = round(shape.prefill_ctx / shape.prefill_tokens) if shape.prefill_tokens else 0
    sizes = [shape.prefill_tokens // k + (1 if j < shape.prefill_tokens % k else 0) for j in range(k)] if k else []
    return GridStep(decode_rows=rows, ctx=max(round(live_ctx / rows), 1) if rows else 0,
                    prefills=tuple((n, start) for n in sizes if n), padding_rows=pads,
                    contiguous=rows > 0 and shape.scattered_ctx == 0,
                    padding_ctx=max(round(shape.padding_ctx / pads), 1) if pads else 0)


CHEAP_STEP_S = 0.15  # grid steps faster than this get CHEAP_REPEATS runs in all (see profile_rows)
CHEAP_REPEATS = 9
# grid steps of at least LARGE_STEP_S take a last pass only where their first two runs, each divided by the
# machine's speed at its time (the pilots'), differ by more than LARGE_AGREE of their mean: on a 2-core AMD EPYC
# (AVX-512) the full grid's 16 steps of at least 0.5 s, timed in 6 shuffled passes with pilots, landed a mean
# 1.3% (max 4.2%) from the median of all 6 by this rule against 1.5% (max 4.1%) by the median of 3 passes, with 4
# of 32 triples taking the third run; the last pass of those steps is about 24 s of the full grid's 2.5 minutes
LARGE_STEP_S = 0.5
LARGE_AGREE = 0.05
# A step of fewer than SETTLE_TOKENS tokens is timed only after a step of fewer than SETTLE_TOKENS: where the
# step just before it was larger, it first runs once untimed. In the real engines' runs on a 2-core Intel Xeon
# (AVX-512, AMX; 2026-12-08, two threads; the eight real engines of three scenarios, the two named paged pooled)
# a step of at most 8 tokens right after one of 128 or more took 1.02-1.44x the cost model (1.10x or more in 6 of
# the 7; after a small step 0.93-1.08x), one of 9-127 tokens 1.05-1.15x (0.96-1.03x); the small pilot probe read
# 1.07-1.54x its baseline after such a step (1.25x or more in 5 of 7) and 0.99-1.09x after a small one, near the
# engines' own small steps after small ones, which put every small-step drift factor of those runs 7-24% above the
# twin's own small-step speed. At one thread: 1.03-1.07x. Timed alone, the same executor's steps after a
# 1,024-token or 8 x 400-token prefill ran 1.00-1.10x: the rest comes with the engines' runs. Decodes, the steps
# that drift factors and the body table's small knots are for, mostly follow decodes in a run.
SETTLE_TOKENS = PILOT_LARGE_TOKENS


def profile_rows(executor, grid: list[GridStep], repeats: int = 3,
                 progress: Callable[[], None] | None = None, cheap_repeats: int | None = None,
                 cheap_s: float = CHEAP_STEP_S, pilot: "PilotProbe | None" = None,
                 large_s: float | None = None) -> list[tuple[dict, float, float]]:
    """Time ``executor`` on every grid step; returns ``(features, median seconds, relative spread)`` rows.

    The grid is timed in ``repeats`` passes, each over every step in its own shuffled order (seeded), one timed
    run per step and pass: a slow phase of the machine
    (its speed drifts 20-30% within minutes here) then lands on a few steps' single runs instead of on all the
    runs of a few steps, and the median across passes discards it. With ``cheap_repeats``, steps whose median
    is under ``cheap_s`` seconds (decode batches, small mixed steps: each pins one knot of the body table,
    and a median of 3 runs of a 2-core machine was off by up to 15% from one profile to the next) get
    further shuffled passes up to that many runs, for little time. ``pilot``: run between the grid's steps
    whenever it is due, as between a real run's steps (its records are the profile's pilot baseline); each
    timing is then divided by the machine's speed at its time against the mean over the passes
    (``PilotProbe.speed_at``) before the median is taken, so a step whose few runs fell in a slow or fast phase
    of the machine does not bend the fit there (the relative spread stays that of the raw timings). With
    ``large_s`` (and ``pilot``; 3 or more ``repeats``), a step whose runs so far took at least ``large_s`` seconds
    each skips the remaining passes when its first two runs, divided by the machine's speed at their times, agree
    within :data:`LARGE_AGREE` (its figure is then their mean; see :data:`LARGE_STEP_S`).

    A step of fewer than :data:`SETTLE_TOKENS` tokens run right after a step (or pilot pair) of at least that many
    first runs once untimed: it is timed as such steps mostly run in an engine, after small steps.

    A step's first run of the first pass is its warm-up (untimed; first-call allocations and GEMM primitives of
    its row bucket) only when it took under ``cheap_s``; a larger step's first run counts, since its first-call
    costs are lost in its time: on a 2-core AMD EPYC (AVX-512) the first runs of the full grid's steps of at least
    0.15 s, with no warm-up at all, took a median 0.96-0.98x (p90 1.06x) of the median of their next three runs,
    and 0.99x (p90 1.07x) after a warm-up, which cost 30 s of the full grid's 169 s
    (steps under 0.15 s: 1.02x, p90 1.17-1.23x, with or without).

    Raises:
        ValueError: the KV pool is too small for the largest grid step.
    """
    import random

    bs, nb = executor.kv.block_size, executor.kv.num_blocks
    need = max(-(-s.kv_tokens // bs) + len(s.prefills) + s.decode_rows for s in grid)
    if need > nb:
        raise ValueError(f"profile grid needs {need} KV blocks, the pool has {nb}")
    batches = [grid_batch(step, bs, nb) for step in grid]
    feats = [step_features(b.seqs) for b in batches]
    times: list[list[float]] = [[] for _ in grid]
    mids: list[list[float]] = [[] for _ in grid]  # when each timed run was halfway (perf_counter seconds)
    last_tokens = 0.0  # of the step run last (a pilot pair ends with a PILOT_LARGE_TOKENS prefill)

    def timed(i):
        nonlocal last_tokens
        if feats[i]["tokens"] < SETTLE_TOKENS <= last_tokens:  # see SETTLE_TOKENS
            executor.execute(batches[i])
        last_tokens = feats[i]["tokens"]
        t0 = time.perf_counter()
        executor.execute(batches[i])
        t1 = time.perf_counter()
        times[i].append(t1 - t0)
        mids[i].append((t0 + t1) / 2)
        if pilot is not None and pilot.due():
            pilot(time.perf_counter())
            last_tokens = PILOT_LARGE_TOKENS

    def settled(i):  # a large step whose two speed-adjusted runs agree needs no third
        if large_s is None or pilot is None or len(times[i]) < 2 or min(times[i]) < large_s:
            return False
        a, b = (t / pilot.speed_at(m, feats[i]["tokens"]) for t, m in zip(times[i][:2], mids[i][:2]))
        return abs(a - b) <= LARGE_AGREE * (a + b) / 2

    for rep in range(repeats):
        order = list(range(len(grid)))
        random.Random(rep).shuffle(order)
        for i in order:
            if rep >= 2 and settled(i):
                if progress and rep == repeats - 1:
                    progress()
                continue
            timed(i)
            if rep == 0 and times[i][0] < cheap_s:  # that run was its warm-up
                times[i].clear()
                mids[i].clear()
                timed(i)
            if progress and rep == repeats - 1:
                progress()
    cheap = [i for i, ts in enumerate(times) if statistics.median(ts) < cheap_s]
    for rep in range(repeats, cheap_repeats or 0):
        random.Random(rep).shuffle(cheap)
        for i in cheap:
            timed(i)
    rows = []
    for f, ts, ms in zip(feats, times, mids):
        cv = statistics.stdev(ts) / statistics.fmean(ts) if len(ts) > 1 else 0.0
        steady = [t / pilot.speed_at(m, f["tokens"]) for t, m in zip(ts, ms)] if pilot is not None else ts
        rows.append((f, statistics.median(steady), cv))
    return rows


def lm_head_table(model, repeats: int = 3, rows: tuple[int, ...] = LM_ROWS,
                  progress: Callable[[], None] | None = None) -> list[list[float]]:
    """``[[rows, seconds], ...]`` of the LM head (``model.compute_logits``) alone."""
    import torch

    import random

    hidden = torch.randn(max(rows), model.cfg.hidden_size, dtype=model.dtype, device=model.device)
    times: dict[int, list[float]] = {m: [] for m in rows}
    for rep in range(repeats):  # shuffled passes, as profile_rows
        order = list(rows)
        random.Random(rep).shuffle(order)
        for m in order:
            if rep == 0:
                model.compute_logits(hidden[:m])
            t0 = time.perf_counter()
            model.compute_logits(hidden[:m])
            times[m].append(time.perf_counter() - t0)
    if progress:
        progress()
    return [[m, statistics.median(times[m])] for m in rows]


class _NullExecutor:
    """An executor that computes nothing: samples token 100 for every row (the engine's overhead alone)."""

    def execute(self, out: SchedulerOutput) -> StepResult:
        sampled = {}
        for s in out.seqs:
            if s.sample and not s.is_padding:
                sampled[s.request_id] = 100
                sampled.update((c, 100) for c in s.fork_ids)
        return StepResult(sampled, 0.0)

    def release(self, request_id: str) -> None:
        pass


def engine_overhead(num_requests: int = 64, prompt_tokens: int = 48, output_tokens: int = 48) -> dict[str, float]:
    """Seconds of the engine's own work per step outside the executor (scheduling, request updates, step
    records): the real paged scheduler and ``LLMEngine`` over a null executor, ``num_requests`` requests at
    once, fitted as ``const + per_seq * num_seqs`` (least squares, both >= 0) over the run's steps."""
    import numpy as np

    from engines.core.config import SchedulerConfig
    from engines.core.kv_cache_manager import PagedKVCacheManager
    from engines.core.llm_engine import LLMEngine
    from engines.core.paged_scheduler import PagedScheduler
    from engines.core.request import Request

    kv = PagedKVCacheManager(num_requests * -(-(prompt_tokens + output_tokens) // 16) + 8, 16, enable_caching=True)
    engine = LLMEngine(PagedScheduler(SchedulerConfig(max_num_seqs=num_requests), kv), _NullExecutor())
    sp = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(Request(f"r{i}", [100 + (i * 31 + k) % 1000 for k in range(prompt_tokens)], sp,
                                   arrival_time=0.0))
    engine.run_to_completion()
    x = np.array([[1.0, s.num_seqs] for s in engine.steps if s.num_seqs])
    y = np.array([s.overhead for s in engine.steps if s.num_seqs])
    sol = relative_nnls(x, y)
    return {"const": float(sol[0]), "per_seq": float(sol[1])}


def fit_table_model(rows: list[tuple[dict, float]], lm_table: list[list[float]],
                    knots: tuple[int, ...] = KNOTS, row_buckets: dict[str, str] | None = None) -> CostModel:
    """Fit ``B``'s knot values and the linear terms (``TABLE_FEATURES``) of a table cost model on measured
    ``(features, seconds)`` rows, after subtracting the measured LM head time: relative-error NNLS.
    ``B`` has a knot at each of ``knots`` that some row's token count equals, and one at the largest token
    count (past it ``B`` extrapolates its last segment). ``row_buckets``: how the engine's GEMMs pad their
    rows (``CostModel.row_buckets``); ``B`` is fitted over the padded rows, its knots at padded row counts."""
    import numpy as np

    shell = CostModel({}, lm_table=lm_table, row_buckets=dict(row_buckets or {}))
    measured = {shell.body_rows(f["tokens"]) for f, _ in rows}
    # a knot no step measured is not fitted
    ks = sorted({shell.body_rows(k) for k in knots} & measured | {max(measured)})
    x, y = [], []
    for f, t in rows:
        x.append(hat_weights(ks, shell.body_rows(f["tokens"])) + [f.get(k, 0.0) for k in TABLE_FEATURES])
        y.append(max(t - shell.predict_lm_head(f.get("sampled", 0.0)), 0.05 * t))
    sol = relative_nnls(np.array(x), np.array(y))
    body = [[float(k), float(v)] for k, v in zip(ks, sol[: len(ks)])]
    coef = {k: float(v) for k, v in zip(TABLE_FEATURES, sol[len(ks):])}
    return CostModel(coef, body_table=body, lm_table=lm_table, row_buckets=shell.row_buckets)


def relative_errors(cm: CostModel, rows) -> list[float]:
    """Signed relative errors (predicted - measured) / measured of ``cm``'s executor time on ``rows``."""
    return [(cm.predict_exec(r[0]) - r[1]) / r[1] for r in rows if r[1] > 0]


def profile(executor, grid: list[GridStep] | None = None, repeats: int = 3, holdout_every: int = 5,
            progress: Callable[[int, int], None] | None = None) -> CostModel:
    """Measure and fit a table cost model of ``executor`` on ``grid`` (default ``FULL_GRID``).

    Every ``holdout_every``-th grid step is held out of a first fit and its error reported
    (``fit_error.holdout_*``); the returned model is refitted on every step. ``fit_error`` also has the fit's
    own errors, ``noise_cv`` the median relative spread of the repeats and ``noise_table`` the same by step size
    (``engines.sim.cost_model.noise_table_of``), ``overhead`` the engine's CPU work,
    ``probe_baseline`` the drift probes (:data:`PROBE_GRID`, timed in the grid's passes but not fitted).

    Raises:
        ValueError: the KV pool is too small for the grid.
    """
    grid = list(grid or FULL_GRID)
    probes = list(PROBE_GRID)
    total = len(grid) + len(probes) + 2
    done = 0

    def tick():
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    lm_table = lm_head_table(executor.model, repeats, progress=tick)
    # the drift probes are timed in the same shuffled passes as the grid, so that their baseline and the fit
    # see the same phases of the machine; they are not fitted. The pilot probes are run between the grid's
    # steps as between a real run's, and their baseline is the geometric mean of all those timings: the
    # machine's mean speed over the time the fit was measured (a median of 3 runs of one step was up to 25%
    # off it), which the pilots between a run's steps are set against
    pilot = PilotProbe(executor)
    rows = profile_rows(executor, grid + probes, repeats, progress=tick, cheap_repeats=CHEAP_REPEATS, pilot=pilot,
                        large_s=LARGE_STEP_S)
    rows, probe_rows = rows[:len(grid)], rows[len(grid):]
    overhead = engine_overhead()
    tick()
    held = [r for i, r in enumerate(rows) if i % holdout_every == holdout_every - 1]
    train = [r for i, r in enumerate(rows) if i % holdout_every != holdout_every - 1]
    buckets = executor.model.row_buckets() if hasattr(executor.model, "row_buckets") else {}
    held_errs = [abs(e) for e in relative_errors(fit_table_model([r[:2] for r in train], lm_table,
                                                                 row_buckets=buckets), held)]
    cm = fit_table_model([r[:2] for r in rows], lm_table, row_buckets=buckets)
    fit_errs = [abs(e) for e in relative_errors(cm, rows)]
    cm.overhead = overhead
    cm.probe_baseline = [{"probe": i, "seconds": t} for i, (_, t, _) in enumerate(probe_rows)]
    for i in PILOT_PROBES:
        ts = [r["seconds"] for r in pilot.records if r["probe"] == i]
        if ts:
            cm.probe_baseline[i] = {"probe": i, "seconds": math.exp(statistics.fmean(math.log(t) for t in ts)),
                                    "samples": len(ts)}
    cm.noise_cv = statistics.median(r[2] for r in rows)
    cm.noise_table = noise_table_of([(f["tokens"], cv) for f, _, cv in rows])
    cm.fit_error = {"fit_mean_abs_rel": statistics.fmean(fit_errs), "fit_max_abs_rel": max(fit_errs),
                    "holdout_mean_abs_rel": statistics.fmean(held_errs), "holdout_max_abs_rel": max(held_errs),
                    "n_holdout": len(held), "n_points": len(rows), "repeats": repeats,
                    "cheap_repeats": CHEAP_REPEATS, "cheap_step_s": CHEAP_STEP_S, "large_step_s": LARGE_STEP_S,
                    "large_agree": LARGE_AGREE}
    cm.fit_error["points"] = [{"features": {k: v for k, v in f.items() if v and k != "const"}, "seconds": t,
                               "spread": cv, "predicted": cm.predict_exec(f)} for f, t, cv in rows]
    return cm


# fixed probe steps timed before and after each real engine run (machine drift against the profile): decode
# batches from 1 to 48 rows, two prefills (128 and 384 tokens: the compute-bound regime, whose drift can differ
# from the decodes') and a mixed step; about 5 s on a 2-core CPU. The last two are the pilot probes
# (PILOT_PROBES), timed once each between the run's own steps too (PilotProbe); they are on the scratch block,
# so they can run while requests hold the pool's blocks.
PROBE_GRID = (GridStep(1, 64), GridStep(4, 128), GridStep(16, 256), GridStep(48, 128), GridStep(prefills=((128, 0),)),
              GridStep(8, 256, ((64, 0),)), GridStep(prefills=((384, 0),)),
              GridStep(4, 64, scratch=True), GridStep(prefills=((PILOT_LARGE_TOKENS, 0),), scratch=True))
PILOT_PROBES = (7, 8)  # indices in PROBE_GRID: a 4-row decode (a small step) and a 128-token prefill (a large one)
# seconds of the engine's own running between two pilot probes: a pair takes about 0.2 s on a 2-core CPU, so
# about a tenth of the run's wall time, which the replay clock does not count
PILOT_EVERY_S = 2.0


def speed_probe(executor, repeats: int = 3, phase: str = "") -> list[dict]:
    """Time ``PROBE_GRID`` on ``executor`` (``profile_rows``: ``repeats`` shuffled passes, medians):
    ``[{"probe": index in PROBE_GRID, "features", "seconds", "phase": phase}]``; steps the KV pool cannot hold
    are left out. Writes the pool's KV blocks: run it when no request holds any."""
    bs, nb = executor.kv.block_size, executor.kv.num_blocks
    idx = [i for i, s in enumerate(PROBE_GRID) if -(-s.kv_tokens // bs) + len(s.prefills) + s.decode_rows <= nb]
    if not idx:
        return []
    rows = profile_rows(executor, [PROBE_GRID[i] for i in idx], repeats)
    return [{"probe": i, "features": f, "seconds": t, "phase": phase} for i, (f, t, _) in zip(idx, rows)]


class PilotProbe:
    """Pilot probes: the :data:`PILOT_PROBES` steps of :data:`PROBE_GRID`, each run once and timed, between a real
    engine's own steps during a replay (``workbench.replay.replay_realtime`` stops its clock meanwhile, so the
    run's latencies do not count them). A 2-core VM's speed swings by 20-30% within a minute in phases of tens of
    seconds (measured: the same five steps timed in 15 interleaved rounds of 5 s ran 0.76-0.89x their median in
    one stretch of 40 s and 1.06-1.42x in the next, every shape moving together: correlation 0.67-0.93, on a
    2-core Intel Xeon; ``benchmarks/machine_phases.py``), so
    probes only before and after a run of 15 s can both miss the phase the run was in. :func:`profile` runs them
    between its grid steps in the same way, and their baseline is the mean over that time, so a run's pilots
    and the profile's are alike: single runs interleaved with other steps, spread over the whole time.
    ``records``: the timings, as :func:`speed_probe`'s with ``phase: "during"`` and ``at`` (seconds on the
    engine's clock)."""

    def __init__(self, executor, every_s: float = PILOT_EVERY_S) -> None:
        bs, nb = executor.kv.block_size, executor.kv.num_blocks
        self.executor, self.every_s = executor, every_s
        self.batches = [(i, grid_batch(PROBE_GRID[i], bs, nb)) for i in PILOT_PROBES]
        self.features = [step_features(b.seqs) for _, b in self.batches]
        self.records: list[dict] = []
        self._last = time.perf_counter()

    def speed_at(self, t: float, tokens: float) -> float:
        """The machine's speed at time ``t`` (the clock of the records' ``at``) against its mean over all the
        records, for a step of ``tokens`` tokens: per pilot, the geometric mean of its timings nearest before and
        after ``t`` over the geometric mean of all its timings; the small pilot's and the large one's mixed by
        drift class (``engines.sim.cost_model.class_mix``; a step of more than the large pilot's 128 tokens takes
        part of the large one's: ``pilot_elasticity``). 1 while a pilot has fewer than two timings."""
        import bisect

        f = []
        for i in PILOT_PROBES:
            rec = sorted((r["at"], math.log(r["seconds"])) for r in self.records if r["probe"] == i)
            if len(rec) < 2:
                return 1.0
            k = bisect.bisect_left([a for a, _ in rec], t)
            near = rec[max(0, k - 1):k + 1]
            f.append(math.exp(statistics.fmean(x for _, x in near) - statistics.fmean(x for _, x in rec)))
        return class_mix(tokens, f[0], f[1], elastic=True)

    def due(self) -> bool:
        """Whether ``every_s`` seconds of wall time have passed since the last pilot (or since construction)."""
        return time.perf_counter() - self._last >= self.every_s

    def __call__(self, at: float) -> None:
        """Run and time each pilot step once; ``at``: the engine's clock now (seconds). The small pilot runs
        once untimed before (:data:`SETTLE_TOKENS`: what ran before a pilot is not known here, and a run's pilots
        mostly come after its long steps, since a pilot is due after the step that crosses its interval)."""
        for (i, batch), f in zip(self.batches, self.features):
            if f["tokens"] < SETTLE_TOKENS:
                self.executor.execute(batch)
            t0 = time.perf_counter()
            self.executor.execute(batch)
            self.records.append({"probe": i, "features": f,
                                 "seconds": time.perf_counter() - t0, "phase": "during", "at": at})
        self._last = time.perf_counter()


def probe_reference(cost_model: CostModel, probe: dict) -> float:
    """The seconds a probe step took when ``cost_model`` was measured (its ``probe_baseline``), else the
    model's prediction of its executor time (a profile without a baseline, or a probe it lacks)."""
    i = probe.get("probe")
    for b in cost_model.probe_baseline:
        if i is not None and b["probe"] == i:
            return b["seconds"]
    return cost_model.predict_exec(probe["features"])


def probe_ratio(cost_model: CostModel, probes: list[dict]) -> float | None:
    """Geometric mean over probe steps of measured / reference executor seconds (:func:`probe_reference`: the
    profile's own timing of the same probe, else its prediction); None without probes."""
    import math

    pairs = [(p["seconds"], probe_reference(cost_model, p)) for p in probes]
    logs = [math.log(t / ref) for t, ref in pairs if t > 0 and ref > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def probe_ratios(cost_model: CostModel, probes: list[dict]) -> dict[str, float | None]:
    """:func:`probe_ratio` over all probe steps (``all``), over those of at most
    ``engines.sim.cost_model.SCALE_SMALL_TOKENS`` tokens (``small``: decodes of a few rows, bound by reading the
    weights from memory) and over those of at least ``SCALE_LARGE_TOKENS`` (``large``: bigger decode batches,
    mixed steps and prefills, bound by the GEMMs' arithmetic); a probe between the two counts in ``all`` only.
    A machine's drift is not one factor: a busy neighbour slows memory-bound steps, a clock change
    compute-bound ones. Each class's probes are those whose steps take its factor in full (``CostModel.scale``)."""
    from engines.sim.cost_model import SCALE_LARGE_TOKENS, SCALE_SMALL_TOKENS

    small = [p for p in probes if p["features"].get("tokens", 0) <= SCALE_SMALL_TOKENS]
    large = [p for p in probes if p["features"].get("tokens", 0) >= SCALE_LARGE_TOKENS]
    return {"all": probe_ratio(cost_model, probes), "small": probe_ratio(cost_model, small),
            "large": probe_ratio(cost_model, large)}


def gemm_probe(rows: int = 64, repeats: int = 5) -> float:
    """GFLOP/s of a ``[rows, 576] x [576, 1536]`` float32 GEMM (SmolLM2-135M's MLP shape): the machine's own
    speed, apart from the engine's."""
    import torch

    a, b = torch.randn(rows, 576), torch.randn(576, 1536)

    def run():
        for _ in range(20):
            torch.mm(a, b)

    t = median_time(run, repeats)
    return 2.0 * rows * 576 * 1536 * 20 / t / 1e9
