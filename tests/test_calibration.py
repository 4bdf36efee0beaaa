"""cost_model: auto and named profiles: the fingerprint decides which profile a sim engine may use, a missing
profile is measured once (also by concurrent processes) and cached, and the run records which one it used."""

import math
import threading
import warnings

import pytest

from engines.sim.cost_model import CostModel
from workbench import calibration
from workbench.calibration import ProfileMismatchError, check_profile, ensure_profile, fingerprint, profile_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fingerprint_names_machine_and_computation(tiny_llama_dir):
    fp = fingerprint("tiny", tiny_llama_dir)
    assert fp["model"] == "tiny" and fp["dtype"] == "float32" and fp["weight_dtype"] == "fp32"
    assert fp["threads"] >= 1 and fp["cpu_capability"] and fp["torch"] and fp["attention"] in ("cpp", "torch")
    assert fingerprint("tiny", tiny_llama_dir, threads=fp["threads"] + 1) != fp
    assert fingerprint("tiny", tiny_llama_dir) == fp  # deterministic: the cache key is stable


def test_model_config_digest_ignores_the_writer_version_but_not_the_architecture(tmp_path):
    """``workbench model pull`` writes config.json with the installed transformers, whose version lands in the
    file: a new transformers release must not make the committed profiles refuse the same model."""
    import json

    from workbench.calibration import model_config_digest

    cfg = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "transformers_version": "5.24.0",
           "_model_name_or_path": "a"}
    (tmp_path / "config.json").write_text(json.dumps(cfg, indent=2))
    before = model_config_digest(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "transformers_version": "5.25.0",
                                                      "_model_name_or_path": "b"}))
    assert model_config_digest(tmp_path) == before
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 29}))
    assert model_config_digest(tmp_path) != before


def test_fingerprint_changes_with_the_engine_kernels(tiny_llama_dir, monkeypatch):
    """A profile cached for older kernels (another kernel source or engine speed revision) is not reused."""
    import engines.real
    import wb_kernels.cpu_ops

    fp = fingerprint("tiny", tiny_llama_dir)
    assert fp["kernels"] == f"r{engines.real.ENGINE_SPEED_REVISION}-{wb_kernels.cpu_ops.source_sha256()}"
    monkeypatch.setattr(engines.real, "ENGINE_SPEED_REVISION", engines.real.ENGINE_SPEED_REVISION + 1)
    bumped = fingerprint("tiny", tiny_llama_dir)
    assert bumped["kernels"] != fp["kernels"] and profile_path(bumped) != profile_path(fp)


def test_profile_of_another_model_is_refused_and_another_machine_warns(tiny_llama_dir):
    fp = fingerprint("tiny", tiny_llama_dir)
    cm = CostModel({"const": 0.01}, fingerprint={**fp, "model": "other"})
    with pytest.raises(ProfileMismatchError, match="engine s: .*model other != tiny"):
        check_profile(cm, fp, "engine s")
    cm.fingerprint = {**fp, "dtype": "bfloat16", "weight_dtype": "bfloat16"}
    with pytest.raises(ProfileMismatchError, match="dtype bfloat16 != float32"):
        check_profile(cm, fp, "engine s")
    cm.fingerprint = {**fp, "cpu": "Other CPU", "threads": 99}
    assert check_profile(cm, fp, "engine s") == ["cpu", "threads"]
    cm.fingerprint = dict(fp)
    assert check_profile(cm, fp, "engine s") == []


def test_fingerprint_takes_the_weight_dtype_and_refuses_another(tiny_llama_dir):
    fp32 = fingerprint("tiny", tiny_llama_dir)
    int8 = fingerprint("tiny", tiny_llama_dir, weight_dtype="int8")
    assert int8["weight_dtype"] == "int8" and int8["dtype"] == "float32"
    assert profile_path(int8) != profile_path(fp32)  # cached apart
    assert fingerprint("tiny", tiny_llama_dir, "bfloat16")["weight_dtype"] == "bf16"
    # a profile measured with fp32 weights is refused for an int8 engine, in one line
    with pytest.raises(ProfileMismatchError, match=r"^engine s: .*weight_dtype fp32 != int8[^\n]*$"):
        check_profile(CostModel({"const": 0.01}, fingerprint=fp32), int8, "engine s")
    # profiles written before the fp32/bf16 names recorded the dense weights by the dtype's name
    assert check_profile(CostModel({"const": 0.01}, fingerprint={**fp32, "weight_dtype": "float32"}), fp32, "e") == []
    for bad, msg in (("fp8", "weight_dtype fp8 is a what-if of the analytic cost model"),
                     ("bf16", "weight_dtype bf16 means dense weights in dtype bfloat16, but dtype is float32")):
        with pytest.raises(ValueError, match=msg):
            fingerprint("tiny", tiny_llama_dir, weight_dtype=bad)


def test_measure_profile_builds_the_model_with_the_weight_dtype(tiny_llama_dir, monkeypatch):
    from engines.real.model import LlamaModel
    from engines.sim import profiler

    built = []
    real_from_dir = LlamaModel.from_dir

    def spy(*a, **k):
        m = real_from_dir(*a, **k)
        built.append(m.weight_dtype)
        return m

    monkeypatch.setattr(LlamaModel, "from_dir", spy)
    monkeypatch.setattr(profiler, "profile", lambda ex, grid, repeats, progress=None: CostModel({"const": 0.01}))
    fp = fingerprint("tiny", tiny_llama_dir, weight_dtype="int4")
    cm = calibration.measure_profile(tiny_llama_dir, fp, quick=True, kv_cache_tokens=256)
    assert built == ["int4"] and cm.fingerprint["weight_dtype"] == "int4" and "weights int4" in cm.source


def test_auto_measures_once_then_reads_the_cache_even_from_concurrent_callers(cache, tiny_llama_dir, monkeypatch):
    calls = []

    def fake_measure(model_dir, fp, quick=False, progress=None, **_):
        calls.append(fp)
        import time

        time.sleep(0.2)  # long enough for the other thread to wait on the lock
        return CostModel({"const": 0.01}, fingerprint=fp, created="now")

    monkeypatch.setattr(calibration, "measure_profile", fake_measure)
    got = []
    threads = [threading.Thread(target=lambda: got.append(ensure_profile("tiny", tiny_llama_dir))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    fp = fingerprint("tiny", tiny_llama_dir)
    assert {str(p) for _, p in got} == {str(profile_path(fp))}
    assert profile_path(fp).parent == cache / "profiles"
    cm, _ = ensure_profile("tiny", tiny_llama_dir)
    assert len(calls) == 1 and cm.fingerprint == fp and cm.coef == {"const": 0.01}


def test_run_uses_auto_profile_and_records_it(cache, tiny_llama_dir, tmp_path, monkeypatch):
    import yaml

    from workbench.runner import run_scenario
    from workbench.scenario import load_scenario

    def fake_measure(model_dir, fp, quick=False, progress=None, **_):
        return CostModel({"const": 0.002, "tokens": 1e-4}, fingerprint=fp, created="2026-12-01T00:00:00")

    monkeypatch.setattr(calibration, "measure_profile", fake_measure)
    sc = {"name": "auto", "model": str(tiny_llama_dir), "trace": {"format": "synthetic", "synthetic": {
        "num_requests": 4, "request_rate": 50.0, "input_range": [8, 20], "output_range": [2, 4]}},
        "engines": [{"name": "sim-paged", "kind": "sim", "kv_cache_tokens": 256, "max_model_len": 64}]}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(sc))
    scenario = load_scenario(p)
    assert scenario.engines[0].cost_model == "auto"
    res = run_scenario(scenario, tmp_path / "out", plots=False)
    prof = res["engines"]["sim-paged"]["profile"]
    assert prof["fingerprint"]["model"] == str(tiny_llama_dir) and prof["created"] == "2026-12-01T00:00:00"
    assert prof["path"].startswith(str(cache / "profiles")) and res["profile"] == prof
    assert res["engines"]["sim-paged"]["drift"] is None  # no real engine in the run: nothing probed


def test_named_profile_of_another_machine_warns_and_of_another_model_fails(tiny_llama_dir, tmp_path):
    import yaml

    from workbench.runner import load_cost_model
    from workbench.scenario import load_scenario

    fp = fingerprint(str(tiny_llama_dir), tiny_llama_dir)
    CostModel({"const": 0.01}, fingerprint={**fp, "cpu": "Some Other CPU"}).save(tmp_path / "other-cpu.json")
    CostModel({"const": 0.01}, fingerprint={**fp, "model_config_sha256": "0" * 16}).save(tmp_path / "other-model.json")
    sc = {"name": "n", "model": str(tiny_llama_dir), "trace": {"format": "synthetic", "synthetic": {"num_requests": 2, "request_rate": 1.0}},
          "engines": [{"name": "a", "kind": "sim", "cost_model": "other-cpu.json"},
                      {"name": "b", "kind": "sim", "cost_model": "other-model.json"}]}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(sc))
    scenario = load_scenario(p)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load_cost_model(scenario, scenario.engines[0], tiny_llama_dir)
    assert any("profile from another machine or setup (differs in cpu" in str(x.message) for x in w)
    with pytest.raises(ValueError, match="engine b: cost_model other-model.json: the profile measured another "
                                         "computation \\(model_config_sha256"):
        load_cost_model(scenario, scenario.engines[1], tiny_llama_dir)


def test_sensitivity_reruns_a_sim_twin_with_slower_steps(tiny_llama_dir, tmp_path):
    """With a real twin, the sim engine runs again with every step 5% slower (same seeds): a step-time
    model with no queueing (requests arrive one at a time, far apart) moves every latency by 5% (elasticity
    1) and the arrival-bound throughput hardly at all."""
    import yaml

    from workbench.runner import run_scenario, slowed_cost_model
    from workbench.scenario import load_scenario

    fp = fingerprint(str(tiny_llama_dir), tiny_llama_dir)
    CostModel({"const": 0.004, "tokens": 2e-5}, fingerprint=fp, created="now").save(tmp_path / "cm.json")
    sc = {"name": "sens", "model": str(tiny_llama_dir), "trace": {"format": "synthetic", "synthetic": {
        "num_requests": 3, "request_rate": 2.0, "input_tokens": 10, "output_tokens": 4}},
        "engines": [{"name": "paged", "kind": "paged", "kv_cache_tokens": 256, "max_model_len": 64},
                    {"name": "sim-paged", "kind": "sim", "kv_cache_tokens": 256, "max_model_len": 64,
                     "cost_model": "cm.json", "step_noise": False}]}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(sc))
    res = run_scenario(load_scenario(p), tmp_path / "out", plots=False, sensitivity=True)
    sens = res["engines"]["sim-paged"]["summary"]["sim_error"]["sensitivity"]
    assert sens["n_seeds"] == 1 and sens["step_time_change"] == 0.05
    for key in ("ttft_ms.p50", "tpot_ms.p50", "e2el_ms.p50"):
        assert sens["elasticity"][key] == pytest.approx(1.0, abs=0.02), sens
    assert abs(sens["elasticity"]["output_throughput"]) < 0.1  # arrival-bound: throughput hardly moves
    # and once more at the twin's own speed: the speed its recorded steps ran at against the raw profile
    matched = res["engines"]["sim-paged"]["summary"]["sim_error"]["speed_matched"]
    assert matched["n_steps_small"] > 0 and matched["scale_small"] > 0
    assert set(matched["dist"]) == {"output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"}
    assert matched["request"]["n_matched"] == 3
    # the step level again with the machine's mean speed over the run taken out: the same real steps
    step = res["engines"]["sim-paged"]["summary"]["sim_error"]["step"]
    assert matched["step"]["n_steps"] == step["n_steps"] > 0 and matched["step"]["shape_median_mape"] is not None
    res = run_scenario(load_scenario(p), tmp_path / "out2", plots=False)
    assert "sensitivity" not in res["engines"]["sim-paged"]["summary"]["sim_error"]
    assert "speed_matched" not in res["engines"]["sim-paged"]["summary"]["sim_error"]
    cm = CostModel({"const": 0.01}, speed_scale=0.9, speed_scale_large=1.2)
    slow = slowed_cost_model(cm, 0.05)
    assert slow.scale(1) == pytest.approx(0.945) and slow.scale(4096) == pytest.approx(1.26)
    assert cm.speed_scale == 0.9  # the original is left as it is


def test_drift_rescales_only_what_the_probes_before_and_after_agree_on():
    """A 2-core VM's speed swings within a minute: a class of probe steps is rescaled only when the probes
    before and after the runs are both off the profile on the same side, and then by the one nearer 1."""
    from engines.sim.cost_model import step_features
    from engines.sim.cost_model import SCALE_SMALL_TOKENS
    from engines.sim.profiler import PROBE_GRID, grid_batch
    from workbench.runner import DRIFT_MARGIN, agreed_factor, drift

    assert agreed_factor(0.90, 0.95, 0.92) == 0.95 and agreed_factor(1.20, 1.08, 1.1) == 1.08
    assert agreed_factor(0.85, 1.05, 0.95) == 1.0  # opposite sides: the machine moved during the runs
    assert agreed_factor(0.85, 1.0 + DRIFT_MARGIN / 2, 0.9) == 1.0  # one end within the margin
    assert agreed_factor(None, None, 0.9) == 0.9 and agreed_factor(None, None, 1.0 + DRIFT_MARGIN / 2) == 1.0

    cm = CostModel({"const": 0.01, "tokens": 1e-3})
    feats = [step_features(grid_batch(s, 16, 8192).seqs) for s in PROBE_GRID]
    cm.probe_baseline = [{"probe": i, "seconds": 2 * cm.predict_exec(f)} for i, f in enumerate(feats)]

    def run(small, large):  # one real run's probes: (before, after) factors x baseline of decodes and prefills
        steps = []
        for phase, k in (("before", 0), ("after", 1)):
            for i, f in enumerate(feats):
                x = small[k] if f["tokens"] <= SCALE_SMALL_TOKENS else large[k]
                steps.append({"probe": i, "features": f, "seconds": x * cm.probe_baseline[i]["seconds"],
                              "phase": phase})
        return {"gemm_gflops": 100.0, "steps": steps}

    d = drift(cm, [run((0.9, 0.94), (1.2, 0.8))])  # decodes faster at both ends; prefills disagree
    assert d["reference"] == "baseline" and d["rescaled"]
    assert d["scale_small"] == pytest.approx(0.94) and d["scale_large"] == 1.0
    assert d["before"]["large"] == pytest.approx(1.2) and d["after"]["large"] == pytest.approx(0.8)
    d = drift(cm, [run((1.0, 1.0), (1.3, 0.7))])
    assert not d["rescaled"] and d["scale_small"] == d["scale_large"] == 1.0 and not d["beyond_max"]


def test_drift_takes_the_pilot_probes_of_the_runs_where_there_are_some():
    """Pilot probes timed between the runs' own steps sample the phases of the machine the runs were in: the
    large class takes their speed ratio (beyond the margin), whatever the probes at the ends say, the small
    class the pilots' and the ends' timings pooled; the ratios of the ends stay as they were measured."""
    from engines.sim.cost_model import step_features
    from engines.sim.profiler import PILOT_PROBES, PROBE_GRID, grid_batch
    from workbench.runner import DRIFT_MARGIN, drift, during_factor

    assert during_factor(1.2) == 1.2 and during_factor(0.9) == 0.9 and during_factor(1 + DRIFT_MARGIN / 2) == 1.0
    cm = CostModel({"const": 0.01, "tokens": 1e-3})
    feats = [step_features(grid_batch(s, 16, 8192).seqs) for s in PROBE_GRID]
    cm.probe_baseline = [{"probe": i, "seconds": 2 * cm.predict_exec(f)} for i, f in enumerate(feats)]
    small, large = PILOT_PROBES
    assert feats[small]["tokens"] <= 8 and feats[large]["tokens"] >= 32  # one pilot of each drift class

    def probe(i, x, phase, at=None):
        return {"probe": i, "features": feats[i], "seconds": x * cm.probe_baseline[i]["seconds"], "phase": phase,
                **({"at": at} if at is not None else {})}

    ends = [probe(i, 1.0 if ph == "before" else 0.8, ph) for ph in ("before", "after") for i in range(len(feats))]
    during = [probe(small, x, "during", t) for t, x in enumerate((1.15, 1.25, 1.2))]
    during += [probe(large, x, "during", t) for t, x in enumerate((0.9, 1.1, 1.0 + DRIFT_MARGIN / 4))]
    d = drift(cm, [{"gemm_gflops": 100.0, "steps": ends + during}])
    assert d["n_pilots"] == 6 and d["during"]["small"] == pytest.approx(1.2, rel=2e-3)
    # small steps take the pilots and the probes at the ends pooled, every timing one sample
    n_small = sum(f["tokens"] <= 8 for f in feats)  # probes of the small class at each end
    pooled = math.exp((n_small * math.log(0.8) + math.log(1.15 * 1.25 * 1.2)) / (2 * n_small + 3))
    assert d["pooled"]["small"] == pytest.approx(pooled) and d["scale_small"] == pytest.approx(pooled)
    assert d["rescaled"]
    assert d["scale_large"] == 1.0  # the large pilots' ratio is within the margin (0.9 x 1.1 x 1.0025)
    assert d["before"]["small"] == pytest.approx(1.0) and d["after"]["large"] == pytest.approx(0.8)
    assert d["speed_ratio"] == pytest.approx(math.sqrt(0.8))  # the ends' probes only
    assert [p["at"] for p in d["probes"][0]["steps"] if p["phase"] == "during"] == [0, 1, 2, 0, 1, 2]
    # steps past the large pilot's 128 tokens take part of the large factor (engines.sim.cost_model.pilot_elasticity)
    assert d["pilot_elasticity"] == {"full_tokens": 128, "floor_tokens": 512, "floor": 0.5}


def test_the_drift_line_names_the_pilots_and_what_was_done():
    from workbench.commands.run import drift_line

    d = {"speed_ratio": 0.8, "speed_ratio_small": 0.844, "speed_ratio_large": 0.777, "reference": "baseline",
         "before": {"all": 0.81, "small": 0.845, "large": 0.789}, "after": {"all": 0.79, "small": 0.843, "large": 0.764},
         "during": {"all": 0.83, "small": 0.857, "large": 0.821}, "n_pilots": 96, "rescaled": True,
         "scale_small": 0.857, "scale_large": 0.821, "margin": 0.01, "max": 1.5, "beyond_max": False}
    line = drift_line("sim-paged", d)
    assert line.startswith("sim sim-paged profile drift: probe steps at 0.800x its own timing of them")
    assert "before the runs 0.845x / 0.789x, after 0.843x / 0.764x; 96 pilot probes during them 0.857x / 0.821x" in line
    assert line.endswith("(rescaled by 0.857x small, 0.821x large steps)")
    quiet = dict(d, rescaled=False, during={"all": 1.0, "small": 1.005, "large": 0.996})
    assert drift_line("s", quiet).endswith("(not rescaled: the pilot probes are within 1%)")
    assert drift_line("s", dict(quiet, n_pilots=0)).endswith("(not rescaled: before and after do not agree beyond 1%)")
    assert "pilot" not in drift_line("s", dict(quiet, n_pilots=0))
