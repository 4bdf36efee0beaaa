"""Triton paged-attention kernels against the PyTorch reference (Triton's interpreter on CPU)."""

import random

import pytest
import torch

triton_attention = pytest.importorskip("wb_kernels.triton_attention")

from wb_kernels.paged_attention import paged_attention_decode, paged_attention_prefill, write_kv  # noqa: E402


def make_cache(rng, num_blocks, bs, kvh, d):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return (torch.randn(num_blocks, bs, kvh, d, generator=g), torch.randn(num_blocks, bs, kvh, d, generator=g), g)


def random_table(rng, num_blocks, n):
    """``n`` distinct blocks in random order (not contiguous: exercises the block-table indirection)."""
    return rng.sample(range(num_blocks), n)


# (batch, heads, kv_heads, head_dim, block_size): GQA groups 1, 2, 3, 4; head_dim 64, 32, 48 (not a power of 2)
DECODE_SHAPES = [(3, 4, 2, 32, 16), (2, 6, 2, 48, 16), (4, 8, 8, 32, 16), (1, 4, 1, 64, 32), (5, 2, 2, 16, 16),
                 (2, 9, 3, 64, 16), (3, 8, 2, 32, 32), (1, 1, 1, 16, 16), (6, 4, 4, 16, 16), (2, 12, 4, 32, 16),
                 (3, 4, 2, 64, 16), (4, 2, 1, 32, 16)]


@pytest.mark.parametrize("i,shape", list(enumerate(DECODE_SHAPES)))
def test_decode_matches_reference(i, shape):
    b, h, kvh, d, bs = shape
    rng = random.Random(100 + i)
    num_blocks = 40
    kc, vc, g = make_cache(rng, num_blocks, bs, kvh, d)
    lens = [rng.randint(1, 5 * bs - 1) for _ in range(b)]  # odd lengths, partially filled last blocks
    lens[0] = 2 * bs + 1 if b > 1 else lens[0]
    width = max(-(-n // bs) for n in lens)
    tables = []
    for n in lens:
        t = random_table(rng, num_blocks, -(-n // bs))
        tables.append(t + [t[0]] * (width - len(t)))
    q = torch.randn(b, h, d, generator=g)
    bt, cl = torch.tensor(tables), torch.tensor(lens)
    ref = paged_attention_decode(q, kc, vc, bt, cl, scale=d ** -0.5)
    out = triton_attention.paged_attention_decode(q, kc, vc, bt, cl)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# (chunk lengths per sequence, cached tokens before each chunk, heads, kv_heads, head_dim, block_size)
PREFILL_CASES = [([5], [0], 4, 2, 32, 16), ([17], [0], 2, 1, 16, 16), ([3], [21], 4, 2, 32, 16),
                 ([1], [30], 2, 2, 16, 16), ([9, 20], [7, 0], 4, 2, 32, 16), ([16], [16], 6, 3, 16, 16),
                 ([33], [5], 2, 1, 32, 16), ([4, 1, 12], [0, 40, 3], 8, 2, 16, 16), ([11], [13], 3, 3, 48, 32),
                 ([2, 2], [31, 1], 4, 4, 64, 16)]


@pytest.mark.parametrize("i,case", list(enumerate(PREFILL_CASES)))
def test_chunked_prefill_matches_reference(i, case):
    ns, starts, h, kvh, d, bs = case
    rng = random.Random(200 + i)
    num_blocks = 48
    kc, vc, g = make_cache(rng, num_blocks, bs, kvh, d)
    tables, refs, qs = [], [], []
    used = list(range(num_blocks))
    rng.shuffle(used)
    for n, s in zip(ns, starts):
        nb = -(-(s + n) // bs)
        t = [used.pop() for _ in range(nb)]
        tables.append(t)
        q = torch.randn(n, h, d, generator=g)
        k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(s, s + n)])
        write_kv(kc, vc, k, v, slots)
        qs.append(q)
    for q, t, s in zip(qs, tables, starts):
        refs.append(paged_attention_prefill(q, kc, vc, torch.tensor(t), s, scale=d ** -0.5))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    cu = torch.tensor([0] + list(torch.tensor(ns).cumsum(0)))
    out = triton_attention.paged_attention_prefill_varlen(torch.cat(qs), kc, vc, bt, cu, torch.tensor(starts))
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-4, rtol=1e-4)
    if len(ns) == 1:  # the single-sequence wrapper has the reference's signature
        one = triton_attention.paged_attention_prefill(qs[0], kc, vc, torch.tensor(tables[0]), starts[0])
        torch.testing.assert_close(one, refs[0], atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_one_line_errors():
    kc = torch.zeros(4, 16, 3, 16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        triton_attention.paged_attention_decode(torch.zeros(1, 4, 16), kc, kc, torch.zeros(1, 1, dtype=torch.long),
                                                torch.ones(1, dtype=torch.long))


def test_engine_with_triton_backend_matches_torch_backend(tiny_llama_dir):
    """The real engine with ``attention_backend="triton"`` (interpreter here; on CUDA ``auto`` picks it)
    produces the torch backend's greedy tokens, with chunked prefill over cached context."""
    from engines.core.sampling_params import SamplingParams
    from engines.llm import LLM

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [30, 31, 32]]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_llama_dir, kv_cache_tokens=256, max_num_batched_tokens=8, attention_backend=backend)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs["triton"] == outs["torch"]
