"""Trace transforms: cut, sample, rescale arrivals and lengths (:func:`apply_transforms`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from workbench.traces.common import LoadStats, TraceError, TraceRequest, check_limit, check_seed, shown
from workbench.traces.day import repeat_requests, synthesize_day
from workbench.traces.ids import request_key, synthesize_prompt_ids
from workbench.traces.synthetic import synthetic_arrivals


def _resize_ids(r: TraceRequest, n_tokens: int, seed: int) -> tuple[list[int] | None, str | None]:
    """Token ids and text for a prompt resized to ``n_tokens``: cut keeps the prefix; growth appends ids."""
    if r.prompt_token_ids is None:
        return None, None
    if n_tokens == len(r.prompt_token_ids):
        return r.prompt_token_ids, None
    if n_tokens < len(r.prompt_token_ids):
        return r.prompt_token_ids[:n_tokens], None
    extra = synthesize_prompt_ids(n_tokens - len(r.prompt_token_ids), seed, request_key(r.request_id))
    return r.prompt_token_ids + extra, None


def _make_day(reqs: list[TraceRequest], repeat: int | None, duration_s: float | None, seed: int,
              stats: LoadStats | None, rate_profile: Sequence[float] | None = None) -> list[TraceRequest]:
    """``reqs`` (sorted, first at 0) repeated ``repeat`` times or replaced by a synthesized ``duration_s`` day."""
    if repeat is not None and duration_s is not None:
        raise TraceError("repeat and duration_s both make a day from the trace: set one of them")
    if rate_profile is not None and duration_s is None:
        raise TraceError("rate_profile shapes a synthesized day: it needs duration_s")
    if repeat is not None:
        return repeat_requests(reqs, repeat, stats)
    if duration_s is not None:
        day = list(synthesize_day(reqs, duration_s, seed, rate_profile))
        if not day:
            raise TraceError(f"duration_s={duration_s:g} s is too short for a request of the synthesized day")
        if stats is not None:
            stats.synthesized = len(day)
        return day
    return reqs


def apply_transforms(
    reqs: Sequence[TraceRequest],
    limit: int | None = None,
    sample: int | None = None,
    seed: int = 0,
    time_scale: float | None = None,
    request_rate: float | None = None,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    length_scale: float | None = None,
    burstiness: float | None = None,
    stats: LoadStats | None = None,
    output_tokens: int | None = None,
    repeat: int | None = None,
    duration_s: float | None = None,
    rate_profile: Sequence[float] | None = None,
) -> list[TraceRequest]:
    """Cut, sample and rescale a trace; returns new requests (the input is not changed).

    Applied in this order:

    1. ``limit``: keep the first N requests (by arrival).
    2. ``sample``: keep N requests drawn at random without replacement (``seed``), sorted by arrival and
       rebased so the first arrives at 0.
    3. ``repeat``: N back-to-back copies (copy k shifted by k x the trace's duration plus its mean gap,
       ids ``<id>+r<k>``; ``stats`` counts multiplied by N), or ``duration_s``: a stationary day of that many
       seconds synthesized from the trace's rate, gap CV and lengths (``seed``; ``stats.synthesized`` is
       its count), shaped by ``rate_profile`` (relative rates over equal slices of the day) when given.
       What each keeps of the trace: :mod:`workbench.traces.day`.
    4. ``time_scale``: multiply every inter-arrival time (2.0 = half the rate; 0 = all at once).
    5. ``request_rate`` (req/s): rescale arrivals so the mean rate, (count - 1) / duration, equals it.
       When the trace has no timing (all arrivals equal, e.g. ShareGPT or sarathi lengths) or ``burstiness``
       is given, arrivals are instead replaced by a gamma process at that rate (burstiness default 1.0 =
       Poisson, see :func:`synthetic_arrivals`). ``inf`` puts every arrival at 0.
    6. ``length_scale``: multiply prompt and output lengths (rounded, at least 1).
    7. ``max_input_tokens`` / ``max_output_tokens``: clip lengths.
    8. ``output_tokens``: every request's output length set to this (a fixed output length, as
       ``vllm bench serve --sharegpt-output-len``); each request it changes is counted.

    Prompt token ids follow the prompt length: cutting keeps the prefix (so shared prefixes stay shared),
    growing appends synthesized ids; ``prompt_text`` is dropped once the length changed.

    ``stats`` (the :class:`LoadStats` the loader filled) gets the requests ``limit`` and ``sample`` cut, as
    skipped, and the requests whose lengths were changed, per reason: a length that ``length_scale``
    rounded to 0 and that was raised to 1 token, a length clipped by a cap. Requests are named by id there.

    Raises:
        TraceError: a setting out of range (limit, sample, caps < 1; sample larger than the trace;
            negative time_scale; request_rate or length_scale <= 0; repeat not in [1, 1000000]; duration_s
            <= 0; both repeat and duration_s; duration_s on a trace without a rate; a bad rate_profile or
            one without duration_s), or an empty trace.
    """
    out = sorted((dataclasses.replace(r) for r in reqs), key=lambda r: r.arrival_s)
    if not out:
        raise TraceError("trace is empty (no requests)")
    check_seed(seed)
    if limit is not None:
        check_limit(limit)
        if stats is not None:
            stats.cut(f"after the first limit={limit} requests", len(out) - limit)
        out = out[:limit]
    if sample is not None:
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
            raise TraceError(f"sample must be a positive integer, got {shown(sample)}")
        if sample > len(out):
            raise TraceError(f"sample={sample} is more than the {len(out)} requests in the trace")
        pick = np.sort(np.random.default_rng([seed, 3]).choice(len(out), size=sample, replace=False))
        if stats is not None:
            stats.cut(f"not drawn by sample={sample}", len(out) - sample)
        out = [out[i] for i in pick]
    t0 = out[0].arrival_s
    for r in out:
        r.arrival_s -= t0
    out = _make_day(out, repeat, duration_s, seed, stats, rate_profile)
    if time_scale is not None:
        if not (isinstance(time_scale, (int, float)) and 0 <= time_scale < math.inf):
            raise TraceError(f"time_scale must be a finite number >= 0, got {shown(time_scale)}")
        for r in out:
            r.arrival_s *= time_scale
    if request_rate is not None:
        if not (isinstance(request_rate, (int, float)) and request_rate > 0):
            raise TraceError(f"request_rate must be > 0 req/s (or inf), got {shown(request_rate)}")
        duration = out[-1].arrival_s
        if math.isinf(request_rate):
            for r in out:
                r.arrival_s = 0.0
        elif burstiness is not None or (duration <= 0 and len(out) > 1):
            for r, t in zip(out, synthetic_arrivals(len(out), request_rate, burstiness or 1.0, seed)):
                r.arrival_s = t
        elif len(out) > 1:
            factor = (len(out) - 1) / request_rate / duration
            for r in out:
                r.arrival_s *= factor
    elif burstiness is not None:
        raise TraceError("burstiness needs request_rate (the rate of the synthetic arrival process)")
    if length_scale is not None:
        if not (isinstance(length_scale, (int, float)) and 0 < length_scale < math.inf):
            raise TraceError(f"length_scale must be a finite number > 0, got {shown(length_scale)}")
    for name, cap in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens),
                      ("output_tokens", output_tokens)):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise TraceError(f"{name} must be a positive integer, got {shown(cap)}")
    for r in out:
        p, o = r.prompt_tokens, r.output_tokens
        where = f"request {r.request_id}"
        if length_scale is not None:
            p, o = round(p * length_scale), round(o * length_scale)
            for column, n in (("prompt_tokens", p), ("output_tokens", o)):
                if n < 1 and stats is not None:
                    stats.change(f"{column} rounded to 0 by length_scale {length_scale:g}, raised to 1", where,
                                 f"{column} {getattr(r, column)} x {length_scale:g}")
            p, o = max(1, p), max(1, o)
        if max_input_tokens is not None and p > max_input_tokens:
            p = max_input_tokens
            if stats is not None:
                stats.change(f"prompt_tokens clipped to max_input_tokens {max_input_tokens}", where)
        if max_output_tokens is not None and o > max_output_tokens:
            o = max_output_tokens
            if stats is not None:
                stats.change(f"output_tokens clipped to max_output_tokens {max_output_tokens}", where)
        if output_tokens is not None and o != output_tokens:
            if stats is not None:
                stats.change(f"output_tokens set to output_tokens {output_tokens}", where, f"was {o}")
            o = output_tokens
        if p != r.prompt_tokens:
            r.prompt_token_ids, r.prompt_text = _resize_ids(r, p, seed)
        r.prompt_tokens, r.output_tokens = p, o
    return out
