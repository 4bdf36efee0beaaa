"""Mooncake trace JSONL loader (arrivals in ms, lengths, 512-token prefix-block hashes)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from workbench.traces.common import (LoadStats, TraceError, TraceRequest, begin_stats, check_file, check_limit,
                                     check_seed, check_vocab, finish, output_count, parse_count, parse_seconds,
                                     read_jsonl, shown)
from workbench.traces.rows import RawRow
from workbench.traces.ids import DEFAULT_VOCAB_HI, DEFAULT_VOCAB_LO, MOONCAKE_BLOCK_TOKENS, mooncake_prompt_ids

# the warning reason of a row whose hash_ids do not cover its input_length in whole recorded blocks
BLOCKS_MISMATCH = f"len(hash_ids) != ceil(input_length / {MOONCAKE_BLOCK_TOKENS})"


def load_mooncake(
    path: str | Path,
    seed: int = 0,
    vocab_lo: int = DEFAULT_VOCAB_LO,
    vocab_hi: int = DEFAULT_VOCAB_HI,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    token_ids: bool = True,
    limit: int | None = None,
    strict: bool = False,
    stats: LoadStats | None = None,
) -> list[TraceRequest]:
    """Mooncake trace JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``.

    ``timestamp`` is milliseconds from the start (converted to seconds). ``hash_ids`` name 512-token prefix
    blocks; each prompt becomes its blocks' deterministic token ids (see :func:`mooncake_prompt_ids`) cut to
    its length, so requests sharing the first k hash ids share their first k blocks of token ids.

    A row needs ``len(hash_ids) == ceil(input_length / 512)``. One that disagrees is replayed as recorded
    (blocks past the prompt are unused; prompt tokens past the last block are the request's own) and
    counted in ``stats.warned``. Rows out of ``timestamp`` order are sorted and counted; an
    ``output_length`` of 0 is replayed as 1 token and counted.

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
        strict: a row whose block count disagrees, out of arrival order or with 0 ``output_length`` is an
            error.
        stats: filled with the row counts (see :class:`LoadStats`).

    Raises:
        TraceError: missing file, invalid JSON, missing or mistyped keys, negative lengths, empty trace;
            under ``strict`` the rows above.
    """
    p = check_file(path)
    check_limit(limit)
    check_seed(seed)
    check_vocab(vocab_lo, vocab_hi)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise TraceError(f"block_tokens must be a positive integer, got {shown(block_tokens)}")
    st = begin_stats(stats, p, "mooncake")
    reqs: list[TraceRequest] = []
    cache: dict[int, np.ndarray] = {}
    for r in iter_mooncake_rows(p, block_tokens, limit, strict, st):
        idx = len(reqs)
        ids = (mooncake_prompt_ids(r.hash_ids, r.prompt_tokens, seed, idx, block_tokens, vocab_lo, vocab_hi, cache)
               if token_ids else None)
        reqs.append(TraceRequest(r.request_id, r.key / 1000.0, r.prompt_tokens, r.output_tokens, ids, None,
                                 r.hash_ids))
    return finish(reqs, p, st, limit if limit is not None and len(reqs) >= limit else None)


def mooncake_seconds(key: float, base: float) -> float:
    """Seconds from ``base`` to ``key`` (both ``timestamp`` in ms), as :func:`load_mooncake` computes them."""
    return key / 1000.0 - base / 1000.0


def iter_mooncake_rows(p: Path, block_tokens: int, limit: int | None, strict: bool,
                       st: LoadStats) -> Iterator[RawRow]:
    """The JSONL's rows in file order, parsed and counted in ``st``; ``key`` is ``timestamp`` in ms,
    ``prompt_tokens`` is scaled to ``block_tokens`` per block (see :func:`load_mooncake`).

    Raises:
        TraceError: as :func:`load_mooncake`.
    """
    for i, (where, obj) in enumerate(read_jsonl(p, limit)):
        st.rows_read += 1
        for key in ("timestamp", "input_length", "output_length", "hash_ids"):
            if key not in obj:
                raise TraceError(f"{where}: missing key {key!r} (need timestamp, input_length, "
                                 "output_length, hash_ids)")
        t_ms = parse_seconds(obj["timestamp"], where, "timestamp")
        st.arrival(t_ms, where, "timestamp", obj["timestamp"], strict)
        n_in = parse_count(obj["input_length"], where, "input_length")
        n_out = output_count(obj["output_length"], where, "output_length", st, strict)
        hashes = obj["hash_ids"]
        if not isinstance(hashes, list) or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hashes
        ):
            raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
        need = -(-n_in // MOONCAKE_BLOCK_TOKENS)
        if len(hashes) != need:
            st.warn(BLOCKS_MISMATCH, where, f"input_length {n_in} needs {need} hash_ids of "
                    f"{MOONCAKE_BLOCK_TOKENS} tokens, got {len(hashes)}", strict)
        if block_tokens != MOONCAKE_BLOCK_TOKENS:
            full, rem = divmod(n_in, MOONCAKE_BLOCK_TOKENS)
            n_in = full * block_tokens + -(-rem * block_tokens // MOONCAKE_BLOCK_TOKENS)
        yield RawRow(t_ms, f"mooncake-{i}", n_in, n_out, where, hashes)
