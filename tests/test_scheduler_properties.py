"""Property tests of the paged and static schedulers driven by a fake executor (no torch, no model).

Each example draws a request mix (arrival step, prompt length, max_tokens, EOS behaviour, abort step),
a small KV pool (so the paged scheduler preempts), a small token budget (so prompts are chunked) and
``max_num_seqs``, runs ``schedule -> fake execute -> update`` until nothing is left, and checks the
KV bookkeeping after every step and the request accounting at the end.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import ContiguousKVCacheManager, PagedKVCacheManager, cdiv
from engines.core.paged_scheduler import PagedScheduler
from engines.core.request import Request, RequestStatus
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import SchedulerOutput, StepResult
from engines.core.static_scheduler import PAD_BLOCK, StaticScheduler
from engines.core.step_shape import _scatter

EOS = 2
ENDED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.REJECTED,
}
PROPS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------------------------
# fake executor and driver
# --------------------------------------------------------------------------------------------


class FakeExecutor:
    """Samples a random token for every row that needs one; EOS with probability ``p_eos``."""

    def __init__(self, seed: int, p_eos: float = 0.1) -> None:
        self.rng = random.Random(seed)
        self.p_eos = p_eos
        self.emitted: dict[str, list[int]] = {}

    def __call__(self, out: SchedulerOutput) -> StepResult:
        sampled = {}
        for seq in out.seqs:
            if seq.sample and not seq.is_padding:
                tok = EOS if self.rng.random() < self.p_eos else self.rng.randrange(3, 100)
                sampled[seq.request_id] = tok
                self.emitted.setdefault(seq.request_id, []).append(tok)
        return StepResult(sampled=sampled, duration=0.0)


class FakeSpecExecutor(FakeExecutor):
    """``FakeExecutor`` that also keeps a random prefix of every row's drafts (speculative decoding), and
    records what the scheduler must append: the kept drafts and the sampled token, cut after EOS and at
    ``max_tokens``."""

    def __call__(self, out: SchedulerOutput) -> StepResult:
        plain = [s for s in out.seqs if not s.num_spec]
        result = super().__call__(SchedulerOutput(seqs=plain))
        for seq in out.seqs:
            if not seq.num_spec:
                continue
            j = self.rng.randint(0, seq.num_spec)
            kept = [self.rng.randrange(3, 100) for _ in range(j)]
            tok = EOS if self.rng.random() < self.p_eos else self.rng.randrange(3, 100)
            result.spec_accepted[seq.request_id], result.sampled[seq.request_id] = kept, tok
            req, sp = seq.request, seq.sampling_params
            emitted = []
            for t in kept + [tok]:
                emitted.append(t)
                if (t in req.eos_token_ids and not sp.ignore_eos) or len(req.output_token_ids) + len(emitted) >= sp.max_tokens:
                    break
            self.emitted.setdefault(seq.request_id, []).extend(emitted)
        return result


@dataclass
class Spec:
    arrival: int
    prompt_len: int
    max_tokens: int
    ignore_eos: bool
    has_eos: bool
    abort_at: int | None


def make_request(i: int, s: Spec) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=[3 + (i * 7 + j) % 90 for j in range(s.prompt_len)],
        sampling_params=SamplingParams(max_tokens=s.max_tokens, ignore_eos=s.ignore_eos),
        eos_token_id=EOS if s.has_eos else None,
    )


def check_paged_step(sched: PagedScheduler, out: SchedulerOutput) -> None:
    kv, cfg = sched.kv, sched.config
    pool = kv.pool
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    # no sharing in these workloads: a used block is held by exactly one table
    tables = kv.block_tables
    held = [b for t in tables.values() for b in t]
    assert pool.num_used_blocks == len(held)
    assert len(set(held)) == len(held), "a block appears in two tables (or twice in one)"
    assert all(pool.blocks[b].ref_cnt == 1 for b in held)
    free = pool._free.block_ids()
    assert len(free) == pool.num_free_blocks
    assert len(set(free)) == len(free)
    assert set(free) == set(range(pool.num_blocks)) - set(held)
    # only running requests hold blocks
    running_ids = {r.request_id for r in sched.running}
    assert {rid for rid, t in tables.items() if t} <= running_ids
    assert len(sched.running) <= cfg.max_num_seqs
    # the step itself
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.seqs) <= cfg.max_num_seqs
    assert len({s.request_id for s in out.seqs}) == len(out.seqs)
    assert not (set(out.preempted_ids) & {s.request_id for s in out.seqs})
    for seq in out.seqs:
        req = sched.requests[seq.request_id]
        assert req.status == RequestStatus.RUNNING
        assert seq.num_tokens >= 1
        assert seq.start_pos == req.num_computed_tokens
        own = seq.num_tokens - seq.num_spec  # speculative rows: the request's own token, then its drafts
        assert seq.token_ids[:own] == req.all_token_ids[seq.start_pos : seq.start_pos + own]
        assert seq.sample == (seq.context_len - seq.num_spec == req.num_tokens_total)
        if seq.num_spec:
            assert own == 1 and seq.sample
            assert req.num_output_tokens + seq.num_spec + 1 <= req.sampling_params.max_tokens
        assert len(seq.block_table) * kv.block_size >= seq.context_len
        assert seq.block_table == tables[seq.request_id]
        # the KV manager's running count of non-consecutive neighbours matches a recount of the table
        assert seq.scatter == _scatter(seq.block_table)
    for rid, t in tables.items():
        assert kv.scatter(rid) == _scatter(t)
    st_ = out.kv_stats
    assert st_.allocated == pool.num_used_blocks * kv.block_size
    assert min(st_.token_states, st_.reserved, st_.internal_frag) >= 0
    assert st_.allocated == st_.token_states + st_.reserved + st_.internal_frag + st_.external_frag
    # internal waste is confined to each running request's last block
    assert st_.internal_frag <= len(sched.running) * (kv.block_size - 1)


def check_static_step(sched: StaticScheduler, out: SchedulerOutput) -> None:
    kv, cfg = sched.kv, sched.config
    assert len(out.seqs) <= cfg.max_batch_size
    assert len(sched.batch) <= cfg.max_batch_size
    # reservations are disjoint runs inside the pool, each large enough for its request
    used = []
    for rid, (start, n, slots) in kv.runs.items():
        assert 0 <= start and start + n <= kv.num_blocks
        assert n == cdiv(slots, kv.block_size)
        used.extend(range(start, start + n))
    assert len(set(used)) == len(used), "two reservations overlap"
    assert set(kv.runs) == {r.request_id for r in sched.batch}
    # a padding row is a decode row at the batch's current length (its longest live row) over PAD_BLOCKs
    longest = max((s.context_len for s in out.seqs if not s.is_padding), default=0)
    for seq in out.seqs:
        if seq.is_padding:
            assert seq.is_decode and seq.num_tokens == 1 and not seq.sample
            assert seq.context_len == longest
            assert seq.block_table == [PAD_BLOCK] * cdiv(longest, kv.block_size)
            continue
        req = sched.requests[seq.request_id]
        assert req.status == RequestStatus.RUNNING
        assert seq.start_pos == req.num_computed_tokens
        assert seq.token_ids == req.all_token_ids[seq.start_pos :]
        assert seq.sample
        assert kv.runs[seq.request_id][2] >= seq.context_len
        assert len(seq.block_table) * kv.block_size >= seq.context_len
    st_ = out.kv_stats
    assert min(st_.token_states, st_.reserved, st_.internal_frag, st_.external_frag) >= 0
    assert st_.allocated == st_.token_states + st_.reserved + st_.internal_frag + st_.external_frag


def drive(sched, specs: list[Spec], seed: int, check, step_cap: int, fake=None):
    """Run the scenario to completion; returns (requests, accepted flags, fake executor, steps)."""
    fake = fake or FakeExecutor(seed)
    reqs = [make_request(i, s) for i, s in enumerate(specs)]
    accepted = [None] * len(reqs)
    last_arrival = max((s.arrival for s in specs), default=0)
    step = 0
    while step <= last_arrival or sched.has_unfinished():
        assert step < step_cap, f"no progress after {step_cap} steps"
        for i, (r, s) in enumerate(zip(reqs, specs)):
            if s.arrival == step:
                accepted[i] = sched.add_request(r)
                if not accepted[i]:
                    assert r.status == RequestStatus.REJECTED
                    assert r.reject_reason and r.request_id in r.reject_reason
        out = sched.schedule()
        check(sched, out)
        if any(not s_.sample and not s_.is_padding for s_ in out.seqs):
            event("chunked prefill")
        result = fake(out)
        finished = sched.update(out, result)
        for r in finished:
            assert r.is_finished and r.request_id not in sched.requests
        for i, (r, s) in enumerate(zip(reqs, specs)):
            if s.abort_at == step and accepted[i]:
                was_finished = r.is_finished
                got = sched.abort(r.request_id)
                assert (got is None) == was_finished
                if got is not None:
                    assert got is r and r.status == RequestStatus.FINISHED_ABORTED
        step += 1
    return reqs, accepted, fake, step


def check_end(sched, reqs, accepted, specs, fake):
    assert not sched.requests and not sched.waiting and not sched.running
    n_fin = n_abort = n_rej = 0
    for r, ok, s in zip(reqs, accepted, specs):
        assert r.status in ENDED, (r.request_id, r.status)
        assert ok == (r.status != RequestStatus.REJECTED)
        n_fin += r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        n_abort += r.status == RequestStatus.FINISHED_ABORTED
        n_rej += r.status == RequestStatus.REJECTED
        out = r.output_token_ids
        # outputs are exactly what the executor sampled for the request, in order (nothing lost
        # on preemption, nothing appended after the end)
        assert out == fake.emitted.get(r.request_id, [])
        assert len(out) <= s.max_tokens
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert len(out) == s.max_tokens
            assert s.ignore_eos or not s.has_eos or EOS not in out
        elif r.status == RequestStatus.FINISHED_STOPPED:
            assert s.has_eos and not s.ignore_eos
            assert out[-1] == EOS and EOS not in out[:-1]
            assert r.stop_reason == EOS
        elif r.status == RequestStatus.REJECTED:
            assert out == [] and r.num_computed_tokens == 0
        elif r.status == RequestStatus.FINISHED_ABORTED:
            assert s.abort_at is not None
            if s.has_eos and not s.ignore_eos:
                assert EOS not in out
    assert n_fin + n_abort + n_rej == len(reqs)
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    # coverage of the interesting paths (pytest --hypothesis-show-statistics)
    for status in {r.status for r in reqs}:
        event(f"some request {status.value}")
    if sched.num_preemptions:
        event("preemption")


# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------


@st.composite
def spec_lists(draw, max_requests=12):
    n = draw(st.integers(2, max_requests))
    specs = []
    for _ in range(n):
        specs.append(
            Spec(
                arrival=draw(st.integers(0, 8)),
                prompt_len=draw(st.one_of(st.integers(1, 40), st.integers(1, 200))),
                max_tokens=draw(st.integers(1, 40)),
                ignore_eos=draw(st.booleans()),
                has_eos=draw(st.booleans()),
                abort_at=draw(st.none() | st.none() | st.integers(0, 60)),
            )
        )
    return specs


@given(
    specs=spec_lists(),
    block_size=st.sampled_from([1, 2, 4, 16]),
    pool_tokens=st.sampled_from([64, 96, 128, 192, 256, 384, 600]),
    budget=st.sampled_from([8, 13, 32, 64, 100, 256]),
    max_num_seqs=st.integers(1, 8),
    max_model_len=st.sampled_from([128, 200, 256]),
    seed=st.integers(0, 2**16),
)
@PROPS
def test_paged_scheduler_invariants(specs, block_size, pool_tokens, budget, max_num_seqs, max_model_len, seed):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    kv = PagedKVCacheManager(max(1, pool_tokens // block_size), block_size)
    sched = PagedScheduler(cfg, kv)
    cap = 50 + sum(s.prompt_len + s.max_tokens for s in specs) * 4
    reqs, accepted, fake, _ = drive(sched, specs, seed, check_paged_step, cap)
    check_end(sched, reqs, accepted, specs, fake)
    for r, ok, s in zip(reqs, accepted, specs):
        expect_reject = s.prompt_len + s.max_tokens > max_model_len or cdiv(
            s.prompt_len + s.max_tokens, block_size
        ) > kv.num_blocks
        assert (not ok) == expect_reject
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not any(kv.block_tables.values())


@given(
    specs=spec_lists(),
    block_size=st.sampled_from([1, 2, 4, 16]),
    pool_tokens=st.sampled_from([64, 128, 256, 600]),
    budget=st.sampled_from([8, 13, 64, 256]),
    max_num_seqs=st.integers(1, 8),
    method=st.sampled_from(["ngram", "layers:1"]),
    k=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
@PROPS
def test_paged_scheduler_invariants_with_speculative_steps(specs, block_size, pool_tokens, budget, max_num_seqs,
                                                           method, k, seed):
    """Speculative steps (drafts verified, a random prefix kept, the rest rolled back) keep every invariant:
    no block leaks or double ownership, outputs exactly what was emitted (cut at EOS / max_tokens)."""
    from engines.core.spec_decode import SpecDecodeConfig

    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256)
    kv = PagedKVCacheManager(max(1, pool_tokens // block_size), block_size)
    sched = PagedScheduler(cfg, kv, SpecDecodeConfig.parse(method, k))
    cap = 50 + sum(s.prompt_len + s.max_tokens for s in specs) * 4
    reqs, accepted, fake, _ = drive(sched, specs, seed, check_paged_step, cap, FakeSpecExecutor(seed))
    check_end(sched, reqs, accepted, specs, fake)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    st_ = sched.spec_stats
    assert st_.num_accepted_tokens <= st_.num_draft_tokens
    if st_.num_drafts:
        event("speculative step")


@given(
    specs=spec_lists(),
    block_size=st.sampled_from([1, 4, 16]),
    pool_tokens=st.integers(256, 1200),
    max_batch_size=st.integers(1, 6),
    reservation=st.sampled_from(["max", "pow2", "oracle"]),
    max_model_len=st.sampled_from([200, 256]),
    seed=st.integers(0, 2**16),
)
@PROPS
def test_static_scheduler_invariants(specs, block_size, pool_tokens, max_batch_size, reservation, max_model_len, seed):
    cfg = SchedulerConfig(max_batch_size=max_batch_size, max_model_len=max_model_len, reservation=reservation)
    kv = ContiguousKVCacheManager(max(1, pool_tokens // block_size), block_size)
    sched = StaticScheduler(cfg, kv)
    cap = 50 + sum(s.max_tokens + 1 for s in specs) * 4
    reqs, accepted, fake, _ = drive(sched, specs, seed, check_static_step, cap)
    check_end(sched, reqs, accepted, specs, fake)
    # the last batch's reservations are released as soon as its last member ends
    assert kv.runs == {}
    assert sched.schedule().is_empty
    assert sched.batch == []


# --------------------------------------------------------------------------------------------
# deterministic cases
# --------------------------------------------------------------------------------------------


def greedy_req(rid: str, prompt_len: int, max_tokens: int, **kw) -> Request:
    return Request(rid, [5] * prompt_len, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), **kw)


def test_preemption_happens_and_outputs_continue():
    # 8 blocks of 4 = 32 slots; three requests of 8 + 12 tokens each cannot all grow
    kv = PagedKVCacheManager(num_blocks=8, block_size=4)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    reqs = [greedy_req(f"r{i}", 8, 12) for i in range(3)]
    for r in reqs:
        assert sched.add_request(r)
    fake = FakeExecutor(seed=0, p_eos=0.0)
    before_preempt: dict[str, list[int]] = {}
    recomputed: set[str] = set()
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 500
        out = sched.schedule()
        check_paged_step(sched, out)
        for rid in out.preempted_ids:
            r = next(r for r in reqs if r.request_id == rid)
            assert r.status == RequestStatus.PREEMPTED and r in sched.waiting
            assert r.num_computed_tokens == 0
            assert not kv.block_tables.get(rid)
            before_preempt.setdefault(rid, list(r.output_token_ids))
        for seq in out.seqs:
            r = sched.requests[seq.request_id]
            if r.num_preemptions and seq.start_pos == 0:
                # recompute: the prefill covers the prompt and the outputs so far
                assert seq.token_ids[: r.num_tokens_total] == r.prompt_token_ids + r.output_token_ids
                assert len(seq.token_ids) <= r.num_tokens_total
                recomputed.add(seq.request_id)
        sched.update(out, fake(out))
    assert sched.num_preemptions > 0
    assert before_preempt and recomputed
    assert any(before_preempt[rid] for rid in before_preempt), "no victim had produced output yet"
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == 12
        assert r.output_token_ids == fake.emitted[r.request_id]
        if r.request_id in before_preempt:
            assert r.output_token_ids[: len(before_preempt[r.request_id])] == before_preempt[r.request_id]
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_newest_running_request_is_the_victim():
    kv = PagedKVCacheManager(num_blocks=4, block_size=2)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    a, b = greedy_req("a", 4, 4), greedy_req("b", 4, 4)
    sched.add_request(a)
    sched.add_request(b)
    fake = FakeExecutor(seed=0, p_eos=0.0)
    out = sched.schedule()  # both prefill: 2 + 2 blocks, pool full
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    sched.update(out, fake(out))
    out = sched.schedule()  # a needs a 3rd block: b (newest) is preempted
    assert out.preempted_ids == ["b"]
    assert [s.request_id for s in out.seqs] == ["a"]
    assert list(sched.waiting) == [b] and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 1


def test_chunked_prefill_splits_prompt_by_budget():
    kv = PagedKVCacheManager(num_blocks=64, block_size=4)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128), kv)
    r = greedy_req("a", 50, 3)
    sched.add_request(r)
    fake = FakeExecutor(seed=0, p_eos=0.0)
    chunks = []
    while sched.has_unfinished():
        out = sched.schedule()
        check_paged_step(sched, out)
        (seq,) = out.seqs
        chunks.append((seq.start_pos, seq.num_tokens, seq.sample))
        sched.update(out, fake(out))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True), (50, 1, True), (51, 1, True)]


def test_budget_shared_between_decode_and_new_prefill():
    kv = PagedKVCacheManager(num_blocks=64, block_size=4)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=128), kv)
    fake = FakeExecutor(seed=0, p_eos=0.0)
    sched.add_request(greedy_req("a", 5, 5))
    out = sched.schedule()
    sched.update(out, fake(out))
    sched.add_request(greedy_req("b", 30, 5))
    out = sched.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.seqs] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_admission():
    kv = PagedKVCacheManager(num_blocks=64, block_size=4)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, max_model_len=128), kv)
    for i in range(4):
        sched.add_request(greedy_req(f"r{i}", 3, 2))
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["r0", "r1"]
    assert out.num_waiting == 2


@pytest.mark.parametrize("kind", ["paged", "static"])
def test_rejections_name_the_request_and_others_finish(kind):
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, max_batch_size=2, reservation="pow2")
    if kind == "paged":
        sched = PagedScheduler(cfg, PagedKVCacheManager(num_blocks=32, block_size=4))
    else:
        sched = StaticScheduler(cfg, ContiguousKVCacheManager(num_blocks=32, block_size=4))
    too_long = greedy_req("too-long", 60, 10)  # 70 > 64
    zero = greedy_req("zero-tokens", 5, 1)
    zero.sampling_params.max_tokens = 0
    empty = greedy_req("empty-prompt", 0, 4)
    ok = [greedy_req(f"ok{i}", 10 + i, 6) for i in range(3)]
    assert not sched.add_request(too_long)
    assert not sched.add_request(zero)
    assert not sched.add_request(empty)
    for r in ok:
        assert sched.add_request(r)
    for r in (too_long, zero, empty):
        assert r.status == RequestStatus.REJECTED
        assert r.request_id in r.reject_reason
        assert r.request_id not in sched.requests
    assert "max_model_len" in too_long.reject_reason
    assert "max_tokens" in zero.reject_reason
    fake = FakeExecutor(seed=1, p_eos=0.0)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 200
        out = sched.schedule()
        sched.update(out, fake(out))
    for r in ok:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6


def test_paged_rejects_request_larger_than_pool():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)  # 16 slots
    sched = PagedScheduler(SchedulerConfig(max_model_len=1024), kv)
    r = greedy_req("big", 10, 7)
    assert not sched.add_request(r)
    assert "big" in r.reject_reason and "KV pool" in r.reject_reason
    assert sched.add_request(greedy_req("fits", 10, 6))


def test_static_rejects_reservation_larger_than_pool():
    kv = ContiguousKVCacheManager(num_blocks=4, block_size=16)  # 64 slots
    sched = StaticScheduler(SchedulerConfig(max_model_len=128, reservation="max"), kv)
    r = greedy_req("res", 4, 4)
    assert not sched.add_request(r)
    assert "res" in r.reject_reason and "'max'" in r.reject_reason


def test_abort_waiting_and_running_frees_blocks():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64), kv)
    a, b = greedy_req("a", 8, 4), greedy_req("b", 8, 4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a"]
    assert kv.pool.num_used_blocks == 2
    assert sched.abort("b") is b and b.status == RequestStatus.FINISHED_ABORTED
    assert sched.abort("b") is None
    assert sched.abort("nope") is None
    # abort between schedule and update: the step's row for it is ignored
    assert sched.abort("a") is a
    assert kv.pool.num_free_blocks == 8
    sched.update(out, StepResult(sampled={"a": 7}, duration=0.0))
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert not sched.has_unfinished()


def test_static_waits_for_whole_batch_and_pads_finished_members():
    kv = ContiguousKVCacheManager(num_blocks=64, block_size=4)
    sched = StaticScheduler(SchedulerConfig(max_batch_size=2, max_model_len=64, reservation="oracle"), kv)
    a, b, c = greedy_req("a", 4, 1), greedy_req("b", 4, 3), greedy_req("c", 4, 1)
    for r in (a, b, c):
        sched.add_request(r)
    fake = FakeExecutor(seed=0, p_eos=0.0)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    sched.update(out, fake(out))
    assert a.status == RequestStatus.FINISHED_LENGTH
    out = sched.schedule()
    assert [(s.request_id, s.is_padding) for s in out.seqs] == [("a", True), ("b", False)]
    assert "c" not in kv.runs and "a" in kv.runs  # a keeps its reservation as padding
    sched.update(out, fake(out))
    out = sched.schedule()
    sched.update(out, fake(out))
    assert b.status == RequestStatus.FINISHED_LENGTH
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["c"]
    assert set(kv.runs) == {"c"}


def test_static_releases_last_batch_when_its_last_member_ends():
    """Reservations are held while any member runs and released when the last one ends."""
    kv = ContiguousKVCacheManager(num_blocks=16, block_size=4)
    sched = StaticScheduler(SchedulerConfig(max_batch_size=2, max_model_len=64, reservation="max"), kv)
    sched.add_request(greedy_req("a", 4, 1))
    fake = FakeExecutor(seed=0, p_eos=0.0)
    out = sched.schedule()
    sched.update(out, fake(out))
    assert not sched.has_unfinished()
    assert kv.runs == {} and sched.kv_stats().allocated == 0
    assert sched.schedule().is_empty


def test_block_table_scatter_follows_fork_copy_on_write_trim_and_swap():
    """``PagedKVCacheManager.scatter`` (kept as tables change) equals a recount of each table after every kind
    of change: growth from a scattered free queue, a fork, a copy-on-write of a shared partly filled block, a
    trim, a swap out and back in, and a free."""
    kv = PagedKVCacheManager(num_blocks=14, block_size=4, num_cpu_blocks=16)
    sp = SamplingParams(max_tokens=8, temperature=0)
    filler = Request("filler", list(range(3, 3 + 40)), sp)
    a = Request("a", list(range(3, 3 + 10)), sp)

    def check():
        for rid, t in kv.block_tables.items():
            assert kv.scatter(rid) == _scatter(t), rid

    assert kv.allocate_slots(filler, 40)
    kv.free(filler)  # its 10 blocks go back to the free queue's tail in reverse order
    assert kv.allocate_slots(a, 10)  # blocks 10, 11, 12 (then 13, then the freed 9, 8, ...)
    a.num_computed_tokens = 10
    check()
    a.append_output(5)
    assert kv.allocate_slots(a, 1)
    a.num_computed_tokens = 11
    for _ in range(6):  # grows into the scattered, reversed blocks freed above
        a.append_output(5)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    check()
    assert kv.scatter("a") > 0
    child = Request("a#1", a.prompt_token_ids, sp, parent_id="a")
    child.num_computed_tokens = a.num_computed_tokens
    kv.fork(a, child)
    check()
    child.append_output(6)
    assert kv.allocate_slots(child, 1)  # writes into the shared partly filled last block: copy-on-write
    assert kv.num_cow_copies == 1
    check()
    assert kv.trim(a, 9) > 0
    check()
    mapping = kv.swap_out(child)
    assert mapping and "a#1" not in kv.block_tables
    check()
    assert kv.swap_in(child, 1) is not None
    check()
    kv.free(a)
    kv.free(child)
    assert not kv._breaks and not kv.block_tables
