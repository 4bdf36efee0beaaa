"""BurstGPT CSV loader (arrivals in s, with model, log type and failed-request filters)."""

from __future__ import annotations

from pathlib import Path

from workbench.traces.common import (TraceError, TraceRequest, check_file, check_limit, finish, parse_count,
                                     parse_seconds, read_csv)


def load_burstgpt(
    path: str | Path,
    model: str | None = None,
    log_type: str | None = None,
    drop_failed: bool = True,
    limit: int | None = None,
) -> list[TraceRequest]:
    """BurstGPT CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``.

    ``Timestamp`` is seconds from the start of the trace.

    Args:
        path: the CSV file.
        model: keep only rows of this ``Model`` (e.g. ``ChatGPT``, ``GPT-4``); None keeps all.
        log_type: keep only rows of this ``Log Type`` (``Conversation log`` or ``API log``); None keeps all.
        drop_failed: drop rows with 0 response tokens (BurstGPT's failed requests).
        limit: keep at most the first N rows that pass the filters.

    Raises:
        TraceError: as for :func:`load_azure`; also when the filters leave nothing.
    """
    p = check_file(path)
    check_limit(limit)
    cols = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
    reqs = []
    for i, (where, row) in enumerate(read_csv(p, cols)):
        t = parse_seconds(row["Timestamp"], where, "Timestamp")
        n_in = parse_count(row["Request tokens"], where, "Request tokens")
        n_out = parse_count(row["Response tokens"], where, "Response tokens")
        if model is not None and row["Model"].strip() != model:
            continue
        if log_type is not None and row["Log Type"].strip() != log_type:
            continue
        if drop_failed and n_out == 0:
            continue
        reqs.append(TraceRequest(f"burstgpt-{i}", t, n_in, n_out))
        if limit is not None and len(reqs) >= limit:
            break
    if not reqs:
        raise TraceError(f"{p}: trace is empty (no requests{' after filters' if model or log_type or drop_failed else ''})")
    return finish(reqs, p)
