"""The quickstart scenario on the real model: the product's headline figures (slow: a few minutes)."""

import pytest

from workbench.runner import run_scenario
from workbench.scenario import load_scenario

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory, smollm2_dir):
    from pathlib import Path

    sc = load_scenario(Path(__file__).parents[1] / "scenarios" / "quickstart.yaml")
    # three interleaved real runs, figures their means: one static run's output throughput moved by 23% between
    # repeats on a 2-core AVX2 AMD EPYC (36.6-46.0 tok/s), enough to flip paged >= 1.5 x static in a single run
    return run_scenario(sc, tmp_path_factory.mktemp("quickstart"), repeat=3)


def test_quickstart_kv_waste_and_throughput(quickstart):
    e = quickstart["engines"]
    paged, static = e["paged"]["summary"], e["static"]["summary"]
    assert paged["num_finished"] == static["num_finished"] == quickstart["num_requests"]
    assert paged["kv_waste_frac"] <= 0.05
    assert static["kv_waste_frac"] >= 0.50
    # the headline, paged >= 1.5 x static, on the median of the interleaved pairs' ratios (paged run i over
    # static run i, which ran next to it): a slow phase of the machine that lands on one run moves one pair, not
    # the verdict. On a 2-core AMD EPYC (AVX-512) CI's first paged run ran its prefills at 525 prompt tok/s
    # against 661-692 in the other two (GEMM probe before it 157 GFLOP/s, the fastest of the three): pairs 1.33,
    # 1.59, 1.57, the ratio of the means 1.4998
    pv = paged["repeats"]["metrics"]["output_throughput"]["values"]
    sv = static["repeats"]["metrics"]["output_throughput"]["values"]
    ratios = sorted(p / s for p, s in zip(pv, sv))
    assert len(ratios) == 3 and ratios[1] >= 1.5, ratios


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


def test_quickstart_simulator_is_measured_against_its_real_twin(quickstart):
    """The quickstart's sim engines use this machine's profile (cost_model auto) and carry their errors at
    step, request and distribution level (the bounds are held in tests/test_fidelity.py on another scenario)."""
    for sim, real in (("sim-paged", "paged"), ("sim-static", "static")):
        e = quickstart["engines"][sim]
        err = e["summary"]["sim_error"]
        print(sim, err["dist"]["output_throughput"], err["request"], {k: err["step"][k] for k in ("mape", "noise_floor")})
        assert err["real_engine"] == real and err["request"]["n_matched"] == quickstart["num_requests"]
        assert e["profile"]["fingerprint"]["model"] == "smollm2-135m"
        assert e["drift"]["n_probe_runs"] == 3 and e["drift"]["probes_of"] == real  # the twin's three runs
