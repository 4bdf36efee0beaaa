"""Statistics shared across the workbench: percentile summaries and confidence intervals of a mean.

Percentiles are ``numpy.percentile`` with linear interpolation, the definition ``vllm bench serve`` uses, so
serving metrics (``workbench.metrics``) and trace summaries (``workbench.traces.trace_stats``) agree with it
and with each other. Intervals (``workbench gate``) are two-sided Student's t intervals of a mean over
repeated runs: half-width = t quantile x sample standard deviation (n - 1) / sqrt(n).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import t


def percentiles(values: ArrayLike, ps: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """The ``ps`` percentiles of ``values``, in the unit of ``values``.

    Args:
        values: the sample (a sequence or array of numbers; not a generator).
        ps: percentiles in [0, 100].

    Returns:
        ``{"p50": .., "p90": .., "p99": ..}``: one key per percentile, ``"p"`` + the percentile as ``%g``
        writes it (``p99.9``), in the order of ``ps``; ``numpy.percentile`` with linear interpolation.

    Raises:
        ValueError: ``values`` is empty, or a percentile is outside [0, 100].
    """
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("percentiles of an empty sample")
    return {f"p{p:g}": float(x) for p, x in zip(ps, np.percentile(v, ps))}


def t_quantile(df: int, q: float = 0.975) -> float:
    """Student's t quantile ``q`` for ``df`` degrees of freedom: ``scipy.stats.t.ppf(q, df)``.

    Args:
        df: degrees of freedom (n - 1 for n samples); below 1 the result is 0.0 (one sample, no interval).
        q: the lower-tail probability, in (0, 1); 0.975 gives a two-sided 95% interval.

    Raises:
        ValueError: ``q`` outside (0, 1).
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile q must be in (0, 1), got {q!r}")
    if df < 1:
        return 0.0
    return float(t.ppf(q, df))


def t975(df: int) -> float:
    """Student's t quantile at 0.975 (two-sided 95%) for ``df`` degrees of freedom (see :func:`t_quantile`)."""
    return t_quantile(df, 0.975)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of the two-sided ``confidence`` interval of the mean of ``values``.

    Half-width = :func:`t_quantile` (n - 1 degrees of freedom, at (1 + confidence) / 2) x the sample
    standard deviation (n - 1 denominator) / sqrt(n); 0.0 for a single value. Both are in the unit of
    ``values``; an infinite value among several gives an infinite mean and a NaN half-width.

    Raises:
        ValueError: ``values`` is empty, or ``confidence`` is outside (0, 1).
    """
    n = len(values)
    if n == 0:
        raise ValueError("interval of an empty sample")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    m = sum(values) / n
    if n < 2:
        return m, 0.0
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    return m, t_quantile(n - 1, (1.0 + confidence) / 2.0) * s / math.sqrt(n)


__all__ = ["mean_interval", "percentiles", "t975", "t_quantile"]
