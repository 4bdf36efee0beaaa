"""The simulator against the real engines on this machine, in CI: calibrate, then replay a scenario the profile
was not fitted on, real and simulated (three repeats each), and hold the errors to CI bounds (looser than the
bounds of a repeated run on a quiet machine). Prints every figure."""

from pathlib import Path

import pytest

from engines.real.model_store import resolve_model
from workbench.calibration import fingerprint, measure_profile
from workbench.fidelity import summary_line
from workbench.runner import run_scenario
from workbench.scenario import load_scenario

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = {"output_throughput": 0.10, "e2el_p50": 0.20}


@pytest.fixture(scope="module")
def fidelity_run(tmp_path_factory, smollm2_dir):
    tmp = tmp_path_factory.mktemp("fidelity")
    fp = fingerprint("smollm2-135m", resolve_model("smollm2-135m"))
    cm = measure_profile(resolve_model("smollm2-135m"), fp, quick=True)  # this machine, the quick grid
    cm.save(tmp / "profile.json")
    print(f"\nprofile: {cm.source}; fit mean {cm.fit_error['fit_mean_abs_rel']:.1%}, "
          f"held out mean {cm.fit_error['holdout_mean_abs_rel']:.1%}")
    sc = load_scenario(ROOT / "scenarios" / "ci-fidelity.yaml",
                       {f"engines.{e}.cost_model": str(tmp / "profile.json") for e in ("sim-paged", "sim-static")})
    # three interleaved real runs (and three noise-seeded simulated ones) rather than one: in one run the static
    # engine's closed-loop users can flip which batch a request joins (measured: the same 32 requests took 7
    # prefill batches in the real run and 8 in the simulated one, and E2EL p50 moved by 20%)
    # sensitivity: each sim engine again with 5% slower steps, so the printed line says how far each figure
    # moves per step-time error (how precise the cost model must be for the bound)
    return run_scenario(sc, tmp / "run", plots=False, repeat=3, sensitivity=True)


@pytest.mark.parametrize("sim", ["sim-paged", "sim-static"])
def test_simulator_within_ci_bounds_of_the_real_engine(fidelity_run, sim):
    e = fidelity_run["engines"][sim]
    err = e["summary"]["sim_error"]
    d = e["drift"]
    phases = " ".join(f"{ph} {d[ph]['small']:.3f}x/{d[ph]['large']:.3f}x" for ph in ("before", "after")
                      if None not in (d[ph].get("small"), d[ph].get("large")))
    print(f"\n{sim} {summary_line(err)}; drift {d['speed_ratio']:.3f}x (probes small/large: {phases or 'n/a'}; "
          f"applied {d['scale_small']:.3f}x/{d['scale_large']:.3f}x) "
          f"({fidelity_run['machine']['processor']}, {fidelity_run['machine']['cpu_capability']}, "
          f"{fidelity_run['machine']['torch_threads']} threads)")
    assert err["request"]["n_matched"] == fidelity_run["num_requests"]
    assert err["sensitivity"]["n_seeds"] == 3 and "output_throughput" in err["sensitivity"]["elasticity"]
    assert err["step"]["n_steps"] > 20 and err["step"]["noise_floor"] is not None
    assert err["step"]["repeat_shape_median_mape"] is not None  # three real repeats: a floor for the shape medians
    assert abs(err["dist"]["output_throughput"]) <= BOUNDS["output_throughput"], err["dist"]
    assert abs(err["dist"]["e2el_ms"]["p50"]) <= BOUNDS["e2el_p50"], err["dist"]
