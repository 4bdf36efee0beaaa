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


# ------------------------------------------------------------------------------- scenario cluster section
def real_cluster_scenario(model_dir, trace=None, **cluster):
    return {"name": "c", "model": str(model_dir),
            "trace": trace or {"format": "mooncake", "path": "builtin:shared_prefix_mooncake.jsonl", "limit": 12,
                               "block_tokens": 16, "request_rate": 20.0},
            "engines": [{"name": "paged", "kind": "paged", "kv_cache_tokens": 4096, "max_model_len": 512},
                        {"name": "sim-paged", "kind": "sim", "cost_model": "builtin:ci-reference",
                         "kv_cache_tokens": 4096, "max_model_len": 512},
                        {"name": "h100", "kind": "sim", "cost_model": "analytic", "hardware": "h100-sxm",
                         "model": "llama-3.2-1b"},
                        {"name": "static", "kind": "static"}],
            "cluster": {"replicas": [{"engine": "paged", "count": 2}], **cluster}}


@pytest.mark.parametrize("cluster, message", [
    ({"replicas": [{"engine": "paged"}, {"engine": "h100"}]},
     "c.yaml: cluster.replicas.1.engine: h100 is kind sim, replicas.0 kind paged; a cluster is all sim or all real"),
    ({"replicas": [{"engine": "static"}]}, "c.yaml: cluster.replicas.0.engine: static is kind static; a cluster"),
    ({"twin": "paged"}, "c.yaml: cluster.twin: 'paged' is not a sim engine of this scenario"),
    ({"replicas": [{"engine": "h100"}], "twin": "sim-paged"},
     "c.yaml: cluster.twin: a twin is for a cluster of real replicas"),
])
def test_bad_real_cluster_sections_are_one_line_errors(tmp_path, cluster, message):
    from workbench.scenario import ScenarioError, validate_scenario

    with pytest.raises(ScenarioError) as e:
        validate_scenario(real_cluster_scenario(tmp_path, **cluster), file="c.yaml", check_files=False)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_real_cluster_refuses_closed_loop_users(tmp_path):
    from workbench.scenario import ScenarioError, validate_scenario

    trace = {"format": "mooncake", "path": "builtin:shared_prefix_mooncake.jsonl", "max_concurrency": 4}
    with pytest.raises(ScenarioError, match="c.yaml: trace.max_concurrency: closed-loop users are not supported"):
        validate_scenario(real_cluster_scenario(tmp_path, trace), file="c.yaml", check_files=False)


def test_scenario_cluster_runs_real_replicas_and_their_sim_twin(tiny_llama_dir, tmp_path):
    from engines.core.config import ModelConfig
    from engines.sim.cost_model import CostModel
    from workbench.cluster import run_scenario_cluster
    from workbench.report import cluster_rows
    from workbench.scenario import validate_scenario
    from workbench.traces import TraceRequest

    sc = validate_scenario(real_cluster_scenario(tiny_llama_dir, routers=["round_robin", "prefix_aware"],
                                                 twin="sim-paged"), check_files=False)
    real = EngineConfig(kind="paged", model=tiny_llama_dir, kv_cache_tokens=2048, max_model_len=512,
                        attention_backend="torch")
    cm = CostModel({"const": 0.002, "tokens": 0.0001, "decode_ctx": 0.0, "prefill_attn": 0.0, "sampled": 0.0})
    twin = EngineConfig(kind="sim", model_config=ModelConfig.from_dir(tiny_llama_dir), cost_model=cm,
                        kv_cache_tokens=2048, max_model_len=512)
    trace = [TraceRequest(r.request_id, r.arrival_time, len(r.prompt_token_ids), 4, r.prompt_token_ids)
             for r in shared_prefix_requests(n=12)]
    section = run_scenario_cluster(sc, [("paged", real, 2)], trace, None, tmp_path, twin_configs=[("sim-paged", twin, 2)])
    assert section["real"] and section["num_replicas"] == 2
    for runs in (section["routers"], section["twin"]["routers"]):
        assert list(runs) == ["round_robin", "prefix_aware"]
        for r in runs.values():
            s = r["summary"]
            assert s["num_finished"] == s["num_requests"] == 12
            assert sum(x["summary"]["num_requests"] for x in r["replicas"]) == 12
    err = section["twin"]["error"]["prefix_aware"]
    assert set(err) == {"prefix_cache_hit_rate_points", "ttft_p99_ratio", "output_throughput_ratio"}
    assert 0 < section["routers"]["round_robin"]["parallel_speedup"]
    assert "parallel_speedup" not in section["twin"]["routers"]["round_robin"]
    _, rows = cluster_rows({"cluster": section})
    assert [r[0] for r in rows if r[1] == "all"] == ["round_robin", "prefix_aware", "round_robin (sim twin)",
                                                     "prefix_aware (sim twin)"]
    assert (tmp_path / "cluster-prefix_aware" / "requests.csv").exists()
    assert (tmp_path / "cluster-twin-round_robin" / "requests.csv").exists()


def test_requests_a_replica_can_never_schedule_fail_as_stalled(tiny_llama_dir):
    from types import SimpleNamespace

    reps = replicas(tiny_llama_dir)

    def stuck_step():  # schedules nothing, as a replica whose requests can never fit
        reps[1].steps.append(SimpleNamespace(num_seqs=0))
        return []

    reps[1].step = stuck_step
    run = replay_cluster_realtime(reps, make_router("round_robin"), shared_prefix_requests(n=4))
    assert len(run.outputs) == 4
    stalled = [o for o in run.outputs if o.finish_reason == "failed"]
    assert sorted(o.request_id for o in stalled) == ["r1", "r3"] and all("stalled" in o.error for o in stalled)
