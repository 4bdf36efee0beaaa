"""What every trace module shares: the request type, the error, the load report, the CSV/JSONL and value parsers.

Every parser reports a bad value as a :class:`TraceError` with one line ``<file>:<line>: <what is wrong>``;
values from the file are quoted through :func:`shown` / :func:`clip` (one line, at most :data:`MAX_SHOWN`
characters). Every loader counts what it did with the file's rows in a :class:`LoadStats` (skipped, changed,
suspect, out of arrival order); with ``strict=True`` a row it would change, warn about or re-order is an
error instead.
"""

from __future__ import annotations

import calendar
import csv
import datetime as _dt
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from workbench.errors import UsageError

BUILTIN_TRACE_DIR = Path(__file__).parent.parent / "data" / "traces"  # workbench/data/traces: the committed slices
MAX_SHOWN = 80  # characters of a file's value that an error message quotes (a longer one is cut, ending in ...)


class TraceError(UsageError):
    """A trace file or trace setting is unusable; the message is one line naming the file and line."""


def clip(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` on one line (line breaks and other unprintable characters escaped), cut to ``limit``
    characters ending in ``...`` when longer."""
    one = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return one if len(one) <= limit else one[:max(limit - 3, 0)] + "..."


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` for an error message: one line, at most ``limit`` characters (see :func:`clip`)."""
    return clip(repr(value), limit)


@dataclass
class TraceRequest:
    """One request of a workload trace.

    Attributes:
        request_id: unique id within the trace (``<format>-<row>`` or the file's own id).
        arrival_s: arrival time in seconds from the trace's first request (the first is 0.0).
        prompt_tokens: prompt length in tokens.
        output_tokens: output tokens to generate (the recorded response length; at least 1, see
            :func:`output_count`).
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


@dataclass
class LoadStats:
    """What loading a trace did with the file's rows; a loader fills the one passed as ``stats=``.

    A row is a data row of a CSV, a non-blank line of a JSONL file or an entry of a JSON list. Every row
    read is either in the trace or skipped: ``rows_read == loaded + sum(skipped.values())``. Changed and
    warned rows are in the trace, counted once under each reason that applies to them.
    :func:`apply_transforms` given the same stats adds the requests it cuts (to ``skipped``, taking them
    off ``loaded``) and the lengths it changes.

    Attributes:
        path: the trace file ("" for format synthetic).
        format: the loader's format name.
        rows_read: rows parsed (a loader's ``limit`` stops reading there: later rows are not read).
        loaded: requests in the trace.
        skipped: reason -> rows read that are not in the trace (a filter, a cut).
        changed: reason -> requests whose recorded value was changed so they can be replayed (a 0-token
            output raised to 1 token) or by a transform (a length rounded to 0 and raised to 1, a cap).
        warned: reason -> requests kept as recorded whose values disagree with each other.
        out_of_order: loaded rows whose arrival is earlier than the loaded row before them in the file.
            The trace is sorted by arrival (stable), so they are replayed at their own times.
        first: ``"<kind>: <reason>"`` (or ``"out of arrival order"``) -> ``"<file>:<line>: <detail>"`` of the
            first row counted under it.
        limit: the loader's ``limit`` when reading stopped there, else None.
        copies: how many back-to-back copies of the file's rows the trace holds (``repeat``); every count
            above is then the sum over the copies, as if the file was read ``copies`` times (a stream
            does read it that many times), so ``rows_read == loaded + sum(skipped.values())`` still holds.
        synthesized: requests of a day synthesized from the loaded rows (``duration_s``), else None; the
            counts above then describe the source rows, not the synthesized requests.
    """

    path: str = ""
    format: str = ""
    rows_read: int = 0
    loaded: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    changed: dict[str, int] = field(default_factory=dict)
    warned: dict[str, int] = field(default_factory=dict)
    out_of_order: int = 0
    first: dict[str, str] = field(default_factory=dict)
    limit: int | None = None
    copies: int = 1
    synthesized: int | None = None
    _last: tuple[Any, str] | None = field(default=None, repr=False, compare=False)

    def start(self, path: str | Path, fmt: str) -> "LoadStats":
        """Forget earlier counts and start on ``path`` of format ``fmt``; returns self."""
        self.path, self.format, self.rows_read, self.loaded, self.out_of_order = str(path), fmt, 0, 0, 0
        self.skipped, self.changed, self.warned, self.first = {}, {}, {}, {}
        self.limit, self._last = None, None
        self.copies, self.synthesized = 1, None
        return self

    def add_copy(self, other: "LoadStats") -> None:
        """Add the counts of one more copy of the file (``other``, filled by re-reading it) to these."""
        self.rows_read += other.rows_read
        self.loaded += other.loaded
        self.out_of_order += other.out_of_order
        for mine, theirs in ((self.skipped, other.skipped), (self.changed, other.changed),
                             (self.warned, other.warned)):
            for reason, n in theirs.items():
                mine[reason] = mine.get(reason, 0) + n
        for k, v in other.first.items():
            self.first.setdefault(k, v)
        self.copies += 1

    def times(self, copies: int) -> None:
        """Count the rows ``copies`` times: the trace now holds that many copies of what was loaded."""
        self.rows_read *= copies
        self.loaded *= copies
        self.out_of_order *= copies
        for counts in (self.skipped, self.changed, self.warned):
            for reason in counts:
                counts[reason] *= copies
        self.copies *= copies

    def _count(self, kind: str, counts: dict[str, int], reason: str, where: str | None, detail: str,
               n: int = 1) -> None:
        counts[reason] = counts.get(reason, 0) + n
        if where is not None:
            self.first.setdefault(f"{kind}: {reason}", f"{where}: {detail}" if detail else where)

    def skip(self, reason: str, where: str | None = None, detail: str = "", n: int = 1) -> None:
        """Count ``n`` rows read that are not in the trace (``where`` names the first, ``detail`` says why)."""
        self._count("skipped", self.skipped, reason, where, detail, n)

    def cut(self, reason: str, n: int) -> None:
        """``n`` requests of the loaded trace were cut by a transform: skipped, and no longer loaded."""
        if n > 0:
            self.skip(reason, n=n)
            self.loaded -= n

    def change(self, reason: str, where: str | None, detail: str = "", strict: bool = False) -> None:
        """Count a request whose recorded value was changed (``detail`` says which and how).

        Raises:
            TraceError: ``strict``: ``<where>: <detail> (strict: ...)``, one line.
        """
        if strict:
            raise TraceError(f"{where}: {detail or reason} (strict: rows are replayed as recorded or not at all)")
        self._count("changed", self.changed, reason, where, detail)

    def warn(self, reason: str, where: str, detail: str = "", strict: bool = False) -> None:
        """Count a request kept as recorded whose values disagree with each other (``detail`` says how).

        Raises:
            TraceError: ``strict``: ``<where>: <detail> (strict)``, one line.
        """
        if strict:
            raise TraceError(f"{where}: {detail or reason} (strict)")
        self._count("warned", self.warned, reason, where, detail)

    def arrival(self, key: Any, where: str, column: str, value: Any, strict: bool = False) -> None:
        """Note a loaded row's arrival and count the row when it is earlier than the loaded row before it.

        Args:
            key: orders arrivals (a number, or a tuple such as (s, ns)).
            where: ``<file>:<line>``.
            column: the arrival's field name.
            value: the arrival as the file writes it (for the message).
            strict: raise instead of counting.

        Raises:
            TraceError: ``strict`` and the row is out of arrival order.
        """
        if self._last is not None and key < self._last[0]:
            detail = f"{column} {clip(str(value))} is earlier than the row before it ({clip(self._last[1])})"
            if strict:
                raise TraceError(f"{where}: {detail} (strict: rows must be in arrival order)")
            self.out_of_order += 1
            self.first.setdefault("out of arrival order", f"{where}: {detail}")
        self._last = (key, str(value))

    def summary(self) -> str:
        """One line: ``<rows_read> rows read, <loaded> loaded`` and the skipped, changed, warned and
        out-of-order counts that are not 0."""
        parts = [f"{self.rows_read} rows read, {self.loaded} loaded"]
        for label, n in (("skipped", sum(self.skipped.values())), ("changed", sum(self.changed.values())),
                         ("warned", sum(self.warned.values())), ("out of arrival order", self.out_of_order)):
            if n:
                parts.append(f"{n} {label}")
        if self.limit is not None:
            parts.append(f"stopped at limit {self.limit}")
        if self.copies > 1:
            parts.append(f"counts summed over {self.copies} copies")
        if self.synthesized is not None:
            parts.append(f"{self.synthesized} requests synthesized from them")
        return ", ".join(parts)

    def notes(self) -> list[str]:
        """One line per reason: what was re-ordered, skipped, changed or warned about, with its first row."""
        out = []
        if self.out_of_order:
            out.append(f"{self.out_of_order} row(s) out of arrival order, sorted by arrival "
                       f"(first {self.first['out of arrival order']})")
        for kind, counts in (("skipped", self.skipped), ("changed", self.changed), ("warned", self.warned)):
            for reason, n in counts.items():
                ex = self.first.get(f"{kind}: {reason}")
                out.append(f"{kind} {n} row(s): {reason}" + (f" (first {ex})" if ex else ""))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The counts as JSON-ready data: the attributes, ``summary`` and ``notes``."""
        return {"path": self.path, "format": self.format, "rows_read": self.rows_read, "loaded": self.loaded,
                "skipped": dict(self.skipped), "changed": dict(self.changed), "warned": dict(self.warned),
                "out_of_order": self.out_of_order, "first": dict(self.first), "limit": self.limit,
                "copies": self.copies, "synthesized": self.synthesized, "summary": self.summary(),
                "notes": self.notes()}


def begin_stats(stats: LoadStats | None, path: str | Path, fmt: str) -> LoadStats:
    """``stats`` (or a new LoadStats when None), started on ``path`` of format ``fmt``."""
    return (stats if stats is not None else LoadStats()).start(path, fmt)


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
        raise TraceError(f"{where}: {column} must be a non-negative integer, got {shown(value)}")
    if isinstance(value, str):
        s = value.strip()
        try:
            n = int(s)
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                raise TraceError(f"{where}: {column} must be a non-negative integer, got {shown(value)}") from None
            if not math.isfinite(f) or not f.is_integer():
                raise TraceError(f"{where}: {column} must be a non-negative integer, got {shown(value)}") from None
            n = int(f)
    elif isinstance(value, int):
        n = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        n = int(value)
    else:
        raise TraceError(f"{where}: {column} must be a non-negative integer, got {shown(value)}")
    if n < 0:
        raise TraceError(f"{where}: {column} must be a non-negative integer, got {shown(value)}")
    return n


def output_count(value: Any, where: str, column: str, stats: LoadStats, strict: bool = False) -> int:
    """An output length in tokens (:func:`parse_count`); a recorded 0 becomes 1, as an engine generates at
    least one token (``max_tokens`` >= 1), counted in ``stats.changed``.

    Raises:
        TraceError: a bad count; a 0 under ``strict``.
    """
    n = parse_count(value, where, column)
    if n == 0:
        if strict:
            raise TraceError(f"{where}: {column} is 0 and an engine generates at least 1 token (strict: rows are "
                             "replayed as recorded or not at all)")
        stats.change(f"0 {column} raised to 1 (an engine generates at least 1 token)", where, f"{column} is 0")
        return 1
    return n


def parse_seconds(value: Any, where: str, column: str) -> float:
    """A finite number of seconds (or milliseconds: the caller converts).

    Raises:
        TraceError: a bool, text that is not a number, NaN or an infinity.
    """
    if isinstance(value, bool):
        raise TraceError(f"{where}: {column} must be a number, got {shown(value)}")
    try:
        f = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {column} must be a number, got {shown(value)}") from None
    if not math.isfinite(f):
        raise TraceError(f"{where}: {column} must be a finite number, got {shown(value)}")
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
        raise TraceError(f"{where}: {column} is not a timestamp like 2023-11-16 18:15:46.6805900, "
                         f"got {shown(value)}")
    y, mo, d, h, mi, sec, frac, tz = m.groups()
    try:
        stamp = _dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(sec))
    except ValueError as e:
        raise TraceError(f"{where}: {column} {shown(value)} is not a valid date/time ({e})") from None
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
            fields, text that is not UTF-8, malformed CSV. A header is quoted cut to :data:`MAX_SHOWN`.
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
                    f"got {clip(','.join(header))}"
                )
            n = 0
            for fields in reader:
                if not fields or not any(f.strip() for f in fields):
                    continue
                where = f"{path}:{reader.line_num}"
                if len(fields) != len(header):
                    raise TraceError(f"{where}: expected {len(header)} columns ({clip(','.join(header))}), "
                                     f"got {len(fields)}")
                yield where, dict(zip(header, fields))
                n += 1
                if limit is not None and n >= limit:
                    return
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise TraceError(f"{path}: malformed CSV ({clip(str(e))})") from None


def read_jsonl(path: Path, limit: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (``"<file>:<line>"``, object) for each non-blank line of a JSON-lines file.

    ``limit`` stops after that many objects.

    Raises:
        TraceError: a line that is not JSON or not a JSON object, text that is not UTF-8.
    """
    n = 0
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
                yield where, obj
                n += 1
                if limit is not None and n >= limit:
                    return
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


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
        raise TraceError(f"limit must be a positive integer, got {shown(limit)}")


def finish(reqs: list[TraceRequest], path: Path | str, stats: LoadStats | None = None,
           stopped_at: int | None = None) -> list[TraceRequest]:
    """Sort by arrival (stable) and rebase arrivals so the first is 0.0 (in place; returns ``reqs``).

    ``stats`` gets ``loaded`` = ``len(reqs)``, and ``limit`` = ``stopped_at`` (the loader's limit, when
    reading stopped there).

    Raises:
        TraceError: no requests (the message names ``path``).
    """
    if stats is not None:
        stats.loaded = len(reqs)
        stats.limit = stopped_at
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
        raise TraceError(f"seed must be a non-negative integer, got {shown(seed)}")


def positive_int(name: str, v: Any) -> int:
    """``v`` when it is a positive integer (not a bool); else TraceError naming the setting ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise TraceError(f"{name} must be a positive integer, got {shown(v)}")
    return v
