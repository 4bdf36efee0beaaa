"""Real-engine cluster replay (workbench.real_cluster) on the tiny random-weight Llama: 2 replicas, one process."""

import random

import pytest
import torch

from engines.core.request import Request
from engines.core.router import make_router
from engines.core.sampling_params import SamplingParams
from engines.factory import EngineConfig, build_engine
from workbench.real_cluster import replay_cluster_realtime


def replicas(model_dir, n=2):
    cfg = EngineConfig(kind="paged", model=model_dir, kv_cache_tokens=2048, block_size=16, max_num_seqs=8,
                       max_num_batched_tokens=512, max_model_len=512, attention_backend="torch")
    return [build_engine(cfg) for _ in range(n)]


def shared_prefix_requests(n=16, groups=2, rate=40.0, seed=0):
    """``n`` requests, each one of ``groups`` 128-token contexts (in pairs: A A B B ...) + 8 own tokens, 4 output
    tokens."""
    rng = random.Random(seed)
    contexts = [[10 + g * 150 + k for k in range(128)] for g in range(groups)]
    return [Request(f"r{i}", contexts[(i // 2) % groups] + [rng.randrange(3, 300) for _ in range(8)],
                    SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=i / rate) for i in range(n)]


def hit_rate(engines):
    q = sum(s.prefix_cache_queries for e in engines for s in e.steps)
    return sum(s.prefix_cache_hits for e in engines for s in e.steps) / q


def test_every_request_ends_counts_add_up_and_round_robin_alternates(tiny_llama_dir):
    before = torch.get_num_threads()
    reps = replicas(tiny_llama_dir)
    reqs = shared_prefix_requests()
    run = replay_cluster_realtime(reps, make_router("round_robin"), reqs)
    ids = [r.request_id for r in reqs]
    assert sorted(o.request_id for o in run.outputs) == sorted(ids)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in run.outputs)
    assert [run.replica_of[i] for i in ids] == [k % 2 for k in range(len(ids))]
    assert len(run.outputs_of(0)) + len(run.outputs_of(1)) == len(ids)
    assert all(e.steps and not e.has_unfinished() for e in reps)
    assert torch.get_num_threads() == before  # restored after the run
    # one shared clock from 0: no request ends before it arrives, none before time 0
    assert all(o.finished_time >= o.arrival_time >= 0 for o in run.outputs)


def test_prefix_aware_hits_more_than_round_robin(tiny_llama_dir):
    rates = {}
    for name in ("round_robin", "prefix_aware"):
        reps = replicas(tiny_llama_dir)
        # contexts in pairs A A B B: round robin puts each context on both replicas, prefix_aware on one
        run = replay_cluster_realtime(reps, make_router(name), shared_prefix_requests(n=16, groups=2))
        assert len(run.outputs) == 16
        rates[name] = hit_rate(reps)
    assert rates["prefix_aware"] > rates["round_robin"]


def test_failing_step_fails_only_that_replicas_requests(tiny_llama_dir):
    reps = replicas(tiny_llama_dir)

    def boom(out):
        raise RuntimeError("device lost")

    reps[1].executor.execute = boom
    reqs = shared_prefix_requests(n=8)
    run = replay_cluster_realtime(reps, make_router("round_robin"), reqs)
    assert sorted(o.request_id for o in run.outputs) == sorted(r.request_id for r in reqs)
    for o in run.outputs:
        if run.replica_of[o.request_id] == 0:
            assert o.finish_reason == "length"
        else:
            assert o.finish_reason == "failed"
            assert "device lost" in o.error or "replica 1 stopped" in o.error
    assert any("device lost" in (o.error or "") for o in run.outputs_of(1))


def test_bad_input_is_one_line_naming_the_field(tiny_llama_dir):
    reps = replicas(tiny_llama_dir, 1)
    with pytest.raises(ValueError, match="max_concurrency"):
        replay_cluster_realtime(reps, make_router("round_robin"), [], max_concurrency=2)
    with pytest.raises(ValueError, match="twice"):
        replay_cluster_realtime(reps * 2, make_router("round_robin"), [])
