"""Variable-length prefill attention: every prefill chunk of a step in one call per layer.

The compiled CPU kernel, the PyTorch reference and the Triton kernel (interpreter) against dense causal
attention on random shapes (grouped-query heads, odd chunk lengths, partial last blocks, chunks after
cached context, several chunks with shuffled block ids in one call), bfloat16 against the float32
reference, and a mixed decode + prefill step through ``LlamaModel.forward`` against the per-chunk path.
In CI a compiled kernel that does not build fails these tests instead of skipping them.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from wb_kernels import cpu_ops
from wb_kernels.paged_attention import causal_attention, paged_attention_prefill, paged_attention_prefill_varlen, write_kv

KERNEL_MISSING = "the compiled CPU kernel (wb_kernels/csrc/paged_attention_cpu.cpp) is unavailable"
F32_TOL = dict(atol=2e-5, rtol=1e-5)
# bfloat16 inputs are exact in float32 and the kernel computes in float32, so the only extra error is the
# output's rounding to bfloat16: at most half an ulp, 2**-9 relative (the tolerance allows one ulp)
BF16_TOL = dict(atol=1e-4, rtol=2**-8)


@pytest.fixture
def kernel(require):
    require(cpu_ops.available(), KERNEL_MISSING, cpu_ops.build_error())


def _triton_varlen():
    try:
        from wb_kernels import triton_attention
    except ImportError:
        return None
    return triton_attention.paged_attention_prefill_varlen if triton_attention.available() else None


def implementation(name: str, require):
    """The varlen function called ``name``; the compiled one needs the kernel (fails in CI without it)."""
    if name == "cpp":
        require(cpu_ops.available(), KERNEL_MISSING, cpu_ops.build_error())
        return cpu_ops.paged_attention_prefill_varlen
    if name == "triton":
        fn = _triton_varlen()
        if fn is None:
            pytest.skip("Triton is not installed or cannot run its interpreter in this process")
        return fn
    return paged_attention_prefill_varlen


def make_step(seed: int, chunks: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype=torch.float32):
    """A KV cache holding, for each ``(new tokens, cached tokens)`` chunk, its sequence's dense K/V on
    shuffled (non-contiguous) blocks, every slot no chunk owns (spare blocks, the tail of partial last
    blocks) NaN so that a read past a chunk's context shows; and the chunks' packed queries.

    Returns:
        dict with ``q [T, H, D]``, caches, ``block_tables [P, max_blocks]`` (padded with spare block ids),
        ``cu [P + 1]``, ``starts [P]`` and per chunk the dense ``k``/``v`` ``[start + n, KVH, D]``.
    """
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    need = [-(-(n + s) // block_size) for n, s in chunks]
    num_blocks = sum(need) + 5
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables, dense_k, dense_v, qs = [], [], [], []
    for (n, start), nb in zip(chunks, need):
        table, ids = ids[:nb], ids[nb:]
        ctx = start + n
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        write_kv(k_cache, v_cache, k, v, slots)
        tables.append(table)
        dense_k.append(k)
        dense_v.append(v)
        qs.append(torch.randn(n, heads, head_dim, generator=gen).to(dtype))
    width = max(need) + 1  # one more than any chunk needs: entries past a chunk's blocks are never read
    spare = ids or [0]
    rows = [t + [rng.choice(spare) for _ in range(width - len(t))] for t in tables]
    lens = [n for n, _ in chunks]
    return dict(q=torch.cat(qs), k_cache=k_cache, v_cache=v_cache, block_tables=torch.tensor(rows),
                cu=torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))]),
                starts=torch.tensor([s for _, s in chunks]), k=dense_k, v=dense_v, chunks=chunks)


def dense_reference(step, scale=None) -> torch.Tensor:
    """Each chunk's causal attention on its dense K/V (float32), packed as the varlen output."""
    outs = []
    bounds = step["cu"].tolist()
    for i, (n, start) in enumerate(step["chunks"]):
        q = step["q"][bounds[i] : bounds[i + 1]].float()
        outs.append(causal_attention(q, step["k"][i].float(), step["v"][i].float(), start, scale))
    return torch.cat(outs)


def run(fn, step, scale=None, q=None):
    q = step["q"] if q is None else q
    return fn(q, step["k_cache"], step["v_cache"], step["block_tables"], step["cu"], step["starts"], scale,
              max_seqlen_q=max(n for n, _ in step["chunks"]))


# (chunks as (new tokens, cached tokens), heads, kv heads, head_dim, block size)
CASES = [
    ([(300, 0)], 9, 3, 64, 16),                                  # SmolLM2's heads, one fresh prompt
    ([(1, 0), (7, 0), (33, 0), (300, 0)], 9, 3, 64, 16),         # odd fresh chunks, partial last blocks
    ([(7, 41), (33, 16), (1, 5), (300, 77)], 9, 3, 64, 8),       # chunks after cached context
    ([(33, 0), (7, 19), (300, 13), (1, 0)], 4, 4, 64, 32),       # no grouping, mixed fresh and cached
    ([(300, 0), (1, 130), (33, 31)], 8, 2, 32, 16),              # groups of 4, head_dim 32
    ([(17, 3), (40, 0)], 8, 2, 64, 32),
    ([(5, 0), (64, 64), (129, 0)], 6, 2, 48, 16),                # head_dim not a multiple of the vector width
    ([(3, 2), (9, 0)], 2, 1, 20, 4),                             # head_dim not a multiple of 4
]


@pytest.mark.parametrize("impl", ["cpp", "torch"])
@pytest.mark.parametrize("i", range(len(CASES)))
def test_varlen_matches_dense_causal_attention(impl, i, require):
    chunks, h, kvh, d, bs = CASES[i]
    fn = implementation(impl, require)
    step = make_step(i, chunks, h, kvh, d, bs)
    out = run(fn, step)
    assert out.shape == step["q"].shape and out.dtype == torch.float32
    torch.testing.assert_close(out, dense_reference(step), **F32_TOL)
    torch.testing.assert_close(run(fn, step, scale=0.3), dense_reference(step, scale=0.3), **F32_TOL)


@pytest.mark.parametrize("i", [1, 2, 4])
def test_triton_varlen_matches_dense_causal_attention(i, require):
    chunks, h, kvh, d, bs = CASES[i]
    fn = implementation("triton", require)
    step = make_step(i, [(min(n, 40), s) for n, s in chunks], h, kvh, d, bs)  # the interpreter is slow
    torch.testing.assert_close(run(fn, step), dense_reference(step), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_bf16_varlen_matches_the_float32_reference(i, kernel):
    chunks, h, kvh, d, bs = CASES[i]
    step = make_step(100 + i, chunks, h, kvh, d, bs, dtype=torch.bfloat16)
    out = run(cpu_ops.paged_attention_prefill_varlen, step)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dense_reference(step), **BF16_TOL)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_bf16_scores_by_pair_dot_products_match_the_float32_key_path(i, kernel, monkeypatch):
    """On a CPU with avx512_bf16 the kernel computes bfloat16 scores with vdpbf16ps, keys read in place; the
    products of two bfloat16 values are exact in float32, so it differs from the float32-key path only in
    the order of float32 additions: both within the float32 reference's tolerance, and within one bfloat16
    ulp of each other (each rounds to bfloat16 on its own, so where the exact value lies near a rounding
    boundary one may round up and the other down: one ulp, up to 2**-7 relative). Elsewhere both calls take the float32-key path and agree bit for bit."""
    from engines.real.cpu_features import cpu_flags

    if "avx512_bf16" in cpu_flags():
        assert cpu_ops.prefill_bf16_dot(), "built on an avx512_bf16 CPU without the vdpbf16ps score path"
    chunks, h, kvh, d, bs = CASES[i]
    step = make_step(200 + i, chunks, h, kvh, d, bs, dtype=torch.bfloat16)
    dot = run(cpu_ops.paged_attention_prefill_varlen, step)
    monkeypatch.setenv("WORKBENCH_PREFILL_FP32_KEYS", "1")
    f32 = run(cpu_ops.paged_attention_prefill_varlen, step)
    want = dense_reference(step)
    torch.testing.assert_close(dot.float(), want, **BF16_TOL)
    torch.testing.assert_close(f32.float(), want, **BF16_TOL)
    if cpu_ops.prefill_bf16_dot() and d % 2 == 0:
        torch.testing.assert_close(dot.float(), f32.float(), atol=1e-4, rtol=2**-7)
    else:
        assert torch.equal(dot, f32)


def test_a_strided_query_view_reads_like_a_copy(kernel):
    """q as the model passes it: the query columns of the fused qkv output (rows strided)."""
    step = make_step(7, [(33, 5), (20, 0)], 9, 3, 64, 16)
    t = step["q"].shape[0]
    qkv = torch.randn(t, (9 + 2 * 3) * 64)
    qkv[:, : 9 * 64] = step["q"].reshape(t, -1)
    q = qkv[:, : 9 * 64].view(t, 9, 64)
    assert not q.is_contiguous()
    torch.testing.assert_close(run(cpu_ops.paged_attention_prefill_varlen, step, q=q),
                               run(cpu_ops.paged_attention_prefill_varlen, step))


def test_chunks_split_differently_give_one_prompt_the_same_outputs(kernel):
    """A 300-token prompt as one fresh chunk or as three chunks (each after the previous ones), run in one
    call together: the same rows."""
    gen = torch.Generator().manual_seed(3)
    h, kvh, d, bs, n = 9, 3, 64, 16, 300
    nb = -(-n // bs)
    k_cache, v_cache = torch.randn(2 * nb + 1, bs, kvh, d, generator=gen), torch.randn(2 * nb + 1, bs, kvh, d, generator=gen)
    k, v = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)
    one, two = list(range(nb)), list(range(2 * nb, nb, -1))  # second copy on other blocks, reversed order
    for table in (one, two):
        write_kv(k_cache, v_cache, k, v, torch.tensor([table[p // bs] * bs + p % bs for p in range(n)]))
    q = torch.randn(n, h, d, generator=gen)
    cuts = [0, 100, 101, 300]
    starts = [0] + cuts[:-1][1:]
    bt = torch.tensor([one] + [two] * 3)
    packed = torch.cat([q, q])
    cu = torch.tensor([0, n] + [n + c for c in cuts[1:]])
    out = cpu_ops.paged_attention_prefill_varlen(packed, k_cache, v_cache, bt, cu, torch.tensor([0] + starts))
    torch.testing.assert_close(out[n:], out[:n], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[:n], causal_attention(q, k, v), **F32_TOL)


def test_bad_inputs_are_one_line_errors(kernel):
    step = make_step(1, [(7, 3), (5, 0)], 4, 2, 16, 8)
    fn = cpu_ops.paged_attention_prefill_varlen
    q, kc, vc, bt, cu, sp = (step[k] for k in ("q", "k_cache", "v_cache", "block_tables", "cu", "starts"))
    bad = [
        ((q, kc, vc, bt, cu[:2], sp), "cu_seqlens_q \\[num_chunks \\+ 1\\]"),
        ((q, kc, vc, bt[:1], cu, sp), "block_tables must be \\[num_chunks, max_blocks\\]"),
        ((q, kc, vc, bt[:, :1], cu, sp), "covers 10 positions, more than its 1 blocks of 8 hold"),
        ((q, kc, vc, torch.full_like(bt, 99), cu, sp), "reads block 99, outside the cache's"),
        ((q, kc, vc, bt, cu + 1, sp), "cu_seqlens_q must run from 0"),
        ((q[:, :3], kc, vc, bt, cu, sp), "multiple of num_kv_heads"),
        ((q.to(torch.bfloat16), kc, vc, bt, cu, sp), "q and k_cache must have the same dtype"),
        ((q.half(), kc.half(), vc.half(), bt, cu, sp), "float32 or bfloat16 tensors only"),
    ]
    for args, match in bad:
        with pytest.raises(RuntimeError, match=match) as e:
            fn(*args)
        assert "\n" not in str(e.value).strip(), str(e.value)
    with pytest.raises(ValueError, match="cu_seqlens_q must be \\[3\\]"):
        paged_attention_prefill_varlen(q, kc, vc, bt, cu[:2], sp)


# ------------------------------------------------------------------------------------------ through the model


def per_chunk_attention(model, q, kc, vc, meta):
    """The per-chunk path this call replaced: decode rows batched, then one prefill call per chunk."""
    nd = meta.num_decode_tokens
    out = torch.empty_like(q)
    if nd:
        out[:nd] = model.attention.decode(q[:nd], kc, vc, meta.decode_block_tables, meta.decode_context_lens,
                                          model.scale)
    bounds = meta.prefill_query_start.tolist()
    for p, start in enumerate(meta.prefill_start_pos.tolist()):
        a, b = nd + bounds[p], nd + bounds[p + 1]
        out[a:b] = paged_attention_prefill(q[a:b].float(), kc.float(), vc.float(), meta.prefill_block_tables[p], start,
                                           model.scale).to(q.dtype)
    return out


def mixed_step(executor, prompts: list[int], cached: list[int], decodes: int, seed: int = 0):
    """Prepare a step with ``decodes`` decode rows and one prefill chunk per entry of ``prompts`` (after
    ``cached`` tokens), after a first step that wrote every sequence's earlier tokens into the cache.

    Returns:
        ``(input_ids, positions, meta)`` of the mixed step.
    """
    from engines.core.sampling_params import SamplingParams
    from engines.core.scheduler import ScheduledSeq

    rng = random.Random(seed)
    bs, sp = executor.kv.block_size, SamplingParams(max_tokens=1, temperature=0)
    free = list(range(executor.kv.num_blocks))
    rng.shuffle(free)
    shapes = [(1, rng.randint(5, 60)) for _ in range(decodes)] + list(zip(prompts, cached))
    first, step = [], []
    for i, (n, c) in enumerate(shapes):
        nb = -(-(n + c) // bs)
        table, free = free[:nb], free[nb:]
        toks = [rng.randrange(3, 300) for _ in range(n + c)]
        if c:
            first.append(ScheduledSeq(f"s{i}", toks[:c], 0, table, False, sp))
        step.append(ScheduledSeq(f"s{i}", toks[c:], c, table, True, sp))
    ids, pos, meta, _ = executor._prepare(first)
    executor.model.forward(ids, pos, meta, executor.kv.layers)
    ids, pos, meta, _ = executor._prepare(step)
    return ids, pos, meta


@pytest.mark.parametrize("backend, dtype", [("cpp", torch.float32), ("cpp", torch.bfloat16), ("torch", torch.float32)])
def test_mixed_step_matches_the_per_chunk_path_with_one_call_per_layer(tiny_llama_dir, backend, dtype, require):
    from engines.real.model import LlamaModel
    from engines.real.model_runner import ModelExecutor

    if backend == "cpp":
        require(cpu_ops.available(), KERNEL_MISSING, cpu_ops.build_error())
    model = LlamaModel.from_dir(tiny_llama_dir, dtype, attention_backend=backend)
    ex = ModelExecutor(model, num_blocks=64, block_size=16)
    ids, pos, meta = mixed_step(ex, prompts=[7, 33, 1, 20], cached=[0, 19, 0, 40], decodes=8)
    assert (meta.num_decode_tokens, meta.num_prefills, meta.prefill_max_query_len) == (8, 4, 33)
    assert meta.prefill_query_start.tolist() == [0, 7, 40, 41, 61]
    assert meta.prefill_start_pos.tolist() == [0, 19, 0, 40]
    assert meta.prefill_block_tables.shape == (4, 4)  # the last chunk's 60 positions: 4 blocks

    calls = {"decode": 0, "prefill_varlen": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    ops = model.attention
    model.attention = dataclasses.replace(ops, prefill_varlen=counted("prefill_varlen", ops.prefill_varlen))
    model.decode_attention = counted("decode", model.decode_attention)
    with torch.inference_mode():
        got = model.forward(ids, pos, meta, ex.kv.layers)
        layers = model.cfg.num_hidden_layers
        assert calls == {"decode": layers, "prefill_varlen": layers}
        model.attention = ops
        model._attention = lambda q, kc, vc, m: per_chunk_attention(model, q, kc, vc, m)
        want = model.forward(ids, pos, meta, ex.kv.layers)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # both attentions compute in float32 and round once to bfloat16: within one bfloat16 ulp (|x| < 4)
        torch.testing.assert_close(got.float(), want.float(), atol=2**-6, rtol=2**-7)
