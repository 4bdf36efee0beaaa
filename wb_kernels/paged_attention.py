"""Paged attention, PyTorch reference (CPU and any device).

The KV cache of one layer is two tensors shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A sequence's keys and values live in the blocks its ``block_table`` lists, in order: position ``p`` is
slot ``p % block_size`` of block ``block_table[p // block_size]``. These functions gather the blocks
and run masked softmax attention with grouped-query heads (each KV head serves
``num_heads // num_kv_heads`` query heads). Scale is ``1/sqrt(head_dim)`` unless given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values into their slots.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64, slot = block_id * block_size + offset.
    """
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Gather blocks into a padded contiguous tensor.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[batch, max_blocks]`` int64 (padding entries may be any valid block id).
    Returns:
        ``[batch, num_kv_heads, max_blocks * block_size, head_dim]``.
    """
    b, mb = block_tables.shape
    bs, kvh, d = cache.shape[1:]
    g = cache.index_select(0, block_tables.reshape(-1)).view(b, mb * bs, kvh, d)
    return g.transpose(1, 2)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole context.

    Args:
        q: ``[batch, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[batch, max_blocks]`` int64.
        context_lens: ``[batch]`` int64, tokens attended (including the query's own, already written).
    Returns:
        ``[batch, num_heads, head_dim]``.
    """
    b, h, d = q.shape
    k = gather_kv(k_cache, block_tables)
    v = gather_kv(v_cache, block_tables)
    pos = torch.arange(k.shape[2], device=q.device)
    mask = (pos[None, :] < context_lens[:, None]).view(b, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.view(b, h, 1, d), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.view(b, h, d)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention for ``n`` new tokens of one sequence at positions ``start_pos .. start_pos+n-1``.

    Their K/V must already be written. Token ``i`` attends to positions ``0 .. start_pos + i``.

    Args:
        q: ``[n, num_heads, head_dim]``.
        block_table: ``[num_blocks_of_seq]`` int64 covering ``start_pos + n`` positions.
    Returns:
        ``[n, num_heads, head_dim]``.
    """
    n, h, d = q.shape
    ctx = start_pos + n
    k = gather_kv(k_cache, block_table.view(1, -1))[:, :, :ctx]
    v = gather_kv(v_cache, block_table.view(1, -1))[:, :, :ctx]
    return causal_attention(q, k[0].transpose(0, 1), v[0].transpose(0, 1), start_pos, scale)


def paged_attention_prefill_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    start_pos: torch.Tensor,
    scale: float | None = None,
    *,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Causal attention for the prefill chunks of several sequences in one call (the reference: one
    :func:`paged_attention_prefill` per chunk).

    Chunk ``s`` is the query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1``, at positions
    ``start_pos[s] ..``; its K/V must already be written, and its row ``i`` attends to positions
    ``0 .. start_pos[s] + i`` of its sequence.

    Args:
        q: ``[total_tokens, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_chunks, max_blocks]`` int64 (entries past a chunk's blocks may be any id).
        cu_seqlens_q: ``[num_chunks + 1]`` int64, cumulative chunk lengths from 0.
        start_pos: ``[num_chunks]`` int64, tokens cached before each chunk.
        max_seqlen_q: the longest chunk (the Triton kernel's launch size); unused here.
    Returns:
        ``[total_tokens, num_heads, head_dim]``.

    Raises:
        ValueError: index tensors whose lengths do not fit together.
    """
    ns = start_pos.shape[0]
    if cu_seqlens_q.shape != (ns + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != ns:
        raise ValueError(f"cu_seqlens_q must be [{ns + 1}] and block_tables [{ns}, max_blocks] for {ns} start positions")
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    bounds, starts = cu_seqlens_q.tolist(), start_pos.tolist()
    for s in range(ns):
        a, b, start = bounds[s], bounds[s + 1], starts[s]
        if b > a:
            table = block_tables[s, : -(-(start + b - a) // bs)]
            out[a:b] = paged_attention_prefill(q[a:b], k_cache, v_cache, table, start, scale)
    return out


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int = 0, scale: float | None = None
) -> torch.Tensor:
    """Dense causal attention with an offset (the reference the paged kernels are tested against).

    Args:
        q: ``[n, num_heads, head_dim]`` for positions ``start_pos .. start_pos + n - 1``.
        k, v: ``[start_pos + n, num_kv_heads, head_dim]``.
    Returns:
        ``[n, num_heads, head_dim]``.
    """
    n, h, d = q.shape
    ctx = k.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if start_pos == 0:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        qpos = torch.arange(start_pos, start_pos + n, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
