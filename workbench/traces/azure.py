"""Azure LLM inference trace (2023 and 2024) CSV loader."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from workbench.traces.common import (LoadStats, TraceError, TraceRequest, begin_stats, check_file, check_limit,
                                     finish, output_count, parse_count, parse_datetime, read_csv)
from workbench.traces.rows import RawRow


def load_azure(path: str | Path, limit: int | None = None, strict: bool = False,
               stats: LoadStats | None = None) -> list[TraceRequest]:
    """Azure LLM inference trace (2023; the 2024 week-long traces use the same columns).

    CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is a datetime string such as
    ``2023-11-16 18:15:46.6805900`` (7 fractional digits = 100 ns, no zone), converted exactly to seconds
    from the first row. Token counts are in the production model's tokens. Rows out of ``TIMESTAMP``
    order are sorted and counted in ``stats``; a ``GeneratedTokens`` of 0 is replayed as 1 token (an
    engine generates at least one) and counted.

    Args:
        path: the CSV file.
        limit: read only the first N data rows.
        strict: a row out of arrival order or with 0 ``GeneratedTokens`` is an error.
        stats: filled with the row counts (see :class:`LoadStats`).

    Raises:
        TraceError: missing file, bad header, wrong column count, unparsable timestamp, bad token count, empty;
            under ``strict`` the rows above.
    """
    p = check_file(path)
    check_limit(limit)
    st = begin_stats(stats, p, "azure")
    raw = list(iter_azure_rows(p, limit, strict, st))
    if not raw:
        raise TraceError(f"{p}: trace is empty (no requests)")
    w0, n0 = min(r.key for r in raw)
    reqs = [TraceRequest(r.request_id, azure_seconds(r.key, (w0, n0)), r.prompt_tokens, r.output_tokens) for r in raw]
    return finish(reqs, p, st, limit if limit is not None and st.rows_read >= limit else None)


def azure_seconds(key: tuple[int, int], base: tuple[int, int]) -> float:
    """Seconds from ``base`` to ``key``, both (whole seconds since the epoch, nanoseconds)."""
    return (key[0] - base[0]) + (key[1] - base[1]) / 1e9


def iter_azure_rows(p: Path, limit: int | None, strict: bool, st: LoadStats) -> Iterator[RawRow]:
    """The Azure CSV's rows in file order, parsed and counted in ``st`` (rows read, changed, out of order);
    ``key`` is (whole seconds since the epoch, nanoseconds) of ``TIMESTAMP``.

    Raises:
        TraceError: as :func:`load_azure`.
    """
    cols = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    for i, (where, row) in enumerate(read_csv(p, cols, limit)):
        st.rows_read += 1
        whole, ns = parse_datetime(row["TIMESTAMP"], where, "TIMESTAMP")
        st.arrival((whole, ns), where, "TIMESTAMP", row["TIMESTAMP"].strip(), strict)
        yield RawRow((whole, ns), f"azure-{i}", parse_count(row["ContextTokens"], where, "ContextTokens"),
                     output_count(row["GeneratedTokens"], where, "GeneratedTokens", st, strict), where)
