"""`workbench sweep` on a tiny random-weight model: 12 simulator points and 3 real-engine points."""

import json

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from engines.sim.cost_model import CostModel
from workbench.cli import app
from workbench.scenario import ScenarioError
from workbench.sweep import expand_grid, parse_axes, plan

SCENARIO = {
    "name": "sweep-tiny",
    "seed": 1,
    "trace": {"format": "synthetic", "synthetic": {"num_requests": 8, "request_rate": 20.0, "lengths": "uniform",
                                                   "input_range": [8, 40], "output_range": [4, 8]}},
    "engines": [
        {"name": "paged", "kind": "paged", "kv_cache_tokens": 512, "max_model_len": 128},
        {"name": "sim-paged", "kind": "sim", "cost_model": "cm.json", "kv_cache_tokens": 512, "max_model_len": 128},
    ],
    "slo": {"ttft_ms": 50},
}
# 3 rates x 4 block sizes on the simulator engine = 12 points; the block-size axis addresses only
# sim-paged, so the real engine's points coincide per rate: 3 real points. One command, 15 points.
AXES = ["--set", "engine=sim-paged,paged", "--set", "trace.request_rate=10,20,40",
        "--set", "engines.sim-paged.block_size=8,16,32,64"]


@pytest.fixture
def scenario_file(tmp_path, tiny_llama_dir):
    CostModel({"const": 0.002, "tokens": 1e-4, "decode_ctx": 0, "prefill_attn": 0, "sampled": 0}).save(tmp_path / "cm.json")
    p = tmp_path / "sweep-tiny.yaml"
    p.write_text(yaml.safe_dump(dict(SCENARIO, model=str(tiny_llama_dir))))
    return p


def test_axes_grid_and_engine_axis(scenario_file):
    axes = parse_axes(["engine=sim-paged,paged", "trace.request_rate=1,2.5", "engines.sim-paged.block_size=8,16"])
    assert axes[1] == ("trace.request_rate", [1, 2.5])
    grid = expand_grid(axes)
    assert len(grid) == 4 + 2  # 2 rates x 2 block sizes on sim-paged; paged drops the sim-paged axis
    assert grid[-1] == ({"trace.request_rate": 2.5}, "paged")
    assert parse_axes(["trace.synthetic.input_range=[8,60],[16,120]"])[0][1] == [[8, 60], [16, 120]]
    _, points = plan(scenario_file, AXES[1::2])
    assert [p.real for p in points].count(True) == 3 and len(points) == 15
    assert points[0].engines == ["sim-paged"] and points[-1].engines == ["paged"]
    for bad, msg in [(["x"], "KEY=V1,V2"), (["a=1", "a=2"], "given twice"), (["a=1,,2"], "empty value|valid YAML")]:
        with pytest.raises(ScenarioError, match=msg):
            parse_axes(bad)
    with pytest.raises(ScenarioError, match="sweep point .*block_size=0"):
        plan(scenario_file, ["engines.sim-paged.block_size=16,0"])
    with pytest.raises(ScenarioError, match="no engine named 'nope'"):
        plan(scenario_file, ["engine=nope"])


def _check_sweep(out, point_reports=True):
    df = pd.read_csv(out / "sweep.csv")
    assert len(df) == 15 and df["point"].nunique() == 15
    sim, real = df[df.kind == "sim"], df[df.kind == "paged"]
    assert len(sim) == 12 and len(real) == 3
    assert sorted(real["request_rate"]) == [10, 20, 40] and set(real["block_size"]) == {16}
    assert set(sim["block_size"]) == {8, 16, 32, 64}
    assert (df["num_finished"] == 8).all() and (df["output_throughput"] > 0).all()
    # the simulator is deterministic: KV waste grows with block_size at every rate (internal fragmentation)
    for _, g in sim.groupby("request_rate"):
        w = g.sort_values("block_size")["kv_waste_frac"].to_numpy()
        assert (w[1:] > w[:-1]).all(), w
    for p in df["point"]:
        assert (out / p / "results.json").exists() and (out / p / "report.html").exists() == point_reports
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    html = (out / "sweep_report.html").read_text()
    assert html.count("data:image/png;base64,") == 1 and ("p014/report.html" in html) == point_reports
    meta = json.loads((out / "sweep.json").read_text())
    assert len(meta["points"]) == 15 and sum(p["real"] for p in meta["points"]) == 3
    return df


def test_sweep_local_12_sim_and_3_real_points(scenario_file, tmp_path, one_thread):
    from workbench.sweep_report import sweep_figure

    out = tmp_path / "sweep"
    r = CliRunner().invoke(app, ["sweep", str(scenario_file), *AXES, "--jobs", "2", "--no-point-reports",
                                 "--out", str(out)])  # point reports: ~1 s of plotting per point
    assert r.exit_code == 0, r.output
    assert "15 points, 15 rows" in r.output
    df = _check_sweep(out, point_reports=False)
    fig = sweep_figure(df, ["engine", "trace.request_rate", "engines.sim-paged.block_size"])
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["output throughput vs rate", "TTFT p50 / p99 vs rate", "E2EL p50 / p99 vs rate",
                      "goodput vs rate", "KV waste vs block_size"]
    rate_ax = fig.axes[0]
    assert len(rate_ax.get_lines()) == 5  # sim-paged at 4 block sizes + paged
    r = CliRunner().invoke(app, ["sweep", str(scenario_file), "--set", "engines.nope.block_size=8"])
    assert r.exit_code == 2 and "no engine named 'nope'" in r.output and "Traceback" not in r.output


def test_sweep_with_ray_executor(scenario_file, tmp_path, one_thread):
    pytest.importorskip("ray")
    out = tmp_path / "sweep-ray"
    r = CliRunner().invoke(app, ["sweep", str(scenario_file), *AXES, "--executor", "ray", "--jobs", "2",
                                 "--no-point-reports", "--out", str(out)])
    assert r.exit_code == 0, r.output
    _check_sweep(out, point_reports=False)
    assert json.loads((out / "sweep.json").read_text())["executor"] == "ray"
