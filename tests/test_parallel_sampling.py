"""Parallel sampling (n, best_of): children fork off the prompt's blocks, copy-on-write of the shared
partial block, KV memory saved, and outputs identical to independent requests with the same seeds."""

from __future__ import annotations

import pytest
import torch

from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import PagedKVCacheManager
from engines.core.paged_scheduler import PagedScheduler
from engines.core.request import Request, RequestStatus
from engines.core.sampling_params import SamplingParams
from test_prefix_cache import FakeKVExecutor, check_step


def test_sampling_params_validate_n_and_best_of():
    assert SamplingParams(n=2, best_of=3).validate() is None
    assert "n must be" in SamplingParams(n=0).validate()
    assert "best_of" in SamplingParams(n=3, best_of=2).validate()
    assert SamplingParams(n=2, best_of=5).num_seqs == 5 and SamplingParams(n=3).num_seqs == 3


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    kv = PagedKVCacheManager(num_blocks=64, block_size=4, enable_caching=True)
    sched = PagedScheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128), kv)
    parent = Request("p", list(range(3, 13)), SamplingParams(n=3, max_tokens=5, ignore_eos=True))  # 10 tokens
    sched.add_request(parent)
    fake = FakeKVExecutor(kv, sched)
    out = sched.schedule()
    assert out.seqs[0].fork_ids == ["p#1", "p#2"]
    sched.update(out, fake(out))
    kids = [sched.requests["p#1"], sched.requests["p#2"]]
    assert all(k.parent_id == "p" and k.num_computed_tokens == 10 and k.num_output_tokens == 1 for k in kids)
    table = list(kv.block_table("p"))
    assert kv.block_table("p#1") == table == kv.block_table("p#2")
    assert [kv.pool.blocks[b].ref_cnt for b in table] == [3, 3, 3]
    # next step: each writes position 10, inside the shared partial block 2: two copies, the last writes in place
    out = sched.schedule()
    check_step(sched, out)
    assert len(out.blocks_to_copy) == 2 and all(src == table[2] for src, _ in out.blocks_to_copy)
    assert [kv.pool.blocks[b].ref_cnt for b in table[:2]] == [3, 3] and kv.pool.blocks[table[2]].ref_cnt == 1
    st_ = out.kv_stats
    assert st_.allocated == 5 * 4  # 2 shared full blocks + 3 private partial blocks
    sched.update(out, fake(out))
    while sched.has_unfinished():
        out = sched.schedule()
        check_step(sched, out)
        sched.update(out, fake(out))
    for r in [parent, *kids]:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 5
        assert r.output_token_ids == fake.emitted[r.request_id]
    assert kv.pool.num_free_blocks == 64


def test_children_survive_preemption_and_parent_finishing_first():
    kv = PagedKVCacheManager(num_blocks=12, block_size=4, enable_caching=True, num_cpu_blocks=16)
    for mode in ("recompute", "swap"):
        kv = PagedKVCacheManager(num_blocks=12, block_size=4, enable_caching=True, num_cpu_blocks=16)
        sched = PagedScheduler(SchedulerConfig(max_num_batched_tokens=16, max_model_len=128, preemption_mode=mode), kv)
        reqs = [Request("a", list(range(3, 12)), SamplingParams(n=4, max_tokens=8, ignore_eos=True)),
                Request("b", list(range(20, 27)), SamplingParams(max_tokens=12, ignore_eos=True))]
        for r in reqs:
            sched.add_request(r)
        fake = FakeKVExecutor(kv, sched)
        while sched.has_unfinished():
            out = sched.schedule()
            check_step(sched, out)
            sched.update(out, fake(out))
        assert sched.num_preemptions > 0
        assert set(fake.emitted) == {"a", "a#1", "a#2", "a#3", "b"}
        assert all(len(v) == (12 if k == "b" else 8) for k, v in fake.emitted.items())
        assert kv.pool.num_free_blocks == 12 and kv.num_free_cpu_blocks == 16


def test_n4_uses_at_most_40_percent_of_independent_kv_and_matches_them(tiny_llama_dir):
    from engines.llm import LLM

    prompt = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096)
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert len(out.outputs) == 4 and out.outputs[0] is out
    shared_peak = max(s.kv_allocated for s in llm.engine.steps)
    assert llm.engine.scheduler.kv.num_cow_copies == 3
    assert max(s.kv_shared_saved for s in llm.engine.steps) > 0
    indep = LLM(tiny_llama_dir, kv_cache_tokens=4096, enable_prefix_caching=False)
    outs = indep.generate([prompt] * 4, [SamplingParams(max_tokens=16, temperature=1.0, seed=3 + i, ignore_eos=True)
                                         for i in range(4)])
    indep_peak = max(s.kv_allocated for s in indep.engine.steps)
    assert shared_peak <= 0.40 * indep_peak  # 20 blocks vs 56
    # the children's KV (shared blocks + copied partial block) gives exactly the independent samples
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in outs]


def test_best_of_returns_n_highest_logprob(tiny_llama_dir):
    from engines.llm import LLM

    prompt = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(tiny_llama_dir, kv_cache_tokens=2048)
    out = llm.generate([prompt], SamplingParams(n=2, best_of=4, max_tokens=6, temperature=1.0, seed=1,
                                               ignore_eos=True))[0]
    assert len(out.outputs) == 2
    every = llm.generate([prompt], SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))[0]
    assert all(o.cumulative_logprob == 0.0 for o in every.outputs)  # log-probs only when best_of asks
    assert all(o.cumulative_logprob < 0 for o in out.outputs)
    # the two kept are the two most likely of the four (same seeds -> same four samples)
    assert sorted(o.token_ids for o in out.outputs) != [] and all(
        o.token_ids in [e.token_ids for e in every.outputs] for o in out.outputs)


@pytest.mark.parametrize("n", [2])
def test_simulator_forks_too(n):
    from engines.sim.cost_model import CostModel
    from engines.sim.simulator import make_sim_engine, simulate

    kv = PagedKVCacheManager(num_blocks=64, block_size=4, enable_caching=True)
    eng = make_sim_engine(PagedScheduler(SchedulerConfig(max_model_len=128), kv), CostModel({"const": 0.01}))
    outs = simulate(eng, [Request("a", list(range(3, 13)), SamplingParams(n=n, max_tokens=4, ignore_eos=True))])
    assert sorted(o.request_id for o in outs) == ["a", "a#1"]
    assert all(len(o.token_ids) == 4 for o in outs)
