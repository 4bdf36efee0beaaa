"""`workbench gate` and `workbench compare` on tiny random-weight models (real paged/static engines)."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from workbench.cli import app
from workbench.gate import Bound, GateError, Interval, RatioBound, check_bound, check_ratio, parse_bound, parse_ratio
from workbench.results import Samples
from workbench.stats import t975

# Arrivals span ~0.5 s (12 requests at 20 req/s) and dominate the run's duration on the tiny model, so
# output throughput is stable on a noisy CPU; 0.25 s of extra work per paged step stretches it 5x or more.
SCENARIO = {
    "name": "gate-tiny",
    "seed": 1,
    "trace": {"format": "synthetic", "synthetic": {"num_requests": 12, "request_rate": 20.0, "lengths": "uniform",
                                                   "input_range": [8, 40], "output_range": [6, 12]}},
    "engines": [
        {"name": "paged", "kind": "paged", "kv_cache_tokens": 512, "max_model_len": 128},
        {"name": "static", "kind": "static", "kv_cache_tokens": 512, "max_model_len": 128, "max_batch_size": 4},
    ],
    "slo": {"ttft_ms": 5000},
}


@pytest.fixture
def scenario_file(tmp_path, tiny_llama_dir):
    p = tmp_path / "gate-tiny.yaml"
    p.write_text(yaml.safe_dump(dict(SCENARIO, model=str(tiny_llama_dir))))
    return p


def _gate(*args):
    return CliRunner().invoke(app, ["gate", *map(str, args)])


def test_gate_fails_on_a_deliberately_slowed_paged_engine(tmp_path, tiny_llama_dir, one_thread):
    scenario_file = tmp_path / "paged-tiny.yaml"
    scenario_file.write_text(yaml.safe_dump(dict(SCENARIO, model=str(tiny_llama_dir), engines=SCENARIO["engines"][:1])))
    base = tmp_path / "baselines" / "tiny.json"
    r = _gate("--scenario", scenario_file, "--baseline", base, "--update-baseline", "--out", tmp_path / "b")
    assert r.exit_code == 0, r.output
    saved = json.loads(base.read_text())
    assert saved["format"] == "workbench-baseline/1" and saved["num_runs"] == 1
    assert saved["engines"]["paged"]["metrics"]["output_throughput"][0] > 0
    bounds = ["--max-drop", "paged.output_throughput=60%", "--max-rise", "paged.duration_s=150%"]

    r = _gate("--scenario", scenario_file, "--baseline", base, *bounds, "--out", tmp_path / "ok")
    assert r.exit_code == 0, r.output
    assert "gate passed: 2 of 2 checks hold" in r.output

    r = _gate("--scenario", scenario_file, "--set", "engines.paged.test_step_delay_s=0.25", "--baseline", base,
              *bounds, "--out", tmp_path / "slow")
    assert r.exit_code == 1, r.output
    for word in ("metric", "engine", "baseline", "value", "bound", "output_throughput", "duration_s", "VIOLATED"):
        assert word in r.output
    assert "gate FAILED: 0 of 2 checks hold, 2 violated" in r.output
    slow = json.loads((tmp_path / "slow" / "run-1" / "results.json").read_text())
    assert slow["engines"]["paged"]["config"]["test_step_delay_s"] == 0.25
    row = next(line for line in r.output.splitlines() if "output_throughput" in line)
    b = saved["engines"]["paged"]["metrics"]["output_throughput"][0]
    assert f"{b:.4g}" in row and f">= {b * 0.4:.4g}" in row  # baseline value and bound in the row


def test_gate_on_results_files_ratio_hash_and_errors(scenario_file, tmp_path, one_thread):
    from workbench.runner import run_scenario
    from workbench.scenario import load_scenario

    run_scenario(load_scenario(scenario_file), tmp_path / "a")
    res = tmp_path / "a" / "results.json"
    r = _gate(res, "--ratio", "paged/static:output_throughput>=0.01", "--show-all")
    assert r.exit_code == 0, r.output
    assert "paged/static" in r.output and ">= 0.01" in r.output
    r = _gate(res, "--ratio", "paged/static:output_throughput>=1000")
    assert r.exit_code == 1 and "VIOLATED" in r.output and ">= 1000" in r.output
    # the results file itself as baseline: every metric reproduces exactly
    r = _gate(res, "--baseline", res, "--max-change", "*=0%")
    assert r.exit_code == 0, r.output
    # another scenario: refused with exit 2 unless --force
    other = tmp_path / "other.yaml"
    other.write_text(scenario_file.read_text().replace("gate-tiny", "gate-other"))
    run_scenario(load_scenario(other), tmp_path / "o")
    r = _gate(tmp_path / "o", "--baseline", res, "--max-drop", "output_throughput=50%")
    assert r.exit_code == 2 and "pass --force" in r.output and "Traceback" not in r.output
    assert _gate(tmp_path / "o", "--baseline", res, "--max-drop", "output_throughput=90%", "--force").exit_code in (0, 1)
    for args, msg in [
        ((res, "--baseline", tmp_path / "none.json", "--max-drop", "output_throughput=5%"), "--update-baseline"),
        ((res, "--baseline", res, "--max-drop", "output_throughput=five"), "expected a percentage"),
        ((res, "--baseline", res, "--max-drop", "nosuch_metric=5%"), "no engine has metric"),
        ((res, "--ratio", "paged:output_throughput>=1"), "NUM/DEN:METRIC"),
        ((res, "--ratio", "paged/nosuch:output_throughput>=1"), "no engine 'nosuch'"),
        ((res,), "no bounds"),
        ((), "give RESULTS"),
    ]:
        r = _gate(*args)
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output, (args, r.output)


def test_confidence_intervals_decide_with_repeats():
    # scipy.stats.t.ppf(0.975, df): the printed tables' 12.706, 2.776 and (df -> inf) 1.960
    assert t975(1) == pytest.approx(12.7062, abs=1e-4) and t975(4) == pytest.approx(2.7764, abs=1e-4)
    assert t975(1000) == pytest.approx(1.9623, abs=1e-4) and t975(0) == 0.0
    iv = Interval.of([10.0, 12.0, 11.0])
    assert iv.mean == 11.0 and iv.half == pytest.approx(4.3027 * 1.0 / 3 ** 0.5, rel=1e-4)
    base = Samples("s", "h", 3, {"e": "paged"}, {"e": {"output_throughput": [100.0, 101.0, 99.0]}})
    noisy = Samples("s", "h", 3, {"e": "paged"}, {"e": {"output_throughput": [80.0, 100.0, 90.0]}})
    tight = Samples("s", "h", 3, {"e": "paged"}, {"e": {"output_throughput": [89.0, 90.0, 91.0]}})
    bound = Bound("drop", "output_throughput", 0.05)
    # mean 90 is 10% below, but the noisy interval (90 +- 24.8) reaches the bound: no violation proven
    assert check_bound(bound, base, noisy)[0].ok
    # the tight interval (90 +- 2.5) lies wholly below (99 - 2.5) * 0.95 = 91.7: violated
    c = check_bound(bound, base, tight)[0]
    assert not c.ok and c.baseline.startswith("100 ±") and c.value.startswith("90 ±")
    assert parse_bound("drop", "e.output_throughput=5%", {"e"}) == Bound("drop", "output_throughput", 0.05, "e")
    assert parse_bound("rise", "e2el_ms.p99=0.1", {"e"}) == Bound("rise", "e2el_ms.p99", 0.1, None)
    assert parse_ratio("a/b:output_throughput>=1.5") == RatioBound("a", "b", "output_throughput", ">=", 1.5)
    two = Samples("s", "h", 3, {}, {"a": {"x": [2.0, 2.1, 2.2]}, "b": {"x": [1.0, 1.0, 1.0]}})
    assert check_ratio(RatioBound("a", "b", "x", ">=", 2.0), two).ok
    assert not check_ratio(RatioBound("a", "b", "x", "<=", 1.5), two).ok
    with pytest.raises(GateError, match="percentage"):
        parse_bound("drop", "x=abc", set())


def test_compare_side_by_side_and_refuses_other_scenarios(scenario_file, tmp_path, one_thread):
    from workbench.runner import run_scenario
    from workbench.scenario import load_scenario

    sc = load_scenario(scenario_file)
    run_scenario(sc, tmp_path / "a")
    run_scenario(sc, tmp_path / "b")
    md = tmp_path / "cmp.md"
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "a" / "results.json"), str(tmp_path / "b"),
                                 "--markdown", str(md)])
    assert r.exit_code == 0, r.output
    assert "output_throughput" in r.output and "b / a" in r.output
    text = md.read_text()
    assert "| engine | metric | a | b | b / a |" in text
    row = next(line for line in text.splitlines() if line.startswith("| static | num_finished |"))
    assert row == "| static | num_finished | 12 | 12 | 1.000x |"
    other = tmp_path / "other.yaml"
    other.write_text(scenario_file.read_text().replace("max_batch_size: 4", "max_batch_size: 2"))
    run_scenario(load_scenario(other), tmp_path / "c")
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "c")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "runs are of different scenarios" in r.output and "pass --force" in r.output
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--force"])
    assert r.exit_code == 0 and "different scenarios, --force" in r.output
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no such results file" in r.output


def test_ci_gate_scenarios_and_committed_baseline():
    from pathlib import Path

    from workbench.scenario import load_scenario, scenario_hash

    root = Path(__file__).parents[1]
    sim = load_scenario(root / "scenarios" / "ci-sim.yaml")
    assert {e.kind for e in sim.engines} == {"sim"}  # deterministic
    base = json.loads((root / "reports" / "baselines" / "ci-sim.json").read_text())
    assert base["scenario_hash"] == scenario_hash(sim), "ci-sim.yaml changed: rewrite its baseline (see the file)"
    assert set(base["engines"]) == {"sim-paged", "sim-static"}
    real = load_scenario(root / "scenarios" / "ci-real.yaml")
    assert {e.kind for e in real.engines} == {"paged", "static"}
    # a load relative to the paged engine's measured capacity: the ratio then means the same on any CPU
    assert real.trace.load is not None and real.trace.load.engine == "paged"
    ci = (root / ".ci" / "run").read_text()
    assert "scenarios/ci-sim.yaml" in ci and "scenarios/ci-real.yaml" in ci
