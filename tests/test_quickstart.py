"""The quickstart scenario on the real model: the product's headline figures (slow: a few minutes)."""

import pytest

from workbench.runner import run_scenario
from workbench.scenario import load_scenario

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory, smollm2_dir):
    from pathlib import Path

    sc = load_scenario(Path(__file__).parents[1] / "scenarios" / "quickstart.yaml")
    return run_scenario(sc, tmp_path_factory.mktemp("quickstart"))


def test_quickstart_kv_waste_and_throughput(quickstart):
    e = quickstart["engines"]
    paged, static = e["paged"]["summary"], e["static"]["summary"]
    assert paged["num_finished"] == static["num_finished"] == quickstart["num_requests"]
    assert paged["kv_waste_frac"] <= 0.05
    assert static["kv_waste_frac"] >= 0.50
    assert paged["output_throughput"] >= 1.5 * static["output_throughput"]


def test_quickstart_simulator_within_15_percent(quickstart):
    for sim in ("sim-paged", "sim-static"):
        err = quickstart["engines"][sim]["summary"]["sim_error"]
        for key in ("output_throughput", "e2el_p50", "e2el_p99"):
            assert abs(err[key]) <= 0.15, (sim, key, err)
