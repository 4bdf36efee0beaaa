"""Automatic prefix caching: block pool hashing/eviction/ref counts, scheduler properties with a fake KV
memory that checks every attended slot holds the right token, swap preemption in the same harness, and
greedy exactness against transformers on the tiny model (prefix caching on/off, chunked prefill on/off)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.core.block_pool import BlockPool, hash_block_tokens
from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import PagedKVCacheManager, cdiv
from engines.core.paged_scheduler import PagedScheduler
from engines.core.request import Request, RequestStatus
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import SchedulerOutput, StepResult

PROPS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def req(rid, ids, max_tokens=4):
    return Request(rid, list(ids), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


# ------------------------------------------------------------------------------------------ block pool


def test_hash_chains_parent_and_extra_keys():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, (1, 2, 3))
    assert hash_block_tokens(h1, [4, 5, 6]) != hash_block_tokens(None, [4, 5, 6])
    assert hash_block_tokens(None, [1, 2, 3], "salt") != h1


def test_freed_cached_block_is_hit_then_evicted_lru():
    pool = BlockPool(3)
    a = pool.allocate(2)  # [0, 1]
    assert pool.cache_block(a[0], 111) and pool.cache_block(a[1], 222)
    assert not pool.cache_block(a[1], 333)  # already has a hash
    pool.free([a[1], a[0]])  # free queue: 2, 1, 0
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2
    # a hit on a free cached block takes it out of the free queue
    assert pool.get_cached_block(111) == 0
    pool.touch([0])
    assert pool.blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2
    # fresh allocation takes 2 (never cached), then evicts 1 (LRU among cached)
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [1]
    assert pool.get_cached_block(222) is None and pool.blocks[1].block_hash is None
    assert pool.num_evictions == 1
    assert pool.get_cached_block(111) == 0  # still held, still cached
    assert pool.allocate(1) is None


def test_duplicate_hash_keeps_first_block_and_touch_shares():
    pool = BlockPool(4)
    a, b = pool.allocate(1)[0], pool.allocate(1)[0]
    assert pool.cache_block(a, 7)
    assert not pool.cache_block(b, 7)
    assert pool.get_cached_block(7) == a and pool.blocks[b].block_hash is None
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 2 and pool.num_shared_blocks == 1
    pool.free([a])
    assert pool.num_shared_blocks == 0 and pool.blocks[a].ref_cnt == 1
    pool.uncache_block(a)
    assert pool.get_cached_block(7) is None


def test_manager_hit_leaves_last_token_and_counts():
    kv = PagedKVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = req("a", range(1, 13))  # 12 tokens = 3 full blocks
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 12)
    assert kv.pool.num_cached_blocks == 3
    # an identical prompt hits only 2 blocks: the last token (and its block) is recomputed
    b = req("b", range(1, 13))
    blocks, n = kv.get_computed_blocks(b)
    assert blocks == kv.block_table("a")[:2] and n == 8
    # a longer prompt with the same first 12 tokens hits all 3
    c = req("c", list(range(1, 13)) + [99, 98])
    blocks_c, n_c = kv.get_computed_blocks(c)
    assert n_c == 12
    assert kv.allocate_slots(c, 2, blocks_c)
    assert kv.block_table("c")[:3] == kv.block_table("a")
    assert [kv.pool.blocks[x].ref_cnt for x in kv.block_table("a")] == [2, 2, 2]
    c.num_computed_tokens = 12
    a.num_computed_tokens = 12
    st_ = kv.stats([a, c], {"c": 2})
    # shared blocks counted once: 3 shared + 1 of c's own
    assert st_.allocated == 4 * 4 and st_.token_states == 12 + 2
    assert st_.allocated == st_.token_states + st_.reserved + st_.internal_frag
    # a different first block misses entirely
    assert kv.get_computed_blocks(req("d", [7] + list(range(2, 13))))[1] == 0
    # a prompt shorter than a block never hits
    assert kv.get_computed_blocks(req("e", [1, 2, 3]))[1] == 0
    kv.free(a)
    kv.free(c)
    assert kv.pool.num_free_blocks == 16 and kv.pool.num_cached_blocks == 3


def test_hit_on_free_blocks_counts_them_against_free_space():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    a = req("a", range(1, 13))
    assert kv.allocate_slots(a, 12)
    kv.free(a)  # 3 cached free blocks + 1 plain free block
    b = req("b", list(range(1, 13)) + list(range(50, 58)))  # 20 tokens: 3 hit + 2 new blocks > 4
    blocks, n = kv.get_computed_blocks(b)
    assert n == 12
    assert not kv.allocate_slots(b, 8, blocks)
    assert kv.pool.num_free_blocks == 4 and kv.block_table("b") == []
    assert all(kv.pool.blocks[x].ref_cnt == 0 for x in blocks)


def test_caching_off_never_hits():
    kv = PagedKVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    assert kv.allocate_slots(req("a", range(1, 13)), 12)
    assert kv.get_computed_blocks(req("b", range(1, 13))) == ([], 0)
    assert kv.pool.num_cached_blocks == 0


# ------------------------------------------------------------------------------ scheduler + fake memory


class FakeKVExecutor:
    """Writes (token id) into a fake block memory for every scheduled token, runs the step's swaps and
    copies, then checks that every slot a sequence attends to holds that sequence's token."""

    def __init__(self, kv: PagedKVCacheManager, sched: PagedScheduler, seed: int = 0) -> None:
        self.kv, self.sched = kv, sched
        self.mem = {b: [None] * kv.block_size for b in range(kv.num_blocks)}
        self.cpu = {b: [None] * kv.block_size for b in range(kv.num_cpu_blocks)}
        self.rng = random.Random(seed)
        self.emitted: dict[str, list[int]] = {}

    def __call__(self, out: SchedulerOutput) -> StepResult:
        bs = self.kv.block_size
        for g, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.mem[g])
        for c, g in out.blocks_to_swap_in:
            self.mem[g] = list(self.cpu[c])
        for s, d in out.blocks_to_copy:
            self.mem[d] = list(self.mem[s])
        for seq in out.seqs:
            for i, t in enumerate(seq.token_ids):
                p = seq.start_pos + i
                self.mem[seq.block_table[p // bs]][p % bs] = t
        sampled = {}
        for seq in out.seqs:
            r = self.sched.requests[seq.request_id]
            for p in range(seq.context_len):
                got = self.mem[seq.block_table[p // bs]][p % bs]
                assert got == r.all_token_ids[p], (seq.request_id, p, got, r.all_token_ids[p])
            if seq.sample:
                for rid in [seq.request_id, *seq.fork_ids]:  # parallel-sampling children sample here too
                    tok = self.rng.randrange(3, 60)
                    sampled[rid] = tok
                    self.emitted.setdefault(rid, []).append(tok)
        return StepResult(sampled, 0.0)


def check_step(sched: PagedScheduler, out: SchedulerOutput) -> None:
    kv, pool = sched.kv, sched.kv.pool
    refs: dict[int, int] = {}
    for t in kv.block_tables.values():
        assert len(set(t)) == len(t)
        for b in t:
            refs[b] = refs.get(b, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt == refs.get(b.block_id, 0)
    free = pool._free.block_ids()
    assert len(free) == pool.num_free_blocks and set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for h, b in pool.cached.items():
        assert pool.blocks[b].block_hash == h
    assert pool.num_shared_blocks == sum(1 for b in pool.blocks if b.ref_cnt > 1)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    s = out.kv_stats
    assert min(s.token_states, s.reserved, s.internal_frag) >= 0
    assert s.allocated == s.token_states + s.reserved + s.internal_frag
    # CPU blocks: the swap pool's free list and the swapped requests' tables partition it
    cpu_held = [c for t in kv.cpu_tables.values() for c in t]
    assert sorted(cpu_held + kv._cpu_free) == list(range(kv.num_cpu_blocks))
    assert set(kv.cpu_tables) == {r.request_id for r in sched.swapped}
    for seq in out.seqs:
        r = sched.requests[seq.request_id]
        assert seq.start_pos == r.num_computed_tokens and seq.block_table == kv.block_tables[r.request_id]


def run(sched: PagedScheduler, reqs, arrivals, seed=0, cap=3000):
    fake = FakeKVExecutor(sched.kv, sched, seed)
    step = 0
    while step <= max(arrivals) or sched.has_unfinished():
        assert step < cap
        for r, a in zip(reqs, arrivals):
            if a == step:
                assert sched.add_request(r)
        out = sched.schedule()
        check_step(sched, out)
        sched.update(out, fake(out))
        step += 1
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == fake.emitted[r.request_id]
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    return fake


@given(
    n=st.integers(2, 10),
    lens=st.lists(st.integers(1, 90), min_size=10, max_size=10),
    bases=st.lists(st.integers(0, 2), min_size=10, max_size=10),
    arrivals=st.lists(st.integers(0, 6), min_size=10, max_size=10),
    max_tokens=st.lists(st.integers(1, 20), min_size=10, max_size=10),
    block_size=st.sampled_from([1, 4, 16]),
    pool_tokens=st.sampled_from([128, 192, 400, 2000]),
    budget=st.sampled_from([7, 32, 256]),
    mode=st.sampled_from(["recompute", "swap"]),
    swap_blocks=st.sampled_from([0, 4, 64]),
    threshold=st.sampled_from([0, 5]),
    seed=st.integers(0, 1000),
)
@PROPS
def test_prefix_cache_scheduler_properties(n, lens, bases, arrivals, max_tokens, block_size, pool_tokens, budget,
                                           mode, swap_blocks, threshold, seed):
    base = [[3 + (b * 31 + j * 7) % 50 for j in range(100)] for b in range(3)]
    reqs = [req(f"r{i}", base[bases[i]][: lens[i]] + [60 + i], max_tokens[i]) for i in range(n)]
    num_blocks = pool_tokens // block_size
    reqs = [r for r in reqs if cdiv(r.max_total_tokens, block_size) <= num_blocks]
    if not reqs:
        return
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=512, preemption_mode=mode,
                          long_prefill_token_threshold=threshold)
    kv = PagedKVCacheManager(num_blocks, block_size, enable_caching=True, num_cpu_blocks=swap_blocks)
    sched = PagedScheduler(cfg, kv)
    run(sched, reqs, arrivals[: len(reqs)], seed)
    assert sched.num_preemptions == sum(r.num_preemptions for r in reqs)
    assert sched.num_preemptions_swap <= sched.num_preemptions
    if mode == "recompute" or swap_blocks == 0:
        assert sched.num_preemptions_swap == 0
    assert kv.prefix_hits <= kv.prefix_queries


def test_second_identical_request_is_served_from_cache():
    kv = PagedKVCacheManager(num_blocks=64, block_size=4, enable_caching=True)
    sched = PagedScheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256), kv)
    a = req("a", range(3, 23), 3)  # 20 tokens
    run(sched, [a], [0])
    b = req("b", range(3, 23), 3)
    assert sched.add_request(b)
    out = sched.schedule()
    (seq,) = out.seqs
    assert (seq.start_pos, seq.num_tokens) == (16, 4)  # 4 full blocks hit minus the last token's block
    assert out.prefix_cache_hits == 16 and out.prefix_cache_queries == 20
    assert kv.prefix_hits == 16 and kv.prefix_queries == 40


def test_recompute_preemption_hits_its_own_blocks():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    a, b = req("a", range(3, 15), 12), req("b", range(20, 32), 12)
    fake = FakeKVExecutor(kv, sched)
    sched.add_request(a)
    sched.add_request(b)
    readmitted = []
    while sched.has_unfinished():
        out = sched.schedule()
        check_step(sched, out)
        for s in out.seqs:
            r = sched.requests[s.request_id]
            if r.num_preemptions and s.start_pos > 0 and s.num_tokens > 1:
                readmitted.append(s.start_pos)
        sched.update(out, fake(out))
    assert sched.num_preemptions > 0
    assert kv.preempted_hits > 0 and readmitted


def test_chunked_prefill_off_waits_for_room_and_rejects_oversized():
    kv = PagedKVCacheManager(num_blocks=64, block_size=4)
    cfg = SchedulerConfig(max_num_batched_tokens=20, max_model_len=256, enable_chunked_prefill=False)
    sched = PagedScheduler(cfg, kv)
    big = req("big", range(3, 40), 2)  # 37 + 2 > 20
    assert not sched.add_request(big) and "chunked prefill off" in big.reject_reason
    a, b = req("a", range(3, 13), 3), req("b", range(3, 18), 2)  # 10 and 15 prompt tokens
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.seqs] == [("a", 10)]  # b (15) does not fit the 10 left
    sched.update(out, StepResult({"a": 5}, 0.0))
    out = sched.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.seqs] == [("a", 1), ("b", 15)]


def test_long_prefill_token_threshold_caps_a_request():
    kv = PagedKVCacheManager(num_blocks=64, block_size=4)
    cfg = SchedulerConfig(max_num_batched_tokens=100, max_model_len=256, long_prefill_token_threshold=16)
    sched = PagedScheduler(cfg, kv)
    sched.add_request(req("a", range(3, 43), 2))
    sched.add_request(req("b", range(3, 8), 2))
    out = sched.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.seqs] == [("a", 16), ("b", 5)]


def test_swap_full_falls_back_to_recompute():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=1)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                           preemption_mode="swap"), kv)
    reqs = [req(f"r{i}", range(3 + i, 11 + i), 12) for i in range(3)]
    run(sched, reqs, [0, 0, 0])
    assert sched.num_preemptions > 0 and sched.num_preemptions_swap == 0


def _swapping_scheduler():
    """Three requests on 8 blocks of 4 tokens with swap preemption and 32 CPU blocks: (kv, sched, fake executor)."""
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=32)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                           preemption_mode="swap"), kv)
    for i in range(3):
        sched.add_request(req(f"r{i}", range(3 + i, 11 + i), 12))
    return kv, sched, FakeKVExecutor(kv, sched)


def test_swap_preemption_keeps_progress():
    kv, sched, fake = _swapping_scheduler()
    swapped_in = 0
    while sched.has_unfinished():
        out = sched.schedule()
        check_step(sched, out)
        for rid in out.preempted_ids:
            r = sched.requests[rid]
            assert r in sched.swapped and r.num_computed_tokens > 0
        swapped_in += bool(out.blocks_to_swap_in)
        sched.update(out, fake(out))
    assert sched.num_preemptions_swap == sched.num_preemptions > 0 and swapped_in
    assert kv.num_free_cpu_blocks == 32


def test_abort_swapped_request_frees_cpu_blocks():
    kv, sched, fake = _swapping_scheduler()
    while not sched.swapped:
        out = sched.schedule()
        sched.update(out, fake(out))
    victim = sched.swapped[0]
    assert sched.abort(victim.request_id) is victim
    assert victim not in sched.swapped and kv.num_free_cpu_blocks == 32


# --------------------------------------------------------------------------------- exactness (tiny model)

_REF: dict = {}


def cached_reference(model_dir, prompts, n):
    """transformers' greedy outputs, computed once per (model, prompts) in this module."""
    from test_engine_tiny import reference

    key = (str(model_dir), tuple(map(tuple, prompts)), n)
    if key not in _REF:
        _REF[key] = reference(model_dir, prompts, n)
    return _REF[key]


def _prompts():
    import torch

    g = torch.Generator().manual_seed(5)
    base = torch.randint(3, 300, (70,), generator=g).tolist()
    tail = lambda n: torch.randint(3, 300, (n,), generator=g).tolist()  # noqa: E731
    return [base + tail(9), base[:40] + tail(30), base + tail(1), list(base), list(base), tail(5), base[:16],
            base[:33] + tail(50)]


@pytest.mark.parametrize("caching,chunked", [(True, True), (False, True), (True, False), (False, False)])
def test_greedy_exact_with_prefix_caching_and_chunked_prefill(tiny_llama_dir, caching, chunked):
    from test_engine_tiny import GREEDY

    from engines.llm import LLM

    prompts = _prompts()
    ref = cached_reference(tiny_llama_dir, prompts, 12)
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096, max_num_batched_tokens=96 if chunked else 512,
              enable_prefix_caching=caching, enable_chunked_prefill=chunked, max_model_len=512)
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)  # everything cached now (when caching)
    assert [o.token_ids for o in first] == ref
    assert [o.token_ids for o in again] == ref
    kv = llm.engine.scheduler.kv
    if caching:
        assert kv.prefix_hits > 0
        # the second round hits every full block but the one holding each prompt's last token
        assert kv.prefix_hits >= sum(((len(p) - 1) // 16) * 16 for p in prompts)
    else:
        assert kv.prefix_hits == 0 and kv.pool.num_cached_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_exact_under_preemption_mid_chunked_prefill(tiny_llama_dir, mode):
    from test_engine_tiny import GREEDY, LENGTHS, prompts_of

    from engines.llm import LLM

    prompts = prompts_of(LENGTHS, seed=3) + _prompts()[:2]
    ref = cached_reference(tiny_llama_dir, prompts, 12)
    llm = LLM(tiny_llama_dir, kv_cache_tokens=288, block_size=16, max_num_batched_tokens=40, max_model_len=512,
              preemption_mode=mode, swap_space_bytes=1 << 22)
    sched = llm.engine.scheduler
    mid_prefill = []
    orig = sched._preempt

    def spy(r, out=None):
        if 0 < r.num_computed_tokens < r.num_prompt_tokens:
            mid_prefill.append(r.request_id)
        return orig(r, out)

    sched._preempt = spy
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert sched.num_preemptions > 0 and mid_prefill
    if mode == "swap":
        assert sched.num_preemptions_swap > 0
        steps = llm.engine.steps
        assert sum(s.swap_bytes for s in steps) > 0 and sum(s.swap_time for s in steps) > 0
    else:
        assert sched.num_preemptions_swap == 0
