"""Shared-prefix workload: the trace's ideal hit rate, the committed Mooncake-format trace, the scenario
knobs, and the simulated prefix-sharing scenario (hit rate vs ideal, throughput gain)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.scenario import ScenarioError, load_scenario, validate_scenario
from workbench.traces.prefix import ideal_prefix_hit_rate, make_shared_prefix_trace

ROOT = Path(__file__).parent.parent


def test_ideal_hit_rate_by_hand():
    a = list(range(40))  # 2 full blocks of 16 + 8
    b = list(range(40))  # identical: hits 2 blocks (32), last token's block recomputed
    c = list(range(32))  # exactly 2 blocks: at most 31 tokens -> 1 block
    d = [99] + list(range(1, 40))  # first block differs: nothing
    r = ideal_prefix_hit_rate([a, b, c, d], 16)
    assert r["queries"] == 40 + 40 + 32 + 40
    assert r["hits"] == 0 + 32 + 16 + 0
    assert r["hit_rate"] == pytest.approx(48 / 152)
    assert ideal_prefix_hit_rate([[1, 2, 3], [1, 2, 3]], 16)["hits"] == 0  # shorter than a block
    with pytest.raises(ValueError):
        ideal_prefix_hit_rate([a], 0)


def test_committed_trace_is_the_generator_output():
    path = ROOT / "workbench/data/traces/shared_prefix_mooncake.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert recs == make_shared_prefix_trace(num_requests=40, seed=0, request_rate=2.0)


def test_bool_knobs_parse_and_bad_values_are_one_line_errors(tmp_path):
    sc = load_scenario(ROOT / "scenarios/prefix-sharing.yaml")
    assert [e.enable_prefix_caching for e in sc.engines if e.policy_name == "paged"] == [True, False, True, False]
    base = {"name": "x", "trace": {"format": "synthetic", "synthetic": {"num_requests": 2, "request_rate": 1}}}
    ok = validate_scenario({**base, "engines": [{"name": "p", "kind": "paged", "preemption_mode": "swap",
                                                 "swap_space_bytes": 1 << 20, "enable_chunked_prefill": False}]})
    assert ok.engines[0].preemption_mode == "swap"
    with pytest.raises(ScenarioError, match="preemption_mode"):
        validate_scenario({**base, "engines": [{"name": "p", "kind": "paged", "preemption_mode": "drop"}]})
    with pytest.raises(ScenarioError, match="block_size"):
        validate_scenario({**base, "engines": [{"name": "p", "kind": "paged", "block_size": True}]})
    with pytest.raises(ScenarioError, match="swap_bandwidth_bytes_per_s is only for kind sim"):
        validate_scenario({**base, "engines": [{"name": "p", "kind": "paged", "swap_bandwidth_bytes_per_s": 1e9}]})


def test_simulated_prefix_sharing_scenario():
    from engines.core.config import ModelConfig
    from workbench.metrics import summarize
    from engines.sim.cost_model import CostModel
    from workbench.runner import BUILTIN_PROFILES, run_engine

    REFERENCE = BUILTIN_PROFILES / "ci-reference.json"  # a committed profile: no calibration in this test
    from workbench.scenario import load_scenario_trace
    from tiny_model import make_tokenizer  # noqa: F401  (tests path)

    sc = load_scenario(ROOT / "scenarios/prefix-sharing.yaml")
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
    trace = load_scenario_trace(sc, None, vocab_lo=100, vocab_hi=49000)
    ideal = ideal_prefix_hit_rate([t.prompt_token_ids for t in trace], 16)["hit_rate"]
    res = {}
    for name in ("sim-paged", "sim-paged-nocache"):
        outs, steps = run_engine(sc, sc.engine(name), None, cfg, trace, None, cost_model=CostModel.load(REFERENCE))
        res[name] = summarize(outs, steps, len(trace))
    on, off = res["sim-paged"], res["sim-paged-nocache"]
    assert abs(on["prefix_cache_hit_rate"] - ideal) <= 0.02
    assert off["prefix_cache_hit_rate"] == 0.0 and off["prefix_cache_queries"] == 0
    assert on["num_finished"] == off["num_finished"] == len(trace)
    # the throughput gain is a capacity claim: at the trace's recorded 2 req/s a machine as fast as the profile
    # keeps up either way (output throughput is then the offered load), so it is checked with every request
    # arriving at once (saturation)
    for t in trace:
        t.arrival_s = 0.0
    sat = {}
    for name in ("sim-paged", "sim-paged-nocache"):
        outs, steps = run_engine(sc, sc.engine(name), None, cfg, trace, None, cost_model=CostModel.load(REFERENCE))
        sat[name] = summarize(outs, steps, len(trace))
    assert sat["sim-paged"]["output_throughput"] >= 1.3 * sat["sim-paged-nocache"]["output_throughput"]
