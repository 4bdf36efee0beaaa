"""Cluster simulation: N sim replicas behind a router on one event heap (engines.sim.cluster)."""

import dataclasses
import random

import pytest

from engines.core.config import SchedulerConfig
from engines.core.request import Request
from engines.core.router import make_router
from engines.core.sampling_params import SamplingParams
from engines.factory import build_scheduler
from engines.sim.cluster import simulate_cluster
from engines.sim.cost_model import CostModel
from engines.sim.simulator import make_sim_engine, simulate

CM = CostModel({"const": 0.01, "tokens": 0.001, "decode_ctx": 0.0, "prefill_attn": 0.0, "sampled": 0.0})
SLOW = CostModel({"const": 0.02, "tokens": 0.002, "decode_ctx": 0.0, "prefill_attn": 0.0, "sampled": 0.0})


def replica(cm=CM, blocks=256):
    cfg = SchedulerConfig(max_model_len=1024, enable_prefix_caching=True)
    return make_sim_engine(build_scheduler("paged", cfg, blocks, 16), cm)


def shared_prefix_requests(n=80, groups=4, rate=10.0, seed=0):
    """``n`` requests, each one of ``groups`` 256-token shared contexts + 32 own tokens, 8 output tokens."""
    rng = random.Random(seed)
    contexts = [[100 + g * 1000 + k for k in range(256)] for g in range(groups)]
    return [Request(str(i), contexts[rng.randrange(groups)] + [rng.randrange(5, 90) for _ in range(32)],
                    SamplingParams(max_tokens=8, ignore_eos=True), arrival_time=i / rate) for i in range(n)]


def trace_of(outs):
    return [(o.request_id, o.finish_reason, o.first_token_time, o.finished_time, tuple(o.token_times)) for o in outs]


def hit_rate(replicas):
    q = sum(s.prefix_cache_queries for r in replicas for s in r.steps)
    return sum(s.prefix_cache_hits for r in replicas for s in r.steps) / q


@pytest.mark.parametrize("users", [None, 3])
def test_one_replica_reproduces_simulate_exactly(users):
    a, b = replica(), replica()
    single = simulate(a, shared_prefix_requests(), max_concurrency=users)
    run = simulate_cluster([b], make_router("prefix_aware"), shared_prefix_requests(), max_concurrency=users)
    assert trace_of(run.outputs) == trace_of(single)
    assert [dataclasses.astuple(s) for s in b.steps] == [dataclasses.astuple(s) for s in a.steps]
    assert set(run.replica_of.values()) == {0}


def test_prefix_aware_beats_round_robin_on_hit_rate_and_counts_add_up():
    rates = {}
    for name in ("round_robin", "prefix_aware"):
        reps = [replica() for _ in range(4)]
        run = simulate_cluster(reps, make_router(name), shared_prefix_requests())
        assert sorted(run.replica_of) == sorted(str(i) for i in range(80))
        assert sorted(o.request_id for o in run.outputs) == sorted(str(i) for i in range(80))
        assert sum(len(run.outputs_of(i)) for i in range(4)) == 80
        assert all(o.finish_reason == "length" for o in run.outputs)
        rates[name] = hit_rate(reps)
    # measured with this seed (a deterministic simulation): 0.711 round robin, 0.844 prefix aware
    assert rates["round_robin"] == pytest.approx(0.711, abs=0.01)
    assert rates["prefix_aware"] == pytest.approx(0.844, abs=0.01)


def test_mixed_hardware_replicas_and_closed_loop_users():
    reps = [replica(), replica(SLOW)]
    run = simulate_cluster(reps, make_router("least_outstanding"), shared_prefix_requests(40), max_concurrency=4)
    assert len(run.outputs) == 40
    assert max(r.scheduler.num_unanswered() for r in reps) == 0
    served = [len(run.outputs_of(i)) for i in range(2)]
    assert sum(served) == 40 and served[0] > served[1]  # the faster replica frees first and gets more


def test_rejected_requests_are_returned_with_their_replica():
    reps = [replica(blocks=4), replica(blocks=4)]
    reqs = shared_prefix_requests(4)  # 296 tokens > 4 blocks of 16: never fits
    run = simulate_cluster(reps, make_router("round_robin"), reqs)
    assert [o.finish_reason for o in run.outputs] == ["rejected"] * 4
    assert [run.replica_of[str(i)] for i in range(4)] == [0, 1, 0, 1]


def test_bad_replica_lists_are_errors():
    e = replica()
    with pytest.raises(ValueError, match="at least one replica"):
        simulate_cluster([], make_router("round_robin"), [])
    with pytest.raises(ValueError, match="listed twice"):
        simulate_cluster([e, e], make_router("round_robin"), [])


# ------------------------------------------------------------------------------- scenario cluster section
def cluster_scenario(**cluster):
    return {"name": "c", "trace": {"format": "mooncake", "path": "builtin:shared_prefix_mooncake.jsonl",
                                   "limit": 16, "request_rate": 8.0},
            "engines": [{"name": "h100", "kind": "sim", "cost_model": "analytic", "hardware": "h100-sxm",
                         "model": "llama-3.2-1b"},
                        {"name": "a100", "kind": "sim", "cost_model": "analytic", "hardware": "a100-80gb",
                         "model": "llama-3.2-1b"}],
            "cluster": cluster}


@pytest.mark.parametrize("cluster, message", [
    ({"replicas": [{"engine": "nope", "count": 2}]}, "c.yaml: cluster.replicas.0.engine: no engine named 'nope'"),
    ({"replicas": [{"engine": "h100", "count": 0}]}, "c.yaml: cluster.replicas.0.count: Input should be greater"),
    ({"router": "random", "replicas": [{"engine": "h100"}]}, "c.yaml: cluster.router: Input should be 'round_robin'"),
    ({"router": "least_kv", "routers": ["round_robin"], "replicas": [{"engine": "h100"}]},
     "c.yaml: cluster.routers: set router (one) or routers (several), not both"),
    ({"replicas": [{"engine": "h100", "replicas": 3}]}, "c.yaml: cluster.replicas.0.replicas: unknown field"),
])
def test_bad_cluster_sections_are_one_line_errors(cluster, message):
    from workbench.scenario import ScenarioError, validate_scenario

    with pytest.raises(ScenarioError) as e:
        validate_scenario(cluster_scenario(**cluster), file="c.yaml")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_run_scenario_writes_cluster_results_per_router_and_replica(tmp_path):
    from workbench.runner import run_scenario
    from workbench.scenario import validate_scenario

    sc = validate_scenario(cluster_scenario(routers=["round_robin", "prefix_aware"],
                                            replicas=[{"engine": "h100", "count": 2}, {"engine": "a100", "count": 1}]))
    res = run_scenario(sc, tmp_path)
    c = res["cluster"]
    assert c["num_replicas"] == 3 and list(c["routers"]) == ["round_robin", "prefix_aware"]
    assert 0 < c["prefix_cache_ideal_hit_rate"] < 1
    assert all(r["summary"]["prefix_cache_hit_rate"] <= c["prefix_cache_ideal_hit_rate"] for r in c["routers"].values())
    for router, r in c["routers"].items():
        s = r["summary"]
        assert s["num_finished"] + s["num_rejected"] + s["num_failed"] == s["num_requests"] == 16
        assert [x["engine"] for x in r["replicas"]] == ["h100", "h100", "a100"]
        assert sum(x["summary"]["num_requests"] for x in r["replicas"]) == 16
        assert sum(x["summary"]["num_steps"] for x in r["replicas"]) == s["num_steps"]
        csv = (tmp_path / f"cluster-{router}" / "requests.csv").read_text().splitlines()
        assert len(csv) == 17 and csv[0].endswith(",replica")
    assert [x["summary"]["num_requests"] for x in c["routers"]["round_robin"]["replicas"]] == [6, 5, 5]
    assert "Cluster what-if" in (tmp_path / "report.html").read_text()


def test_lazily_read_requests_and_streamed_outputs_give_the_same_cluster_run():
    """A generator of requests with outputs and step records streamed to callbacks (a simulated day's way)
    gives what a list with everything kept gives: the same outputs, routing and step records."""
    kept_reps = [replica() for _ in range(3)]
    kept = simulate_cluster(kept_reps, make_router("prefix_aware"), shared_prefix_requests())
    reps = [replica() for _ in range(3)]
    outs, steps = [], []
    run = simulate_cluster(reps, make_router("prefix_aware"), iter(shared_prefix_requests()), on_output=outs.append,
                           on_steps=steps.extend, steps_window=8)
    assert run.outputs == [] and trace_of(outs) == trace_of(kept.outputs)
    assert run.replica_of == kept.replica_of
    assert len(steps) > 0 and all(len(r.steps) <= 9 for r in reps)
    assert len(steps) + sum(len(r.steps) for r in reps) == sum(len(r.steps) for r in kept_reps)
