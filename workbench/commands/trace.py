"""``workbench trace inspect``: a trace file's format, size, rate, burstiness and length percentiles."""

from __future__ import annotations

import json

from workbench.errors import UsageError


def guess_format(path: str) -> str:
    """The trace format a file's name suggests.

    Raises:
        UsageError: the name says nothing (then ``--format`` is needed).
    """
    p = path.lower()
    if p.endswith(".jsonl"):
        return "mooncake"
    if p.endswith(".json"):
        return "sharegpt"
    if "azure" in p:
        return "azure"
    if "burst" in p:
        return "burstgpt"
    if p.endswith(".csv"):
        return "vidur"
    raise UsageError(f"{path}: cannot tell the trace format from the name; pass --format")


def inspect(path: str, fmt: str | None = None, as_json: bool = False) -> None:
    """Print the trace's statistics (``workbench.traces.trace_stats``), as text or JSON.

    Raises:
        TraceError: the file is unreadable or a row is bad.
    """
    from workbench.traces import load_trace, trace_stats

    fmt = fmt or guess_format(path)
    reqs = load_trace(fmt, path, **({"token_ids": False} if fmt == "mooncake" else {}))
    st = trace_stats(reqs)
    st["format"] = fmt
    if as_json:
        print(json.dumps(st, indent=2))
        return
    print(f"format {fmt}, {st['count']} requests over {st['duration_s']:.1f} s: {st['rate']:.3f} req/s, "
          f"burstiness (inter-arrival CV) {st['burstiness']:.2f}")
    for k in ("prompt_tokens", "output_tokens"):
        d = st[k]
        print(f"  {k:14s} mean {d['mean']:.0f}  p50 {d['p50']:.0f}  p90 {d['p90']:.0f}  p99 {d['p99']:.0f}  max {d['max']:.0f}")
