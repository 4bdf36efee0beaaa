"""The measured (table) cost model: step shapes, the joint NNLS fit of the body table and the attention terms,
engine overhead, seeded step noise, and the probe ratio that detects drift."""

import statistics

import pytest

from engines.core.row_buckets import gemm_rows
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import ScheduledSeq
from engines.core.step_shape import StepShape
from engines.sim.cost_model import (SCALE_LARGE_TOKENS, SCALE_SMALL_TOKENS, CostModel, StepNoise, hat_weights,
                                    noise_table_of, shape_features, step_features)
from engines.sim.profiler import (FULL_GRID, PROBE_GRID, GridStep, fit_table_model, grid_batch,
                                  probe_ratio, probe_ratios)

SP = SamplingParams(max_tokens=4, temperature=0)


def test_step_shape_counts_each_kind_of_row():
    seqs = [ScheduledSeq("d", [5], 99, [0] * 7, True, SP),                       # decode at context 100
            ScheduledSeq("pad", [0], 99, [0] * 7, False, SP, is_padding=True),  # padding row at 100
            ScheduledSeq("p", [5] * 30, 0, [1, 2], True, SP),                     # fresh prefill of 30
            ScheduledSeq("c", [5] * 10, 64, [3] * 5, False, SP,                   # chunk after 64 cached
                         fork_ids=["c1"], fork_params=[SP])]
    s = StepShape.of(seqs)
    assert (s.tokens, s.decode_rows, s.padding_rows, s.decode_ctx) == (42, 1, 1, 200)
    assert (s.prefill_seqs, s.prefill_tokens, s.prefill_attn, s.prefill_ctx) == (2, 40, 30 * 30 + 10 * 74, 640)
    assert s.padding_ctx == 100 and s.scattered_ctx == 100  # block 0 seven times: no neighbour is the next id
    scattered = StepShape.of([ScheduledSeq("d", [5], 63, [4, 5, 9, 10], True, SP)])  # one break of 3 neighbours
    assert scattered.scattered_ctx == pytest.approx(64 / 3)
    assert s.sampled == 2 and s.kind == "mixed"
    f = step_features(seqs)
    assert f["rows"] == 2 and f["const"] == 1 and f["tokens"] == 42 and f["live_ctx"] == 100
    assert StepShape.of(seqs[:2]).kind == "padded" and StepShape.of(seqs[:1]).kind == "decode"
    assert StepShape.of(seqs[2:3]).kind == "prefill" and StepShape.of([]).kind == "empty"


def test_hat_weights_interpolate_and_extrapolate():
    knots = [1, 2, 4, 8]
    assert hat_weights(knots, 3) == [0, 0.5, 0.5, 0]
    assert hat_weights(knots, 0.5) == [0.5, 0, 0, 0]
    assert hat_weights(knots, 12) == [0, 0, -1.0, 2.0]  # the last segment, extended
    assert hat_weights(knots, 0) == [0, 0, 0, 0]


def _true_model():
    body = [[k, 0.02 + 0.0015 * k + (0.004 if k >= 48 else 0.0)] for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)]
    lm = [[1, 0.003], [8, 0.004], [64, 0.02], [128, 0.04]]
    coef = {"rows": 2e-4, "live_ctx": 1.5e-6, "scattered_ctx": 3e-7, "padding_ctx": 4e-7, "prefill_seqs": 2e-3, "prefill_attn": 2e-7, "prefill_ctx": 1e-7,
            "sampled": 5e-5}
    return CostModel(coef, body_table=body, lm_table=lm)


def test_table_fit_recovers_a_known_model_on_the_profile_grid():
    true = _true_model()
    rows = []
    for step in FULL_GRID:
        f = step_features(grid_batch(step, 16, 8192).seqs)
        rows.append((f, true.predict_exec(f)))
    cm = fit_table_model(rows, true.lm_table)
    errs = [abs(cm.predict_exec(f) - t) / t for f, t in rows]
    assert max(errs) < 1e-6
    for k in ("live_ctx", "scattered_ctx", "padding_ctx", "prefill_ctx"):  # identified apart from the body table by the context sweeps
        assert cm.coef[k] == pytest.approx(true.coef[k], rel=1e-3), k
    # off the grid: a multi-prompt prefill and a mixed step the fit never saw
    for step in (GridStep(prefills=((300, 0), (200, 0), (40, 0))), GridStep(20, 700, ((100, 300),))):
        f = step_features(grid_batch(step, 16, 8192).seqs)
        assert cm.predict_exec(f) == pytest.approx(true.predict_exec(f), rel=0.02)


def test_row_buckets_make_the_body_a_step_function_of_the_tokens(tmp_path):
    # the real engine's oneDNN layers run a 518-token step's GEMMs at 576 rows
    assert gemm_rows(518, "onednn") == 576 and gemm_rows(518, "") == 518 and gemm_rows(16, "onednn") == 16
    with pytest.raises(ValueError, match="row bucket scheme"):
        gemm_rows(3, "mkl")
    true = _true_model()
    true.row_buckets = {"body": "onednn", "lm_head": "onednn"}
    rows = []
    for step in FULL_GRID:
        f = step_features(grid_batch(step, 16, 8192).seqs)
        rows.append((f, true.predict_exec(f)))
    off = step_features(grid_batch(GridStep(prefills=((518, 0),)), 16, 8192).seqs)
    cm = fit_table_model(rows, true.lm_table, row_buckets=true.row_buckets)
    assert max(abs(cm.predict_exec(f) - t) / t for f, t in rows) < 1e-6
    assert cm.predict_exec(off) == pytest.approx(true.predict_exec(off), rel=1e-6)
    # the same steps fitted as if rows ran as they are: the off-bucket step comes out 7% short
    plain = fit_table_model(rows, true.lm_table)
    assert plain.predict_exec(off) < 0.95 * true.predict_exec(off)
    cm.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json").row_buckets == true.row_buckets
    (tmp_path / "bad.json").write_text((tmp_path / "p.json").read_text().replace('"onednn"', '"mkl"'))
    with pytest.raises(ValueError, match="not a cost-model profile"):
        CostModel.load(tmp_path / "bad.json")


def test_overhead_noise_and_speed_scale():
    cm = _true_model()
    cm.overhead = {"const": 1e-4, "per_seq": 1e-6}
    f = shape_features(StepShape(tokens=8, decode_rows=8, decode_ctx=800, sampled=8))
    assert cm.predict_features(f) == pytest.approx(cm.predict_exec(f) + 1e-4 + 8e-6)
    base = cm.predict_exec(f)
    cm.speed_scale = 1.25
    assert cm.predict_exec(f) == pytest.approx(1.25 * base)
    cm.noise_cv = 0.05
    assert cm.noise(None) is None
    a, b = cm.noise(7), cm.noise(7)
    draws = [a() for _ in range(4000)]
    assert draws[:5] == [b() for _ in range(5)]  # seeded: the same draws
    assert statistics.fmean(draws) == pytest.approx(1.0, abs=0.005)
    assert statistics.stdev(draws) == pytest.approx(0.05, rel=0.1)


def test_probe_ratio_is_the_geometric_mean_of_measured_over_predicted():
    cm = _true_model()
    probes = []
    for step, factor in ((GridStep(1, 64), 1.1), (GridStep(16, 256), 1.21)):
        f = step_features(grid_batch(step, 16, 1024).seqs)
        probes.append({"features": f, "seconds": factor * cm.predict_exec(f)})
    assert probe_ratio(cm, probes) == pytest.approx(1.1 ** 1.5)
    assert probe_ratio(cm, []) is None


def test_profile_round_trip_keeps_tables_overhead_noise_and_fingerprint(tmp_path):
    cm = _true_model()
    cm.overhead, cm.noise_cv, cm.fingerprint, cm.created = {"const": 1e-4, "per_seq": 0.0}, 0.03, {"model": "m"}, "t"
    cm.probe_baseline = [{"probe": 0, "seconds": 0.04}, {"probe": 6, "seconds": 0.8}]
    cm.noise_table = [[2.0, 0.1], [300.0, 0.02]]
    cm.save(tmp_path / "p.json")
    back = CostModel.load(tmp_path / "p.json")
    assert (back.body_table, back.lm_table, back.overhead, back.noise_cv, back.fingerprint, back.created) == (
        cm.body_table, cm.lm_table, cm.overhead, 0.03, {"model": "m"}, "t")
    assert back.probe_baseline == cm.probe_baseline
    assert back.noise_table == [[2.0, 0.1], [300.0, 0.02]]


def test_noise_table_groups_spreads_by_power_of_two_buckets_of_tokens():
    # buckets [1, 2), [2, 4), [4, 8), [64, 128), [1024, 2048): the first two have fewer than 3 points and join
    # the next larger bucket; the last bucket's 2 points, with none after them, join the one before
    pts = [(1, 0.20), (3, 0.14), (4, 0.12), (5, 0.10), (6, 0.08), (64, 0.05), (100, 0.04), (120, 0.06),
           (1024, 0.02), (1500, 0.01)]
    table = noise_table_of(pts)
    assert len(table) == 2
    (t0, c0), (t1, c1) = table
    assert t0 == pytest.approx((1 * 3 * 4 * 5 * 6) ** (1 / 5)) and c0 == pytest.approx(0.12)
    assert t1 == pytest.approx((64 * 100 * 120 * 1024 * 1500) ** (1 / 5)) and c1 == pytest.approx(0.04)
    assert noise_table_of([]) == []
    assert noise_table_of([(8, 0.1)]) == [[pytest.approx(8.0), 0.1]]  # too few for any bucket: one knot of what there is


def test_step_noise_spread_follows_the_step_size():
    table = [[4.0, 0.10], [256.0, 0.02]]
    noise = StepNoise(0.05, 3, table)
    assert noise.sigma_at(1) == noise.sigma_at(4) == pytest.approx(0.0998, abs=1e-4)  # the end knots beyond them
    assert noise.sigma_at(5000) == pytest.approx(0.02, abs=1e-4)
    assert noise.sigma_at(32) == pytest.approx(0.06, abs=1e-4)  # halfway in log(tokens): cv 0.06
    small = [noise(2) for _ in range(4000)]
    large = [noise(1000) for _ in range(4000)]
    for draws, cv in ((small, 0.10), (large, 0.02)):
        assert statistics.fmean(draws) == pytest.approx(1.0, abs=0.01)  # mean one at every size
        assert statistics.stdev(draws) == pytest.approx(cv, rel=0.1)
    # one draw per call, with or without a table: a table of one knot at the scalar spread gives the same draws
    plain, flat = StepNoise(0.05, 3), StepNoise(0.05, 3, [[16.0, 0.05]])
    assert [plain() for _ in range(5)] == [flat(t) for t in (1, 30, 500, 2, 4000)]


def test_the_simulator_draws_each_steps_noise_at_its_tokens():
    from engines.sim.executor import CostModelExecutor, VirtualClock
    from engines.core.scheduler import SchedulerOutput

    cm = _true_model()
    cm.noise_cv, cm.noise_table = 0.05, [[1.0, 0.0], [8.0, 0.0], [512.0, 0.3]]  # small steps exact, large ones not
    ex = CostModelExecutor(cm, VirtualClock(), seed=5)
    decode = SchedulerOutput(grid_batch(GridStep(4, 64), 16, 1024).seqs)
    prefill = SchedulerOutput(grid_batch(GridStep(prefills=((512, 0),)), 16, 1024).seqs)
    small = [ex.execute(decode).duration for _ in range(5)]
    large = [ex.execute(prefill).duration for _ in range(5)]
    assert max(small) == pytest.approx(min(small)) == pytest.approx(cm.predict_step(decode))
    assert max(large) / min(large) > 1.1


def test_drift_is_measured_against_the_profiles_own_timing_of_each_probe():
    """A fit 7% off at one probe step reads as drift against the predictions; against the profile's own timing
    of the probes (``probe_baseline``) a machine at the profile's speed reads 1.0, and a 10% slower one 1.1."""
    cm = _true_model()
    probes = []
    for i, step in enumerate(PROBE_GRID):
        f = step_features(grid_batch(step, 16, 8192).seqs)
        probes.append({"probe": i, "features": f,
                       "seconds": cm.predict_exec(f) * (0.93 if i == len(PROBE_GRID) - 1 else 1.0)})
    assert probe_ratio(cm, probes) == pytest.approx(0.93 ** (1 / len(PROBE_GRID)))
    cm.probe_baseline = [{"probe": p["probe"], "seconds": p["seconds"]} for p in probes]
    assert probe_ratio(cm, probes) == pytest.approx(1.0)
    assert probe_ratio(cm, [{**p, "seconds": 1.1 * p["seconds"]} for p in probes]) == pytest.approx(1.1)
    # a probe the baseline does not have is compared with the prediction
    assert probe_ratio(cm, [{**probes[-1], "probe": None}]) == pytest.approx(0.93)


def test_profile_times_every_probe_step_as_its_baseline(tiny_llama_dir):
    import torch

    from engines.real.model import LlamaModel
    from engines.real.model_runner import ModelExecutor
    from engines.sim.profiler import QUICK_GRID, profile

    ex = ModelExecutor(LlamaModel.from_dir(tiny_llama_dir, torch.float32), 2048, 16)
    cm = profile(ex, QUICK_GRID, repeats=1)
    assert [b["probe"] for b in cm.probe_baseline] == list(range(len(PROBE_GRID)))
    assert all(b["seconds"] > 0 for b in cm.probe_baseline)
    assert cm.fit_error["n_points"] == len(QUICK_GRID)  # the probes are timed, not fitted


def test_drift_has_a_memory_bound_and_a_compute_bound_factor():
    """A machine whose steps of a few rows (bound by reading the weights) run 10% faster than its profile and
    whose larger steps (bound by arithmetic) run 5% slower: the probe ratios tell the two apart, a probe
    between the two classes counts in neither, and the rescaled model predicts both within the rounding."""
    cm = _true_model()
    probes, truth = [], {}
    for step in PROBE_GRID:
        f = step_features(grid_batch(step, 16, 8192).seqs)
        factor = 0.9 if f["tokens"] <= SCALE_SMALL_TOKENS else 1.05 if f["tokens"] >= SCALE_LARGE_TOKENS else 1.0
        probes.append({"features": f, "seconds": factor * cm.predict_exec(f)})
        truth[step] = (f, factor * cm.predict_exec(f))
    r = probe_ratios(cm, probes)
    assert r["small"] == pytest.approx(0.9) and r["large"] == pytest.approx(1.05)
    assert 0.9 < r["all"] < 1.05
    cm.speed_scale, cm.speed_scale_large = r["small"], r["large"]
    for f, seconds in truth.values():
        if f["tokens"] <= SCALE_SMALL_TOKENS or f["tokens"] >= SCALE_LARGE_TOKENS:
            assert cm.predict_exec(f) == pytest.approx(seconds, rel=1e-9)
    # between the two sizes the factor is linear in log(tokens)
    mid = (SCALE_SMALL_TOKENS * SCALE_LARGE_TOKENS) ** 0.5
    assert cm.scale(mid) == pytest.approx((0.9 + 1.05) / 2)
    assert cm.scale(1) == 0.9 and cm.scale(4096) == 1.05
    cm.speed_scale_large = None
    assert cm.scale(4096) == 0.9


def test_steps_past_the_pilots_size_take_part_of_its_drift():
    """The probes' large-class factor is the 128-token pilot's reading of the machine; a step of more tokens
    follows it only in part (measured: about half from 512 tokens on): it takes the factor raised to
    ``pilot_elasticity``, 1 up to the pilot's size, 0.5 from 512 tokens, log-linear between. A factor measured on
    the steps themselves (``speed_elastic`` False) applies as it is."""
    from engines.sim.cost_model import (PILOT_ELASTICITY_FLOOR, PILOT_ELASTICITY_FLOOR_TOKENS, PILOT_LARGE_TOKENS,
                                        pilot_elasticity)

    assert PILOT_LARGE_TOKENS == 128 and PILOT_ELASTICITY_FLOOR_TOKENS == 512 and PILOT_ELASTICITY_FLOOR == 0.5
    assert pilot_elasticity(32) == pilot_elasticity(128) == 1.0
    assert pilot_elasticity(256) == pytest.approx(0.75)  # halfway in log(tokens)
    assert pilot_elasticity(512) == pilot_elasticity(8192) == 0.5
    cm = CostModel({"const": 0.01}, speed_scale=0.9, speed_scale_large=1.21, speed_elastic=True)
    assert cm.scale(4) == 0.9 and cm.scale(64) == cm.scale(128) == 1.21
    assert cm.scale(256) == pytest.approx(1.21 ** 0.75) and cm.scale(3000) == pytest.approx(1.1)
    cm.speed_elastic = False
    assert cm.scale(3000) == 1.21
    # the profile's pilot normalization takes the same share: a 3,000-token step's run is divided by the square
    # root of the large pilot's speed against its mean
    from engines.sim.profiler import PILOT_PROBES, PROBE_GRID, PilotProbe
    from types import SimpleNamespace

    assert PROBE_GRID[PILOT_PROBES[1]].prefills == ((PILOT_LARGE_TOKENS, 0),)
    pilot = PilotProbe(SimpleNamespace(kv=SimpleNamespace(block_size=16, num_blocks=64)))
    for at, small, large in ((0.0, 0.01, 0.1), (1.0, 0.01, 0.1), (2.0, 0.01, 0.4), (3.0, 0.01, 0.4)):
        pilot.records += [{"probe": PILOT_PROBES[0], "seconds": small, "at": at},
                          {"probe": PILOT_PROBES[1], "seconds": large, "at": at}]
    assert pilot.speed_at(2.5, 128) == pytest.approx(2.0)  # 0.4 against the geometric mean 0.2
    assert pilot.speed_at(2.5, 3000) == pytest.approx(2.0 ** 0.5)
    assert pilot.speed_at(2.5, 4) == pytest.approx(1.0)


def test_real_spread_says_whether_the_sim_is_within_the_real_repeats():
    from workbench.fidelity import real_spread, summary_line

    real = {"output_throughput": 10.0, "ttft_ms": {"p50": 100.0},
            "repeats": {"n": 3, "metrics": {
                "output_throughput": {"min": 9.0, "max": 11.0, "spread": 0.2},
                "ttft_ms.p50": {"min": 80.0, "max": 120.0, "spread": 0.4}}}}
    sim = {"output_throughput": 11.5, "ttft_ms": {"p50": 90.0}}
    got = real_spread(sim, real)
    assert got == {"output_throughput": {"spread": 0.2, "within_range": False},
                   "ttft_ms.p50": {"spread": 0.4, "within_range": True}}
    assert real_spread(sim, {"output_throughput": 10.0}) is None
    err = {"real_engine": "paged", "step": {}, "request": {}, "real_spread": got,
           "dist": {"output_throughput": 0.15, **{m: {"p50": 0.0, "p99": 0.0} for m in
                                                  ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}}}
    assert "1 of 2 figures within the real repeats' range" in summary_line(err)


def test_real_spread_says_which_bounds_the_real_mean_cannot_pin():
    """With the repeats' std: the relative standard error of the real mean (and of the sim's, where it ran several
    seeds), and for a bounded figure whether two of them fit in the bound and how many repeats would make them fit
    (the quickstart's TPOT p50 over three paged repeats on a 2-core AMD EPYC: 306, 304 and 188 ms)."""
    import math

    from workbench.fidelity import real_spread, summary_line, unresolved

    tpot = [306.1, 304.4, 188.5]
    mean, std = sum(tpot) / 3, statistics.stdev(tpot)
    real = {"output_throughput": 108.1, "tpot_ms": {"p50": mean}, "itl_ms": {"p90": 100.0},
            "repeats": {"n": 3, "metrics": {
                "output_throughput": {"mean": 108.1, "std": 2.49, "min": 105.2, "max": 109.7, "spread": 0.042},
                "tpot_ms.p50": {"mean": mean, "std": std, "min": 188.5, "max": 306.1, "spread": 0.44},
                "itl_ms.p90": {"mean": 100.0, "std": 30.0, "min": 70.0, "max": 130.0, "spread": 0.6}}}}
    sim = {"output_throughput": 107.7, "tpot_ms": {"p50": 224.3}, "itl_ms": {"p90": 99.0}}
    got = real_spread(sim, real)
    thr, tp = got["output_throughput"], got["tpot_ms.p50"]
    assert thr["sem"] == pytest.approx(2.49 / 108.1 / math.sqrt(3))
    assert thr["resolvable"] is True and thr["bound"] == 0.05 and thr["repeats_for_bound"] == 2  # (2 x 2.3% / 5%)^2 < 1
    assert tp["sem"] == pytest.approx(std / mean / math.sqrt(3)) and tp["sem"] > 0.14
    assert tp["resolvable"] is False and tp["bound"] == 0.10
    assert tp["repeats_for_bound"] == math.ceil((2 * std / mean / 0.10) ** 2) == 26
    assert "bound" not in got["itl_ms.p90"] and "sem" in got["itl_ms.p90"]  # no bound on ITL p90
    assert tp["error_sem"] == tp["sem"]  # a sim engine of one run adds no error of its own
    assert list(unresolved(got)) == ["tpot_ms.p50"]
    err = {"real_engine": "paged", "step": {}, "request": {}, "real_spread": got,
           "dist": {"output_throughput": -0.004, **{m: {"p50": 0.0, "p99": 0.0} for m in
                                                   ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}}}
    assert ("do not pin the error to its bound (2 standard errors of the real and sim means) for TPOT p50 "
            "(+/-29%; 26 repeats would)") in summary_line(err)
    one = {**real, "repeats": {"n": 1, "metrics": real["repeats"]["metrics"]}}
    assert "sem" not in real_spread(sim, one)["tpot_ms.p50"]  # one run has no standard error
    # a sim engine run with three noise seeds adds its own standard error (relative to the real mean)
    noisy = {**sim, "repeats": {"n": 3, "metrics": {"output_throughput": {"std": 3.0}, "tpot_ms.p50": {"std": 9.0}}}}
    got = real_spread(noisy, real)
    thr = got["output_throughput"]
    assert thr["sim_sem"] == pytest.approx(3.0 / 108.1 / math.sqrt(3))
    assert thr["error_sem"] == pytest.approx(math.hypot(thr["sem"], thr["sim_sem"]))
    assert thr["resolvable"] is True and thr["repeats_for_bound"] == math.ceil(
        (2 * math.hypot(2.49, 3.0) / 108.1 / 0.05) ** 2) == 3
    assert got["tpot_ms.p50"]["repeats_for_bound"] == math.ceil((2 * math.hypot(std, 9.0) / mean / 0.10) ** 2)
    assert "sim_sem" not in got["itl_ms.p90"]  # the sim engine did not report that figure's spread


def test_sensitivity_is_the_mean_relative_move_per_unit_of_step_time():
    from workbench.fidelity import FIGURE_BOUNDS, sensitivity, summary_line

    def summ(thr, ttft, tpot):
        return {"output_throughput": thr, "ttft_ms": {"p50": ttft, "p99": 2 * ttft}, "tpot_ms": {"p50": tpot},
                "e2el_ms": {"p50": None}}

    as_run = [summ(100.0, 1000.0, 200.0), summ(110.0, 2000.0, 300.0)]
    slowed = [summ(95.0, 1100.0, 250.0), summ(104.5, 2200.0, 360.0)]  # throughput -5%, TTFT +10%, TPOT +25%/+20%
    got = sensitivity(as_run, slowed, step=0.05)
    assert got["n_seeds"] == 2 and got["step_time_change"] == 0.05
    e = got["elasticity"]
    assert e["output_throughput"] == pytest.approx(-1.0)
    assert e["ttft_ms.p50"] == pytest.approx(2.0) and e["ttft_ms.p99"] == pytest.approx(2.0)
    assert e["tpot_ms.p50"] == pytest.approx((0.25 + 0.20) / 2 / 0.05)
    assert "e2el_ms.p50" not in e  # missing in the summaries: no figure, not a zero
    assert got["step_error_for_bound"]["tpot_ms.p50"] == pytest.approx(FIGURE_BOUNDS["tpot_ms.p50"] / 4.5)
    with pytest.raises(ValueError, match="one slowed run per run"):
        sensitivity(as_run, slowed[:1])
    err = {"real_engine": "paged", "step": {}, "request": {}, "sensitivity": got,
           "dist": {"output_throughput": 0.0, **{m: {"p50": 0.0, "p99": 0.0} for m in
                                                 ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}}}
    assert "5% slower steps move throughput -5.0%, ttft p50 +10.0%, tpot p50 +22.5%" in summary_line(err)


def test_a_recorded_step_shape_replays_as_a_grid_step_of_the_same_work():
    """``grid_step_of`` rebuilds a step from its recorded shape (sums only): a step whose rows share one context
    and whose chunks are alike comes back with the same shape (scattered blocks stay scattered, consecutive ones
    consecutive); chunks of unequal length come back split evenly, with the same tokens, chunks, sampled rows and
    (to rounding) cached context, and less prefill attention."""
    from engines.sim.profiler import grid_step_of

    def shape(step):
        return StepShape.of(grid_batch(step, 16, 512).seqs)

    fields = ("tokens", "decode_rows", "padding_rows", "decode_ctx", "prefill_seqs", "prefill_tokens",
              "prefill_attn", "prefill_ctx", "sampled", "padding_ctx")
    for step in (GridStep(1, 64), GridStep(8, 300), GridStep(4, 100, contiguous=True),
                 GridStep(16, 256, prefills=((128, 0), (128, 0))), GridStep(prefills=((64, 512),)),
                 GridStep(3, 200, padding_rows=5, padding_ctx=90)):
        before = shape(step)
        after = shape(grid_step_of(before))
        assert [getattr(after, f) for f in fields] == [getattr(before, f) for f in fields], step
        assert (after.scattered_ctx == 0) == (before.scattered_ctx == 0), step
    before = StepShape.of([ScheduledSeq("a", list(range(100)), 0, list(range(7)), True, SP),
                           ScheduledSeq("b", list(range(20)), 50, list(range(7, 12)), True, SP)])
    after = shape(grid_step_of(before))
    assert (after.tokens, after.prefill_seqs, after.prefill_tokens, after.sampled) == (120, 2, 120, 2)
    assert before.prefill_ctx == 1000 and after.prefill_ctx == 120 * 8  # mean start round(1000 / 120) = 8
    assert after.prefill_attn == 2 * 60 * (8 + 60) < before.prefill_attn == 100 * 100 + 20 * 70


def test_cheap_grid_steps_get_more_runs():
    """Steps under ``cheap_s`` are timed ``cheap_repeats`` times in all (one warm-up run besides); a step of at
    least ``cheap_s`` is timed ``repeats`` times with no warm-up (its first run counts)."""
    from collections import Counter
    from types import SimpleNamespace

    from engines.sim.profiler import profile_rows

    class CountingExecutor:
        kv = SimpleNamespace(block_size=16, num_blocks=256)

        def __init__(self):
            self.calls = Counter()

        def execute(self, out):
            self.calls[tuple(s.request_id for s in out.seqs), out.seqs[0].context_len] += 1

    grid = [GridStep(1, 64), GridStep(4, 128)]
    ex = CountingExecutor()
    rows = profile_rows(ex, grid, repeats=3, cheap_repeats=9, cheap_s=10.0)  # every step is cheap
    assert sorted(ex.calls.values()) == [10, 10] and len(rows) == 2
    ex = CountingExecutor()
    profile_rows(ex, grid, repeats=3, cheap_repeats=9, cheap_s=0.0)  # none is
    assert sorted(ex.calls.values()) == [3, 3]


def test_pilot_probes_take_the_machines_phases_out_of_the_profile(monkeypatch):
    """A machine that runs 1.5x slower in the middle third of every pass: a grid step's median of three runs
    lands in the slow phase or not by chance, while divided by the speed the pilot probes saw around each run
    every step comes out at the same multiple of its own cost (the machine's mean speed over the profile)."""
    from types import SimpleNamespace

    from engines.sim import profiler
    from engines.sim.profiler import PILOT_PROBES, PilotProbe, profile_rows

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(profiler, "time", SimpleNamespace(perf_counter=lambda: clock.now))  # this module's clock only
    grid = [GridStep(r, 64) for r in range(1, 13)]  # 12 decode steps of 1-12 rows
    period = 3.0  # seconds: a slow second after two fast ones, while a timed run and its pilots take 0.13-0.16 s

    def cost(out):  # seconds at full speed: 0.04 + 2.5 ms per row
        return 0.04 + 0.0025 * len(out.seqs)

    class PhasedExecutor:
        kv = SimpleNamespace(block_size=16, num_blocks=256)

        def execute(self, out):
            slow = period / 3 <= clock.now % period < 2 * period / 3
            clock.now += cost(out) * (1.5 if slow else 1.0)

    ex = PhasedExecutor()
    raw = profile_rows(ex, grid, repeats=3)
    pilot = PilotProbe(ex, every_s=0.0)  # after every timed run
    steady = profile_rows(ex, grid, repeats=3, pilot=pilot)
    # a pilot pair after every run: each step's three timed ones and its warm-up (every step is under cheap_s)
    assert {r["probe"] for r in pilot.records} == set(PILOT_PROBES) and len(pilot.records) == 2 * 4 * len(grid)
    base = [cost(grid_batch(g, 16, 256)) for g in grid]
    raw_ratio = [t / b for (_, t, _), b in zip(raw, base)]
    steady_ratio = [t / b for (_, t, _), b in zip(steady, base)]
    assert max(raw_ratio) / min(raw_ratio) > 1.4  # some medians in the slow phase, some not
    m = statistics.median(steady_ratio)
    assert 1.0 < m < 1.5  # the machine's mean speed over the passes
    # a run next to a change of phase has one pilot of each phase around it: a few are off, never by much
    assert sum(abs(x / m - 1) < 0.01 for x in steady_ratio) >= 9 and max(steady_ratio) / min(steady_ratio) < 1.1
    assert max(cv for *_, cv in steady) > 0.1  # the spread stays that of the raw timings, phases and all


def test_large_grid_steps_skip_the_last_pass_when_their_two_runs_agree(monkeypatch):
    """With ``large_s``, a step of at least that many seconds whose first two speed-adjusted runs agree within
    ``LARGE_AGREE`` is timed twice (its figure their mean); one whose second run was 20% slower on a machine of
    steady speed gets its third run, and the median of the three; steps under ``large_s`` keep every pass."""
    from collections import Counter
    from types import SimpleNamespace

    from engines.sim import profiler
    from engines.sim.profiler import LARGE_AGREE, PilotProbe, profile_rows

    assert 0 < LARGE_AGREE < 0.2
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(profiler, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    grid = [GridStep(prefills=((512, 0),)), GridStep(prefills=((1024, 0),)), GridStep(4, 64)]
    calls = Counter()

    class SteadyExecutor:  # seconds = tokens / 1000; the 1,024-token prefill's second run is 20% slow
        kv = SimpleNamespace(block_size=16, num_blocks=256)

        def execute(self, out):
            tokens = sum(len(s.token_ids) for s in out.seqs)
            key = None if out.seqs[0].block_table[0] == 256 else tokens  # the pilots run on the scratch block
            calls[key] += 1
            clock.now += tokens / 1000 * (1.2 if key == 1024 and calls[key] == 2 else 1.0)

    ex = SteadyExecutor()
    pilot = PilotProbe(ex, every_s=0.0)
    rows = profile_rows(ex, grid, repeats=3, pilot=pilot, large_s=0.5)
    # the decode: a warm-up and three runs, each after a pilot pair or a prefill, so each first settles
    assert calls[512] == 2 and calls[1024] == 3 and calls[4] == 2 * 4
    assert rows[0][1] == pytest.approx(0.512, rel=0.02) and rows[1][1] == pytest.approx(1.024, rel=0.02)
    calls.clear()
    profile_rows(ex, grid, repeats=3, pilot=PilotProbe(ex, every_s=0.0))  # without large_s: every pass
    assert calls[512] == 3 and calls[1024] == 3


def test_small_steps_are_timed_after_small_steps(monkeypatch):
    """A machine where a step of fewer than ``SETTLE_TOKENS`` tokens takes 1.5x its time right after a larger
    step: every small grid step run after a large one (or after a pilot pair, which ends with a 128-token
    prefill) first runs once untimed, so its figure is its time after small steps, as decodes run in an engine;
    the small pilot runs once untimed before its timing, whatever ran before it."""
    from types import SimpleNamespace

    from engines.sim import profiler
    from engines.sim.profiler import PILOT_PROBES, SETTLE_TOKENS, PilotProbe, profile_rows

    assert SETTLE_TOKENS == 128
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(profiler, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    grid = [GridStep(1, 64), GridStep(4, 64), GridStep(16, 64), GridStep(prefills=((256, 0),)),
            GridStep(prefills=((512, 0),))]
    ran: list[int] = []

    class StickyExecutor:  # 10 ms + 1 ms per token, 1.5x for a small step after a large one
        kv = SimpleNamespace(block_size=16, num_blocks=256)

        def execute(self, out):
            tokens = sum(len(s.token_ids) for s in out.seqs)
            slow = tokens < SETTLE_TOKENS <= (ran[-1] if ran else 0)
            ran.append(tokens)
            clock.now += (0.01 + tokens / 1000) * (1.5 if slow else 1.0)

    ex = StickyExecutor()
    rows = profile_rows(ex, grid, repeats=3)
    assert [t for _, t, _ in rows] == pytest.approx([0.011, 0.014, 0.026, 0.266, 0.522])
    settles = [i for i in range(1, len(ran) - 1) if ran[i] < 128 <= ran[i - 1]]
    assert settles and all(ran[i + 1] == ran[i] for i in settles)  # each then ran again, timed
    ran.clear()
    pilot = PilotProbe(ex, every_s=0.0)
    rows = profile_rows(ex, grid, repeats=3, pilot=pilot)
    assert [t for _, t, _ in rows] == pytest.approx([0.011, 0.014, 0.026, 0.266, 0.522])
    small = [r["seconds"] for r in pilot.records if r["probe"] == PILOT_PROBES[0]]
    assert small == pytest.approx([0.014] * len(small))  # 4 tokens, never the 1.5x


def test_twin_speed_is_the_geometric_mean_of_measured_over_raw_prediction_per_class():
    """The speed of the twin's own steps is taken against the profile without its drift factors: small steps
    (at most ``SCALE_SMALL_TOKENS`` tokens) and large ones (at least ``SCALE_LARGE_TOKENS``) apart, steps
    between counted in neither."""
    import math
    from types import SimpleNamespace

    from engines.core.step_shape import StepShape
    from engines.sim.cost_model import shape_features
    from workbench.fidelity import summary_line, twin_speed

    cm = CostModel({"const": 0.01, "tokens": 1e-4}, speed_scale=0.5, speed_scale_large=3.0)  # factors ignored
    raw = CostModel({"const": 0.01, "tokens": 1e-4})

    def step(tokens, ratio, prefill=False):
        rows = 0 if prefill else tokens
        shape = StepShape(tokens=tokens, decode_rows=rows, decode_ctx=10 * rows, prefill_seqs=int(prefill),
                          prefill_tokens=tokens - rows, sampled=1)
        return SimpleNamespace(num_seqs=1, duration=ratio * raw.predict_features(shape_features(shape)) - 0.002,
                               overhead=0.002, shape=shape)

    mid = int((SCALE_SMALL_TOKENS * SCALE_LARGE_TOKENS) ** 0.5)
    steps = [step(1, 1.1), step(SCALE_SMALL_TOKENS, 1.21), step(mid, 5.0), step(SCALE_LARGE_TOKENS, 0.9),
             step(1024, 0.9, prefill=True), SimpleNamespace(num_seqs=0, duration=0.0, overhead=0.0, shape=StepShape())]
    got = twin_speed(cm, steps)
    assert got["scale_small"] == pytest.approx(math.sqrt(1.1 * 1.21))
    assert got["scale_large"] == pytest.approx(0.9)
    assert got["n_steps_small"] == 2 and got["n_steps_large"] == 2
    assert twin_speed(cm, steps[:2])["scale_large"] is None
    err = {"real_engine": "paged", "step": {}, "request": {},
           "dist": {"output_throughput": 0.0, **{m: {"p50": 0.0, "p99": 0.0} for m in
                                                 ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}},
           "speed_matched": {**got, "dist": {"output_throughput": 0.01, **{m: {"p50": -0.02, "p99": 0.0} for m in
                                                                          ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}}}}
    assert ("at the twin's own speed (1.154x/0.900x the profile, small/large steps): throughput +1.0%, "
            "TTFT p50 -2.0%, TPOT p50 -2.0%, E2EL p50 -2.0%") in summary_line(err)


def test_step_errors_score_the_cost_model_and_the_other_repeats_against_one_repeat():
    """``repeat_shape_median_mape`` scores the other real repeats' pooled shape medians against each repeat's own
    (leave one out), ``shape_median_mape_per_repeat`` the cost model's, over the same shapes: those seen at least
    3 times in the repeat and in the others."""
    from types import SimpleNamespace

    from workbench.fidelity import repeat_shape_errors, step_errors, summary_line

    small = StepShape(tokens=4, decode_rows=4, decode_ctx=1024, sampled=4)
    large = StepShape(tokens=32, decode_rows=32, decode_ctx=8192, sampled=32)

    def steps(shape, seconds):
        return [SimpleNamespace(num_seqs=shape.decode_rows, duration=d, overhead=0.0, shape=shape) for d in seconds]

    cm = CostModel(coef={"const": 1.0})  # predicts 1 s for every step

    def predict(s):
        return cm.predict_features(shape_features(s.shape))

    rep1 = steps(small, [1.0, 1.0, 1.0]) + steps(large, [2.0, 2.0, 2.0])
    rep2 = steps(small, [1.2, 1.2, 1.2]) + steps(large, [2.0, 2.0])  # large: two steps, no median here
    # only small counts: repeat 1 has 1.0 (others 1.2, model 1.0), repeat 2 has 1.2 (others 1.0, model 1.0)
    got = repeat_shape_errors([rep1, rep2], predict)
    assert got["repeat_shape_median_mape"] == pytest.approx((0.2 / 1.0 + 0.2 / 1.2) / 2)
    assert got["shape_median_mape_per_repeat"] == pytest.approx((0.0 + 0.2 / 1.2) / 2)
    # a third repeat of large only: repeat 1 small (others 1.2) and large 2.0 (others 2, 2, 2.5 x 3: 2.5);
    # repeat 2 small 1.2 (others 1.0); repeat 3 large 2.5 (others 2.0 x 5)
    rep3 = steps(large, [2.5, 2.5, 2.5])
    got = repeat_shape_errors([rep1, rep2, rep3], predict)
    assert got["repeat_shape_median_mape"] == pytest.approx(((0.2 / 1.0 + 0.5 / 2.0) / 2 + 0.2 / 1.2 + 0.5 / 2.5) / 3)
    assert got["shape_median_mape_per_repeat"] == pytest.approx(((0.0 + 1.0 / 2.0) / 2 + 0.2 / 1.2 + 1.5 / 2.5) / 3)
    assert repeat_shape_errors([rep1], predict) == {"repeat_shape_median_mape": None,
                                                    "shape_median_mape_per_repeat": None}
    assert repeat_shape_errors([rep1, rep2])["shape_median_mape_per_repeat"] is None
    got = step_errors(cm, rep1 + rep2, [rep1, rep2])
    assert got["repeat_shape_median_mape"] == pytest.approx((0.2 / 1.0 + 0.2 / 1.2) / 2)
    assert got["shape_median_mape_per_repeat"] == pytest.approx((0.0 + 0.2 / 1.2) / 2)
    assert step_errors(cm, rep1)["repeat_shape_median_mape"] is None
    err = {"real_engine": "paged", "step": got, "request": {},
           "dist": {"output_throughput": 0.0, **{m: {"p50": 0.0, "p99": 0.0} for m in
                                                 ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}}}
    assert "(against one real repeat: the cost model 8.3%, the other repeats 18.3%)" in summary_line(err)


def test_request_errors_state_the_real_repeats_own_per_request_difference():
    """Per-request MAPEs are taken between the means over each side's repeats; ``noise_floor`` puts each real
    repeat against the mean of the other ones (leave one out), pooled."""
    from types import SimpleNamespace

    from workbench.fidelity import request_errors, summary_line

    def out(rid, ttft, e2el):
        return SimpleNamespace(request_id=rid, finish_reason="length", arrival_time=0.0, first_token_time=ttft,
                               finished_time=e2el, token_ids=[1, 2], token_times=[ttft, e2el])

    real = [[out("a", 1.0, 10.0), out("b", 2.0, 20.0)], [out("a", 3.0, 14.0), out("b", 2.0, 20.0)]]
    sim = [[out("a", 2.0, 12.0), out("b", 3.0, 20.0)]]
    got = request_errors(sim, real)
    assert got["n_matched"] == 2
    assert got["ttft_mape"] == pytest.approx((0.0 + 0.5) / 2)
    assert got["e2el_mape"] == pytest.approx(0.0)
    floor = got["noise_floor"]  # repeat 1 vs repeat 2 and back: a 1 vs 3, 3 vs 1; b equal
    assert floor["n_repeats"] == 2
    assert floor["ttft_mape"] == pytest.approx((2 / 3 + 0 + 2 / 1 + 0) / 4)
    assert floor["e2el_mape"] == pytest.approx((4 / 14 + 0 + 4 / 10 + 0) / 4)
    assert request_errors(sim, real[:1])["noise_floor"] is None
    err = {"real_engine": "paged", "step": {}, "request": got,
           "dist": {"output_throughput": 0.0, **{m: {"p50": 0.0, "p99": 0.0} for m in
                                                 ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}}}
    assert "per-request MAPE TTFT 25.0% E2EL 0.0% (real repeats among themselves 66.7% / 17.1%)" in summary_line(err)
