"""BlockPool, the paged and contiguous KV managers, and the static reservation policies (no torch)."""

import pytest

from engines.core.block_pool import BlockPool, BlockPoolError
from engines.core.kv_cache_manager import ContiguousKVCacheManager, PagedKVCacheManager, cdiv, reservation_tokens
from engines.core.request import Request
from engines.core.sampling_params import SamplingParams


def req(rid: str, prompt_len: int, max_tokens: int = 16, computed: int = 0) -> Request:
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    r.num_computed_tokens = computed
    return r


# --------------------------------------------------------------------------------------------
# BlockPool
# --------------------------------------------------------------------------------------------


def test_pool_rejects_empty():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_sets_refcount_and_counts():
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert all(pool.blocks[i].ref_cnt == 1 for i in ids)
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 5


def test_allocate_returns_none_when_short_and_takes_nothing():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.blocks[3].ref_cnt == 0
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) is None


def test_free_returns_blocks_and_double_free_raises():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids)
    assert pool.num_free_blocks == 4
    assert all(pool.blocks[i].ref_cnt == 0 for i in ids)
    with pytest.raises(BlockPoolError):
        pool.free([ids[0]])
    # freeing a never-allocated block is the same error
    with pytest.raises(BlockPoolError):
        BlockPool(2).free([1])


def test_double_free_within_one_call_raises():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    with pytest.raises(BlockPoolError):
        pool.free([b, b])
    assert pool.blocks[b].ref_cnt == 0


def test_incref_shares_and_free_needs_all_refs():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.incref(ids)
    assert [pool.blocks[i].ref_cnt for i in ids] == [2, 2]
    pool.free(ids)
    assert [pool.blocks[i].ref_cnt for i in ids] == [1, 1]
    assert pool.num_used_blocks == 2  # still held by the other sharer
    pool.free(ids)
    assert pool.num_used_blocks == 0
    with pytest.raises(BlockPoolError):
        pool.incref([ids[0]])  # cannot share a free block


def test_free_queue_is_fifo():
    pool = BlockPool(6)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    assert (a, b) == ([0, 1], [2, 3])
    pool.free([3, 1])  # free queue now: 4, 5, 3, 1
    pool.free([0])  # 4, 5, 3, 1, 0
    assert pool.allocate(3) == [4, 5, 3]
    assert pool.allocate(2) == [1, 0]
    assert pool.allocate(1) is None
    pool.free([2])
    assert pool.allocate(1) == [2]


def test_block_returns_to_queue_only_when_refcount_hits_zero():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    pool.incref([0])
    pool.free([0])  # still referenced
    pool.free([1])
    pool.free([0])
    # 1 was returned before 0's last reference went away
    assert pool.allocate(2) == [1, 0]


def test_free_queue_matches_an_ordered_dict_model():
    """Random allocate / free / touch (a cache hit on a free block) keep the linked free queue in the same
    LRU order as an OrderedDict model of it, with the same counts."""
    import random
    from collections import OrderedDict

    rng = random.Random(7)
    pool = BlockPool(12)
    model: OrderedDict[int, None] = OrderedDict((i, None) for i in range(12))
    held: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(1, 4)
            got = pool.allocate(n)
            if n > len(model):
                assert got is None
            else:
                assert got == [model.popitem(last=False)[0] for _ in range(n)]
                held += got
        elif op < 0.8 and held:
            i = held.pop(rng.randrange(len(held)))
            pool.free([i])
            model[i] = None
        elif model:  # take a free block from anywhere in the queue, as a prefix-cache hit does
            i = rng.choice(list(model))
            pool.touch([i])
            del model[i]
            held.append(i)
        assert pool._free.block_ids() == list(model)
        assert pool.num_free_blocks == len(model) == len(pool._free)


def test_free_queue_remove_of_an_unqueued_block_raises():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(BlockPoolError, match="block 0 is not in the free queue"):
        pool._free.remove(pool.blocks[0])


@pytest.mark.parametrize("extra", [None, "lora-7", ("salt", 3)])
@pytest.mark.parametrize("n_tokens", [0, 3, 4, 13, 16])
def test_hash_token_blocks_equals_chained_block_hashes(extra, n_tokens):
    """The one-pack hashing of many blocks gives the digests of hashing block by block, chained from a
    parent; a trailing partial block is left out."""
    from engines.core.block_pool import hash_block_tokens, hash_token_blocks

    ids = [(7919 * i) % 49152 for i in range(n_tokens)]
    parent = hash_block_tokens(None, [5, 6, 7, 8], extra)
    want, h = [], parent
    for b in range(n_tokens // 4):
        h = hash_block_tokens(h, ids[4 * b : 4 * b + 4], extra)
        want.append(h)
    assert hash_token_blocks(parent, ids, 4, extra) == want
    assert hash_token_blocks(parent, tuple(ids), 4, extra) == want
    assert len(want) == n_tokens // 4
    with pytest.raises(TypeError):
        hash_token_blocks(None, [1, 2, "3", 4], 4)


# --------------------------------------------------------------------------------------------
# PagedKVCacheManager
# --------------------------------------------------------------------------------------------


def test_cdiv():
    assert [cdiv(a, 4) for a in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_slots_grows_by_ceil_division():
    kv = PagedKVCacheManager(num_blocks=10, block_size=4)
    r = req("a", 10)
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_table("a")) == cdiv(10, 4) == 3
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 1)  # 11 tokens fit in 3 blocks
    assert len(kv.block_table("a")) == 3
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1)  # 13th token needs a 4th block
    assert len(kv.block_table("a")) == 4
    r.num_computed_tokens = 13
    assert kv.allocate_slots(r, 7)  # 20 -> 5 blocks
    assert len(kv.block_table("a")) == 5
    assert kv.pool.num_used_blocks == 5
    assert kv.block_table("a") == [0, 1, 2, 3, 4]


def test_allocate_slots_chunked_prefill_growth():
    kv = PagedKVCacheManager(num_blocks=16, block_size=16)
    r = req("a", 100)
    for chunk in (7, 30, 16, 47):
        assert kv.allocate_slots(r, chunk)
        r.num_computed_tokens += chunk
        assert len(kv.block_table("a")) == cdiv(r.num_computed_tokens, 16)


def test_allocate_slots_fails_without_partial_allocation():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    a, b = req("a", 8), req("b", 12)
    assert kv.allocate_slots(a, 8)  # 2 blocks
    assert not kv.allocate_slots(b, 12)  # needs 3, only 2 free
    assert kv.block_table("b") == []
    assert kv.pool.num_free_blocks == 2
    # a growing request that does not fit keeps its old table untouched
    a.num_computed_tokens = 8
    assert not kv.allocate_slots(a, 9)  # 17 tokens -> 5 blocks, needs 3 more
    assert kv.block_table("a") == [0, 1]
    assert kv.pool.num_free_blocks == 2


def test_free_releases_all_blocks_and_is_idempotent():
    kv = PagedKVCacheManager(num_blocks=6, block_size=2)
    a, b = req("a", 5), req("b", 3)
    assert kv.allocate_slots(a, 5)
    assert kv.allocate_slots(b, 3)
    assert kv.pool.num_used_blocks == 5
    kv.free(a)
    assert kv.pool.num_used_blocks == 2
    assert "a" not in kv.block_tables
    kv.free(a)  # no-op
    kv.free(req("never", 1))  # no-op
    kv.free(b)
    assert kv.pool.num_free_blocks == 6
    for blk in kv.pool.blocks:
        assert blk.ref_cnt == 0


def test_free_returns_tail_blocks_first():
    kv = PagedKVCacheManager(num_blocks=4, block_size=1)
    a = req("a", 3)
    assert kv.allocate_slots(a, 3)  # [0, 1, 2]
    kv.free(a)  # reversed: queue = 3, 2, 1, 0
    b = req("b", 4)
    assert kv.allocate_slots(b, 4)
    assert kv.block_table("b") == [3, 2, 1, 0]


def test_fits_ever():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    assert kv.fits_ever(req("a", 10, max_tokens=6))  # 16 tokens
    assert not kv.fits_ever(req("b", 10, max_tokens=7))  # 17 tokens


def test_paged_stats_hand_computed():
    kv = PagedKVCacheManager(num_blocks=10, block_size=4)
    # a: prompt 10, max_tokens 3 (13 total); 10 computed in 3 blocks (12 slots)
    a = req("a", 10, max_tokens=3)
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    # b: prompt 5, max_tokens 1 (6 total); 5 computed in 2 blocks (8 slots)
    b = req("b", 5, max_tokens=1)
    assert kv.allocate_slots(b, 5)
    b.num_computed_tokens = 5
    # c: holds nothing yet
    c = req("c", 4, max_tokens=4)
    s = kv.stats([a, b, c])
    assert s.total_slots == 40
    assert s.allocated == 20
    # a: states 10, reserved min(12-10, 13-10)=2; b: states 5, reserved min(8-5, 6-5)=1
    assert s.token_states == 15
    assert s.reserved == 3
    assert s.internal_frag == 2  # b's last two slots can never be used
    assert s.external_frag == 0
    assert s.waste_frac == pytest.approx(1 - 15 / 20)
    assert s.usage_frac == pytest.approx(20 / 40)
    assert s.allocated == s.token_states + s.reserved + s.internal_frag + s.external_frag


def test_paged_stats_scheduled_but_not_computed():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    r = req("a", 6, max_tokens=10)
    assert kv.allocate_slots(r, 6)  # scheduled, not yet computed
    s = kv.stats([r])
    assert (s.allocated, s.token_states, s.reserved, s.internal_frag) == (8, 0, 8, 0)
    assert s.waste_frac == 1.0


def test_empty_stats():
    s = PagedKVCacheManager(num_blocks=4, block_size=4).stats([])
    assert (s.allocated, s.token_states, s.reserved, s.internal_frag) == (0, 0, 0, 0)
    assert s.waste_frac == 0.0 and s.usage_frac == 0.0


# --------------------------------------------------------------------------------------------
# ContiguousKVCacheManager
# --------------------------------------------------------------------------------------------


def test_contiguous_reserve_first_fit_and_free():
    kv = ContiguousKVCacheManager(num_blocks=10, block_size=4)
    a, b, c, d = req("a", 1), req("b", 1), req("c", 1), req("d", 1)
    assert kv.reserve(a, 10)  # 3 blocks: 0..2
    assert kv.reserve(b, 8)  # 2 blocks: 3..4
    assert kv.reserve(c, 13)  # 4 blocks: 5..8
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.block_table("b") == [3, 4]
    assert kv.block_table("c") == [5, 6, 7, 8]
    assert not kv.reserve(d, 5)  # needs 2 blocks, only block 9 free
    assert "d" not in kv.runs
    kv.free(a)  # free extents: [0,3), [9,10)
    assert kv._free_extents() == [(0, 3), (9, 1)]
    assert kv.reserve(d, 5)  # first fit: starts at 0
    assert kv.block_table("d") == [0, 1]
    e = req("e", 1)
    assert kv.reserve(e, 4)  # first fit: the 1-block hole at 2, not block 9
    assert kv.block_table("e") == [2]
    kv.free(b)
    kv.free(c)
    f = req("f", 1)
    assert kv.reserve(f, 28)  # 7 blocks: 3..9
    assert kv.block_table("f") == list(range(3, 10))
    kv.free(f)
    kv.free(f)  # no-op
    kv.free(d)
    kv.free(e)
    assert kv.runs == {}
    assert kv._free_extents() == [(0, 10)]


def test_contiguous_fits_ever():
    kv = ContiguousKVCacheManager(num_blocks=4, block_size=4)
    assert kv.fits_ever(16)
    assert not kv.fits_ever(17)


def test_contiguous_stats_alignment_gap_is_external():
    kv = ContiguousKVCacheManager(num_blocks=16, block_size=4)
    # a: prompt 5, max_tokens 3 (8 total), reserved 10 slots (3 blocks = 12; gap 2), computed 6
    a = req("a", 5, max_tokens=3, computed=6)
    assert kv.reserve(a, 10)
    # b: prompt 3, max_tokens 2 (5 total), reserved 16 (4 blocks; gap 0), computed 3
    b = req("b", 3, max_tokens=2, computed=3)
    assert kv.reserve(b, 16)
    s = kv.stats([a, b])
    assert s.total_slots == 64
    assert s.allocated == 12 + 16
    assert s.external_frag == 2 + 0
    assert s.token_states == 6 + 3
    # a: min(10-6, 8-6)=2; b: min(16-3, 5-3)=2
    assert s.reserved == 2 + 2
    # a: 10-6-2=2; b: 16-3-2=11
    assert s.internal_frag == 2 + 11
    assert s.allocated == s.token_states + s.reserved + s.internal_frag + s.external_frag
    assert s.waste_frac == pytest.approx(1 - 9 / 28)


@pytest.mark.parametrize("bs", [1, 3, 4, 16])
@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_contiguous_stats_sum_identity(bs, policy):
    kv = ContiguousKVCacheManager(num_blocks=2048 // bs, block_size=bs)
    reqs = []
    for i, (p, m, c) in enumerate([(100, 28, 0), (100, 29, 50), (7, 3, 9), (1, 1, 1), (33, 40, 60), (64, 64, 127)]):
        r = req(str(i), p, max_tokens=m, computed=c)
        assert kv.reserve(r, reservation_tokens(policy, r, max_model_len=256))
        reqs.append(r)
    s = kv.stats(reqs)
    assert s.allocated == s.token_states + s.reserved + s.internal_frag + s.external_frag
    assert s.allocated == sum(len(kv.block_table(r.request_id)) for r in reqs) * bs
    assert min(s.token_states, s.reserved, s.internal_frag, s.external_frag) >= 0
    if bs == 1:
        assert s.external_frag == 0
    # requests not passed in are not counted
    assert kv.stats([]).allocated == 0


# --------------------------------------------------------------------------------------------
# reservation policies
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt,max_tokens,expected",
    [(100, 28, 128), (100, 29, 256), (1, 1, 2), (63, 1, 64), (64, 1, 128), (500, 100, 1024)],
)
def test_pow2(prompt, max_tokens, expected):
    assert reservation_tokens("pow2", req("r", prompt, max_tokens), max_model_len=4096) == expected


def test_pow2_capped_at_max_model_len():
    assert reservation_tokens("pow2", req("r", 100, 29), max_model_len=200) == 200
    assert reservation_tokens("pow2", req("r", 100, 28), max_model_len=128) == 128


def test_pow2_of_one_token():
    r = Request("r", [1], SamplingParams(max_tokens=1))
    r.sampling_params.max_tokens = 0  # max_total_tokens == 1 -> 2**0
    assert reservation_tokens("pow2", r, max_model_len=64) == 1


def test_max_and_oracle():
    r = req("r", 100, 28)
    assert reservation_tokens("max", r, max_model_len=2048) == 2048
    assert reservation_tokens("oracle", r, max_model_len=2048) == 128
    assert reservation_tokens("oracle", r, max_model_len=2048, oracle_len=105) == 105


def test_unknown_policy():
    with pytest.raises(ValueError, match="reservation"):
        reservation_tokens("lifo", req("r", 1), max_model_len=16)
