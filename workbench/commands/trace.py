"""``workbench trace inspect``: a trace file's format, size, rate, burstiness, length percentiles and what
loading it skipped, changed or re-ordered."""

from __future__ import annotations

import json
from pathlib import Path

from workbench.errors import UsageError


def _jsonl_keys(path: str) -> set[str]:
    """The keys of the first non-blank line of a JSON-lines file (empty when unreadable: the loader says why)."""
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    obj = json.loads(line)
                    return set(obj) if isinstance(obj, dict) else set()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass
    return set()


def guess_format(path: str) -> str:
    """The trace format a file's name (for ``.jsonl``, its first line) suggests.

    A ``.jsonl`` file whose first object has ``StartTimeOffset`` is ``apex``, any other ``mooncake``.

    Raises:
        UsageError: the name says nothing (then ``--format`` is needed).
    """
    p = path.lower()
    if p.endswith(".jsonl"):
        from workbench.traces.apex import ARRIVAL_KEY

        return "apex" if ARRIVAL_KEY in _jsonl_keys(path) else "mooncake"
    if p.endswith(".json"):
        return "sharegpt"
    if "azure" in p:
        return "azure"
    if "burst" in p:
        return "burstgpt"
    if p.endswith(".csv"):
        return "vidur"
    raise UsageError(f"{path}: cannot tell the trace format from the name; pass --format")


def _figure(value: float | None, fmt: str, unit: str, why: str | None) -> str:
    """``value`` written with ``fmt`` and ``unit``, or ``n/a (<why>)`` when it is undefined."""
    return f"n/a ({why})" if value is None else f"{value:{fmt}}{unit}"


def inspect(path: str, fmt: str | None = None, as_json: bool = False, strict: bool = False) -> None:
    """Print the trace's statistics (``workbench.traces.trace_stats``) and its load notes
    (``workbench.traces.LoadStats``), as text or JSON.

    Undefined figures (the rate of a trace without arrival times, the burstiness of fewer than 3 requests)
    are ``n/a`` in text and null in JSON, with the reason (JSON: ``undefined``). JSON adds ``load``: the
    row counts (``rows_read``, ``loaded``, ``skipped``, ``changed``, ``warned``, ``out_of_order``, ``notes``).

    Args:
        path: the trace file.
        fmt: its format (default: :func:`guess_format`).
        as_json: print one JSON object instead of text.
        strict: a row the loader would change, warn about or re-order is an error (see the loaders).

    Raises:
        TraceError: the file is unreadable or a row is bad (or, under ``strict``, suspect).
    """
    from workbench.traces import LoadStats, load_trace, trace_stats

    fmt = fmt or guess_format(path)
    load = LoadStats()
    kwargs: dict = {"stats": load}
    if strict:
        kwargs["strict"] = True
    if fmt == "mooncake":
        kwargs["token_ids"] = False
    reqs = load_trace(fmt, path, **kwargs)
    st = trace_stats(reqs)
    st["format"] = fmt
    st["load"] = load.to_dict()
    if as_json:
        print(json.dumps(st, indent=2))
        return
    why = st["undefined"]
    head = f"format {fmt}, {st['count']} requests over {st['duration_s']:.1f} s: "
    if why.get("rate") is not None and why.get("rate") == why.get("burstiness"):
        print(head + f"rate and burstiness (inter-arrival CV) n/a ({why['rate']})")
    else:
        print(head + f"rate {_figure(st['rate'], '.3f', ' req/s', why.get('rate'))}, "
              f"burstiness (inter-arrival CV) {_figure(st['burstiness'], '.2f', '', why.get('burstiness'))}")
    for k in ("prompt_tokens", "output_tokens"):
        d = st[k]
        print(f"  {k:14s} mean {d['mean']:.0f}  p50 {d['p50']:.0f}  p90 {d['p90']:.0f}  p99 {d['p99']:.0f}  max {d['max']:.0f}")
    print(f"  {Path(path).name}: {load.summary()}")
    for note in load.notes():
        print(f"  note: {note}")
