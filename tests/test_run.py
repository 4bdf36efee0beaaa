"""`workbench run` end to end on a tiny random-weight model (real paged/static engines and the simulator)."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from engines.sim.cost_model import CostModel
from workbench.cli import app
from workbench.runner import run_scenario
from workbench.scenario import load_scenario

SCENARIO = {
    "name": "tiny",
    "seed": 1,
    "trace": {"format": "synthetic", "synthetic": {"num_requests": 10, "request_rate": 40.0, "lengths": "uniform",
                                                   "input_range": [8, 60], "output_range": [2, 9]}},
    "engines": [
        {"name": "paged", "kind": "paged", "kv_cache_tokens": 512, "max_model_len": 128},
        {"name": "static", "kind": "static", "kv_cache_tokens": 512, "max_model_len": 128, "reservation": "max"},
        {"name": "sim-paged", "kind": "sim", "policy": "paged", "cost_model": "cm.json", "kv_cache_tokens": 512,
         "max_model_len": 128},
        {"name": "sim-static", "kind": "sim", "policy": "static", "cost_model": "cm.json", "kv_cache_tokens": 512,
         "max_model_len": 128},
    ],
    "slo": {"ttft_ms": 5000},
}


def res_steps(out, engine):
    import csv

    with open(out / engine / "steps.csv") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


@pytest.fixture
def scenario_file(tmp_path, tiny_llama_dir):
    CostModel({"const": 0.002, "tokens": 1e-4, "decode_ctx": 0, "prefill_attn": 0, "sampled": 0}).save(tmp_path / "cm.json")
    d = dict(SCENARIO, model=str(tiny_llama_dir))
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_run_writes_results_csvs_plots_and_report(scenario_file, tmp_path):
    out = tmp_path / "out"
    res = run_scenario(load_scenario(scenario_file), out)
    assert res["num_requests"] == 10
    for name in ("paged", "static", "sim-paged", "sim-static"):
        s = res["engines"][name]["summary"]
        assert s["num_finished"] + s["num_rejected"] + s["num_failed"] == 10
        assert s["num_finished"] == 10 and s["output_throughput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(s[key]) == {"mean", "p50", "p90", "p99", "count"} and s[key]["count"] > 0
        assert (out / name / "requests.csv").read_text().count("\n") == 11
        assert (out / name / "steps.csv").exists()
    assert res["engines"]["static"]["summary"]["kv_waste_frac"] > res["engines"]["paged"]["summary"]["kv_waste_frac"]
    for sim, real in (("sim-paged", "paged"), ("sim-static", "static")):
        err = res["engines"][sim]["summary"]["sim_error"]
        assert err["real_engine"] == real
        # every real step checked against the cost model, every request matched by id
        assert err["step"]["n_steps"] == sum(1 for st in res_steps(out, real) if st["num_seqs"] > 0)
        assert err["request"]["n_matched"] == 10 and err["request"]["e2el_mape"] > 0
        assert set(err["dist"]) == {"output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"}
        assert set(err["dist"]["itl_ms"]) == {"mean", "p50", "p90", "p99"}
        # the profile used (a hand-written file: no fingerprint) and the drift probes of the real runs
        e = res["engines"][sim]
        assert e["profile"]["path"].endswith("cm.json") and e["profile"]["fingerprint"] == {}
        # the twin's own run (one of the two real runs) gives the probes
        assert e["drift"]["n_probe_runs"] == 1 and e["drift"]["probes_of"] == real and e["drift"]["speed_ratio"] > 0
    assert res["profile"]["path"].endswith("cm.json")
    assert "sim_error.step" in res["formulas"] and "drift" in res["formulas"]
    # where each real engine ran and on which attention kernels (the simulator has no runtime)
    import torch

    from wb_kernels import cpu_ops

    expect_dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    expect_attn = "triton" if torch.cuda.is_available() else ("cpp" if cpu_ops.available() else "torch")
    for name in ("paged", "static"):
        rt = res["engines"][name]["runtime"]
        assert (rt["device"], rt["attention"]) == (expect_dev, expect_attn) and rt["device_name"]
    assert "runtime" not in res["engines"]["sim-paged"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["scenario_hash"] and "tpot_ms" in saved["formulas"] and saved["versions"]["torch"]
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 6 and "<table>" in html and "Simulator vs real" in html
    assert (out / "sim_fidelity.png").read_bytes()[:4] == b"\x89PNG"  # real vs sim CDFs and per-request E2EL
    for png in ("throughput.png", "latency_cdf.png", "kv_usage.png", "kv_waste.png", "batch_preemptions.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_cli_run_and_clear_errors(scenario_file, tmp_path):
    r = CliRunner().invoke(app, ["run", str(scenario_file), "--out", str(tmp_path / "o"),
                                 "--set", "engines.paged.max_num_seqs=4"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o" / "report.html").exists()
    # a cost model 1000x too slow: the run says the simulator is off and what to use instead
    CostModel({"const": 2.0, "tokens": 0.1, "decode_ctx": 0, "prefill_attn": 0, "sampled": 0}).save(
        scenario_file.parent / "slow.json")
    r = CliRunner().invoke(app, ["run", str(scenario_file), "--out", str(tmp_path / "o2"),
                                 "--set", "engines.sim-paged.cost_model=slow.json"])
    assert r.exit_code == 0, r.output
    assert "note: a simulator's output throughput is more than 15% off its real engine" in r.output
    assert "cost_model: auto" in r.output
    # drift far beyond the margin is not corrected: the profile does not describe this machine
    assert "not rescaled: beyond" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(scenario_file.read_text().replace("reservation: max", "reservation: maxx"))
    r = CliRunner().invoke(app, ["run", str(bad)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "bad.yaml" in r.output and "reservation" in r.output
    r = CliRunner().invoke(app, ["run", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "missing.yaml" in r.output


def test_trace_inspect(tmp_path):
    from workbench.scenario import resolve_path

    r = CliRunner().invoke(app, ["trace", "inspect", str(resolve_path("builtin:azure_conv_slice.csv", "."))])
    assert r.exit_code == 0, r.output
    assert "format azure, 400 requests" in r.output and "prompt_tokens" in r.output
    bad = tmp_path / "bad_azure.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,abc\n")
    r = CliRunner().invoke(app, ["trace", "inspect", str(bad), "--format", "azure"])
    assert r.exit_code == 2 and "bad_azure.csv:2" in r.output and "Traceback" not in r.output
