"""Load relative to capacity (`trace.load`), saturation figures, `workbench run --repeat`, and
`workbench capacity` over several engines: on the simulator and a tiny random-weight model."""

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from engines.sim.cost_model import CostModel
from workbench.cli import app
from workbench.load import apply_load, capacity_from_outputs, offered_rate, probe_sample
from workbench.runner import mean_summary, run_scenario
from workbench.scenario import ScenarioError, load_scenario, validate_scenario
from workbench.traces import TraceRequest

SIM = {"kv_cache_tokens": 1024, "max_model_len": 256, "cost_model": "cm.json"}


def _scenario(model_dir, load=None, engines=None, **trace):
    tr = {"format": "synthetic", "synthetic": {"num_requests": 40, "request_rate": 2.0, "lengths": "uniform",
                                               "input_range": [8, 120], "output_range": [4, 40]}, **trace}
    if load is not None:
        tr["load"] = load
    return {"name": "load-test", "model": str(model_dir), "seed": 3, "trace": tr,
            "engines": engines or [
                {"name": "sim-paged", "kind": "sim", "policy": "paged", "max_num_seqs": 32, **SIM},
                {"name": "sim-static", "kind": "sim", "policy": "static", "reservation": "max",
                 "max_batch_size": 32, **SIM}],
            "slo": {"ttft_ms": 2000, "tpot_ms": 200}}


@pytest.fixture
def write(tmp_path, tiny_llama_dir):
    CostModel({"const": 0.004, "tokens": 2e-4, "decode_ctx": 1e-6, "prefill_attn": 0, "sampled": 1e-4}).save(
        tmp_path / "cm.json")

    def _write(**kw):
        p = tmp_path / "s.yaml"
        p.write_text(yaml.safe_dump(_scenario(tiny_llama_dir, **kw)))
        return p
    return _write


def _trace(n, gap):
    return [TraceRequest(request_id=str(i), arrival_s=i * gap, prompt_tokens=10 + i, output_tokens=5)
            for i in range(n)]


def test_probe_sample_spreads_over_the_trace_and_arrives_at_once():
    s = probe_sample(_trace(10, 1.0), 4)
    assert [r.request_id for r in s] == ["probe-0", "probe-3", "probe-6", "probe-9"]
    assert all(r.arrival_s == 0.0 for r in s)
    assert len(probe_sample(_trace(5, 1.0), None)) == 5  # default 24, at most the trace
    with pytest.raises(ValueError, match="empty"):
        probe_sample([], 4)


def test_apply_load_rescales_to_factor_times_capacity():
    t = _trace(11, 0.5)  # 10 gaps over 5 s: 2 req/s recorded
    assert offered_rate(t) == pytest.approx(2.0)
    out, info = apply_load(t, capacity_req_s=4.0, factor=1.5)
    assert offered_rate(out) == pytest.approx(6.0)
    assert info["offered_req_s"] == pytest.approx(6.0) and info["recorded_req_s"] == pytest.approx(2.0)
    assert info["time_scale"] == pytest.approx(1 / 3)
    # the arrival pattern is kept: every gap shrinks by the same factor
    assert [r.arrival_s for r in out] == pytest.approx([i * 0.5 / 3 for i in range(11)])


def test_capacity_from_outputs_and_no_finished_request():
    from engines.core.llm_engine import RequestOutput

    def out(rid, fin, n, reason="length"):
        return RequestOutput(rid, None, [1], [7] * n, "", reason, arrival_time=0.0, finished_time=fin)

    c = capacity_from_outputs([out("a", 1.0, 10), out("b", 4.0, 30), out("c", None, 0, "rejected")])
    assert c["capacity_req_s"] == pytest.approx(2 / 4.0) and c["output_tok_s"] == pytest.approx(10.0)
    assert c["num_finished"] == 2 and c["num_requests"] == 3
    with pytest.raises(ValueError, match="no request of the capacity probe finished"):
        capacity_from_outputs([out("c", None, 0, "rejected")])


def test_load_factor_two_offers_twice_the_rate_of_factor_one(write, tmp_path):
    res = {}
    for f in (1.0, 2.0):
        res[f] = run_scenario(load_scenario(write(load={"engine": "sim-paged", "factor": f})), tmp_path / f"o{f}",
                              plots=False)
    l1, l2 = res[1.0]["load"], res[2.0]["load"]
    assert l1["capacity_req_s"] == l2["capacity_req_s"] > 0  # the simulator is deterministic
    assert l2["offered_req_s"] == pytest.approx(2 * l1["offered_req_s"])
    assert l1["engine"] == "sim-paged" and l1["method"] == "saturation_probe" and l1["probe_requests"] == 24
    assert all(r["engines"]["sim-paged"]["summary"]["num_finished"] == 40 for r in res.values())
    cap = res[1.0]["capacity"]
    assert set(cap["engines"]) == {"sim-paged", "sim-static"}
    assert cap["ratios"]["sim-paged/sim-static"] == pytest.approx(
        cap["engines"]["sim-paged"]["capacity_req_s"] / cap["engines"]["sim-static"]["capacity_req_s"])
    assert cap["ratios"]["sim-paged/sim-static"] > 1.2  # paged batching sustains more than static
    # overloading by 2x leaves a queue behind on the static policy; both report whether they kept up
    sat2 = res[2.0]["engines"]["sim-static"]["summary"]["saturation"]
    assert sat2["final_queue"] > 0 and 0 < sat2["waiting_time_frac"] <= 1


def test_replayed_arrivals_follow_the_offered_rate(write, tmp_path):
    import pandas as pd

    res = run_scenario(load_scenario(write(load={"engine": "sim-static", "factor": 0.5, "probe_requests": 8})),
                       tmp_path / "o", plots=False)
    arr = pd.read_csv(tmp_path / "o" / "sim-paged" / "requests.csv")["arrival_s"]
    assert (len(arr) - 1) / (arr.max() - arr.min()) == pytest.approx(res["load"]["offered_req_s"], rel=1e-6)
    assert res["load"]["probe_requests"] == 8 and res["load"]["engine"] == "sim-static"
    assert res["load"]["offered_req_s"] == pytest.approx(0.5 * res["capacity"]["engines"]["sim-static"]["capacity_req_s"])


def test_saturation_says_whether_the_engine_kept_up(write, tmp_path):
    light = run_scenario(load_scenario(write(load={"engine": "sim-paged", "factor": 0.1})), tmp_path / "a", plots=False)
    s = light["engines"]["sim-paged"]["summary"]["saturation"]
    assert s["final_queue"] == 0 and s["waiting_time_frac"] < 0.05
    assert "saturation" in light["formulas"] and "load" in light["formulas"]


def test_load_validation_names_the_field(tiny_llama_dir):
    bad = _scenario(tiny_llama_dir, load={"engine": "nope", "factor": 1.0})
    with pytest.raises(ScenarioError, match=r"no engine named 'nope'"):
        validate_scenario(bad, "s.yaml", check_files=False)
    bad = _scenario(tiny_llama_dir, load={"engine": "sim-paged", "factor": 0})
    with pytest.raises(ScenarioError, match=r"trace.load.factor"):
        validate_scenario(bad, "s.yaml", check_files=False)
    bad = _scenario(tiny_llama_dir, load={"engine": "sim-paged", "factor": 1.0}, time_scale=2.0)
    with pytest.raises(ScenarioError, match=r"time_scale and load both set the arrival rate"):
        validate_scenario(bad, "s.yaml", check_files=False)
    oa = [{"name": "srv", "kind": "openai", "base_url": "http://127.0.0.1:1/v1"}]
    with pytest.raises(ScenarioError, match=r"kind openai"):
        validate_scenario(_scenario(tiny_llama_dir, load={"engine": "srv", "factor": 1.0}, engines=oa), "s.yaml",
                          check_files=False)


def test_mean_summary_averages_and_reports_spread():
    a = {"output_throughput": 10.0, "num_finished": 4, "e2el_ms": {"p50": 1.0, "p99": 3.0}, "reject_reasons": ["x"],
         "saturation": {"final_queue": None}}
    b = {"output_throughput": 14.0, "num_finished": 4, "e2el_ms": {"p50": 3.0, "p99": 5.0}, "reject_reasons": [],
         "saturation": {"final_queue": None}}
    m = mean_summary([a, b])
    assert m["output_throughput"] == 12.0 and m["num_finished"] == 4 and m["e2el_ms"] == {"p50": 2.0, "p99": 4.0}
    assert m["reject_reasons"] == ["x"] and m["saturation"]["final_queue"] is None
    t = m["repeats"]["metrics"]["output_throughput"]
    assert m["repeats"]["n"] == 2 and t["values"] == [10.0, 14.0] and t["min"] == 10.0 and t["max"] == 14.0
    assert t["std"] == pytest.approx(2 ** 0.5 * 2)


def test_run_repeat_interleaves_real_engines_then_runs_sims_once(tmp_path, tiny_llama_dir):
    """Real engines first (interleaved), then the simulator, once: a profile without step noise is deterministic
    (with noise it would run as many times, one noise seed each)."""
    CostModel({"const": 0.002, "tokens": 1e-4, "decode_ctx": 0, "prefill_attn": 0, "sampled": 0}).save(tmp_path / "cm.json")
    sc = _scenario(tiny_llama_dir, engines=[
        {"name": "paged", "kind": "paged", "kv_cache_tokens": 1024, "max_model_len": 256},
        {"name": "static", "kind": "static", "kv_cache_tokens": 1024, "max_model_len": 256},
        {"name": "sim-paged", "kind": "sim", "policy": "paged", **SIM}])
    sc["trace"]["synthetic"].update(num_requests=6, request_rate=50.0, output_range=[2, 6])
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(sc))
    order = []

    def progress(name, kind, total):
        order.append(name)
        return None
    res = run_scenario(load_scenario(tmp_path / "s.yaml"), tmp_path / "o", progress, plots=False, repeat=2)
    assert order == ["paged #1", "static #1", "paged #2", "static #2", "sim-paged"]
    for name in ("paged", "static"):
        s = res["engines"][name]["summary"]
        assert s["repeats"]["n"] == 2 and len(s["repeats"]["metrics"]["output_throughput"]["values"]) == 2
        assert s["output_throughput"] == pytest.approx(s["repeats"]["metrics"]["output_throughput"]["mean"])
        assert s["num_finished"] == 6
        assert (tmp_path / "o" / name / "repeat-2" / "requests.csv").exists()
    assert "repeats" not in res["engines"]["sim-paged"]["summary"]
    assert res["machine"]["cpu_capability"] and res["machine"]["torch_threads"] >= 1


def test_cli_run_repeat_must_be_positive(write):
    r = CliRunner().invoke(app, ["run", str(write()), "--repeat", "0"])
    assert r.exit_code == 2 and "--repeat must be >= 1" in r.output


def test_cli_run_prints_load_and_capacity(write, tmp_path):
    r = CliRunner().invoke(app, ["run", str(write(load={"engine": "sim-paged", "factor": 1.2})), "--out",
                                 str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert re.search(r"load: 1\.2 x capacity of sim-paged \([0-9.]+ req/s, saturation_probe of 24 requests\)", r.output)
    assert re.search(r"capacity ratio: sim-paged/sim-static [0-9.]+x", r.output)
    assert "Load and capacity" in (tmp_path / "o" / "report.html").read_text()


def test_capacity_of_several_engines_and_their_ratio(write):
    r = CliRunner().invoke(app, ["capacity", str(write()), "--engine", "sim-paged", "--engine", "sim-static",
                                 "--tolerance", "0.05"])
    assert r.exit_code == 0, r.output
    caps = dict((e, float(c)) for c, e in re.findall(r"capacity: ([0-9.]+) req/s \(([a-z-]+),", r.output))
    assert set(caps) == {"sim-paged", "sim-static"}
    ratio = float(re.search(r"capacity ratio sim-static/sim-paged: ([0-9.]+)x", r.output).group(1))
    assert ratio == pytest.approx(caps["sim-static"] / caps["sim-paged"], rel=0.01)
    r = CliRunner().invoke(app, ["capacity", str(write()), "--engine", "sim-paged", "--engine", "sim-paged"])
    assert r.exit_code == 2 and "named twice" in r.output
    r = CliRunner().invoke(app, ["capacity", str(write()), "--engine", "sim-paged", "--engine", "sim-static",
                                 "--json", "--tolerance", "0.1"])
    doc = json.loads(r.stdout)
    assert set(doc["capacity"]) == {"sim-paged", "sim-static"} and "sim-static/sim-paged" in doc["ratios"]


def test_capacity_runs_on_a_scenario_with_trace_load(write):
    """A scenario written with trace.load (like the quickstart) can still be searched: the search sets the rate."""
    r = CliRunner().invoke(app, ["capacity", str(write(load={"engine": "sim-paged", "factor": 9.0})), "--engine",
                                 "sim-paged", "--tolerance", "0.1"])
    assert r.exit_code == 0, r.output
    assert "capacity:" in r.output
