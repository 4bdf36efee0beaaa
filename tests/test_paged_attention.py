"""Paged attention (decode and chunked prefill) against dense causal attention on random shapes."""

import math
import random

import pytest
import torch

from wb_kernels.paged_attention import (
    causal_attention,
    gather_kv,
    paged_attention_decode,
    paged_attention_prefill,
    write_kv,
)

TOL = dict(atol=1e-5, rtol=1e-5)
BLOCK_SIZES = (1, 4, 16)
HEAD_DIMS = (16, 32, 64)
NUM_CASES = 24


def naive_attention(q, k, v, start_pos, scale=None):
    """Loop-and-softmax reference: q [n, h, d], k/v [ctx, kvh, d]; token i sees 0..start_pos+i."""
    n, h, d = q.shape
    kvh = k.shape[1]
    groups = h // kvh
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    for i in range(n):
        ctx = start_pos + i + 1
        for head in range(h):
            kh = head // groups
            s = (k[:ctx, kh] @ q[i, head]) * scale
            out[i, head] = torch.softmax(s, dim=0) @ v[:ctx, kh]
    return out


def odd_len(rng: random.Random, block_size: int, lo: int = 1, hi: int = 77) -> int:
    """An odd length that, for block_size > 1, leaves the last block partially filled."""
    while True:
        n = rng.randrange(lo, hi) | 1
        if block_size == 1 or n % block_size:
            return n


def case(seed: int):
    rng = random.Random(seed)
    block_size = BLOCK_SIZES[seed % 3]
    head_dim = HEAD_DIMS[(seed // 3) % 3]
    return dict(
        rng=rng,
        gen=torch.Generator().manual_seed(seed),
        block_size=block_size,
        head_dim=head_dim,
        batch=rng.randint(1, 5),
        kvh=rng.randint(1, 4),
        groups=rng.randint(1, 3),
    )


def scattered_tables(rng: random.Random, lens: list[int], block_size: int):
    """Random, non-contiguous, disjoint block tables drawn from a pool with spare blocks."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + rng.randint(3, 12)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for k in need:
        tables.append(ids[at : at + k])
        at += k
    return num_blocks, tables


def fill_cache(gen, num_blocks, block_size, kvh, d, tables, lens):
    """Garbage-filled caches, then each sequence's dense K/V written through a slot mapping."""
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen) * 10
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen) * 10
    dense_k, dense_v = [], []
    for table, n in zip(tables, lens):
        k = torch.randn(n, kvh, d, generator=gen)
        v = torch.randn(n, kvh, d, generator=gen)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)], dtype=torch.int64)
        write_kv(k_cache, v_cache, k, v, slots)
        dense_k.append(k)
        dense_v.append(v)
    return k_cache, v_cache, dense_k, dense_v


def padded(tables, rng, num_blocks):
    width = max(len(t) for t in tables)
    rows = [t + [rng.randrange(num_blocks) for _ in range(width - len(t))] for t in tables]
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_decode_matches_dense(seed):
    c = case(seed)
    rng, gen, bs, d, kvh = c["rng"], c["gen"], c["block_size"], c["head_dim"], c["kvh"]
    h = kvh * c["groups"]
    lens = [odd_len(rng, bs) for _ in range(c["batch"])]
    num_blocks, tables = scattered_tables(rng, lens, bs)
    k_cache, v_cache, dk, dv = fill_cache(gen, num_blocks, bs, kvh, d, tables, lens)
    q = torch.randn(c["batch"], h, d, generator=gen)
    out = paged_attention_decode(q, k_cache, v_cache, padded(tables, rng, num_blocks), torch.tensor(lens))
    assert out.shape == (c["batch"], h, d)
    for i, n in enumerate(lens):
        ref = causal_attention(q[i : i + 1], dk[i], dv[i], start_pos=n - 1)
        torch.testing.assert_close(out[i : i + 1], ref, **TOL)
        if i == 0:
            torch.testing.assert_close(out[i : i + 1], naive_attention(q[i : i + 1], dk[i], dv[i], n - 1), **TOL)


@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_prefill_chunk_matches_dense(seed):
    c = case(seed)
    rng, gen, bs, d, kvh = c["rng"], c["gen"], c["block_size"], c["head_dim"], c["kvh"]
    h = kvh * c["groups"]
    # several sequences share the cache; each runs one chunk (start_pos > 0 except every 4th case)
    lens = [odd_len(rng, bs, lo=3) for _ in range(c["batch"])]
    num_blocks, tables = scattered_tables(rng, lens, bs)
    k_cache, v_cache, dk, dv = fill_cache(gen, num_blocks, bs, kvh, d, tables, lens)
    for i, ctx in enumerate(lens):
        start = 0 if (seed % 4 == 0 and i == 0) else rng.randrange(1, ctx)
        n = ctx - start
        q = torch.randn(n, h, d, generator=gen)
        # the table may be longer than needed (the rest of the sequence's blocks); only ctx is read
        table = tables[i] + [rng.randrange(num_blocks) for _ in range(rng.randint(0, 2))]
        out = paged_attention_prefill(q, k_cache, v_cache, torch.tensor(table, dtype=torch.int64), start)
        assert out.shape == (n, h, d)
        ref = causal_attention(q, dk[i], dv[i], start_pos=start)
        torch.testing.assert_close(out, ref, **TOL)
        if i == 0:
            torch.testing.assert_close(out, naive_attention(q, dk[i], dv[i], start), **TOL)


@pytest.mark.parametrize("seed", range(6))
def test_chunked_prefill_equals_one_shot(seed):
    """Running a prompt in chunks (K/V written chunk by chunk) gives the one-shot prefill's outputs."""
    c = case(seed)
    rng, gen, bs, d, kvh = c["rng"], c["gen"], c["block_size"], c["head_dim"], c["kvh"]
    h = kvh * c["groups"]
    n = odd_len(rng, bs, lo=9)
    num_blocks, (table,) = scattered_tables(rng, [n], bs)
    k = torch.randn(n, kvh, d, generator=gen)
    v = torch.randn(n, kvh, d, generator=gen)
    q = torch.randn(n, h, d, generator=gen)
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    bt = torch.tensor(table, dtype=torch.int64)
    cuts = sorted(rng.sample(range(1, n), 2))
    outs = []
    for a, b in zip([0] + cuts, cuts + [n]):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(a, b)], dtype=torch.int64)
        write_kv(k_cache, v_cache, k[a:b], v[a:b], slots)
        outs.append(paged_attention_prefill(q[a:b], k_cache, v_cache, bt, a))
    torch.testing.assert_close(torch.cat(outs), causal_attention(q, k, v), **TOL)


def test_decode_with_explicit_scale():
    gen = torch.Generator().manual_seed(5)
    bs, kvh, d, h = 4, 2, 16, 4
    k_cache = torch.randn(6, bs, kvh, d, generator=gen)
    v_cache = torch.randn(6, bs, kvh, d, generator=gen)
    table = [4, 1, 3]
    n = 11
    dk = gather_kv(k_cache, torch.tensor([table]))[0].transpose(0, 1)[:n]
    dv = gather_kv(v_cache, torch.tensor([table]))[0].transpose(0, 1)[:n]
    q = torch.randn(1, h, d, generator=gen)
    out = paged_attention_decode(q, k_cache, v_cache, torch.tensor([table]), torch.tensor([n]), scale=0.3)
    torch.testing.assert_close(out, naive_attention(q, dk, dv, n - 1, scale=0.3), **TOL)


def test_causal_attention_matches_naive():
    gen = torch.Generator().manual_seed(1)
    for start, n, kvh, groups in [(0, 7, 2, 3), (5, 4, 1, 2), (3, 1, 4, 1)]:
        q = torch.randn(n, kvh * groups, 32, generator=gen)
        k = torch.randn(start + n, kvh, 32, generator=gen)
        v = torch.randn(start + n, kvh, 32, generator=gen)
        torch.testing.assert_close(causal_attention(q, k, v, start), naive_attention(q, k, v, start), **TOL)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_write_kv_places_tokens_at_block_slot(block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, kvh, d = 7, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, kvh, d)
    v_cache = torch.zeros(num_blocks, block_size, kvh, d)
    places = [(5, 0), (2, block_size - 1), (0, block_size // 2), (6, 0)]
    if block_size > 1:
        places.append((5, 1))
    k = torch.randn(len(places), kvh, d, generator=gen)
    v = torch.randn(len(places), kvh, d, generator=gen)
    slots = torch.tensor([b * block_size + o for b, o in places], dtype=torch.int64)
    write_kv(k_cache, v_cache, k, v, slots)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, (b, o) in enumerate(places):
        assert torch.equal(k_cache[b, o], k[i])
        assert torch.equal(v_cache[b, o], v[i])
        written[b, o] = True
    assert not k_cache[~written].any() and not v_cache[~written].any()


def test_gather_kv_orders_blocks_by_table():
    bs, kvh, d = 2, 1, 1
    cache = torch.arange(5 * bs, dtype=torch.float32).view(5, bs, kvh, d)
    g = gather_kv(cache, torch.tensor([[3, 0], [1, 4]]))
    assert g.shape == (2, kvh, 2 * bs, d)
    assert g[0, 0, :, 0].tolist() == [6, 7, 0, 1]
    assert g[1, 0, :, 0].tolist() == [2, 3, 8, 9]
