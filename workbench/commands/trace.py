"""``workbench trace inspect``: a trace file's format, size, rate, burstiness, length percentiles, what
loading it skipped, changed or re-ordered, and what reading it cost (wall time, rows/s, peak RSS), as
recorded or made into a day (``--repeat``, ``--duration-s``)."""

from __future__ import annotations

import json
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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


def rss_bytes() -> int:
    """This process's resident memory now (bytes; Linux ``/proc/self/status``), 0 where unreadable."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (bytes; ``ru_maxrss``, which Linux gives in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Loaded:
    """A trace loaded for inspection: its statistics, its load report, and how it was read.

    Attributes:
        stats: ``workbench.traces.trace_stats`` of the requests.
        load: the ``LoadStats`` filled while reading.
        mode: ``stream`` (read row by row, only lengths and arrivals kept) or ``whole`` (every request held).
    """

    stats: dict
    load: Any
    mode: str


def _load_stream(path: str, fmt: str, kwargs: dict, repeat: int | None, duration_s: float | None,
                 seed: int, reread: bool = False, rate_profile: list[float] | None = None) -> Loaded:
    """Stream the trace (repeated or as a synthesized day) keeping only arrivals and lengths (24 bytes a request)."""
    from workbench.traces import LoadStats, iter_trace, repeat_stream, synthesize_day, trace_stats_arrays

    load = LoadStats()
    if duration_s is not None:
        reqs = synthesize_day(list(iter_trace(fmt, path, stats=load, **kwargs)), duration_s, seed, rate_profile)
    elif repeat is not None:
        reqs = repeat_stream(lambda st: iter_trace(fmt, path, stats=st, **kwargs), repeat, load, reread)
    else:
        reqs = iter_trace(fmt, path, stats=load, **kwargs)
    t, p, o = array("d"), array("q"), array("q")
    for r in reqs:
        t.append(r.arrival_s)
        p.append(r.prompt_tokens)
        o.append(r.output_tokens)
    if duration_s is not None:
        load.synthesized = len(t)
    stats = trace_stats_arrays(np.frombuffer(t, dtype=np.float64), np.frombuffer(p, dtype=np.int64),
                               np.frombuffer(o, dtype=np.int64))
    return Loaded(stats, load, "stream")


def _load_whole(path: str, fmt: str, kwargs: dict, repeat: int | None, duration_s: float | None,
                seed: int, reread: bool = False, rate_profile: list[float] | None = None) -> Loaded:
    """Load every request (``load_trace``), then repeat or synthesize the day (``apply_transforms``)."""
    from workbench.traces import LoadStats, apply_transforms, load_trace, trace_stats

    load = LoadStats()
    reqs = load_trace(fmt, path, stats=load, **kwargs)
    if repeat is not None or duration_s is not None:
        reqs = apply_transforms(reqs, seed=seed, stats=load, repeat=repeat, duration_s=duration_s,
                                rate_profile=rate_profile)
    return Loaded(trace_stats(reqs), load, "whole")


def parse_profile(text: str | None, duration_s: float | None) -> list[float] | None:
    """``--rate-profile 1,0.5,2`` as a list of relative rates (None when not given).

    Raises:
        TraceError: not numbers >= 0 with a positive sum, or given without ``--duration-s``.
    """
    from workbench.traces import TraceError
    from workbench.traces.day import check_profile

    if text is None:
        return None
    if duration_s is None:
        raise TraceError("--rate-profile shapes a synthesized day: it needs --duration-s")
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise TraceError(f"--rate-profile must be comma-separated numbers, got {text[:80]!r}") from None
    check_profile(values)
    return values


def inspect(path: str, fmt: str | None = None, as_json: bool = False, strict: bool = False,
            repeat: int | None = None, duration_s: float | None = None, seed: int = 0, whole: bool = False,
            reread: bool = False, rate_profile: str | None = None) -> None:
    """Print the trace's statistics (``workbench.traces.trace_stats``), its load notes
    (``workbench.traces.LoadStats``) and what reading it cost, as text or JSON.

    Undefined figures (the rate of a trace without arrival times, the burstiness of fewer than 3 requests)
    are ``n/a`` in text and null in JSON, with the reason (JSON: ``undefined``). JSON adds ``load``: the
    row counts (``rows_read``, ``loaded``, ``skipped``, ``changed``, ``warned``, ``out_of_order``,
    ``copies``, ``synthesized``, ``notes``), and ``cost``: ``mode`` (stream or whole), ``load_s`` (wall
    seconds to read and summarise), ``rows_per_s`` (rows read / load_s), ``requests_per_s``,
    ``rss_before_bytes`` (resident memory before reading) and ``peak_rss_bytes`` (the process's peak so
    far, imports included), plus ``repeat`` and ``day_duration_s`` as asked. ``count`` and ``duration_s``
    are the repeated or synthesized trace's.

    Args:
        path: the trace file.
        fmt: its format (default: :func:`guess_format`).
        as_json: print one JSON object instead of text.
        strict: a row the loader would change, warn about or re-order is an error (see the loaders).
        repeat: inspect this many back-to-back copies (``workbench.traces.day``).
        duration_s: inspect a day of this many seconds synthesized from the trace (seeded by ``seed``).
        seed: seeds the synthesized day.
        whole: load every request (``load_trace``) instead of streaming (formats that cannot stream are
            always loaded whole).
        reread: with ``repeat`` and streaming, parse the file once per copy instead of keeping the first
            copy's requests to replay (memory independent of the file's length; ``repeat`` x the time).
        rate_profile: with ``duration_s``: comma-separated relative rates over equal slices of the day.

    Raises:
        TraceError: the file is unreadable or a row is bad (or, under ``strict``, suspect); a bad
            ``repeat`` or ``duration_s``, or both.
    """
    from workbench.traces import STREAMED_FORMATS, TraceError
    from workbench.traces.day import check_copies, check_duration

    fmt = fmt or guess_format(path)
    if repeat is not None and duration_s is not None:
        raise TraceError("--repeat and --duration-s both make a day from the trace: pass one of them")
    repeat = check_copies(repeat) if repeat is not None else None
    duration_s = check_duration(duration_s) if duration_s is not None else None
    profile = parse_profile(rate_profile, duration_s)
    kwargs: dict = {"strict": True} if strict else {}
    if fmt == "mooncake" and (whole or fmt not in STREAMED_FORMATS):
        kwargs["token_ids"] = False
    rss0, t0 = rss_bytes(), time.perf_counter()
    streamed = not whole and fmt in STREAMED_FORMATS
    got = (_load_stream if streamed else _load_whole)(path, fmt, kwargs, repeat, duration_s, seed, reread, profile)
    elapsed = time.perf_counter() - t0
    st, load = got.stats, got.load
    st["format"] = fmt
    st["load"] = load.to_dict()
    st["cost"] = {"mode": got.mode, "load_s": elapsed, "rows_per_s": load.rows_read / elapsed if elapsed > 0 else None,
                  "requests_per_s": st["count"] / elapsed if elapsed > 0 else None, "rss_before_bytes": rss0,
                  "peak_rss_bytes": peak_rss_bytes(), "repeat": repeat, "reread": reread, "day_duration_s": duration_s}
    if as_json:
        print(json.dumps(st, indent=2))
        return
    _print_text(path, fmt, st, load)


def _print_text(path: str, fmt: str, st: dict, load: Any) -> None:
    """The text form of :func:`inspect`'s figures."""
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
    c = st["cost"]
    rate = f", {c['rows_per_s']:,.0f} rows/s" if c["rows_per_s"] else ""
    mode = c["mode"] + (", file parsed once per copy" if c["reread"] and c["repeat"] else "")
    print(f"  read ({mode}) in {c['load_s']:.2f} s{rate}; peak RSS {c['peak_rss_bytes'] / 2**20:.1f} MiB "
          f"({c['rss_before_bytes'] / 2**20:.1f} MiB before reading)")
