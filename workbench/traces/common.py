"""What every trace module shares: the request type, the error, and the CSV and value parsers.

Every parser reports a bad value as a :class:`TraceError` with one line ``<file>:<line>: <what is wrong>``.
"""

from __future__ import annotations

import calendar
import csv
import datetime as _dt
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from workbench.errors import UsageError

BUILTIN_TRACE_DIR = Path(__file__).parent.parent / "data" / "traces"  # workbench/data/traces: the committed slices


class TraceError(UsageError):
    """A trace file or trace setting is unusable; the message is one line naming the file and line."""


@dataclass
class TraceRequest:
    """One request of a workload trace.

    Attributes:
        request_id: unique id within the trace (``<format>-<row>`` or the file's own id).
        arrival_s: arrival time in seconds from the trace's first request (the first is 0.0).
        prompt_tokens: prompt length in tokens.
        output_tokens: output tokens to generate (the recorded response length).
        prompt_token_ids: the prompt's token ids when the trace gives text (tokenized) or prefix hashes
            (Mooncake); None for traces that give only counts (see :func:`ensure_prompt_ids`).
        prompt_text: the prompt text when the trace gives it (ShareGPT); None otherwise, and None once a
            transform changed the prompt's length (the text would no longer match the ids).
        hash_ids: Mooncake's prefix block ids (None for other formats); kept so ids can be made later.
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    hash_ids: list[int] | None = None


def check_file(path: str | Path) -> Path:
    """``path`` as a Path, once it is known to be an existing regular file.

    Raises:
        TraceError: no such file, or not a regular file (a folder, a device).
    """
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if not p.is_file():
        raise TraceError(f"{p}: not a regular file")
    return p


def parse_count(value: Any, where: str, column: str) -> int:
    """A token count: a non-negative integer (``"12"``, ``12``, ``"12.0"``).

    ``where`` (``<file>:<line>``) and ``column`` name the value in the error.

    Raises:
        TraceError: a bool, a negative or fractional number, or text that is not a number.
    """
    if isinstance(value, bool):
        raise TraceError(f"{where}: {column} must be a non-negative integer, got {value!r}")
    if isinstance(value, str):
        s = value.strip()
        try:
            n = int(s)
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                raise TraceError(f"{where}: {column} must be a non-negative integer, got {value!r}") from None
            if not math.isfinite(f) or not f.is_integer():
                raise TraceError(f"{where}: {column} must be a non-negative integer, got {value!r}") from None
            n = int(f)
    elif isinstance(value, int):
        n = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        n = int(value)
    else:
        raise TraceError(f"{where}: {column} must be a non-negative integer, got {value!r}")
    if n < 0:
        raise TraceError(f"{where}: {column} must be a non-negative integer, got {value!r}")
    return n


def parse_seconds(value: Any, where: str, column: str) -> float:
    """A finite number of seconds (or milliseconds: the caller converts).

    Raises:
        TraceError: a bool, text that is not a number, NaN or an infinity.
    """
    if isinstance(value, bool):
        raise TraceError(f"{where}: {column} must be a number, got {value!r}")
    try:
        f = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {column} must be a number, got {value!r}") from None
    if not math.isfinite(f):
        raise TraceError(f"{where}: {column} must be a finite number, got {value!r}")
    return f


_DATETIME_RE = re.compile(
    r"^(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:[.,](\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$"
)


def parse_datetime(value: str, where: str, column: str) -> tuple[int, int]:
    """``2023-11-16 18:15:46.6805900`` -> (whole seconds since the epoch, nanoseconds).

    Any number of fractional digits (Azure writes 7, i.e. 100 ns) is kept to the nanosecond without going
    through a float. No zone means UTC (only differences matter); ``Z`` or ``+hh:mm`` offsets are applied.
    A plain number is taken as seconds.

    Raises:
        TraceError: neither a timestamp of that shape nor a finite number, or an impossible date.
    """
    s = value.strip()
    m = _DATETIME_RE.match(s)
    if m is None:
        try:
            f = float(s)
        except ValueError:
            f = math.nan
        if math.isfinite(f):
            whole = math.floor(f)
            return whole, int(round((f - whole) * 1e9))
        raise TraceError(f"{where}: {column} is not a timestamp like 2023-11-16 18:15:46.6805900, got {value!r}")
    y, mo, d, h, mi, sec, frac, tz = m.groups()
    try:
        stamp = _dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(sec))
    except ValueError as e:
        raise TraceError(f"{where}: {column} {value!r} is not a valid date/time ({e})") from None
    whole = calendar.timegm(stamp.timetuple())
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        digits = tz[1:].replace(":", "")
        whole -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    ns = int((frac or "0")[:9].ljust(9, "0"))
    return whole, ns


def read_csv(path: Path, required: Sequence[str], limit: int | None = None) -> Iterator[tuple[str, dict[str, str]]]:
    """Yield (``"<file>:<line>"``, row dict) for each data row of a CSV with a header naming ``required``.

    Extra columns are allowed; blank lines are skipped; every row must have as many fields as the header.
    ``limit`` stops after that many data rows.

    Raises:
        TraceError: an empty file, a header lacking a required column, a row with another number of
            fields, text that is not UTF-8, malformed CSV.
    """
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            header = None
            for fields in reader:
                if fields and any(f.strip() for f in fields):
                    header = [f.strip() for f in fields]
                    break
            if header is None:
                raise TraceError(f"{path}: file is empty (expected a CSV header {','.join(required)})")
            hline = reader.line_num
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(
                    f"{path}:{hline}: header lacks column(s) {', '.join(missing)}; expected {','.join(required)}, "
                    f"got {','.join(header)}"
                )
            n = 0
            for fields in reader:
                if not fields or not any(f.strip() for f in fields):
                    continue
                where = f"{path}:{reader.line_num}"
                if len(fields) != len(header):
                    raise TraceError(f"{where}: expected {len(header)} columns ({','.join(header)}), got {len(fields)}")
                yield where, dict(zip(header, fields))
                n += 1
                if limit is not None and n >= limit:
                    return
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise TraceError(f"{path}: malformed CSV ({e})") from None


def read_header(p: Path) -> list[str]:
    """The first non-blank CSV row, stripped (empty list for an empty file or one that is not CSV text)."""
    try:
        with p.open(newline="", encoding="utf-8-sig") as fh:
            for fields in csv.reader(fh):
                if fields and any(f.strip() for f in fields):
                    return [f.strip() for f in fields]
    except (UnicodeDecodeError, csv.Error):
        pass  # read_csv reports it with context
    return []


def check_limit(limit: int | None) -> None:
    """Raises TraceError unless ``limit`` (rows or requests to keep) is None or a positive integer."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise TraceError(f"limit must be a positive integer, got {limit!r}")


def finish(reqs: list[TraceRequest], path: Path | str) -> list[TraceRequest]:
    """Sort by arrival (stable) and rebase arrivals so the first is 0.0 (in place; returns ``reqs``).

    Raises:
        TraceError: no requests (the message names ``path``).
    """
    if not reqs:
        raise TraceError(f"{path}: trace is empty (no requests)")
    reqs.sort(key=lambda r: r.arrival_s)
    t0 = reqs[0].arrival_s
    if t0 != 0.0:
        for r in reqs:
            r.arrival_s = r.arrival_s - t0
    return reqs


def check_vocab(vocab_lo: int, vocab_hi: int) -> None:
    """Raises TraceError unless [vocab_lo, vocab_hi) is a non-empty range of non-negative token ids."""
    if not (0 <= vocab_lo < vocab_hi):
        raise TraceError(f"vocab range must satisfy 0 <= vocab_lo < vocab_hi, got [{vocab_lo}, {vocab_hi})")


def check_seed(seed: int) -> None:
    """Raises TraceError unless ``seed`` is a non-negative integer (not a bool)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TraceError(f"seed must be a non-negative integer, got {seed!r}")


def positive_int(name: str, v: Any) -> int:
    """``v`` when it is a positive integer (not a bool); else TraceError naming the setting ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise TraceError(f"{name} must be a positive integer, got {v!r}")
    return v
