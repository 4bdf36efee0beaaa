"""Vidur request-trace CSV loader (also sarathi-serve's lengths CSV, which has no arrivals)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from workbench.traces.common import (LoadStats, TraceRequest, begin_stats, check_file, check_limit, finish,
                                     output_count, parse_count, parse_seconds, read_csv, read_header)
from workbench.traces.rows import RawRow


def load_vidur(path: str | Path, limit: int | None = None, strict: bool = False,
               stats: LoadStats | None = None) -> list[TraceRequest]:
    """Vidur request trace CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (``arrived_at`` in s).

    Also reads sarathi-serve's lengths CSV ``num_prefill_tokens,num_decode_tokens,...`` that has no
    ``arrived_at`` column: all arrivals are then 0 (apply ``request_rate`` in :func:`apply_transforms`).
    Extra columns are ignored. Rows out of ``arrived_at`` order are sorted and counted in ``stats``; a
    ``num_decode_tokens`` of 0 is replayed as 1 token and counted.

    Args:
        path: the CSV file.
        limit: read only the first N data rows.
        strict: a row out of arrival order or with 0 ``num_decode_tokens`` is an error.
        stats: filled with the row counts (see :class:`LoadStats`).

    Raises:
        TraceError: missing file, header without the token columns, wrong column count, bad numbers, empty;
            under ``strict`` the rows above.
    """
    p = check_file(path)
    check_limit(limit)
    st = begin_stats(stats, p, "vidur")
    reqs = [TraceRequest(r.request_id, r.key, r.prompt_tokens, r.output_tokens)
            for r in iter_vidur_rows(p, limit, strict, st)]
    return finish(reqs, p, st, limit if limit is not None and st.rows_read >= limit else None)


def vidur_seconds(key: float, base: float) -> float:
    """Seconds from ``base`` to ``key`` (both ``arrived_at`` in s)."""
    return key - base


def iter_vidur_rows(p: Path, limit: int | None, strict: bool, st: LoadStats) -> Iterator[RawRow]:
    """The CSV's rows in file order, parsed and counted in ``st``; ``key`` is ``arrived_at`` in s (0.0 for a
    lengths CSV without it).

    Raises:
        TraceError: as :func:`load_vidur`.
    """
    has_arrival = "arrived_at" in read_header(p)
    cols = (("arrived_at",) if has_arrival else ()) + ("num_prefill_tokens", "num_decode_tokens")
    for i, (where, row) in enumerate(read_csv(p, cols, limit)):
        st.rows_read += 1
        t = 0.0
        if has_arrival:
            t = parse_seconds(row["arrived_at"], where, "arrived_at")
            st.arrival(t, where, "arrived_at", row["arrived_at"].strip(), strict)
        yield RawRow(t, f"vidur-{i}", parse_count(row["num_prefill_tokens"], where, "num_prefill_tokens"),
                     output_count(row["num_decode_tokens"], where, "num_decode_tokens", st, strict), where)
