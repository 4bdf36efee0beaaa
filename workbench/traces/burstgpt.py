"""BurstGPT CSV loader (arrivals in s, with model, log type and failed-request filters)."""

from __future__ import annotations

from pathlib import Path

from workbench.traces.common import (LoadStats, TraceError, TraceRequest, begin_stats, check_file, check_limit,
                                     finish, output_count, parse_count, parse_seconds, read_csv, shown)

FAILED = "failed request: 0 Response tokens (drop_failed)"  # the skip reason of BurstGPT's failed requests


def load_burstgpt(
    path: str | Path,
    model: str | None = None,
    log_type: str | None = None,
    drop_failed: bool = True,
    limit: int | None = None,
    strict: bool = False,
    stats: LoadStats | None = None,
) -> list[TraceRequest]:
    """BurstGPT CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``.

    ``Timestamp`` is seconds from the start of the trace. Every row a filter drops is counted in
    ``stats.skipped`` under its reason; loaded rows out of ``Timestamp`` order are sorted and counted.

    Args:
        path: the CSV file.
        model: keep only rows of this ``Model`` (e.g. ``ChatGPT``, ``GPT-4``); None keeps all.
        log_type: keep only rows of this ``Log Type`` (``Conversation log`` or ``API log``); None keeps all.
        drop_failed: drop rows with 0 response tokens (BurstGPT's failed requests). When False they are
            replayed with 1 output token (an engine generates at least one), counted as changed.
        limit: keep at most the first N rows that pass the filters.
        strict: a loaded row out of arrival order, or (``drop_failed=False``) with 0 response tokens, is
            an error. Filtered rows are not errors.
        stats: filled with the row counts (see :class:`LoadStats`).

    Raises:
        TraceError: as for :func:`load_azure`; also when the filters leave nothing.
    """
    p = check_file(path)
    check_limit(limit)
    st = begin_stats(stats, p, "burstgpt")
    cols = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
    reqs = []
    for i, (where, row) in enumerate(read_csv(p, cols)):
        st.rows_read += 1
        t = parse_seconds(row["Timestamp"], where, "Timestamp")
        n_in = parse_count(row["Request tokens"], where, "Request tokens")
        n_out = parse_count(row["Response tokens"], where, "Response tokens")
        if model is not None and row["Model"].strip() != model:
            st.skip(f"Model is not {shown(model)}", where, f"Model {shown(row['Model'].strip())}")
            continue
        if log_type is not None and row["Log Type"].strip() != log_type:
            st.skip(f"Log Type is not {shown(log_type)}", where, f"Log Type {shown(row['Log Type'].strip())}")
            continue
        if drop_failed and n_out == 0:
            st.skip(FAILED, where)
            continue
        if n_out == 0:
            n_out = output_count(n_out, where, "Response tokens", st, strict)
        st.arrival(t, where, "Timestamp", row["Timestamp"].strip(), strict)
        reqs.append(TraceRequest(f"burstgpt-{i}", t, n_in, n_out))
        if limit is not None and len(reqs) >= limit:
            break
    if not reqs:
        st.loaded = 0
        filtered = " after filters" if model or log_type or drop_failed else ""
        raise TraceError(f"{p}: trace is empty (no requests{filtered}; {st.summary()})")
    return finish(reqs, p, st, limit if limit is not None and len(reqs) >= limit else None)
