"""Streaming a trace file (:func:`iter_trace`): requests one at a time, in arrival order, without holding
the file's rows, for traces too long to load whole (a day of traffic, a week-long Azure 2024 trace).

Formats ``azure``, ``vidur`` and ``mooncake`` are read row by row (:data:`STREAMED_FORMATS`); the others
are loaded whole by :func:`load_trace` and then yielded. Streamed requests carry lengths and, for
Mooncake, ``hash_ids``; never ``prompt_token_ids`` (make them later, for the requests a run keeps, with
:func:`ensure_prompt_ids`).
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from workbench.traces.azure import azure_seconds, iter_azure_rows
from workbench.traces.common import (LoadStats, TraceError, TraceRequest, begin_stats, check_file, check_limit,
                                     shown)
from workbench.traces.formats import FORMATS, load_trace
from workbench.traces.ids import MOONCAKE_BLOCK_TOKENS
from workbench.traces.mooncake import iter_mooncake_rows, mooncake_seconds
from workbench.traces.rows import RawRow
from workbench.traces.vidur import iter_vidur_rows, vidur_seconds

STREAMED_FORMATS: tuple[str, ...] = ("azure", "vidur", "mooncake")
# rows a stream holds back to sort rows that the file has slightly out of arrival order; a row earlier than
# one already yielded (out of order by more than this) is an error, as the stream cannot sort it
DEFAULT_REORDER_WINDOW = 4096

_SECONDS: dict[str, Callable[[Any, Any], float]] = {"azure": azure_seconds, "vidur": vidur_seconds,
                                                     "mooncake": mooncake_seconds}


def iter_trace(format: str, path: str | Path | None = None, limit: int | None = None, strict: bool = False,
               stats: LoadStats | None = None, reorder_window: int = DEFAULT_REORDER_WINDOW,
               block_tokens: int = MOONCAKE_BLOCK_TOKENS, **kwargs: Any) -> Iterator[TraceRequest]:
    """The requests of a trace file in arrival order, arrivals in seconds from the first (0.0).

    For :data:`STREAMED_FORMATS` the file is read row by row, so memory does not grow with its length;
    the requests are those of ``load_trace(format, path, limit=, strict=)`` (Mooncake: with
    ``token_ids=False`` and ``block_tokens``), same ids, arrivals, lengths and order, provided no row is
    out of arrival order by more than ``reorder_window`` rows. ``stats`` is filled as the stream goes and
    holds the same counts as ``load_trace``'s once the stream is exhausted. Other formats (and extra
    ``kwargs``, which only they take) are loaded whole by :func:`load_trace`, then yielded.

    Args:
        format: one of :data:`FORMATS`.
        path: the trace file.
        limit: read only the first N rows.
        strict: a row the loader would change, warn about or re-order is an error.
        stats: filled with the row counts (:class:`LoadStats`).
        reorder_window: rows held back to sort rows slightly out of arrival order (0: the file must be in
            order).
        block_tokens: mooncake only: tokens per prefix block in the replay.

    Raises:
        TraceError: any loader error (raised when the stream reaches the row); a row out of arrival order by
            more than ``reorder_window`` rows; an empty trace; a bad setting.
    """
    if format not in _SECONDS or kwargs:
        if format not in FORMATS:
            raise TraceError(f"unknown trace format {shown(format)}; known formats: {', '.join(FORMATS)}")
        extra: dict[str, Any] = {"block_tokens": block_tokens} if format == "mooncake" else {}
        if limit is not None:
            extra["limit"] = limit
        if strict:
            extra["strict"] = True
        yield from load_trace(format, path, stats=stats, **extra, **kwargs)
        return
    if path is None:
        raise TraceError(f"{format}: a trace file path is required")
    if isinstance(reorder_window, bool) or not isinstance(reorder_window, int) or reorder_window < 0:
        raise TraceError(f"reorder_window must be an integer >= 0, got {shown(reorder_window)}")
    p = check_file(path)
    check_limit(limit)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise TraceError(f"block_tokens must be a positive integer, got {shown(block_tokens)}")
    st = begin_stats(stats, p, format)
    if format == "azure":
        rows = iter_azure_rows(p, limit, strict, st)
    elif format == "vidur":
        rows = iter_vidur_rows(p, limit, strict, st)
    else:
        rows = iter_mooncake_rows(p, block_tokens, limit, strict, st)
    yield from _in_order(rows, _SECONDS[format], reorder_window, st)
    if st.loaded == 0:
        raise TraceError(f"{p}: trace is empty (no requests)")
    st.limit = limit if limit is not None and st.rows_read >= limit else None


def _in_order(rows: Iterable[RawRow], seconds: Callable[[Any, Any], float], window: int,
              st: LoadStats) -> Iterator[TraceRequest]:
    """``rows`` sorted by key (stable) through a heap of ``window`` + 1 rows, as requests rebased to the first
    yielded row; counts each in ``st.loaded``.

    Raises:
        TraceError: a row earlier than one already yielded.
    """
    heap: list[tuple[Any, int, RawRow]] = []
    base: Any = None
    last: Any = None
    for seq, row in enumerate(rows):
        if last is not None and row.key < last:
            raise TraceError(f"{row.where}: arrives before a row already streamed: out of arrival order by more "
                             f"than reorder_window={window} rows (load the trace whole to sort it)")
        heapq.heappush(heap, (row.key, seq, row))
        if len(heap) > window:
            last, _, r = heapq.heappop(heap)
            base = last if base is None else base
            st.loaded += 1
            yield _request(r, seconds(r.key, base))
    while heap:
        last, _, r = heapq.heappop(heap)
        base = last if base is None else base
        st.loaded += 1
        yield _request(r, seconds(r.key, base))


def _request(r: RawRow, arrival_s: float) -> TraceRequest:
    """The request of a parsed row arriving at ``arrival_s`` (s from the trace's first request)."""
    return TraceRequest(r.request_id, arrival_s, r.prompt_tokens, r.output_tokens, None, None, r.hash_ids)
