"""Shared-prefix workloads: the trace's ideal prefix-cache hit rate, and a Mooncake-format trace generator.

``ideal_prefix_hit_rate`` is what a prefix cache of unlimited size would hit on a trace, counted the way
the engine counts (``vllm:prefix_cache_hits / vllm:prefix_cache_queries``, in tokens): requests are
admitted in arrival order; a request hits the longest run of leading *full* blocks (``block_size``
tokens) that some earlier request computed, at most ``len(prompt) - 1`` tokens (the last prompt token
is always recomputed so there are logits to sample from); then all of its own full prompt blocks are
cached. Generated output tokens are not counted as reusable (a later prompt never contains them here).

``make_shared_prefix_trace`` writes a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks; see :func:`workbench.traces.load_mooncake`) with the
structure of Mooncake's conversation/tool-agent traces (FAST'25): a few long shared contexts (system
prompts, documents, tool descriptions) that many requests start with, followed by request-specific
blocks, and follow-up turns that extend an earlier request's blocks. It is synthetic: no lengths or
ids come from a recorded trace.

Scaling: replay such a trace with ``trace.block_tokens`` (tokens per hash block, e.g. 64 instead of
512): whole blocks stay whole, so prefix sharing is kept block for block. ``trace.length_scale``
instead scales each prompt length and then cuts its token ids to that length: shared prefixes stay
shared, but a shortened prompt keeps only its first blocks, so the reuse fraction changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from engines.core.block_pool import hash_token_blocks
from workbench.traces.ids import MOONCAKE_BLOCK_TOKENS


def ideal_prefix_hit_rate(prompts: Sequence[Sequence[int]], block_size: int) -> dict:
    """Hits, queries (tokens) and hit rate of an unlimited prefix cache over ``prompts`` in order.

    Args:
        prompts: token ids of each request's prompt, in admission (arrival) order.
        block_size: the engine's tokens per KV block.

    Returns:
        ``{"hits": int, "queries": int, "hit_rate": float}``.

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set = set()
    hits = queries = 0
    for p in prompts:
        n = len(p)
        queries += n
        hashes = hash_token_blocks(None, p, block_size)
        k = 0
        for h in hashes[: max(0, n - 1) // block_size]:
            if h not in seen:
                break
            k += 1
        hits += k * block_size
        seen.update(hashes)
    return {"hits": hits, "queries": queries, "hit_rate": hits / queries if queries else 0.0}


def make_shared_prefix_trace(num_requests: int = 80, num_contexts: int = 6, context_blocks: tuple[int, int] = (6, 14),
                             question_blocks: tuple[int, int] = (1, 3), follow_up_prob: float = 0.3,
                             output_tokens: tuple[int, int] = (16, 48), request_rate: float = 4.0,
                             seed: int = 0) -> list[dict]:
    """Mooncake-format records (dicts) of a shared-prefix workload (see the module docstring).

    Each request starts with one of ``num_contexts`` shared contexts (Zipf-like popularity) of
    ``context_blocks`` hash blocks, or (with ``follow_up_prob``) continues an earlier request (all its
    blocks), then adds ``question_blocks`` new blocks, the last one partly filled. Output lengths are
    uniform in ``output_tokens``; arrivals are Poisson at ``request_rate`` req/s. Block counts are in
    512-token hash blocks, lengths in tokens, ``timestamp`` in ms from the first request.

    Raises:
        ValueError: (from numpy) a range with lo > hi, or ``num_contexts`` < 1.
    """
    rng = np.random.default_rng(seed)
    next_id = 0

    def new_blocks(n):
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    contexts = [new_blocks(int(rng.integers(context_blocks[0], context_blocks[1] + 1))) for _ in range(num_contexts)]
    pop = 1.0 / np.arange(1, num_contexts + 1)
    pop /= pop.sum()
    t = 0.0
    out: list[dict] = []
    for _ in range(num_requests):
        if out and rng.random() < follow_up_prob:
            prev = out[int(rng.integers(len(out)))]["hash_ids"]
            base = list(prev)
        else:
            base = list(contexts[int(rng.choice(num_contexts, p=pop))])
        q = new_blocks(int(rng.integers(question_blocks[0], question_blocks[1] + 1)))
        hash_ids = base + q
        last = int(rng.integers(64, MOONCAKE_BLOCK_TOKENS + 1))  # the last block is partly filled
        out.append({"timestamp": int(round(t * 1000)),
                    "input_length": (len(hash_ids) - 1) * MOONCAKE_BLOCK_TOKENS + last,
                    "output_length": int(rng.integers(output_tokens[0], output_tokens[1] + 1)), "hash_ids": hash_ids})
        t += float(rng.exponential(1.0 / request_rate))
    return out


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    """Write records one JSON object per line to ``path``; returns it as a Path.

    Raises:
        OSError: the file cannot be written.
    """
    p = Path(path)
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p
