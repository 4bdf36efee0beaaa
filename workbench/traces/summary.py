"""A trace's summary statistics (:func:`trace_stats`): count, duration, rate, burstiness, lengths."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from workbench.stats import percentiles
from workbench.traces.common import TraceError, TraceRequest


def _lengths(values: np.ndarray) -> dict[str, float]:
    """``{mean, p50, p90, p99, max}`` of a non-empty array of token lengths (tokens)."""
    return {"mean": float(values.mean()), **percentiles(values, (50, 90, 99)), "max": float(values.max())}


def trace_stats(reqs: Sequence[TraceRequest]) -> dict[str, Any]:
    """Summary of a trace.

    Returns:
        ``count``; ``duration_s`` (last arrival - first, s); ``rate`` (req/s, (count - 1) / duration);
        ``burstiness`` (coefficient of variation of inter-arrival times, std / mean: about 1 for Poisson);
        ``prompt_tokens`` and ``output_tokens``: each ``{mean, p50, p90, p99, max}`` in tokens;
        ``undefined``: figure name -> why it is None. ``rate`` is None for one request or when every
        request arrives at the same time (a trace without arrival times, such as sarathi lengths or
        ShareGPT); ``burstiness`` is None with fewer than 3 requests (2 gaps) or a zero mean gap.

    Raises:
        TraceError: empty trace.
    """
    if not reqs:
        raise TraceError("trace is empty (no requests)")
    return trace_stats_arrays(np.array([r.arrival_s for r in reqs], dtype=np.float64),
                              np.array([r.prompt_tokens for r in reqs], dtype=np.float64),
                              np.array([r.output_tokens for r in reqs], dtype=np.float64))


def trace_stats_arrays(arrivals: np.ndarray, prompt_tokens: np.ndarray, output_tokens: np.ndarray) -> dict[str, Any]:
    """:func:`trace_stats` of a trace given as three equal-length arrays: arrivals (s), prompt and output
    lengths (tokens); what a stream collects instead of the requests (24 bytes a request as float64).

    Raises:
        TraceError: empty arrays.
    """
    n = len(arrivals)
    if n == 0:
        raise TraceError("trace is empty (no requests)")
    t = np.sort(np.asarray(arrivals, dtype=np.float64))
    duration = float(t[-1] - t[0])
    gaps = np.diff(t)
    undefined: dict[str, str] = {}
    same_time = f"all {n} requests arrive at the same time; set request_rate to replay them at a rate"
    rate = None
    if n < 2:
        undefined["rate"] = "needs at least 2 requests, the trace has 1"
    elif duration <= 0:
        undefined["rate"] = same_time
    else:
        rate = (n - 1) / duration
    cv = None
    if len(gaps) < 2:
        undefined["burstiness"] = f"needs at least 3 requests (2 inter-arrival gaps), the trace has {n}"
    elif gaps.mean() <= 0:
        undefined["burstiness"] = same_time
    else:
        cv = float(gaps.std() / gaps.mean())
    return {
        "count": n,
        "duration_s": duration,
        "rate": rate,
        "burstiness": cv,
        "prompt_tokens": _lengths(np.asarray(prompt_tokens, dtype=np.float64)),
        "output_tokens": _lengths(np.asarray(output_tokens, dtype=np.float64)),
        "undefined": undefined,
    }
