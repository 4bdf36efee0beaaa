"""Mooncake trace JSONL loader (arrivals in ms, lengths, 512-token prefix-block hashes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from workbench.traces.common import (TraceError, TraceRequest, check_file, check_limit, check_seed, check_vocab, finish,
                                     parse_count, parse_seconds)
from workbench.traces.ids import DEFAULT_VOCAB_HI, DEFAULT_VOCAB_LO, MOONCAKE_BLOCK_TOKENS, mooncake_prompt_ids


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
    p = check_file(path)
    check_limit(limit)
    check_seed(seed)
    check_vocab(vocab_lo, vocab_hi)
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
                t_ms = parse_seconds(obj["timestamp"], where, "timestamp")
                n_in = parse_count(obj["input_length"], where, "input_length")
                n_out = parse_count(obj["output_length"], where, "output_length")
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
    return finish(reqs, p)
