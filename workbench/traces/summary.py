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
        ``count``; ``duration_s`` (last arrival - first, s); ``rate`` (req/s, (count - 1) / duration, 0.0
        when the duration is 0); ``burstiness`` (coefficient of variation of inter-arrival times,
        std / mean: about 1 for Poisson; None with fewer than 2 gaps or a zero mean gap);
        ``prompt_tokens`` and ``output_tokens``: each ``{mean, p50, p90, p99, max}`` in tokens.

    Raises:
        TraceError: empty trace.
    """
    if not reqs:
        raise TraceError("trace is empty (no requests)")
    t = np.sort(np.array([r.arrival_s for r in reqs], dtype=np.float64))
    duration = float(t[-1] - t[0])
    gaps = np.diff(t)
    cv = None
    if len(gaps) >= 2 and gaps.mean() > 0:
        cv = float(gaps.std() / gaps.mean())
    return {
        "count": len(reqs),
        "duration_s": duration,
        "rate": (len(reqs) - 1) / duration if duration > 0 else 0.0,
        "burstiness": cv,
        "prompt_tokens": _lengths(np.array([r.prompt_tokens for r in reqs], dtype=np.float64)),
        "output_tokens": _lengths(np.array([r.output_tokens for r in reqs], dtype=np.float64)),
    }
