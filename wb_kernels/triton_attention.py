"""Paged attention in Triton: a decode kernel and a prefill/chunked-prefill kernel over block tables.

Same cache layout and semantics as the PyTorch reference in ``wb_kernels.paged_attention``: per layer,
``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``; position ``p`` of a
sequence lives in slot ``p % block_size`` of block ``block_table[p // block_size]``; query head ``h``
reads KV head ``h // (num_heads // num_kv_heads)`` (GQA). Both kernels read the blocks in place (no
gather) with an online softmax (running max and sum, as FlashAttention / vLLM's paged kernels), in
float32 accumulators whatever the input dtype.

* ``paged_attention_decode``: one query token per sequence; grid ``(batch, num_heads)``; each program
  walks its sequence's blocks.
* ``paged_attention_prefill_varlen``: a chunk of ``n_s`` new tokens per sequence at positions
  ``start_s .. start_s + n_s - 1`` (their K/V already written): each attends to every earlier context
  token through the block table and causally within the chunk. Grid ``(seqs, query tiles, heads)``.

Without a CUDA device the module sets ``TRITON_INTERPRET=1`` before importing Triton, so the kernels
run (slowly) in Triton's interpreter on CPU tensors: that is how the tests check them on this machine.
Triton reads that variable when it is first imported, so a process that imported Triton earlier
(building a transformers model does) cannot interpret them: ``available()`` is then False, and the
kernels raise a one-line error saying to set ``TRITON_INTERPRET=1`` in the environment.
"""

from __future__ import annotations

import os
import sys

import torch

# Triton imported before this module without the interpreter, on a machine with no GPU: kernels cannot run
_NO_INTERPRETER = (not torch.cuda.is_available() and "triton" in sys.modules
                   and os.environ.get("TRITON_INTERPRET") != "1")
if not torch.cuda.is_available():  # pragma: no branch - CPU machines run the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


NO_INTERPRETER_ERROR = ("Triton was imported before wb_kernels.triton_attention without TRITON_INTERPRET=1 and there is "
                        "no CUDA device, so its kernels cannot run; set TRITON_INTERPRET=1 in the environment")


def available() -> bool:
    """The kernels can run: a CUDA device, or Triton's interpreter (see the module docstring)."""
    return not _NO_INTERPRETER


def _check_runnable() -> None:
    if _NO_INTERPRETER:
        raise RuntimeError(NO_INTERPRETER_ERROR)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, lens_ptr, scale,
                   stride_qb, stride_qh, stride_ob, stride_oh,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    ctx = tl.load(lens_ptr + seq)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    nblocks = tl.cdiv(ctx, BLOCK_SIZE)
    for b in range(0, nblocks):
        phys = tl.load(bt_ptr + seq * stride_bt + b).to(tl.int64)
        pos = b * BLOCK_SIZE + offs_s
        smask = pos < ctx
        kp = k_ptr + phys * stride_kb + offs_s[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
        k = tl.load(kp, mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(smask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        vp = v_ptr + phys * stride_vb + offs_s[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :]
        v = tl.load(vp, mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_q_ptr, start_ptr, scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kvh = head // GROUP
    q0 = tl.load(cu_q_ptr + seq)
    n = tl.load(cu_q_ptr + seq + 1) - q0
    if tile * BLOCK_M < n:
        start = tl.load(start_ptr + seq)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < n
        qpos = start + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        offs_s = tl.arange(0, BLOCK_SIZE)
        qp = q_ptr + (q0 + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        q = tl.load(qp, mask=mmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        last = start + tl.minimum((tile + 1) * BLOCK_M, n)  # keys up to the tile's last query (exclusive)
        for b in range(0, tl.cdiv(last, BLOCK_SIZE)):
            phys = tl.load(bt_ptr + seq * stride_bt + b).to(tl.int64)
            kpos = b * BLOCK_SIZE + offs_s
            kmask = kpos < last
            kp = k_ptr + phys * stride_kb + offs_s[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
            k = tl.load(kp, mask=kmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            allowed = (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet (masked rows)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            vp = v_ptr + phys * stride_vb + offs_s[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :]
            v = tl.load(vp, mask=kmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        op = out_ptr + (q0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(op, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> tuple[int, int]:
    _check_runnable()
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) dimension")
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    if num_heads % kvh:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kvh})")
    if bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two for the Triton kernels, got {bs}")
    return bs, num_heads // kvh


def _check_device(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"q, k_cache and v_cache must be on one device, got {q.device}, {k_cache.device} "
                         f"and {v_cache.device}")


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One query token per sequence attending to its whole context (Triton).

    Args:
        q: ``[batch, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (block_size a power of 2).
        block_tables: ``[batch, max_blocks]`` int (entries past a sequence's blocks are not read).
        context_lens: ``[batch]`` int, tokens attended (>= 1), including the query's own.
    Returns:
        ``[batch, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: shapes that do not fit together.
        RuntimeError: the kernels cannot run in this process (see ``available``).
    """
    b, h, d = q.shape
    bs, group = _check_cache(k_cache, v_cache, h)
    _check_device(q, k_cache, v_cache)
    q = q.contiguous()
    bt = block_tables.to(device=q.device, dtype=torch.int32).contiguous()
    lens = context_lens.to(device=q.device, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)
    scale = scale if scale is not None else d ** -0.5
    _decode_kernel[(b, h)](q, k_cache, v_cache, out, bt, lens, scale,
                           q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                           v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
                           GROUP=group, BLOCK_SIZE=bs, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d))
    return out


def paged_attention_prefill_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, start_pos: torch.Tensor,
                                   scale: float | None = None, block_m: int = 16,
                                   max_seqlen_q: int | None = None) -> torch.Tensor:
    """Chunks of new tokens of several sequences, each attending to its cached context and causally
    within the chunk (Triton).

    Args:
        q: ``[total_tokens, num_heads, head_dim]``, sequence ``s``'s tokens at rows
            ``cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, with the chunk's K/V written.
        block_tables: ``[num_seqs, max_blocks]`` int covering ``start_pos[s] + n_s`` positions.
        cu_seqlens_q: ``[num_seqs + 1]`` int, cumulative chunk lengths (starts at 0).
        start_pos: ``[num_seqs]`` int, position of each chunk's first token (= tokens cached before it).
        block_m: query rows per program (a power of 2 >= 16).
        max_seqlen_q: the longest chunk, in tokens, when the caller knows it (as flash-attention's
            ``max_seqlen_q``); None reads it from ``cu_seqlens_q``, which waits for the device.
    Returns:
        ``[total_tokens, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: shapes that do not fit together.
        RuntimeError: the kernels cannot run in this process (see ``available``).
    """
    t, h, d = q.shape
    bs, group = _check_cache(k_cache, v_cache, h)
    ns = block_tables.shape[0]
    if cu_seqlens_q.shape != (ns + 1,) or start_pos.shape != (ns,):
        raise ValueError(f"cu_seqlens_q must be [{ns + 1}] and start_pos [{ns}] for {ns} block tables")
    _check_device(q, k_cache, v_cache)
    q = q.contiguous()
    # index tensors go where the kernel reads them (a block table built on the host, say)
    bt = block_tables.to(device=q.device, dtype=torch.int32).contiguous()
    cu = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    st = start_pos.to(device=q.device, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)
    if max_seqlen_q is not None:
        max_n = max_seqlen_q if ns else 0
    else:
        max_n = int((cu[1:] - cu[:-1]).max()) if ns else 0
    if max_n == 0:
        return out
    scale = scale if scale is not None else d ** -0.5
    grid = (ns, triton.cdiv(max_n, block_m), h)
    _prefill_kernel[grid](q, k_cache, v_cache, out, bt, cu, st, scale,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                          k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
                          GROUP=group, BLOCK_SIZE=bs, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                          BLOCK_M=block_m)
    return out


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                            start_pos: int, scale: float | None = None) -> torch.Tensor:
    """One sequence's chunk, with ``wb_kernels.paged_attention.paged_attention_prefill``'s signature.

    Args:
        q: ``[n, num_heads, head_dim]``; block_table: ``[num_blocks_of_seq]`` int.
    Returns:
        ``[n, num_heads, head_dim]``.
    """
    n = q.shape[0]
    return paged_attention_prefill_varlen(q, k_cache, v_cache, block_table.view(1, -1),
                                          torch.tensor([0, n], device=q.device),
                                          torch.tensor([start_pos], device=q.device), scale, max_seqlen_q=n)
