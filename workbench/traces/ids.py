"""Prompt token ids for traces that record only lengths (or Mooncake's prefix-block hashes).

Ids are deterministic from the scenario seed, so a replay is the same run after run, and a prompt cut
shorter keeps a prefix of its longer self's ids (shared prefixes stay shared).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Sequence

import numpy as np

from workbench.traces.common import TraceError, TraceRequest, check_seed, check_vocab

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash block as recorded in the Mooncake traces
DEFAULT_VOCAB_LO = 100  # synthesized ids are drawn from [DEFAULT_VOCAB_LO, DEFAULT_VOCAB_HI)
DEFAULT_VOCAB_HI = 49000

_SYNTH_TAG = 0x5E17  # keeps synthesize_prompt_ids' seed sequences apart from Mooncake's (seed, hash id) ones
# vocabularies up to this size get interned ids (one int object per id value, shared by every prompt)
MAX_INTERNED_VOCAB = 1 << 20


@functools.lru_cache(maxsize=4)
def _int_table(vocab_hi: int) -> np.ndarray:
    """An object array whose item i is the int i, for i < ``vocab_hi`` (about 36 bytes an entry)."""
    return np.array(range(vocab_hi), dtype=object)


def as_id_list(ids: np.ndarray, vocab_hi: int) -> list[int]:
    """``ids.tolist()``, but every id below :data:`MAX_INTERNED_VOCAB` is one shared int object per value:
    a list of fresh ints costs 8 + 32 bytes a token, this one 8 (a 1,100-token prompt: 9 KB instead of
    44 KB), and indexing the table is faster than making the ints."""
    if vocab_hi > MAX_INTERNED_VOCAB or ids.size == 0:
        return ids.tolist()
    return _int_table(vocab_hi)[ids].tolist()


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
    check_seed(seed)
    check_vocab(vocab_lo, vocab_hi)
    if n_tokens < 0 or request_index < 0:
        raise TraceError(f"n_tokens and request_index must be >= 0, got {n_tokens}, {request_index}")
    rng = np.random.default_rng([seed, request_index, _SYNTH_TAG])
    return as_id_list(rng.integers(vocab_lo, vocab_hi, size=n_tokens, dtype=np.int64), vocab_hi)


def _block_ids(cache: dict[int, np.ndarray], h: int, seed: int, block_tokens: int, lo: int, hi: int) -> np.ndarray:
    """The ``block_tokens`` ids of hash block ``h`` (drawn once per (seed, h), then kept in ``cache``)."""
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
    ``_cache`` (hash id -> block ids) lets a loader draw each block once for a whole trace.

    Raises:
        TraceError: a negative seed, an empty vocab range, ``block_tokens`` < 1.
    """
    check_seed(seed)
    check_vocab(vocab_lo, vocab_hi)
    if block_tokens < 1:
        raise TraceError(f"block_tokens must be >= 1, got {block_tokens}")
    cache = {} if _cache is None else _cache
    n_blocks = min(len(hash_ids), -(-n_tokens // block_tokens))
    parts = [_block_ids(cache, int(h), seed, block_tokens, vocab_lo, vocab_hi) for h in hash_ids[:n_blocks]]
    ids = as_id_list(np.concatenate(parts)[:n_tokens], vocab_hi) if parts else []
    if len(ids) < n_tokens:
        ids += synthesize_prompt_ids(n_tokens - len(ids), seed, request_index, vocab_lo, vocab_hi)
    return ids


def request_key(request_id: str) -> int:
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

    Raises:
        TraceError: a negative seed, an empty vocab range, ``block_tokens`` < 1.
    """
    cache: dict[int, np.ndarray] = {}
    out = []
    for r in reqs:
        if r.prompt_token_ids is not None:
            out.append(r)
            continue
        key = request_key(r.request_id)
        if r.hash_ids is not None:
            ids = mooncake_prompt_ids(r.hash_ids, r.prompt_tokens, seed, key, block_tokens, vocab_lo, vocab_hi, cache)
        else:
            ids = synthesize_prompt_ids(r.prompt_tokens, seed, key, vocab_lo, vocab_hi)
        out.append(dataclasses.replace(r, prompt_token_ids=ids))
    return out
