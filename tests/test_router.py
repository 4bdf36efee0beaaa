"""Routers of a cluster: which replica serves a request (engines.core.router)."""

import pytest

from engines.core.config import SchedulerConfig
from engines.core.request import Request
from engines.core.router import ROUTERS, make_router, prompt_block_hashes
from engines.core.sampling_params import SamplingParams
from engines.factory import build_scheduler
from engines.sim.cost_model import CostModel
from engines.sim.simulator import make_sim_engine

CM = CostModel({"const": 0.01, "tokens": 0.001, "decode_ctx": 0.0, "prefill_attn": 0.0, "sampled": 0.0})
BS = 16
PREFIX = list(range(100, 100 + 4 * BS))  # four full blocks


def replica(caching=True, policy="paged", blocks=64):
    cfg = SchedulerConfig(max_model_len=512, enable_prefix_caching=caching)
    return make_sim_engine(build_scheduler(policy, cfg, blocks, BS), CM)


def req(rid, prompt, max_tokens=4):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def load(engine, n, prompt=(7,) * 20):
    for i in range(n):
        engine.add_request(req(f"load-{id(engine)}-{i}", prompt))


def cache_prefix(engine, prompt):
    """Run one request with ``prompt`` to the end, so its full blocks stay in the prefix cache (free)."""
    engine.add_request(req("warm", prompt, 1))
    engine.run_to_completion()


def test_round_robin_cycles_in_arrival_order():
    r, reps = make_router("round_robin"), [replica() for _ in range(3)]
    assert [r.choose(req(str(i), [1, 2]), reps) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_outstanding_picks_the_emptiest_lowest_index_on_ties():
    reps = [replica() for _ in range(4)]
    for e, n in zip(reps, (3, 1, 2, 1)):
        load(e, n)
    assert make_router("least_outstanding").choose(req("x", [1]), reps) == 1


def test_least_kv_picks_the_lowest_block_usage():
    reps = [replica() for _ in range(3)]
    for e, n in zip(reps, (2, 0, 1)):
        load(e, n, prompt=[7] * 100)
        if n:
            e.step()  # the prefills take their blocks
    reps[1].add_request(req("queued", [7] * 100))  # waiting, holds no block yet
    assert make_router("least_kv").choose(req("x", [1]), reps) == 1


def test_prefix_aware_picks_the_replica_holding_the_prefix():
    reps = [replica() for _ in range(3)]
    cache_prefix(reps[2], PREFIX + [1, 2, 3])
    hashes = prompt_block_hashes(req("x", PREFIX + [9] * 5), BS)
    assert [e.scheduler.kv.num_cached_prefix_blocks(hashes) for e in reps] == [0, 0, 4]
    assert make_router("prefix_aware").choose(req("x", PREFIX + [9] * 5), reps) == 2
    # a prompt sharing only the first two blocks still goes there: 2 hits beat 0
    assert make_router("prefix_aware").choose(req("y", PREFIX[: 2 * BS] + [9] * 40), reps) == 2


def test_prefix_aware_falls_back_to_least_outstanding_without_hits():
    reps = [replica() for _ in range(3)]
    cache_prefix(reps[0], PREFIX + [1])
    load(reps[0], 1)
    load(reps[2], 2)
    assert make_router("prefix_aware").choose(req("x", [5] * 80), reps) == 1


def test_prefix_aware_respects_the_load_bound():
    reps = [replica() for _ in range(2)]
    cache_prefix(reps[0], PREFIX + [1])
    load(reps[0], 3)  # 3 in flight vs 0
    prompt = PREFIX + [9] * 5
    assert make_router("prefix_aware", max_imbalance=3).choose(req("x", prompt), reps) == 0
    assert make_router("prefix_aware", max_imbalance=2).choose(req("x", prompt), reps) == 1


def test_prefix_aware_ignores_replicas_without_a_prefix_cache():
    reps = [replica(caching=False), replica(policy="static"), replica()]
    for e in reps[:2]:
        cache_prefix(e, PREFIX + [1])
    load(reps[2], 1)
    assert make_router("prefix_aware").choose(req("x", PREFIX + [9]), reps) == 0  # no hits: least loaded


def test_prompt_hashes_leave_the_last_token_to_compute():
    assert len(prompt_block_hashes(req("a", PREFIX), BS)) == 3  # 64 tokens: blocks 0-2, token 63 is computed
    assert len(prompt_block_hashes(req("b", PREFIX + [1]), BS)) == 4


def test_unknown_router_and_bad_bound_are_errors():
    with pytest.raises(ValueError, match="router must be one of round_robin"):
        make_router("random")
    with pytest.raises(ValueError, match="max_imbalance must be >= 0"):
        make_router("prefix_aware", max_imbalance=-1)
    assert ROUTERS == ("round_robin", "least_outstanding", "least_kv", "prefix_aware")
