"""GPU what-if: catalogues, kv-calc, memory fit, analytic cost model, tp, quantization,
speculative decoding and the Orca policy in the simulator."""

import pytest
from typer.testing import CliRunner

from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import ContiguousKVCacheManager
from engines.core.orca_scheduler import OrcaScheduler, orca_reservation
from engines.core.request import Request
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import ScheduledSeq
from engines.factory import build_whatif_engine
from engines.sim.analytic_cost_model import AnalyticCostModel, Efficiency, SpecDecodeConfig
from engines.sim.catalog import GIB, MIB, CatalogError, get_hardware, get_model, hardware_names, memory_plan, model_names
from engines.sim.simulator import simulate
from workbench.cli import app
from workbench.scenario import ScenarioError, validate_scenario
from workbench.commands.spec_sweep import spec_sweep


def test_catalogues_have_the_required_entries_with_sources():
    for hw in ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "l40s"):
        assert hw in hardware_names() and get_hardware(hw).source.startswith(("NVIDIA", "http"))
    assert get_hardware("a100-80gb").fp8_flops is None  # no FP8 tensor cores on Ampere
    assert get_hardware("h100-sxm").bf16_flops == pytest.approx(989.4e12)
    for m in ("llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "mistral-7b",
              "opt-13b", "opt-66b", "opt-175b", "smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b"):
        assert m in model_names() and get_model(m).source


@pytest.mark.parametrize("name,per_token,params_b", [
    ("llama-3.1-70b", 327_680, 70.55),   # 2 x 80 x 8 x 128 x 2
    ("qwen2.5-7b", 57_344, 7.62),        # 2 x 28 x 4 x 128 x 2
    ("opt-13b", 819_200, 12.84),         # 2 x 40 x 40 x 128 x 2 (MHA)
    ("mistral-7b", 131_072, 7.24),       # 2 x 32 x 8 x 128 x 2
])
def test_kv_bytes_and_params_from_the_catalogue(name, per_token, params_b):
    m = get_model(name)
    assert m.kv_bytes_per_token("bf16") == per_token
    assert m.kv_bytes_per_token("fp8") == per_token // 2
    assert m.num_params / 1e9 == pytest.approx(params_b, abs=0.01)


def test_smollm2_catalogue_entry_matches_the_engine_config():
    from engines.core.config import ModelConfig

    mc = get_model("smollm2-135m").to_model_config()
    assert isinstance(mc, ModelConfig) and mc.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4


def test_kv_calc_cli_llama70b():
    r = CliRunner().invoke(app, ["kv-calc", "--model", "llama-3.1-70b", "--dtype", "bf16", "--tokens", "2048"])
    assert r.exit_code == 0, r.output
    assert "327,680 bytes" in r.output and "(640.0 MiB) for 2,048 tokens" in r.output
    r = CliRunner().invoke(app, ["kv-calc", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--tp", "4", "--json"])
    import json

    d = json.loads(r.output)
    assert d["kv_bytes_per_request"] == 640 * MIB and d["kv_bytes_per_token_per_gpu"] == 81_920 and d["weights_fit"]
    r = CliRunner().invoke(app, ["kv-calc", "--model", "llama-9", "--hardware", "h100-sxm"])
    assert r.exit_code == 2 and "unknown model 'llama-9'" in r.output


def test_72b_fits_four_a100_80gb_in_bf16_but_not_one():
    m, hw = get_model("qwen2.5-72b"), get_hardware("a100-80gb")
    one, four = memory_plan(m, hw, 1), memory_plan(m, hw, 4)
    assert one.weights / GIB == pytest.approx(135.4, abs=0.1) and not one.weights_fit and one.num_blocks == 0
    assert four.weights / GIB == pytest.approx(33.9, abs=0.1) and four.weights_fit
    assert four.kv_pool_bytes / GIB == pytest.approx(36.9, abs=0.2)
    assert four.kv_tokens == pytest.approx(483_000, rel=0.01)  # 81,920 B/token/GPU
    with pytest.raises(CatalogError, match="does not fit 1 x a100-80gb"):
        build_whatif_engine("paged", AnalyticCostModel(m, hw, 1), m.to_model_config())
    eng = build_whatif_engine("paged", AnalyticCostModel(m, hw, 4), m.to_model_config())
    assert eng.scheduler.kv.num_blocks == four.num_blocks


def test_awq_int4_70b_fits_one_80gb_card_with_room_for_kv():
    m, hw = get_model("llama-3.1-70b"), get_hardware("a100-80gb")
    assert not memory_plan(m, hw, 1, "bf16").weights_fit
    p = memory_plan(m, hw, 1, "awq")
    # 68.45 B linear weights x (0.5 + 2.5/128) B + 2.10 B embedding/LM-head params x 2 B
    assert p.weights / GIB == pytest.approx(37.0, abs=0.1) and p.weights_fit
    assert p.kv_pool_bytes / GIB == pytest.approx(33.4, abs=0.2)
    assert p.kv_tokens == pytest.approx(109_360, rel=0.01) and p.kv_tokens // 2048 >= 50  # 53 requests of 2k


def seq(n, start, decode=None):
    return ScheduledSeq("r", [1] * n, start, [0], True, SamplingParams())


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    m, hw = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    eff = Efficiency.default(step_overhead_s=0.0)
    cm = AnalyticCostModel(m, hw, 1, efficiency=eff)
    dec = cm.breakdown([seq(1, 1000)])
    # weights 2 x 6.98e9 B + LM head 2 x 0.525e9 B at 0.8 x 3.35 TB/s
    assert dec["gemm"] == pytest.approx((m.linear_params * 2 + m.lm_head_params * 2) / (3.35e12 * 0.8))
    pre = cm.breakdown([seq(4096, 0)])
    assert pre["gemm"] == pytest.approx(2 * 4096 * m.linear_params / (989.4e12 * 0.7) + 2 * m.lm_head_params / (989.4e12 * 0.7))
    fp8 = AnalyticCostModel(m, hw, 1, weight_dtype="fp8", efficiency=eff).breakdown([seq(4096, 0)])
    assert fp8["gemm"] == pytest.approx(pre["gemm"] / 2, rel=0.01)  # FP8 tensor cores: 2x peak
    a100_fp8 = AnalyticCostModel(m, get_hardware("a100-80gb"), 1, weight_dtype="fp8", efficiency=eff)
    assert a100_fp8.breakdown([seq(4096, 0)])["gemm"] == pytest.approx(  # no FP8 units: BF16 peak
        AnalyticCostModel(m, get_hardware("a100-80gb"), 1, efficiency=eff).breakdown([seq(4096, 0)])["gemm"])
    awq = AnalyticCostModel(m, hw, 1, weight_dtype="awq", efficiency=eff)
    assert awq.breakdown([seq(1, 1000)])["gemm"] < dec["gemm"] / 3  # 4.16 bits per linear weight
    assert awq.breakdown([seq(4096, 0)])["gemm"] == pytest.approx(pre["gemm"] * 1.3)  # dequant overhead


def test_tensor_parallel_splits_weights_and_adds_ring_allreduce():
    m, hw = get_model("llama-3.1-70b"), get_hardware("h100-sxm")
    eff = Efficiency.default()
    b1 = AnalyticCostModel(m, hw, 1).breakdown([seq(1, 100)])
    b4 = AnalyticCostModel(m, hw, 4).breakdown([seq(1, 100)])
    assert b4["gemm"] == pytest.approx(b1["gemm"] / 4)
    assert "allreduce" not in b1
    msg = m.hidden_size * 2  # one token, bf16
    ring = 2 * 3 / 4 * msg / (450e9 * eff.link) + eff.allreduce_latency_s
    assert b4["allreduce"] == pytest.approx(2 * 80 * ring)
    with pytest.raises(CatalogError, match="divide the 64 attention heads"):
        AnalyticCostModel(m, hw, 3)


def test_calibrate_recovers_an_efficiency():
    m, hw = get_model("llama-3.1-8b"), get_hardware("a100-80gb")
    truth = AnalyticCostModel(m, hw, efficiency=Efficiency.default(memory=0.6, compute=0.5))
    steps = [[seq(1, 500)] * b for b in (1, 8, 64)] + [[seq(2048, 0)]]
    fitted = AnalyticCostModel(m, hw).calibrate([(s, truth.predict(s)) for s in steps])
    assert fitted.efficiency.memory == pytest.approx(0.6, rel=0.1)
    assert fitted.efficiency.compute == pytest.approx(0.5, rel=0.1)


def test_spec_decode_emits_the_expected_tokens_per_step():
    m, hw, d = get_model("llama-3.1-70b"), get_hardware("h100-sxm"), get_model("qwen2.5-0.5b")
    sc = SpecDecodeConfig(d, 5, 0.7)
    assert sc.expected_tokens_per_step == pytest.approx((1 - 0.7 ** 6) / 0.3)  # 2.94
    cm = AnalyticCostModel(m, hw, 4, spec=sc)
    eng = build_whatif_engine("paged", cm, m.to_model_config(), max_model_len=4096, seed=1)
    outs = simulate(eng, [Request(str(i), [1] * 64, SamplingParams(max_tokens=2000, ignore_eos=True)) for i in range(4)])
    assert all(len(o.token_ids) == 2000 for o in outs)
    dec_steps = sum(1 for s in eng.steps if s.num_decode_tokens)
    per_step = 1999 / dec_steps  # every request decodes in every decode step (first token from prefill)
    assert per_step == pytest.approx(sc.expected_tokens_per_step, rel=0.03)
    assert all(o.token_times == sorted(o.token_times) and len(o.token_times) == 2000 for o in outs)


def test_spec_decode_what_if_70b_batch1_speedup_and_shrinking_gain():
    rows = {r["batch"]: r["speedup"] for r in spec_sweep(batches=(1, 16, 64), output_tokens=128)}
    assert 1.5 <= rows[1] <= 2.5
    assert rows[1] > rows[16] > rows[64]


def test_orca_is_iteration_level_with_contiguous_reservations():
    cfg = SchedulerConfig(max_num_seqs=8, max_model_len=256, reservation="oracle")
    sched = OrcaScheduler(cfg, ContiguousKVCacheManager(num_blocks=8, block_size=16))  # 128 slots
    r = [Request(str(i), [1] * 10, SamplingParams(max_tokens=o, ignore_eos=True)) for i, o in enumerate((2, 40, 20))]
    assert orca_reservation("pow2", r[1], 256) == 10 + 64 and orca_reservation("max", r[1], 256) == 256
    from engines.core.llm_engine import LLMEngine
    from engines.sim.cost_model import CostModel
    from engines.sim.simulator import CostModelExecutor, VirtualClock

    clock = VirtualClock()
    eng = LLMEngine(sched, CostModelExecutor(CostModel({"const": 0.01}), clock), clock=clock)
    outs = {o.request_id: o for o in simulate(eng, [r[0], r[1]] + [Request("2", [1] * 10, SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=0.05)])}
    # request 2 joins the running batch while request 1 (40 tokens) is still decoding: no batch barrier
    assert outs["2"].first_scheduled_time < outs["1"].finished_time
    assert max(s.kv_allocated for s in eng.steps) <= 128


def scenario(**engine):
    return {"name": "t", "trace": {"format": "synthetic", "synthetic": {"num_requests": 4, "request_rate": 1}},
            "engines": [{"name": "e", **engine}]}


def test_scenario_engine_fields():
    sc = validate_scenario(scenario(kind="sim", hardware="h100-sxm", model="llama-3.1-70b", tp=4))
    assert sc.engines[0].cost_model == "analytic" and sc.cost_model_path(sc.engines[0]) is None
    for bad, msg in [({"kind": "sim", "hardware": "b200"}, "unknown hardware 'b200'"),
                     ({"kind": "paged", "hardware": "h100-sxm"}, "hardware is only for kind sim"),
                     ({"kind": "sim", "cost_model": "analytic"}, "needs hardware"),
                     ({"kind": "sim", "hardware": "h100-sxm", "speculative_model": "qwen2.5-0.5b"}, "together"),
                     ({"kind": "sim", "hardware": "h100-sxm", "efficiency": {"compute": 2}}, "efficiency.compute"),
                     ({"kind": "sim", "tp": 2}, "need cost_model analytic")]:
        with pytest.raises(ScenarioError, match=msg):
            validate_scenario(scenario(**bad))


def test_whatif_sim_engine_from_a_scenario():
    from engines.factory import build_engine
    from workbench.runner import engine_config

    sc = validate_scenario(scenario(kind="sim", policy="orca", hardware="a100-40gb", model="opt-13b",
                                    reservation="max"))
    eng = build_engine(engine_config(sc, sc.engines[0], None, None))
    assert eng.scheduler.kv.num_blocks == memory_plan(get_model("opt-13b"), get_hardware("a100-40gb")).num_blocks
    assert eng.scheduler.config.max_model_len == 2048


def test_paper_check_sweep_and_sustained_rate():
    from pathlib import Path

    from workbench.commands.paper_check import sustained_rates, sweep
    from workbench.scenario import load_scenario

    sc = load_scenario(Path(__file__).parents[1] / "scenarios/paper/pagedattention_opt13b.yaml",
                       overrides={"trace.synthetic.num_requests": 40})
    rows = sweep(sc, [0.5, 8.0])
    assert {r["engine"] for r in rows} == {"vllm", "orca-oracle", "orca-pow2", "orca-max"}
    assert all(r["finished"] == 40 and r["kv_blocks"] == 880 for r in rows)
    by = {(r["rate"], r["engine"]): r["normalized_latency_s_per_token"] for r in rows}
    assert by[(8.0, "orca-max")] > by[(8.0, "vllm")]
    pts = [{"engine": "a", "rate": 1, "normalized_latency_s_per_token": 0.05},
           {"engine": "a", "rate": 2, "normalized_latency_s_per_token": 0.15}]
    assert sustained_rates(pts, 0.1) == {"a": pytest.approx(1.5)}
