"""KV accounting over shared blocks: the pool's running counts and the one-pass shortcut of
``PagedKVCacheManager.stats`` and ``kv_shared_saved`` agree with a block-by-block recount after every step.

The shortcut (``_shared_full_states``) replaced an O(blocks held) loop that made a simulated step of 200
requests sharing prompts cost about 15 ms; it must give exactly what the loop gives. Workloads draw shared
prompt prefixes (prefix-cache hits), parallel sampling and beam search (forked sequences share partly filled
blocks, copied on write), a small pool (preemption by recompute or swap) and chunked prefill, and run on the
simulator's engine loop (the real scheduler and KV manager, a cost model instead of the model).
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import KVStats, PagedKVCacheManager
from engines.core.llm_engine import kv_shared_saved
from engines.core.paged_scheduler import PagedScheduler
from engines.core.request import Request
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import SchedulerOutput
from engines.sim.cost_model import CostModel
from engines.sim.simulator import make_sim_engine, simulate

CM = CostModel({"const": 0.01, "tokens": 0.001, "decode_ctx": 0.0, "prefill_attn": 0.0, "sampled": 0.0})
PROPS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def recount_pool(kv: PagedKVCacheManager) -> None:
    """The pool's shared-block counters equal a recount over its blocks."""
    blocks = kv.pool.blocks
    assert kv.pool.num_shared_blocks == sum(1 for b in blocks if b.ref_cnt > 1)
    assert kv.pool.num_extra_refs == sum(b.ref_cnt - 1 for b in blocks if b.ref_cnt > 1)
    assert kv.pool.num_shared_unhashed == sum(1 for b in blocks if b.ref_cnt > 1 and b.block_hash is None)


def saved_by_block(kv: PagedKVCacheManager, requests) -> int:
    """``kv_shared_saved`` as a block-by-block recount: (ref count - 1) x block_size per distinct held block."""
    seen = {b for r in requests for b in kv.block_tables.get(r.request_id, ())}
    return sum(kv.pool.blocks[b].ref_cnt - 1 for b in seen) * kv.block_size


def check_stats(kv: PagedKVCacheManager, requests, scheduled: dict[str, int], got: KVStats) -> bool:
    """``got`` equals the block-by-block accounting; returns whether the one-pass shortcut applied."""
    states, reserved = kv._states_by_block(requests, scheduled)
    assert (got.token_states, got.reserved) == (states, reserved)
    assert got.internal_frag == got.allocated - states - reserved
    return bool(kv.pool.num_shared_blocks) and kv._shared_full_states(requests, scheduled) is not None


@given(
    prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 70)), min_size=2, max_size=10),
    max_tokens=st.lists(st.integers(1, 30), min_size=10, max_size=10),
    forks=st.lists(st.sampled_from([1, 1, 1, 2, 3, "beam"]), min_size=10, max_size=10),
    arrivals=st.lists(st.floats(0, 0.2), min_size=10, max_size=10),
    block_size=st.sampled_from([1, 4, 16]),
    pool_tokens=st.sampled_from([320, 2000]),  # 10 blocks of 16 can deadlock concurrent beam searches: see test_beam_search
    budget=st.sampled_from([16, 64, 512]),
    caching=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
)
@PROPS
def test_shared_block_accounting_matches_a_block_by_block_recount(prompts, max_tokens, forks, arrivals, block_size,
                                                                   pool_tokens, budget, caching, mode):
    base = [[3 + (b * 31 + j * 7) % 50 for j in range(80)] for b in range(3)]
    reqs = []
    for i, (b, n) in enumerate(prompts):
        f = forks[i]
        sp = (SamplingParams(max_tokens=max_tokens[i], beam_width=2) if f == "beam"
              else SamplingParams(max_tokens=max_tokens[i], n=f, temperature=1.0 if f > 1 else 0.0))
        reqs.append(Request(f"r{i}", base[b][:n] + [60 + i], sp, arrival_time=arrivals[i]))
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256, preemption_mode=mode,
                          enable_prefix_caching=caching)
    kv = PagedKVCacheManager(pool_tokens // block_size, block_size, enable_caching=caching,
                             num_cpu_blocks=64 if mode == "swap" else 0)
    sched = PagedScheduler(cfg, kv)
    eng = make_sim_engine(sched, CM)
    shortcut = {"schedule": 0, "between steps": 0}
    saved_at_schedule: list[int] = []  # the step record's kv_shared_saved is taken before the update

    def on_schedule(out: SchedulerOutput) -> None:
        scheduled = {s.request_id: s.num_tokens for s in out.seqs if not s.is_padding}
        shortcut["schedule"] += check_stats(kv, sched.running, scheduled, out.kv_stats)
        recount_pool(kv)
        saved_at_schedule.append(saved_by_block(kv, sched.running))

    eng.on_schedule = on_schedule
    step = eng.step

    def checked_step():
        outs = step()
        recount_pool(kv)
        shortcut["between steps"] += check_stats(kv, sched.running, {}, sched.kv_stats())
        assert eng.steps[-1].kv_shared_saved == saved_at_schedule[-1]
        assert kv_shared_saved(kv, sched.running) == saved_by_block(kv, sched.running)
        return outs

    eng.step = checked_step
    outs = simulate(eng, reqs)
    assert {o.parent_id or o.request_id for o in outs} == {r.request_id for r in reqs}
    assert kv.pool.num_extra_refs == kv.pool.num_shared_blocks == kv.pool.num_shared_unhashed == 0
    for where, n in shortcut.items():
        if n:
            event(f"one-pass shared accounting used ({where})")
