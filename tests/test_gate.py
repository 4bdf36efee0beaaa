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
    assert "gate passed: 3 of 3 checks hold" in r.output  # the two bounds and paged num_failed == 0

    r = _gate("--scenario", scenario_file, "--set", "engines.paged.test_step_delay_s=0.25", "--baseline", base,
              *bounds, "--out", tmp_path / "slow")
    assert r.exit_code == 1, r.output
    for word in ("metric", "engine", "baseline", "value", "bound", "output_throughput", "duration_s", "VIOLATED"):
        assert word in r.output
    assert "gate FAILED: 1 of 3 checks hold, 2 violated" in r.output
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
    for name, e in base["engines"].items():  # the gate holds num_failed == 0 and compares num_rejected
        assert e["metrics"]["num_failed"] == [0.0] and e["metrics"]["num_rejected"] == [0.0], name
    real = load_scenario(root / "scenarios" / "ci-real.yaml")
    assert {e.kind for e in real.engines} == {"paged", "static"}
    # a load relative to the paged engine's measured capacity: the ratio then means the same on any CPU
    assert real.trace.load is not None and real.trace.load.engine == "paged"
    ci = (root / ".ci" / "run").read_text()
    assert "scenarios/ci-sim.yaml" in ci and "scenarios/ci-real.yaml" in ci


# ------------------------------------------------------------------------- bounds that must not lie


def _summary(**over):
    """A results.json engine summary: 12 requests all finished, unless ``over`` says otherwise."""
    s = {"output_throughput": 100.0, "duration_s": 2.0, "ttft_ms": {"p50": 10.0, "p99": 20.0},
         "num_finished": 12, "num_rejected": 0, "num_failed": 0, "num_requests": 12}
    s.update(over)
    return s


def _write_run(path, engines: dict, scenario_hash="h1"):
    """A minimal results.json at ``path/results.json``: ``engines`` maps name -> summary."""
    path.mkdir(parents=True, exist_ok=True)
    data = {"scenario": {"name": "fake"}, "scenario_hash": scenario_hash,
            "engines": {n: {"kind": "paged", "summary": s} for n, s in engines.items()}}
    (path / "results.json").write_text(json.dumps(data))
    return path / "results.json"


def test_ratio_over_a_zero_or_missing_denominator_fails(tmp_path):
    r = RatioBound("paged", "static", "output_throughput", ">=", 1.4)
    zero = Samples("s", "h", 1, {}, {"paged": {"output_throughput": [50.0]}, "static": {"output_throughput": [0.0]}})
    c = check_ratio(r, zero)
    assert not c.ok and c.value == "n/a" and "denominator static.output_throughput is 0 in 1 of 1 run(s)" in c.note
    missing = Samples("s", "h", 1, {}, {"paged": {"output_throughput": [50.0]}, "static": {}})
    c = check_ratio(r, missing)
    assert not c.ok and "denominator static.output_throughput is missing in 1 of 1 run(s)" in c.note
    # repeats: one of three runs has no value (Samples then hold two), one has a zero
    gap = Samples("s", "h", 3, {}, {"paged": {"output_throughput": [50.0] * 3},
                                    "static": {"output_throughput": [9.0] * 2}})
    assert not check_ratio(r, gap).ok and "missing in 1 of 3" in check_ratio(r, gap).note
    one_zero = Samples("s", "h", 3, {}, {"paged": {"output_throughput": [50.0] * 3},
                                         "static": {"output_throughput": [9.0, 0.0, 9.0]}})
    assert not check_ratio(r, one_zero).ok and "is 0 in 1 of 3" in check_ratio(r, one_zero).note
    numless = Samples("s", "h", 1, {}, {"paged": {}, "static": {"output_throughput": [9.0]}})
    assert "numerator paged.output_throughput is missing" in check_ratio(r, numless).note
    with pytest.raises(GateError, match="neither engine has metric"):
        check_ratio(RatioBound("paged", "static", "nosuch", ">=", 1.0), zero)

    # on the command line: every static request rejected, so its throughput is 0 -> exit 1 with the reason
    res = _write_run(tmp_path / "run", {"paged": _summary(),
                                        "static": _summary(output_throughput=0.0, num_finished=0, num_rejected=12)})
    out = _gate(res, "--ratio", "paged/static:output_throughput>=1.4")
    assert out.exit_code == 1, out.output
    assert "violated: paged/static output_throughput ratio: the denominator static.output_throughput is 0" in out.output
    assert "gate FAILED" in out.output


def test_a_bound_that_checks_nothing_is_an_error(tmp_path):
    base = Samples("s", "h", 1, {}, {"b": {"x": [1.0]}})
    new = Samples("s", "h", 1, {}, {"a": {"x": [1.0]}})
    with pytest.raises(GateError, match=r"--max-change \*=0\.1% checks nothing"):
        check_bound(Bound("change", "*", 0.001), base, new)
    with pytest.raises(GateError, match=r"--max-drop x=5%: no engine has metric 'x'"):
        check_bound(Bound("drop", "x", 0.05), base, new)
    # on the command line: same scenario, but the baseline's engines are not in the results
    res = _write_run(tmp_path / "run", {"paged": _summary()})
    other = _write_run(tmp_path / "base", {"paged-old": _summary()})
    out = _gate(res, "--baseline", other, "--max-change", "*=0.1%")
    assert out.exit_code == 2 and "checks nothing" in out.output and "*=0.1%" in out.output, out.output
    assert "0 of 0 checks" not in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1


def test_a_metric_the_results_lost_violates_its_bound():
    base = Samples("s", "h", 1, {}, {"e": {"x": [1.0], "ttft_ms.p99": [20.0]}})
    new = Samples("s", "h", 1, {}, {"e": {"x": [1.0]}})  # e.g. no request finished: no latency percentiles
    checks = {c.metric: c for c in check_bound(Bound("change", "*", 0.001), base, new)}
    assert checks["x"].ok and not checks["ttft_ms.p99"].ok
    assert "e.ttft_ms.p99 is in the baseline but missing in 1 of 1 run(s)" in checks["ttft_ms.p99"].note
    (c,) = check_bound(Bound("rise", "ttft_ms.p99", 0.1), base, new)
    assert not c.ok


def test_bounds_on_negative_metrics_keep_their_order():
    def gate(kind, frac, b, v):
        base = Samples("s", "h", len(b), {}, {"e": {"m": b}})
        new = Samples("s", "h", len(v), {}, {"e": {"m": v}})
        return check_bound(Bound(kind, "m", frac), base, new)[0]

    c = gate("change", 0.1, [-10.0], [-10.5])  # within 10% of -10
    assert c.ok and c.bound.startswith("in [-11, -9]") and c.change == "-5.00%"
    assert not gate("change", 0.1, [-10.0], [-12.0]).ok and not gate("change", 0.1, [-10.0], [-8.0]).ok
    assert gate("drop", 0.05, [-10.0], [-10.4]).ok and not gate("drop", 0.05, [-10.0], [-10.6]).ok
    assert gate("drop", 0.05, [-10.0], [-10.4]).bound.startswith(">= -10.5")
    assert gate("rise", 0.05, [-10.0], [-9.6]).ok and not gate("rise", 0.05, [-10.0], [-9.4]).ok
    assert gate("change", 0.0, [-3.0], [-3.0]).ok  # exact reproduction of a negative value
    # positive values are unchanged: [m (1 - p), m (1 + p)]
    assert gate("change", 0.1, [10.0], [10.5]).bound.startswith("in [9, 11]")
    # an interval around 0 (several runs) keeps lo <= hi too
    from workbench.gate import allowed_range

    for vals in ([-1.0, 1.0, 0.5], [-5.0, -4.0, -6.0], [4.0, 5.0, 6.0], [-2.0]):
        lo, hi = allowed_range(Interval.of(vals), 0.2)
        iv = Interval.of(vals)
        assert lo <= iv.mean - iv.half <= iv.mean + iv.half <= hi, vals


def test_a_baseline_given_as_results_is_named_as_such(tmp_path):
    from workbench.results import samples_from_results, write_baseline

    res = _write_run(tmp_path / "run", {"paged": _summary()})
    base = write_baseline(samples_from_results([res]), tmp_path / "base.json")
    for bounds in (("--max-drop", "output_throughput=5%"), ("--max-change", "*=0.1%")):
        out = _gate(base, "--baseline", base, *bounds)
        assert out.exit_code == 2, out.output
        assert f"{base} is a gate baseline, not a run's results.json: pass it as --baseline" in out.output
        assert "metrics: " not in out.output and len(out.output.strip().splitlines()) == 1
    # the right way round works; a run works as a baseline too (one run)
    assert _gate(res, "--baseline", base, "--max-change", "*=0.1%").exit_code == 0
    assert _gate(res, "--baseline", res, "--max-change", "*=0%").exit_code == 0
    # a file with engines but no summaries on either side: said so, not "metrics: " and nothing
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "results.json").write_text(json.dumps({"scenario_hash": "h1", "engines": {"paged": {"kind": "paged"}}}))
    out = _gate(res, "--baseline", empty / "results.json", "--max-drop", "output_throughput=5%")
    assert out.exit_code == 2 and "no engine summary metrics (engines: paged)" in out.output, out.output
    out = _gate(empty, "--ratio", "paged/paged:output_throughput>=1")
    assert out.exit_code == 2 and "no engine summary metrics" in out.output, out.output


def test_failed_requests_fail_the_gate_and_rejections_are_a_metric(tmp_path):
    from workbench.commands.gate import main
    from workbench.errors import UsageError

    ok = _write_run(tmp_path / "ok", {"paged": _summary(), "static": _summary(output_throughput=50.0)})
    failed = _write_run(tmp_path / "failed", {"paged": _summary(num_failed=2, num_finished=10),
                                              "static": _summary(output_throughput=50.0)})
    ratio = ("--ratio", "paged/static:output_throughput>=1.4")
    out = _gate(ok, *ratio, "--show-all")
    assert out.exit_code == 0 and "gate passed: 3 of 3 checks hold" in out.output, out.output
    assert "num_failed" in out.output and "== 0" in out.output
    out = _gate(failed, *ratio)
    assert out.exit_code == 1, out.output
    assert "violated: paged num_failed: paged has failed requests in 1 of 1 run(s) (up to 2)" in out.output
    assert "gate FAILED: 2 of 3 checks hold, 1 violated" in out.output
    # the opt-out: only the bounds asked for
    assert main([str(failed)], ratio=["paged/static:output_throughput>=1.4"], allow_failed=True) == 0
    # no baseline is written from runs with failed requests unless asked to
    with pytest.raises(UsageError, match=r"not writing .*paged.* have failed requests .*--allow-failed"):
        main([str(failed)], baseline=str(tmp_path / "b.json"), update_baseline=True)
    assert not (tmp_path / "b.json").exists()
    assert main([str(failed)], baseline=str(tmp_path / "b.json"), update_baseline=True, allow_failed=True) == 0
    # rejections are compared with the baseline like any metric; they do not trip the failed-requests check
    rejected = _write_run(tmp_path / "rejected", {"paged": _summary(num_rejected=3, num_finished=9),
                                                  "static": _summary(output_throughput=50.0)})
    out = _gate(rejected, "--baseline", ok, "--max-change", "*=0.1%")
    assert out.exit_code == 1, out.output
    rows = [line for line in out.output.splitlines() if "VIOLATED" in line]
    assert any("num_rejected" in line for line in rows) and not any("num_failed" in line for line in rows)
    assert _gate(rejected, *ratio).exit_code == 0
