"""workbench plan: fewest replicas per hardware x tp choice meeting an SLO (workbench.plan)."""

import csv
import json

import pytest
import yaml
from typer.testing import CliRunner

from workbench.cli import app
from workbench.plan import PlanPoint, evaluate, min_replicas, parse_slo


def fake_probe(needed, tried):
    def probe(n):
        tried.append(n)
        return PlanPoint(n, n >= needed, [] if n >= needed else ["too slow"], {})
    return probe


def test_min_replicas_doubles_then_bisects():
    tried = []
    best, points = min_replicas(fake_probe(5, tried), 64)
    assert best.replicas == 5 and tried == [1, 2, 4, 8, 6, 5] and len(points) == 6


def test_min_replicas_caps_the_doubling_and_reports_no_answer():
    tried = []
    best, _ = min_replicas(fake_probe(10, tried), 6)
    assert best is None and tried == [1, 2, 4, 6]
    tried = []
    assert min_replicas(fake_probe(6, tried), 6)[0].replicas == 6 and tried == [1, 2, 4, 6, 5]
    with pytest.raises(ValueError, match="--max-replicas must be >= 1"):
        min_replicas(fake_probe(1, []), 0)


def test_parse_slo_and_evaluate():
    assert parse_slo(["ttft_ms.p99=2000", "tpot_ms.p50=50"]) == {"ttft_ms.p99": 2000.0, "tpot_ms.p50": 50.0}
    for bad in ("ttft_ms.p99", "ttft_ms.p99=0", "ttft_ms.p99=fast"):
        with pytest.raises(ValueError, match="expected METRIC=LIMIT"):
            parse_slo([bad])
    summary = {"ttft_ms": {"p99": 2500.0}, "tpot_ms": {"p99": None}, "num_finished": 9, "num_rejected": 1,
               "num_failed": 0}
    p = evaluate(summary, {"ttft_ms.p99": 2000.0, "tpot_ms.p99": 50.0}, 3)
    assert not p.ok and p.violations == ["ttft_ms.p99 2500 > 2000", "1 requests rejected"]
    summary.update(num_rejected=0, ttft_ms={"p99": 1500.0})
    assert evaluate(summary, {"ttft_ms.p99": 2000.0, "tpot_ms.p99": 50.0}, 3).ok


def tiny_scenario(tmp_path):
    sc = {"name": "tiny-plan",
          "trace": {"format": "synthetic", "synthetic": {"num_requests": 40, "request_rate": 40.0,
                                                         "input_tokens": 2048, "output_tokens": 16}},
          "engines": [{"name": "gpu", "kind": "sim", "cost_model": "analytic", "hardware": "h100-sxm",
                       "model": "llama-3.1-8b"}]}
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(sc))
    return p


def test_a_choice_whose_weights_do_not_fit_is_reported_not_run():
    from engines.factory import EngineConfig
    from workbench.plan import PlanTask, plan_choice

    engine = EngineConfig(kind="sim", policy="paged", model="llama-3.1-70b", hardware="h100-sxm")
    r = plan_choice(PlanTask("a100-40gb", 2, engine, [], None, {"ttft_ms.p99": 1.0}, "round_robin", 8, 4))
    assert not r.feasible and r.replicas is None and r.points == []
    assert r.reason.startswith("llama-3.1-70b (bf16) does not fit 2 x a100-40gb: weights 65.7 GiB")


def test_plan_command_sizes_each_choice(tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["plan", str(tiny_scenario(tmp_path)), "--slo", "ttft_ms.p99=300",
                                 "--hardware", "h100-sxm,a100-40gb", "--tp", "1,2", "--max-replicas", "16",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = {(x["hardware"], x["tp"]): x for x in csv.DictReader((out / "plan.csv").open())}
    assert len(rows) == 4
    for row in rows.values():
        n = int(row["replicas"])
        assert 1 <= n <= 16 and int(row["gpus"]) == n * int(row["tp"])
        assert float(row["ttft_ms.p99"]) <= 300
        assert f"{n}+" in row["tried"].split() and (n == 1 or f"{n - 1}-" in row["tried"].split())
    # the faster GPU never needs more GPUs than the slower one at the same tp
    for tp in ("1", "2"):
        assert int(rows[("h100-sxm", tp)]["gpus"]) <= int(rows[("a100-40gb", tp)]["gpus"])


@pytest.mark.parametrize("args, message", [
    (["--hardware", "b200", "--slo", "ttft_ms.p99=1"], "--hardware 'b200': unknown b200; known:"),
    (["--hardware", "h100-sxm", "--slo", "ttft_ms.p99=1", "--tp", "0"], "--tp '0': expected comma-separated integers"),
    (["--hardware", "h100-sxm", "--slo", "ttft=fast"], "--slo 'ttft=fast': expected METRIC=LIMIT"),
    (["--hardware", "h100-sxm"], "tiny.yaml: no SLO: pass --slo METRIC=LIMIT"),
    (["--hardware", "h100-sxm", "--slo", "ttft_ms.p99=1", "--router", "random"], "--router 'random': expected one of"),
])
def test_plan_bad_options_are_one_line_errors(tmp_path, args, message):
    r = CliRunner().invoke(app, ["plan", str(tiny_scenario(tmp_path))] + args)
    assert r.exit_code == 2
    line = r.output.strip()
    assert line.startswith("error: ") and message in line and "\n" not in line
