"""Workload traces: load public LLM-serving traces (and synthetic ones) into one request list.

Every loader returns a list of :class:`TraceRequest`, sorted by arrival, with arrivals in seconds from the
first request (the first is at 0.0). Formats (``load_trace(format, path, **kwargs)``):

=========== ===================================================================================================
``azure``    Azure LLM inference trace 2023 CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (datetime strings)
``mooncake`` Mooncake JSONL ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token
             prefix blocks, replayed as deterministic token ids so shared prefixes share ids)
``burstgpt`` BurstGPT CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`` (s)
``sharegpt`` ShareGPT JSON ``[{id, conversations: [{from, value}]}]``: first human turn is the prompt text
``vidur``    Vidur CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (s), or sarathi-serve's lengths CSV
             ``num_prefill_tokens,num_decode_tokens,...`` without arrivals (all at 0)
``synthetic`` Poisson/gamma arrivals at a rate, lengths fixed, uniform, lognormal or drawn from a lengths CSV
=========== ===================================================================================================

Every bad input raises :class:`TraceError` with one line ``<file>:<line>: <what is wrong>``.
Then :func:`apply_transforms` cuts, samples, rescales time and lengths; :func:`trace_stats` summarises.
"""

from __future__ import annotations

import calendar
import csv
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

FORMATS: tuple[str, ...] = ("azure", "mooncake", "burstgpt", "sharegpt", "vidur", "synthetic")
LENGTH_DISTS: tuple[str, ...] = ("fixed", "uniform", "lognormal", "file")
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash block as recorded in the Mooncake traces
DEFAULT_VOCAB_LO = 100
DEFAULT_VOCAB_HI = 49000
BUILTIN_TRACE_DIR = Path(__file__).parent / "data" / "traces"

_SYNTH_TAG = 0x5E17  # keeps synthesize_prompt_ids' seed sequences apart from Mooncake's (seed, hash id) ones


class TraceError(ValueError):
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


# ----------------------------------------------------------------------------------------------- helpers


def _check_file(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if not p.is_file():
        raise TraceError(f"{p}: not a regular file")
    return p


def _count(value: Any, where: str, column: str) -> int:
    """A token count: a non-negative integer (``"12"``, ``12``, ``"12.0"``)."""
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


def _seconds(value: Any, where: str, column: str) -> float:
    """A finite number of seconds (or milliseconds: the caller converts)."""
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


def _parse_datetime(value: str, where: str, column: str) -> tuple[int, int]:
    """``2023-11-16 18:15:46.6805900`` -> (whole seconds since the epoch, nanoseconds).

    Any number of fractional digits (Azure writes 7, i.e. 100 ns) is kept to the nanosecond without going
    through a float. No zone means UTC (only differences matter); ``Z`` or ``+hh:mm`` offsets are applied.
    A plain number is taken as seconds.
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


def _read_csv(path: Path, required: Sequence[str], limit: int | None = None) -> Iterator[tuple[str, dict[str, str]]]:
    """Yield (``"<file>:<line>"``, row dict) for each data row of a CSV with a header naming ``required``.

    Extra columns are allowed; blank lines are skipped; every row must have as many fields as the header.
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


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise TraceError(f"limit must be a positive integer, got {limit!r}")


def _finish(reqs: list[TraceRequest], path: Path | str) -> list[TraceRequest]:
    """Sort by arrival (stable) and rebase arrivals so the first is 0.0; an empty trace is an error."""
    if not reqs:
        raise TraceError(f"{path}: trace is empty (no requests)")
    reqs.sort(key=lambda r: r.arrival_s)
    t0 = reqs[0].arrival_s
    if t0 != 0.0:
        for r in reqs:
            r.arrival_s = r.arrival_s - t0
    return reqs


def _check_vocab(vocab_lo: int, vocab_hi: int) -> None:
    if not (0 <= vocab_lo < vocab_hi):
        raise TraceError(f"vocab range must satisfy 0 <= vocab_lo < vocab_hi, got [{vocab_lo}, {vocab_hi})")


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TraceError(f"seed must be a non-negative integer, got {seed!r}")


# ----------------------------------------------------------------------------------------- token ids


def synthesize_prompt_ids(
    n_tokens: int, seed: int, request_index: int, vocab_lo: int = DEFAULT_VOCAB_LO, vocab_hi: int = DEFAULT_VOCAB_HI
) -> list[int]:
    """Deterministic prompt token ids for traces that give only counts.

    Args:
        n_tokens: how many ids (>= 0).
        seed: scenario seed (>= 0).
        request_index: any non-negative integer that tells requests apart (a row index, or a key from a
            request id); the same (seed, request_index) always gives the same ids, and a shorter request
            gets a prefix of a longer one's ids.
        vocab_lo, vocab_hi: ids are drawn uniformly from [vocab_lo, vocab_hi).

    Raises:
        TraceError: negative n_tokens or seed, or an empty vocab range.
    """
    _check_seed(seed)
    _check_vocab(vocab_lo, vocab_hi)
    if n_tokens < 0 or request_index < 0:
        raise TraceError(f"n_tokens and request_index must be >= 0, got {n_tokens}, {request_index}")
    rng = np.random.default_rng([seed, request_index, _SYNTH_TAG])
    return rng.integers(vocab_lo, vocab_hi, size=n_tokens, dtype=np.int64).tolist()


def _block_ids(cache: dict[int, np.ndarray], h: int, seed: int, block_tokens: int, lo: int, hi: int) -> np.ndarray:
    blk = cache.get(h)
    if blk is None:
        blk = np.random.default_rng([seed, h]).integers(lo, hi, size=block_tokens, dtype=np.int64)
        cache[h] = blk
    return blk


def mooncake_prompt_ids(
    hash_ids: Sequence[int],
    n_tokens: int,
    seed: int = 0,
    request_index: int = 0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    vocab_lo: int = DEFAULT_VOCAB_LO,
    vocab_hi: int = DEFAULT_VOCAB_HI,
    _cache: dict[int, np.ndarray] | None = None,
) -> list[int]:
    """A Mooncake prompt: its hash blocks' token ids concatenated and cut to ``n_tokens``.

    Block id ``h`` is always the same ``block_tokens`` ids, drawn from ``numpy.random.default_rng([seed, h])``
    in [vocab_lo, vocab_hi); so two prompts that share their first k hash ids share their first
    ``k * block_tokens`` token ids. Tokens beyond the last block (when ``n_tokens`` exceeds
    ``len(hash_ids) * block_tokens``) come from :func:`synthesize_prompt_ids` with ``request_index``.
    """
    _check_seed(seed)
    _check_vocab(vocab_lo, vocab_hi)
    if block_tokens < 1:
        raise TraceError(f"block_tokens must be >= 1, got {block_tokens}")
    cache = {} if _cache is None else _cache
    n_blocks = min(len(hash_ids), -(-n_tokens // block_tokens))
    parts = [_block_ids(cache, int(h), seed, block_tokens, vocab_lo, vocab_hi) for h in hash_ids[:n_blocks]]
    ids = np.concatenate(parts)[:n_tokens].tolist() if parts else []
    if len(ids) < n_tokens:
        ids += synthesize_prompt_ids(n_tokens - len(ids), seed, request_index, vocab_lo, vocab_hi)
    return ids


def _request_key(request_id: str) -> int:
    """A stable 63-bit integer from a request id (so synthesized ids do not depend on list position)."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


def ensure_prompt_ids(
    reqs: Sequence[TraceRequest],
    seed: int = 0,
    vocab_lo: int = DEFAULT_VOCAB_LO,
    vocab_hi: int = DEFAULT_VOCAB_HI,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Copies of ``reqs`` where every request has ``prompt_token_ids`` of length ``prompt_tokens``.

    Requests that already have ids keep them. Mooncake requests (``hash_ids`` set) get their prefix blocks
    (:func:`mooncake_prompt_ids`, with ``block_tokens`` as used when loading); the others get
    :func:`synthesize_prompt_ids` keyed by a hash of their ``request_id`` (stable under sampling).
    """
    cache: dict[int, np.ndarray] = {}
    out = []
    for r in reqs:
        if r.prompt_token_ids is not None:
            out.append(r)
            continue
        key = _request_key(r.request_id)
        if r.hash_ids is not None:
            ids = mooncake_prompt_ids(r.hash_ids, r.prompt_tokens, seed, key, block_tokens, vocab_lo, vocab_hi, cache)
        else:
            ids = synthesize_prompt_ids(r.prompt_tokens, seed, key, vocab_lo, vocab_hi)
        out.append(dataclasses.replace(r, prompt_token_ids=ids))
    return out


# ------------------------------------------------------------------------------------------- loaders


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
    p = _check_file(path)
    _check_limit(limit)
    cols = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    raw = []
    for i, (where, row) in enumerate(_read_csv(p, cols, limit)):
        whole, ns = _parse_datetime(row["TIMESTAMP"], where, "TIMESTAMP")
        raw.append((f"azure-{i}", whole, ns, _count(row["ContextTokens"], where, "ContextTokens"),
                    _count(row["GeneratedTokens"], where, "GeneratedTokens")))
    if not raw:
        raise TraceError(f"{p}: trace is empty (no requests)")
    w0, n0 = min((r[1], r[2]) for r in raw)
    reqs = [TraceRequest(rid, (w - w0) + (ns - n0) / 1e9, pt, ot) for rid, w, ns, pt, ot in raw]
    return _finish(reqs, p)


def load_mooncake(
    path: str | Path,
    seed: int = 0,
    vocab_lo: int = DEFAULT_VOCAB_LO,
    vocab_hi: int = DEFAULT_VOCAB_HI,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    token_ids: bool = True,
    limit: int | None = None,
) -> list[TraceRequest]:
    """Mooncake trace JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``.

    ``timestamp`` is milliseconds from the start (converted to seconds). ``hash_ids`` name 512-token prefix
    blocks; each prompt becomes its blocks' deterministic token ids (see :func:`mooncake_prompt_ids`) cut to
    its length, so requests sharing the first k hash ids share their first k blocks of token ids.

    Args:
        path: the JSONL file.
        seed: seeds the block contents (with each hash id).
        vocab_lo, vocab_hi: token ids are drawn from [vocab_lo, vocab_hi).
        block_tokens: tokens per block in the replay. 512 replays as recorded; a smaller value shrinks
            every prompt by ``block_tokens / 512`` while keeping its number of blocks (whole blocks stay
            whole, a partial last block shrinks in proportion, rounded up), so prefix sharing is replayed
            at a smaller scale. Output lengths are not scaled.
        token_ids: make ``prompt_token_ids`` now. A full trace at 512 tokens per block is ~60 M ids; pass
            False to keep only ``hash_ids`` and call :func:`ensure_prompt_ids` after cutting the trace.
        limit: read only the first N requests.

    Raises:
        TraceError: missing file, invalid JSON, missing or mistyped keys, negative lengths, empty trace.
    """
    p = _check_file(path)
    _check_limit(limit)
    _check_seed(seed)
    _check_vocab(vocab_lo, vocab_hi)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise TraceError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    reqs: list[TraceRequest] = []
    cache: dict[int, np.ndarray] = {}
    try:
        with p.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{p}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
                for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                    if key not in obj:
                        raise TraceError(f"{where}: missing key {key!r} (need timestamp, input_length, "
                                         "output_length, hash_ids)")
                t_ms = _seconds(obj["timestamp"], where, "timestamp")
                n_in = _count(obj["input_length"], where, "input_length")
                n_out = _count(obj["output_length"], where, "output_length")
                hashes = obj["hash_ids"]
                if not isinstance(hashes, list) or any(
                    isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hashes
                ):
                    raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
                if block_tokens != MOONCAKE_BLOCK_TOKENS:
                    full, rem = divmod(n_in, MOONCAKE_BLOCK_TOKENS)
                    n_in = full * block_tokens + -(-rem * block_tokens // MOONCAKE_BLOCK_TOKENS)
                idx = len(reqs)
                ids = (mooncake_prompt_ids(hashes, n_in, seed, idx, block_tokens, vocab_lo, vocab_hi, cache)
                       if token_ids else None)
                reqs.append(TraceRequest(f"mooncake-{idx}", t_ms / 1000.0, n_in, n_out, ids, None, hashes))
                if limit is not None and len(reqs) >= limit:
                    break
    except UnicodeDecodeError as e:
        raise TraceError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return _finish(reqs, p)


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
    p = _check_file(path)
    _check_limit(limit)
    cols = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
    reqs = []
    for i, (where, row) in enumerate(_read_csv(p, cols)):
        t = _seconds(row["Timestamp"], where, "Timestamp")
        n_in = _count(row["Request tokens"], where, "Request tokens")
        n_out = _count(row["Response tokens"], where, "Response tokens")
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
    return _finish(reqs, p)


def load_vidur(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Vidur request trace CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (``arrived_at`` in s).

    Also reads sarathi-serve's lengths CSV ``num_prefill_tokens,num_decode_tokens,...`` that has no
    ``arrived_at`` column: all arrivals are then 0 (apply ``request_rate`` in :func:`apply_transforms`).
    Extra columns are ignored.

    Raises:
        TraceError: missing file, header without the token columns, wrong column count, bad numbers, empty.
    """
    p = _check_file(path)
    _check_limit(limit)
    has_arrival = "arrived_at" in _header(p)
    cols = (("arrived_at",) if has_arrival else ()) + ("num_prefill_tokens", "num_decode_tokens")
    reqs = []
    for i, (where, row) in enumerate(_read_csv(p, cols, limit)):
        t = _seconds(row["arrived_at"], where, "arrived_at") if has_arrival else 0.0
        reqs.append(TraceRequest(f"vidur-{i}", t, _count(row["num_prefill_tokens"], where, "num_prefill_tokens"),
                                 _count(row["num_decode_tokens"], where, "num_decode_tokens")))
    return _finish(reqs, p)


def _header(p: Path) -> list[str]:
    """The first non-blank CSV row, stripped (empty list for an empty file)."""
    try:
        with p.open(newline="", encoding="utf-8-sig") as fh:
            for fields in csv.reader(fh):
                if fields and any(f.strip() for f in fields):
                    return [f.strip() for f in fields]
    except (UnicodeDecodeError, csv.Error):
        pass  # _read_csv reports it with context
    return []


_HUMAN = ("human", "user")
_ASSISTANT = ("gpt", "chatgpt", "assistant", "bard", "model")


def _tokenize_fn(tokenizer: Any) -> Callable[[str], list[int]]:
    if tokenizer is None:
        raise TraceError("sharegpt needs a tokenizer (a transformers tokenizer or a callable text -> list[int])")
    if hasattr(tokenizer, "encode"):
        return lambda text: list(tokenizer.encode(text))
    if callable(tokenizer):
        return lambda text: list(tokenizer(text))
    raise TraceError(f"tokenizer must have .encode or be callable, got {type(tokenizer).__name__}")


def load_sharegpt(
    path: str | Path,
    tokenizer: Any = None,
    default_output_tokens: int = 128,
    limit: int | None = None,
) -> list[TraceRequest]:
    """ShareGPT JSON: a list of ``{"id", "conversations": [{"from", "value"}, ...]}``.

    The first human turn is the prompt (``prompt_text``, tokenized into ``prompt_token_ids``). The output
    length is the token count of the first assistant (``gpt``) turn after it, else ``default_output_tokens``.
    Conversations without a human turn are skipped. All arrivals are 0: apply ``request_rate`` (and
    ``burstiness``) in :func:`apply_transforms` for a synthetic arrival process.

    Args:
        path: the JSON file.
        tokenizer: a transformers tokenizer (``.encode`` is used) or any callable text -> list[int].
        default_output_tokens: output length when a conversation has no assistant turn.
        limit: keep at most the first N usable conversations.

    Raises:
        TraceError: missing file, invalid JSON (with its line), an entry that is not a conversation (with its
            index), no tokenizer, no usable conversation.
    """
    p = _check_file(path)
    _check_limit(limit)
    tok = _tokenize_fn(tokenizer)
    if isinstance(default_output_tokens, bool) or not isinstance(default_output_tokens, int) or default_output_tokens < 1:
        raise TraceError(f"default_output_tokens must be a positive integer, got {default_output_tokens!r}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TraceError(f"{p}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, list):
        raise TraceError(f"{p}: expected a JSON list of conversations, got {type(data).__name__}")
    reqs: list[TraceRequest] = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        where = f"{p}: entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise TraceError(f"{where}: expected an object with a 'conversations' list")
        turns = entry["conversations"]
        for j, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
                raise TraceError(f"{where}: conversations[{j}] must be an object with string 'from' and 'value'")
        first = next((j for j, t in enumerate(turns) if t["from"].lower() in _HUMAN), None)
        if first is None:
            continue
        text = turns[first]["value"]
        ids = tok(text)
        reply = next((t["value"] for t in turns[first + 1:] if t["from"].lower() in _ASSISTANT), None)
        n_out = len(tok(reply)) if reply is not None else default_output_tokens
        rid = str(entry.get("id", f"sharegpt-{i}"))
        if rid in seen:
            rid = f"{rid}#{i}"
        seen.add(rid)
        reqs.append(TraceRequest(rid, 0.0, len(ids), max(1, n_out), ids, text))
        if limit is not None and len(reqs) >= limit:
            break
    return _finish(reqs, p)


def _length_pairs(path: str | Path) -> list[tuple[int, int]]:
    """(prompt, output) token pairs from any lengths-bearing CSV this module reads."""
    p = _check_file(path)
    header = _header(p)
    for fmt, loader in (("vidur", load_vidur), ("azure", load_azure), ("burstgpt", load_burstgpt)):
        needed = {"vidur": ("num_prefill_tokens",), "azure": ("ContextTokens",), "burstgpt": ("Request tokens",)}[fmt]
        if all(c in header for c in needed):
            return [(r.prompt_tokens, r.output_tokens) for r in loader(p)]
    raise TraceError(
        f"{p}:1: not a lengths CSV: need columns num_prefill_tokens,num_decode_tokens (or Azure/BurstGPT columns), "
        f"got {','.join(header) or 'nothing'}"
    )


def synthetic_arrivals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` arrival times (s) of a gamma renewal process, the first at 0.0.

    Inter-arrival times are Gamma(shape=burstiness, scale=1/(request_rate*burstiness)) as in
    ``vllm bench serve``: mean 1/request_rate; burstiness 1.0 is Poisson, < 1 burstier, > 1 more regular.
    ``request_rate`` = inf puts every arrival at 0.
    """
    if not (isinstance(request_rate, (int, float)) and request_rate > 0):
        raise TraceError(f"request_rate must be > 0 req/s (or inf), got {request_rate!r}")
    if not (isinstance(burstiness, (int, float)) and 0 < burstiness < math.inf):
        raise TraceError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    _check_seed(seed)
    if math.isinf(request_rate) or n <= 1:
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise TraceError(f"{name} must be a positive integer, got {v!r}")
    return v


def load_synthetic(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    lengths: str = "fixed",
    input_tokens: int = 256,
    output_tokens: int = 128,
    input_range: Sequence[int] | None = None,
    output_range: Sequence[int] | None = None,
    input_sigma: float = 0.5,
    output_sigma: float = 0.5,
    input_min: int = 1,
    input_max: int | None = None,
    output_min: int = 1,
    output_max: int | None = None,
    lengths_path: str | Path | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """A synthetic workload, deterministic from ``seed``.

    Arrivals: :func:`synthetic_arrivals` (gamma process at ``request_rate`` req/s; burstiness 1.0 = Poisson).
    Lengths (tokens; prompt and output drawn independently, each >= 1):

    - ``fixed``: every request ``input_tokens`` / ``output_tokens``.
    - ``uniform``: integers uniform in ``input_range`` = [lo, hi] and ``output_range`` (inclusive).
    - ``lognormal``: arithmetic mean ``input_tokens`` / ``output_tokens`` and log-space sigma
      ``input_sigma`` / ``output_sigma``, rounded and clipped to [input_min, input_max] / [output_min, output_max].
    - ``file``: (prompt, output) pairs drawn with replacement from the lengths CSV ``lengths_path``
      (sarathi/vidur, Azure or BurstGPT columns), then clipped like lognormal.

    Raises:
        TraceError: a setting out of range, a missing setting for the chosen ``lengths``, a bad lengths file.
    """
    n = _positive_int("num_requests", num_requests)
    _check_seed(seed)
    if lengths not in LENGTH_DISTS:
        raise TraceError(f"lengths must be one of {', '.join(LENGTH_DISTS)}, got {lengths!r}")
    arrivals = synthetic_arrivals(n, request_rate, burstiness, seed)
    rng = np.random.default_rng([seed, 2])
    if lengths == "fixed":
        p_len = np.full(n, _positive_int("input_tokens", input_tokens))
        o_len = np.full(n, _positive_int("output_tokens", output_tokens))
    elif lengths == "uniform":
        bounds = []
        for name, rng_ in (("input_range", input_range), ("output_range", output_range)):
            if rng_ is None or len(rng_) != 2 or not (1 <= int(rng_[0]) <= int(rng_[1])):
                raise TraceError(f"lengths uniform needs {name} = [lo, hi] with 1 <= lo <= hi, got {rng_!r}")
            bounds.append((int(rng_[0]), int(rng_[1])))
        p_len = rng.integers(bounds[0][0], bounds[0][1] + 1, size=n)
        o_len = rng.integers(bounds[1][0], bounds[1][1] + 1, size=n)
    elif lengths == "lognormal":
        draws = []
        for name, mean, sigma in (("input", input_tokens, input_sigma), ("output", output_tokens, output_sigma)):
            if not (isinstance(mean, (int, float)) and mean > 0):
                raise TraceError(f"lengths lognormal needs {name}_tokens (the mean) > 0, got {mean!r}")
            if not (isinstance(sigma, (int, float)) and sigma >= 0):
                raise TraceError(f"lengths lognormal needs {name}_sigma >= 0, got {sigma!r}")
            mu = math.log(mean) - sigma * sigma / 2.0
            draws.append(np.rint(rng.lognormal(mu, sigma, size=n)).astype(np.int64))
        p_len, o_len = draws
    else:
        if lengths_path is None:
            raise TraceError("lengths file needs lengths_path (a CSV of prompt/output token counts)")
        pairs = np.asarray(_length_pairs(lengths_path), dtype=np.int64)
        pick = rng.integers(0, len(pairs), size=n)
        p_len, o_len = pairs[pick, 0], pairs[pick, 1]
    if lengths in ("lognormal", "file"):
        for name, lo, hi in (("input", input_min, input_max), ("output", output_min, output_max)):
            if lo is None or lo < 1 or (hi is not None and hi < lo):
                raise TraceError(f"{name}_min must be >= 1 and <= {name}_max, got {lo!r}, {hi!r}")
        p_len = np.clip(p_len, input_min, input_max)
        o_len = np.clip(o_len, output_min, output_max)
    p_len, o_len = np.maximum(p_len, 1), np.maximum(o_len, 1)
    return [TraceRequest(f"synthetic-{i}", arrivals[i], int(p_len[i]), int(o_len[i])) for i in range(n)]


_LOADERS: dict[str, Callable[..., list[TraceRequest]]] = {
    "azure": load_azure,
    "mooncake": load_mooncake,
    "burstgpt": load_burstgpt,
    "sharegpt": load_sharegpt,
    "vidur": load_vidur,
}


def load_trace(format: str, path: str | Path | None = None, **kwargs: Any) -> list[TraceRequest]:
    """Load a trace of the given format (one of :data:`FORMATS`); ``kwargs`` go to that format's loader.

    For ``synthetic`` ``path`` is optional and, when given, is the lengths CSV (``lengths="file"``).

    Raises:
        TraceError: unknown format (the message lists the known ones), or any loader error.
    """
    if format == "synthetic":
        if path is not None:
            kwargs.setdefault("lengths_path", path)
            kwargs.setdefault("lengths", "file")
        try:
            return load_synthetic(**kwargs)
        except TypeError as e:
            raise TraceError(f"synthetic: {e}") from None
    loader = _LOADERS.get(format)
    if loader is None:
        raise TraceError(f"unknown trace format {format!r}; known formats: {', '.join(FORMATS)}")
    if path is None:
        raise TraceError(f"{format}: a trace file path is required")
    try:
        return loader(path, **kwargs)
    except TypeError as e:  # an unknown keyword for this loader
        raise TraceError(f"{path}: {format} loader: {e}") from None


# ------------------------------------------------------------------------------------------ transforms


def _resize_ids(r: TraceRequest, n_tokens: int, seed: int) -> tuple[list[int] | None, str | None]:
    """Token ids and text for a prompt resized to ``n_tokens``: cut keeps the prefix; growth appends ids."""
    if r.prompt_token_ids is None:
        return None, None
    if n_tokens == len(r.prompt_token_ids):
        return r.prompt_token_ids, None
    if n_tokens < len(r.prompt_token_ids):
        return r.prompt_token_ids[:n_tokens], None
    extra = synthesize_prompt_ids(n_tokens - len(r.prompt_token_ids), seed, _request_key(r.request_id))
    return r.prompt_token_ids + extra, None


def apply_transforms(
    reqs: Sequence[TraceRequest],
    limit: int | None = None,
    sample: int | None = None,
    seed: int = 0,
    time_scale: float | None = None,
    request_rate: float | None = None,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    length_scale: float | None = None,
    burstiness: float | None = None,
) -> list[TraceRequest]:
    """Cut, sample and rescale a trace; returns new requests (the input is not changed).

    Applied in this order:

    1. ``limit``: keep the first N requests (by arrival).
    2. ``sample``: keep N requests drawn at random without replacement (``seed``), sorted by arrival and
       rebased so the first arrives at 0.
    3. ``time_scale``: multiply every inter-arrival time (2.0 = half the rate; 0 = all at once).
    4. ``request_rate`` (req/s): rescale arrivals so the mean rate, (count - 1) / duration, equals it.
       When the trace has no timing (all arrivals equal, e.g. ShareGPT or sarathi lengths) or ``burstiness``
       is given, arrivals are instead replaced by a gamma process at that rate (burstiness default 1.0 =
       Poisson, see :func:`synthetic_arrivals`). ``inf`` puts every arrival at 0.
    5. ``length_scale``: multiply prompt and output lengths (rounded, at least 1).
    6. ``max_input_tokens`` / ``max_output_tokens``: clip lengths.

    Prompt token ids follow the prompt length: cutting keeps the prefix (so shared prefixes stay shared),
    growing appends synthesized ids; ``prompt_text`` is dropped once the length changed.

    Raises:
        TraceError: a setting out of range (limit, sample, caps < 1; sample larger than the trace;
            negative time_scale; request_rate or length_scale <= 0), or an empty trace.
    """
    out = sorted((dataclasses.replace(r) for r in reqs), key=lambda r: r.arrival_s)
    if not out:
        raise TraceError("trace is empty (no requests)")
    _check_seed(seed)
    if limit is not None:
        _check_limit(limit)
        out = out[:limit]
    if sample is not None:
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
            raise TraceError(f"sample must be a positive integer, got {sample!r}")
        if sample > len(out):
            raise TraceError(f"sample={sample} is more than the {len(out)} requests in the trace")
        pick = np.sort(np.random.default_rng([seed, 3]).choice(len(out), size=sample, replace=False))
        out = [out[i] for i in pick]
    t0 = out[0].arrival_s
    for r in out:
        r.arrival_s -= t0
    if time_scale is not None:
        if not (isinstance(time_scale, (int, float)) and 0 <= time_scale < math.inf):
            raise TraceError(f"time_scale must be a finite number >= 0, got {time_scale!r}")
        for r in out:
            r.arrival_s *= time_scale
    if request_rate is not None:
        if not (isinstance(request_rate, (int, float)) and request_rate > 0):
            raise TraceError(f"request_rate must be > 0 req/s (or inf), got {request_rate!r}")
        duration = out[-1].arrival_s
        if math.isinf(request_rate):
            for r in out:
                r.arrival_s = 0.0
        elif burstiness is not None or (duration <= 0 and len(out) > 1):
            for r, t in zip(out, synthetic_arrivals(len(out), request_rate, burstiness or 1.0, seed)):
                r.arrival_s = t
        elif len(out) > 1:
            factor = (len(out) - 1) / request_rate / duration
            for r in out:
                r.arrival_s *= factor
    elif burstiness is not None:
        raise TraceError("burstiness needs request_rate (the rate of the synthetic arrival process)")
    if length_scale is not None:
        if not (isinstance(length_scale, (int, float)) and 0 < length_scale < math.inf):
            raise TraceError(f"length_scale must be a finite number > 0, got {length_scale!r}")
    for name, cap in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens)):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise TraceError(f"{name} must be a positive integer, got {cap!r}")
    for r in out:
        p, o = r.prompt_tokens, r.output_tokens
        if length_scale is not None:
            p, o = max(1, round(p * length_scale)), max(1, round(o * length_scale))
        if max_input_tokens is not None:
            p = min(p, max_input_tokens)
        if max_output_tokens is not None:
            o = min(o, max_output_tokens)
        if p != r.prompt_tokens:
            r.prompt_token_ids, r.prompt_text = _resize_ids(r, p, seed)
        r.prompt_tokens, r.output_tokens = p, o
    return out


def _pcts(values: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
    }


def trace_stats(reqs: Sequence[TraceRequest]) -> dict[str, Any]:
    """Summary of a trace.

    Returns:
        ``count``; ``duration_s`` (last arrival - first, s); ``rate`` (req/s, (count - 1) / duration, 0.0
        when the duration is 0); ``burstiness`` (coefficient of variation of inter-arrival times,
        std / mean: about 1 for Poisson; None with fewer than 2 gaps or a zero mean gap);
        ``prompt_tokens`` and ``output_tokens``: each ``{mean, p50, p90, p99, max}`` in tokens.

    Raises:
        TraceError: empty trace.
    """
    if not reqs:
        raise TraceError("trace is empty (no requests)")
    t = np.sort(np.array([r.arrival_s for r in reqs], dtype=np.float64))
    duration = float(t[-1] - t[0])
    gaps = np.diff(t)
    cv = None
    if len(gaps) >= 2 and gaps.mean() > 0:
        cv = float(gaps.std() / gaps.mean())
    return {
        "count": len(reqs),
        "duration_s": duration,
        "rate": (len(reqs) - 1) / duration if duration > 0 else 0.0,
        "burstiness": cv,
        "prompt_tokens": _pcts(np.array([r.prompt_tokens for r in reqs], dtype=np.float64)),
        "output_tokens": _pcts(np.array([r.output_tokens for r in reqs], dtype=np.float64)),
    }
