"""Azure LLM inference trace (2023 and 2024) CSV loader."""

from __future__ import annotations

from pathlib import Path

from workbench.traces.common import (TraceError, TraceRequest, check_file, check_limit, finish, parse_count,
                                     parse_datetime, read_csv)


def load_azure(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Azure LLM inference trace (2023; the 2024 week-long traces use the same columns).

    CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is a datetime string such as
    ``2023-11-16 18:15:46.6805900`` (7 fractional digits = 100 ns, no zone), converted exactly to seconds
    from the first row. Token counts are in the production model's tokens.

    Args:
        path: the CSV file.
        limit: read only the first N data rows.

    Raises:
        TraceError: missing file, bad header, wrong column count, unparsable timestamp, bad token count, empty.
    """
    p = check_file(path)
    check_limit(limit)
    cols = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    raw = []
    for i, (where, row) in enumerate(read_csv(p, cols, limit)):
        whole, ns = parse_datetime(row["TIMESTAMP"], where, "TIMESTAMP")
        raw.append((f"azure-{i}", whole, ns, parse_count(row["ContextTokens"], where, "ContextTokens"),
                    parse_count(row["GeneratedTokens"], where, "GeneratedTokens")))
    if not raw:
        raise TraceError(f"{p}: trace is empty (no requests)")
    w0, n0 = min((r[1], r[2]) for r in raw)
    reqs = [TraceRequest(rid, (w - w0) + (ns - n0) / 1e9, pt, ot) for rid, w, ns, pt, ot in raw]
    return finish(reqs, p)
