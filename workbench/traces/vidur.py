"""Vidur request-trace CSV loader (also sarathi-serve's lengths CSV, which has no arrivals)."""

from __future__ import annotations

from pathlib import Path

from workbench.traces.common import (TraceRequest, check_file, check_limit, finish, parse_count, parse_seconds,
                                     read_csv, read_header)


def load_vidur(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Vidur request trace CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (``arrived_at`` in s).

    Also reads sarathi-serve's lengths CSV ``num_prefill_tokens,num_decode_tokens,...`` that has no
    ``arrived_at`` column: all arrivals are then 0 (apply ``request_rate`` in :func:`apply_transforms`).
    Extra columns are ignored.

    Raises:
        TraceError: missing file, header without the token columns, wrong column count, bad numbers, empty.
    """
    p = check_file(path)
    check_limit(limit)
    has_arrival = "arrived_at" in read_header(p)
    cols = (("arrived_at",) if has_arrival else ()) + ("num_prefill_tokens", "num_decode_tokens")
    reqs = []
    for i, (where, row) in enumerate(read_csv(p, cols, limit)):
        t = parse_seconds(row["arrived_at"], where, "arrived_at") if has_arrival else 0.0
        reqs.append(TraceRequest(f"vidur-{i}", t, parse_count(row["num_prefill_tokens"], where, "num_prefill_tokens"),
                                 parse_count(row["num_decode_tokens"], where, "num_decode_tokens")))
    return finish(reqs, p)
