"""APEX+ request-trace JSONL loader (its LMSYS-Chat and other traces: arrivals in ns, prompt and output lengths)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from workbench.traces.common import (LoadStats, TraceError, TraceRequest, begin_stats, check_file, check_limit,
                                     finish, output_count, parse_count, read_jsonl, shown)

ARRIVAL_KEY = "StartTimeOffset"  # ns from the trace's first request
# accepted spellings of the prompt and output lengths (tokens), APEX+'s own first
PROMPT_KEYS = ("ContextTokens", "InputTokens", "input_tokens", "input_length", "prompt_tokens")
OUTPUT_KEYS = ("GeneratedTokens", "OutputTokens", "output_tokens", "output_length", "completion_tokens")


def _one_of(obj: dict[str, Any], keys: tuple[str, ...], what: str, where: str) -> tuple[str, Any]:
    """(key, value) of the one key of ``keys`` that ``obj`` has; TraceError when none or several."""
    found = [k for k in keys if k in obj]
    if not found:
        raise TraceError(f"{where}: missing the {what} (one of {', '.join(keys)})")
    if len(found) > 1:
        raise TraceError(f"{where}: {what} given twice ({' and '.join(found)}); give one")
    return found[0], obj[found[0]]


def _nanoseconds(value: Any, where: str) -> int | float:
    """``StartTimeOffset`` as a number of ns: an int stays exact, a float must be finite and >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: {ARRIVAL_KEY} must be a non-negative number of nanoseconds, got {shown(value)}")
    return value


def load_apex(path: str | Path, limit: int | None = None, strict: bool = False,
              stats: LoadStats | None = None) -> list[TraceRequest]:
    """APEX+ request trace JSONL: one object per line, ``{"StartTimeOffset": ns, "ContextTokens": n,
    "GeneratedTokens": n}`` (the traces of microsoft/apex_plus, e.g. its LMSYS-Chat ``lmsys_*.jsonl``).

    ``StartTimeOffset`` is nanoseconds from the first request (a JSON number; converted to seconds, exactly
    for integers). The prompt length (tokens) may be spelled ``ContextTokens`` (APEX+), ``InputTokens``,
    ``input_tokens``, ``input_length`` or ``prompt_tokens``; the output length (tokens) ``GeneratedTokens``
    (APEX+), ``OutputTokens``, ``output_tokens``, ``output_length`` or ``completion_tokens``. Other keys are
    ignored. Rows out of ``StartTimeOffset`` order are sorted and counted in ``stats``; an output length
    of 0 is replayed as 1 token and counted.

    Args:
        path: the JSONL file.
        limit: read only the first N requests.
        strict: a row out of arrival order or with a 0-token output is an error.
        stats: filled with the row counts (see :class:`LoadStats`).

    Raises:
        TraceError: missing file, invalid JSON, a line that is not an object, a missing or negative
            ``StartTimeOffset``, a length missing, given twice or not a non-negative integer, empty trace;
            under ``strict`` the rows above.
    """
    p = check_file(path)
    check_limit(limit)
    st = begin_stats(stats, p, "apex")
    raw: list[tuple[int | float, int, int]] = []
    for where, obj in read_jsonl(p, limit):
        st.rows_read += 1
        if ARRIVAL_KEY not in obj:
            raise TraceError(f"{where}: missing key {ARRIVAL_KEY!r} (ns from the first request)")
        t_ns = _nanoseconds(obj[ARRIVAL_KEY], where)
        st.arrival(t_ns, where, ARRIVAL_KEY, obj[ARRIVAL_KEY], strict)
        pk, pv = _one_of(obj, PROMPT_KEYS, "prompt length", where)
        ok, ov = _one_of(obj, OUTPUT_KEYS, "output length", where)
        raw.append((t_ns, parse_count(pv, where, pk), output_count(ov, where, ok, st, strict)))
    if not raw:
        raise TraceError(f"{p}: trace is empty (no requests)")
    t0 = min(r[0] for r in raw)
    reqs = [TraceRequest(f"apex-{i}", (t - t0) / 1e9, n_in, n_out) for i, (t, n_in, n_out) in enumerate(raw)]
    return finish(reqs, p, st, limit if limit is not None and len(reqs) >= limit else None)
