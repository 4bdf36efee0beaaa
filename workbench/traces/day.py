"""Day-long traces from shorter ones: back-to-back copies (:func:`repeat_stream`, :func:`repeat_requests`)
or a day synthesized from a trace's statistics (:func:`synthesize_day`).

What each keeps of the source trace:

- **repeat** (N copies, copy k shifted by k x span): every request's lengths, every inter-arrival gap
  inside a copy and the order inside a copy are the recorded ones. Not kept: the gap across a seam (it
  is the source's mean gap, not a recorded one), any trend over the day (the source's hour is replayed
  N times, so there is no diurnal profile), and the uniqueness of prompts for traces that carry prompt
  token ids (ShareGPT) or prefix blocks (Mooncake): copy k's prompts are copy 0's, so a prefix cache can
  hit across copies. Length-only traces (Azure, Vidur, BurstGPT) get distinct synthesized prompts per
  copy, as their token ids are keyed by request id and copies get new ids (``<id>+r<k>``).
- **synthesized day** (``duration_s``): the source's mean arrival rate, its inter-arrival coefficient of
  variation (as the shape of a gamma renewal process) and its joint (prompt, output) length distribution
  (whole requests drawn with replacement); optionally a given ``rate_profile`` (relative rates over the
  day, e.g. 24 hourly values) on top of that mean rate. Not kept: the order of requests, the source's own
  change of rate over time (the day is stationary, or follows the given profile), correlations between
  neighbouring requests, and any recorded gap.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from workbench.traces.common import LoadStats, TraceError, TraceRequest, check_seed, shown

MAX_COPIES = 1_000_000  # a bound on ``repeat``, so a typo does not start an endless stream
SYNTH_CHUNK = 65536  # arrivals and length draws made per batch by synthesize_day (bounds its memory)


def check_copies(copies: Any) -> int:
    """``copies`` when it is an integer in [1, :data:`MAX_COPIES`].

    Raises:
        TraceError: ``repeat must be an integer in [1, 1000000], got ...``.
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= MAX_COPIES:
        raise TraceError(f"repeat must be an integer in [1, {MAX_COPIES}], got {shown(copies)}")
    return copies


def check_duration(duration_s: Any) -> float:
    """``duration_s`` (seconds) when it is a finite number > 0.

    Raises:
        TraceError: ``duration_s must be a finite number of seconds > 0, got ...``.
    """
    if isinstance(duration_s, bool) or not isinstance(duration_s, (int, float)) or not 0 < duration_s < math.inf:
        raise TraceError(f"duration_s must be a finite number of seconds > 0, got {shown(duration_s)}")
    return float(duration_s)


def repeat_span(count: int, last_arrival_s: float) -> float:
    """Seconds between the starts of two copies of a trace of ``count`` requests whose last arrives at
    ``last_arrival_s`` (the first at 0): its duration plus its mean gap, so the seam's gap is the mean gap;
    0.0 for one request or a trace without arrival times (every copy then arrives at 0)."""
    if count < 2 or last_arrival_s <= 0:
        return 0.0
    return last_arrival_s * count / (count - 1)


def _copy(r: TraceRequest, k: int, shift_s: float) -> TraceRequest:
    """Request ``r`` in copy ``k`` (k >= 1): id ``<id>+r<k>``, arrival ``shift_s`` seconds later."""
    return dataclasses.replace(r, request_id=f"{r.request_id}+r{k}", arrival_s=r.arrival_s + shift_s)


def repeat_stream(make: Callable[[LoadStats], Iterable[TraceRequest]], copies: int,
                  stats: LoadStats | None = None, reread: bool = False) -> Iterator[TraceRequest]:
    """``copies`` back-to-back copies of a trace, streamed: ``make(stats)`` yields the trace once (arrivals
    from 0, in order; e.g. ``lambda st: iter_trace("azure", path, stats=st)``). Copy k (from 0) arrives
    k x :func:`repeat_span` later and its ids end in ``+r<k>`` (copy 0 keeps the source ids). ``stats``
    gets copy 0's counts, then each further copy's added (:meth:`LoadStats.add_copy`), as if the file was
    read ``copies`` times. See the module docstring for what is kept.

    Memory: by default copy 0's requests are kept to replay the later copies (memory of one copy, the
    source; time of reading it once). ``reread`` calls ``make`` again for every copy instead: memory does
    not grow with the source either, and the file is parsed ``copies`` times.

    Raises:
        TraceError: a bad ``copies``; (``reread``) a copy with another number of requests than the first (the
            source changed while being read); any error of ``make``.
    """
    check_copies(copies)
    st = stats if stats is not None else LoadStats()
    kept: list[TraceRequest] | None = None if reread or copies == 1 else []
    n, last = 0, 0.0
    for r in make(st):
        n, last = n + 1, r.arrival_s
        if kept is not None:
            kept.append(r)
        yield r
    span = repeat_span(n, last)
    once = copy.deepcopy(st)
    for k in range(1, copies):
        sub = once if kept is not None else LoadStats()
        m = 0
        for r in (kept if kept is not None else make(sub)):
            m += 1
            yield _copy(r, k, k * span)
        if m != n:
            raise TraceError(f"{sub.path or 'trace'}: copy {k + 1} has {m} requests, copy 1 had {n} "
                             "(did the source change while it was read?)")
        st.add_copy(sub)


def repeat_requests(reqs: Sequence[TraceRequest], copies: int, stats: LoadStats | None = None) -> list[TraceRequest]:
    """:func:`repeat_stream` of a loaded trace (sorted by arrival, the first at 0): a new list of
    ``copies`` x ``len(reqs)`` requests; ``stats`` counts are multiplied by ``copies`` (:meth:`LoadStats.times`).

    Raises:
        TraceError: a bad ``copies``, an empty trace.
    """
    check_copies(copies)
    if not reqs:
        raise TraceError("trace is empty (no requests)")
    span = repeat_span(len(reqs), reqs[-1].arrival_s - reqs[0].arrival_s)
    out = list(reqs)
    for k in range(1, copies):
        out.extend(_copy(r, k, k * span) for r in reqs)
    if stats is not None:
        stats.times(copies)
    return out


def _gamma_shape(arrivals: np.ndarray) -> tuple[float, float]:
    """(rate in req/s, gamma shape = 1 / CV^2 of the gaps) of sorted arrivals (s).

    Raises:
        TraceError: fewer than 3 requests or all at the same time (no rate or CV to copy).
    """
    gaps = np.diff(arrivals)
    if len(gaps) < 2 or gaps.mean() <= 0:
        raise TraceError(f"duration_s synthesizes a day from the trace's arrival rate and gaps; the trace needs "
                         f"at least 3 requests at different times, it has {len(arrivals)} over "
                         f"{float(arrivals[-1] - arrivals[0]) if len(arrivals) else 0.0:g} s")
    cv = float(gaps.std() / gaps.mean())
    return (len(arrivals) - 1) / float(arrivals[-1] - arrivals[0]), 1.0 / max(cv, 1e-3) ** 2


def check_profile(rate_profile: Any) -> np.ndarray:
    """``rate_profile`` as relative rates with mean 1 (float64 array).

    Raises:
        TraceError: not a non-empty list of finite numbers >= 0 with a positive sum.
    """
    try:
        m = np.asarray(rate_profile, dtype=np.float64)
    except (TypeError, ValueError):
        m = np.array([np.nan])
    if (isinstance(rate_profile, (str, bytes)) or m.ndim != 1 or m.size == 0 or not np.isfinite(m).all()
            or (m < 0).any() or m.sum() <= 0):
        raise TraceError(f"rate_profile must be a list of finite relative rates >= 0, not all 0, "
                         f"got {shown(rate_profile)}")
    return m / m.mean()


def _warp(duration: float, rate_profile: Sequence[float] | None) -> Callable[[np.ndarray], np.ndarray]:
    """Operational time -> time (s): the identity, or the inverse of the profile's cumulative relative rate
    (piecewise linear over equal slices of ``duration``), so a stationary process becomes one whose rate in
    slice i is the profile's i-th value times the mean rate."""
    if rate_profile is None:
        return lambda u: u
    m = check_profile(rate_profile)
    edges = np.linspace(0.0, duration, m.size + 1)
    cum = np.concatenate(([0.0], np.cumsum(m * (duration / m.size))))
    return lambda u: np.interp(u, cum, edges)


def synthesize_day(source: Sequence[TraceRequest], duration_s: float, seed: int = 0,
                   rate_profile: Sequence[float] | None = None) -> Iterator[TraceRequest]:
    """Requests over [0, ``duration_s``) s with the source trace's statistics, deterministic from ``seed``.

    Arrivals: a gamma renewal process (first at 0) at the source's mean rate, (count - 1) / duration req/s,
    whose gap CV is the source's (gamma shape 1 / CV^2; 1 = Poisson). ``rate_profile`` (relative rates of
    equal slices of the day, e.g. 24 hourly values; scaled to mean 1, so the day's mean rate stays the
    source's) warps that process's time so slice i runs at value i x the mean rate (gaps inside a slice are
    stretched alike, so their CV stays the source's); None: stationary. Each request is a copy of a source
    request drawn uniformly with replacement (its prompt and output lengths together, and its prompt ids,
    text or prefix blocks when it has them), named ``day-<i>``. About rate x ``duration_s`` requests; drawn
    in batches of :data:`SYNTH_CHUNK`, so memory does not grow with the day. See the module docstring for
    what is not kept.

    Raises:
        TraceError: a bad ``duration_s``, ``seed`` or ``rate_profile``; a source without a rate (fewer than
            3 requests, or all at one time).
    """
    duration = check_duration(duration_s)
    check_seed(seed)
    warp = _warp(duration, rate_profile)
    arrivals = np.sort(np.array([r.arrival_s for r in source], dtype=np.float64))
    rate, shape = _gamma_shape(arrivals)
    rng = np.random.default_rng([seed, 7])
    t, i = 0.0, 0
    while True:
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=SYNTH_CHUNK)
        picks = rng.integers(0, len(source), size=SYNTH_CHUNK)
        times = t + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
        for when, pick in zip(warp(times).tolist(), picks.tolist()):
            if when >= duration:
                return
            yield dataclasses.replace(source[pick], request_id=f"day-{i}", arrival_s=when)
            i += 1
        t = float(times[-1] + gaps[-1])
