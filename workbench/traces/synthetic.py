"""Synthetic workloads: gamma-process arrivals and fixed, uniform, lognormal or file-drawn lengths."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from workbench.traces.azure import load_azure
from workbench.traces.burstgpt import load_burstgpt
from workbench.traces.common import (TraceError, TraceRequest, check_file, check_seed, clip, positive_int, read_header,
                                     shown)
from workbench.traces.vidur import load_vidur

LENGTH_DISTS: tuple[str, ...] = ("fixed", "uniform", "lognormal", "file")


def _length_pairs(path: str | Path) -> list[tuple[int, int]]:
    """(prompt, output) token pairs from any lengths-bearing CSV this module reads."""
    p = check_file(path)
    header = read_header(p)
    for fmt, loader in (("vidur", load_vidur), ("azure", load_azure), ("burstgpt", load_burstgpt)):
        needed = {"vidur": ("num_prefill_tokens",), "azure": ("ContextTokens",), "burstgpt": ("Request tokens",)}[fmt]
        if all(c in header for c in needed):
            return [(r.prompt_tokens, r.output_tokens) for r in loader(p)]
    raise TraceError(
        f"{p}:1: not a lengths CSV: need columns num_prefill_tokens,num_decode_tokens (or Azure/BurstGPT columns), "
        f"got {clip(','.join(header)) or 'nothing'}"
    )


def synthetic_arrivals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` arrival times (s) of a gamma renewal process, the first at 0.0.

    Inter-arrival times are Gamma(shape=burstiness, scale=1/(request_rate*burstiness)) as in
    ``vllm bench serve``: mean 1/request_rate; burstiness 1.0 is Poisson, < 1 burstier, > 1 more regular.
    ``request_rate`` = inf puts every arrival at 0.
    """
    if not (isinstance(request_rate, (int, float)) and request_rate > 0):
        raise TraceError(f"request_rate must be > 0 req/s (or inf), got {shown(request_rate)}")
    if not (isinstance(burstiness, (int, float)) and 0 < burstiness < math.inf):
        raise TraceError(f"burstiness must be a finite number > 0, got {shown(burstiness)}")
    check_seed(seed)
    if math.isinf(request_rate) or n <= 1:
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def load_synthetic(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    lengths: str = "fixed",
    input_tokens: int = 256,
    output_tokens: int = 128,
    input_range: Sequence[int] | None = None,
    output_range: Sequence[int] | None = None,
    input_sigma: float = 0.5,
    output_sigma: float = 0.5,
    input_min: int = 1,
    input_max: int | None = None,
    output_min: int = 1,
    output_max: int | None = None,
    lengths_path: str | Path | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """A synthetic workload, deterministic from ``seed``.

    Arrivals: :func:`synthetic_arrivals` (gamma process at ``request_rate`` req/s; burstiness 1.0 = Poisson).
    Lengths (tokens; prompt and output drawn independently, each >= 1):

    - ``fixed``: every request ``input_tokens`` / ``output_tokens``.
    - ``uniform``: integers uniform in ``input_range`` = [lo, hi] and ``output_range`` (inclusive).
    - ``lognormal``: arithmetic mean ``input_tokens`` / ``output_tokens`` and log-space sigma
      ``input_sigma`` / ``output_sigma``, rounded and clipped to [input_min, input_max] / [output_min, output_max].
    - ``file``: (prompt, output) pairs drawn with replacement from the lengths CSV ``lengths_path``
      (sarathi/vidur, Azure or BurstGPT columns), then clipped like lognormal.

    Raises:
        TraceError: a setting out of range, a missing setting for the chosen ``lengths``, a bad lengths file.
    """
    n = positive_int("num_requests", num_requests)
    check_seed(seed)
    if lengths not in LENGTH_DISTS:
        raise TraceError(f"lengths must be one of {', '.join(LENGTH_DISTS)}, got {shown(lengths)}")
    arrivals = synthetic_arrivals(n, request_rate, burstiness, seed)
    rng = np.random.default_rng([seed, 2])
    if lengths == "fixed":
        p_len = np.full(n, positive_int("input_tokens", input_tokens))
        o_len = np.full(n, positive_int("output_tokens", output_tokens))
    elif lengths == "uniform":
        bounds = []
        for name, rng_ in (("input_range", input_range), ("output_range", output_range)):
            if rng_ is None or len(rng_) != 2 or not (1 <= int(rng_[0]) <= int(rng_[1])):
                raise TraceError(f"lengths uniform needs {name} = [lo, hi] with 1 <= lo <= hi, got {shown(rng_)}")
            bounds.append((int(rng_[0]), int(rng_[1])))
        p_len = rng.integers(bounds[0][0], bounds[0][1] + 1, size=n)
        o_len = rng.integers(bounds[1][0], bounds[1][1] + 1, size=n)
    elif lengths == "lognormal":
        draws = []
        for name, mean, sigma in (("input", input_tokens, input_sigma), ("output", output_tokens, output_sigma)):
            if not (isinstance(mean, (int, float)) and mean > 0):
                raise TraceError(f"lengths lognormal needs {name}_tokens (the mean) > 0, got {shown(mean)}")
            if not (isinstance(sigma, (int, float)) and sigma >= 0):
                raise TraceError(f"lengths lognormal needs {name}_sigma >= 0, got {shown(sigma)}")
            mu = math.log(mean) - sigma * sigma / 2.0
            draws.append(np.rint(rng.lognormal(mu, sigma, size=n)).astype(np.int64))
        p_len, o_len = draws
    else:
        if lengths_path is None:
            raise TraceError("lengths file needs lengths_path (a CSV of prompt/output token counts)")
        pairs = np.asarray(_length_pairs(lengths_path), dtype=np.int64)
        pick = rng.integers(0, len(pairs), size=n)
        p_len, o_len = pairs[pick, 0], pairs[pick, 1]
    if lengths in ("lognormal", "file"):
        for name, lo, hi in (("input", input_min, input_max), ("output", output_min, output_max)):
            if lo is None or lo < 1 or (hi is not None and hi < lo):
                raise TraceError(f"{name}_min must be >= 1 and <= {name}_max, got {shown(lo)}, {shown(hi)}")
        p_len = np.clip(p_len, input_min, input_max)
        o_len = np.clip(o_len, output_min, output_max)
    p_len, o_len = np.maximum(p_len, 1), np.maximum(o_len, 1)
    return [TraceRequest(f"synthetic-{i}", arrivals[i], int(p_len[i]), int(o_len[i])) for i in range(n)]
