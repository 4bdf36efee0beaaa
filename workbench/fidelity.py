"""How far a sim engine is from its real twin, measured three ways (``results.json`` ``sim_error``).

* step level: every real step's recorded shape fed to the sim engine's cost model, prediction vs the measured
  executor time plus the engine's own overhead: the cost model alone, free of queueing;
* request level: per-request errors of TTFT and E2EL, requests matched by id;
* distribution level: signed relative errors of output throughput and of the mean, p50, p90 and p99 of TTFT,
  TPOT, ITL and E2EL.

Per-request errors are the honest figure: errors of means and percentiles let errors of opposite sign cancel
(inference-sim/sim-to-real-accuracy-validation makes the same point).
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from workbench.metrics import relative_error

MIN_SHAPE_STEPS = 3  # steps a shape needs for its median to count in shape_median_mape
DIST_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
DIST_STATS = ("mean", "p50", "p90", "p99")

FORMULAS = {
    "sim_error.step": "over the real engine's steps (every repeat): e = (cost model's prediction of the step's shape - measured duration - overhead) / (measured duration + overhead); mape = mean |e|, mean = mean e (signed), p90 = 90th percentile of |e|; shape_median_mape = mean over step shapes (kind x rows x tokens x context per row x cached context per prefill token, power-of-2 buckets) seen at least 3 times of |median prediction - median measured| / median measured (shape_median_mape_all: over every shape); noise_floor = median |d - shape median| / shape median of the measured steps of shapes seen at least 3 times (the real executor's own step-to-step spread); repeat_shape_median_mape (with 2 or more real repeats): the shape medians of the other real repeats pooled (leave one out) against each repeat's own, |median(others) - median(repeat)| / median(repeat) over the shapes seen at least 3 times in the repeat and in the others, averaged over the shapes and then over the repeats: the real engine's own per-shape repeat-to-repeat difference; shape_median_mape_per_repeat: the same with the cost model's median prediction of the repeat's steps in place of median(others), over the same shapes: the cost model and the other repeats scored against one repeat alike (shape_median_mape is taken against the medians of all repeats pooled, which hold less noise)",
    "sim_error.request": "requests finished in both, matched by id: ttft_mape = mean |sim TTFT - real TTFT| / real TTFT, e2el_mape likewise (each side: the mean over its repeats of each request; a sim engine with step noise runs as many repeats as its twin, noise seeds seed + i); noise_floor (with 2 or more real repeats): the same two MAPEs of each real repeat against the mean of the other repeats, pooled over the repeats (leave one out): the real engine's own per-request repeat-to-repeat difference, with one repeat on the measured side where the sim is compared with the mean of all of them)",
    "profile": "a sim engine's cost model: path, fingerprint (CPU model and ISA flags, torch CPU kernel level, threads, torch version, model and its config hash, dtype, weight dtype, attention kernels) and when it was measured; cost_model auto measures this machine's on first use (workbench.calibration)",
    "drift": "before and after each real engine run the fixed probe steps (engines.sim.profiler.PROBE_GRID) are timed (phase before / after); a sim engine takes the probes of its real twin's runs (probes_of; all real runs' when it has no twin); each probe's reference is the profile's own timing of the same step (probe_baseline, timed in the profile's grid passes; reference: baseline), else the profile's prediction (reference: prediction); speed_ratio = geometric mean over the probes of measured / reference seconds; speed_ratio_small and speed_ratio_large = the same over probe steps of at most engines.sim.cost_model.SCALE_SMALL_TOKENS tokens (memory-bound: decodes of a few rows) and of at least SCALE_LARGE_TOKENS (compute-bound: larger decode batches, mixed steps, prefills); before and after: the same three over each phase's probes; during: the same three over the pilot probes (engines.sim.profiler.PILOT_PROBES: a 4-row decode and a 128-token prefill on the KV cache's scratch block; the decode after one untimed run of it, engines.sim.profiler.SETTLE_TOKENS) timed once each between the real runs' own steps whenever 2 s of the run (PILOT_EVERY_S) have passed since the last, the replay clock stopped meanwhile (n_pilots timings; each such probe's at is the engine clock then), against their baseline in the profile, the geometric mean of the same pilots run between the profile's grid steps in the same way (not in speed_ratio); pooled: the same three over every probe timing of the three phases; the factor of each class (scale_small, scale_large), where there are pilots, is its reading when off by more than margin (workbench.runner.during_factor): for small steps the pooled ratio, for large ones the pilots' (workbench.runner.POOLED_CLASSES), else the phase ratio nearer 1 when both phases are off by more than margin on the same side, else 1 (workbench.runner.agreed_factor); when either factor is not 1 and every ratio is within [1 / max, max] the sim engine's predictions are multiplied by a factor of the step's tokens: scale_small up to SCALE_SMALL_TOKENS (8) tokens, scale_large from SCALE_LARGE_TOKENS (32), linear in log(tokens) between, and for a step of more tokens than the large pilot (pilot_elasticity.full_tokens, 128) scale_large ** e, e = 1 at full_tokens falling linearly in log(tokens) to pilot_elasticity.floor (0.5) at floor_tokens (512) and that beyond (engines.sim.cost_model.pilot_elasticity: such steps were measured to follow the pilot's speed about half as much) (CostModel.scale; rescaled; beyond max the profile is of another machine and is left as it is: beyond_max); gemm_gflops: a [64, 576] x [576, 1536] float32 GEMM's speed",
    "sim_error.dist": "(sim - real) / real of output_throughput and of each of mean, p50, p90, p99 of ttft_ms, tpot_ms, itl_ms, e2el_ms (real: the mean over the repeats)",
    "sim_error.sensitivity": "how much each figure moves when every simulated step is slower by step_time_change (5%): the sim engine is run again with its cost model's predictions times 1 + step_time_change, with the same noise seeds as its runs; elasticity[figure] = mean over the seeds of (slowed / as run - 1) / step_time_change (1.0: the figure moves as much as the step time; 5.0: five times as much); step_error_for_bound[figure] = bound / |elasticity|: the largest error of the step times that keeps the figure within its bound (the bounds: 5% throughput, 10% p50s, 15% p99s)",
    "sim_error.speed_matched": "the sim engine run again (same noise seeds) at the speed its real twin's own steps ran, to tell the cost model's and scheduler's error from the machine's drift: scale_small = geometric mean over the twin's steps of at most engines.sim.cost_model.SCALE_SMALL_TOKENS tokens of measured (duration + overhead) / the profile's prediction without drift factors, scale_large the same over steps of at least SCALE_LARGE_TOKENS tokens (CostModel.scale interpolates between); dist and request as sim_error.dist and sim_error.request for that run; step as sim_error.step with the cost model at that speed (what is left is the error of the step shapes, the machine's mean speed over the run taken out). The real run's own timings inform it, so it is a diagnostic, not a prediction: a what-if has no real run to take its speed from",
    "sim_error.real_spread": "with repeated real runs, per figure of sim_error.dist (output_throughput, <metric>.<stat>): spread = (max - min) / mean of the real repeats, within_range = min <= sim value <= max: an error smaller than the real engine's own repeat-to-repeat spread cannot be told from a repeat; sem = std / mean / sqrt(n) (std with n - 1): the relative standard error of the real mean that the sim is compared with; sim_sem = the sim engine's std over its noise seeds / the real mean / sqrt(its seeds), where it ran two or more; error_sem = sqrt(sem^2 + sim_sem^2): the standard error of the relative error; for a figure with a bound (bound: 5% throughput, 10% p50s, 15% p99s): resolvable = 2 x error_sem <= bound (the error is pinned to within the bound, about 95% for a normal spread), repeats_for_bound = ceil((2 x sqrt(std^2 + sim std^2) / real mean / bound)^2), at least 2: the repeats on each side that would pin it so, at these spreads",
}


def _bucket(x: float) -> int:
    """Power-of-2 bucket of ``x`` (0 for 0)."""
    return 0 if x <= 0 else int(math.floor(math.log2(x))) + 1


def shape_key(shape) -> tuple:
    """The bucket a step's shape falls in for per-shape medians: (kind, rows, tokens, context per row)."""
    rows = shape.decode_rows + shape.padding_rows
    return (shape.kind, _bucket(rows), _bucket(shape.tokens), _bucket(shape.decode_ctx / rows if rows else 0),
            _bucket(shape.prefill_ctx / max(shape.prefill_tokens, 1)))


def _shape_medians(steps, predict=None) -> dict[tuple, tuple[float, int, float | None]]:
    """shape key -> (median measured seconds, number of steps, median of ``predict(step)`` or None) of ``steps``
    that computed something."""
    groups: dict[tuple, list] = {}
    for s in steps:
        if s.num_seqs and s.duration > 0:
            groups.setdefault(shape_key(s.shape), []).append(s)
    return {k: (float(np.median([s.duration + s.overhead for s in v])), len(v),
                float(np.median([predict(s) for s in v])) if predict else None) for k, v in groups.items()}


def repeat_shape_errors(steps_by_repeat: list[list], predict=None) -> dict:
    """Per-shape medians of each real repeat against the other repeats pooled (leave one out) and against the
    cost model, over the same shapes: those seen at least ``MIN_SHAPE_STEPS`` times in the repeat and in the
    others (``FORMULAS["sim_error.step"]``).

    Args:
        steps_by_repeat: each real repeat's ``StepRecord``s.
        predict: step -> predicted seconds (the cost model on the step's shape), or None.

    Returns:
        ``repeat_shape_median_mape``: mean over repeats of the mean over shapes of
        ``|median(others) - median(repeat)| / median(repeat)``: the real engine's own per-shape repeat-to-repeat
        difference, what a cost model that predicted each shape as the other repeats ran it would score;
        ``shape_median_mape_per_repeat``: the same with the cost model's median prediction (of the repeat's
        steps) in place of the others' median (None without ``predict``). Both None with fewer than two repeats
        or no shape on both sides.
    """
    floor, model = [], []
    for i, mine in enumerate(steps_by_repeat if len(steps_by_repeat) >= 2 else []):
        own = _shape_medians(mine, predict)
        others = _shape_medians([s for j, run in enumerate(steps_by_repeat) if j != i for s in run])
        keys = [k for k, (_, n, _) in own.items()
                if n >= MIN_SHAPE_STEPS and others.get(k, (0, 0))[1] >= MIN_SHAPE_STEPS]
        if keys:
            floor.append(statistics.fmean(abs(others[k][0] - own[k][0]) / own[k][0] for k in keys))
            if predict:
                model.append(statistics.fmean(abs(own[k][2] - own[k][0]) / own[k][0] for k in keys))
    return {"repeat_shape_median_mape": statistics.fmean(floor) if floor else None,
            "shape_median_mape_per_repeat": statistics.fmean(model) if model else None}


def step_errors(cost_model, steps, steps_by_repeat: list[list] | None = None) -> dict:
    """Step-level error of ``cost_model`` on real ``steps`` (``StepRecord``s of one or more runs); see
    ``FORMULAS["sim_error.step"]``. Steps that computed nothing are skipped. ``steps_by_repeat``: the same steps
    split by real repeat, for ``repeat_shape_median_mape`` and ``shape_median_mape_per_repeat``
    (:func:`repeat_shape_errors`; None without)."""
    from engines.sim.cost_model import shape_features

    pred, meas, keys = [], [], []
    for s in steps:
        if not s.num_seqs or s.duration <= 0:
            continue
        pred.append(cost_model.predict_features(shape_features(s.shape)))
        meas.append(s.duration + s.overhead)
        keys.append(shape_key(s.shape))
    if not meas:
        return {"n_steps": 0}
    p, m = np.array(pred), np.array(meas)
    e = (p - m) / m
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    shape_errs, all_errs, dev = [], [], []
    by_kind: dict[str, list[float]] = {}
    for k, idx in groups.items():
        mm, pm = float(np.median(m[idx])), float(np.median(p[idx]))
        all_errs.append(abs(pm - mm) / mm)
        if len(idx) >= MIN_SHAPE_STEPS:  # a median of one or two steps is a step, not a shape's median
            shape_errs.append(abs(pm - mm) / mm)
            by_kind.setdefault(k[0], []).append(abs(pm - mm) / mm)
            dev.extend(abs(m[i] - mm) / mm for i in idx)
    return {"n_steps": len(m), "n_shapes": len(groups), "n_shapes_median": len(shape_errs),
            "mape": float(np.abs(e).mean()), "mean": float(e.mean()), "p90": float(np.percentile(np.abs(e), 90)),
            "shape_median_mape": float(np.mean(shape_errs)) if shape_errs else None,
            "shape_median_mape_all": float(np.mean(all_errs)),
            "shape_median_mape_by_kind": {k: float(np.mean(v)) for k, v in sorted(by_kind.items())},
            "noise_floor": float(np.median(dev)) if dev else None,
            **repeat_shape_errors(steps_by_repeat or [],
                                  lambda s: cost_model.predict_features(shape_features(s.shape)))}


def request_errors(sim_runs: list, real_runs: list) -> dict:
    """Per-request MAPE of TTFT and E2EL; ``sim_runs`` and ``real_runs`` are lists of each repeat's outputs (each
    side averaged per request id over its repeats). With two or more real repeats, ``noise_floor`` holds the same
    MAPEs of each real repeat against the mean of the other repeats (pooled; ``FORMULAS["sim_error.request"]``):
    how far the real engine's own repeats land from each other per request, else None."""
    from workbench.metrics import request_metrics

    def table(outs):
        t = {}
        for o in outs:
            m = request_metrics(o) if o.finish_reason in ("stop", "length") else None
            if m is not None:
                t[o.request_id] = (m.ttft, m.e2el)
        return t

    def mean_of(tables, rid):
        vals = [t[rid] for t in tables if rid in t]
        if len(vals) != len(tables):
            return None
        return statistics.fmean(v[0] for v in vals), statistics.fmean(v[1] for v in vals)

    def mapes(one: list[dict], other: list[dict]) -> tuple[list[float], list[float]]:
        ttft, e2el = [], []
        for rid in one[0] if one else ():
            s, r = mean_of(one, rid), mean_of(other, rid)
            if s is None or r is None:
                continue
            (st, se), (rt, re_) = s, r
            if rt > 0:
                ttft.append(abs(st - rt) / rt)
            if re_ > 0:
                e2el.append(abs(se - re_) / re_)
        return ttft, e2el

    sims, reals = [table(outs) for outs in sim_runs], [table(outs) for outs in real_runs]
    ttft, e2el = mapes(sims, reals)
    floor = None
    if len(reals) >= 2:
        # leave one out: each real repeat against the mean of the others, pooled over the repeats
        pairs = [mapes([reals[i]], reals[:i] + reals[i + 1:]) for i in range(len(reals))]
        ft, fe = [x for p in pairs for x in p[0]], [x for p in pairs for x in p[1]]
        floor = {"n_repeats": len(reals), "ttft_mape": statistics.fmean(ft) if ft else None,
                 "e2el_mape": statistics.fmean(fe) if fe else None}
    return {"n_matched": len(e2el), "ttft_mape": statistics.fmean(ttft) if ttft else None,
            "e2el_mape": statistics.fmean(e2el) if e2el else None, "noise_floor": floor}


def dist_errors(sim: dict, real: dict) -> dict:
    """Signed relative errors of the summary figures (``FORMULAS["sim_error.dist"]``)."""
    out = {"output_throughput": relative_error(sim["output_throughput"], real["output_throughput"])}
    for m in DIST_METRICS:
        s, r = sim.get(m) or {}, real.get(m) or {}
        out[m] = {k: relative_error(s[k], r[k]) if s.get(k) is not None and r.get(k) is not None else None
                  for k in DIST_STATS}
    return out


def real_spread(sim: dict, real: dict) -> dict | None:
    """For each figure of :func:`dist_errors` that the real twin repeated: its repeat-to-repeat ``spread``
    ((max - min) / mean over the repeats) and whether the simulated value lies within the repeats' range
    (``within_range``), keyed ``output_throughput`` and ``<metric>.<stat>``; None without repeats. With the
    repeats' ``std`` and two or more of them, also the relative standard error of their mean (``sem``), the same
    of the sim engine's mean over its seeds where it ran several (``sim_sem``, relative to the real mean), their
    root sum of squares (``error_sem``: the standard error of the relative error itself) and, for a figure of
    :data:`FIGURE_BOUNDS`, whether that error is pinned to within the bound (``resolvable``: 2 x error_sem <=
    bound) and how many repeats on each side would pin it at these spreads (``repeats_for_bound``;
    ``FORMULAS["sim_error.real_spread"]``). A figure whose repeats scatter widely, such as a TPOT p50 that lands in
    one of two modes by the order in which a burst of arrivals meets the steps, cannot be held to a 10% bound
    with three of them."""
    rep = ((real.get("repeats") or {}).get("metrics")) or {}
    if not rep:
        return None
    n = (real.get("repeats") or {}).get("n") or 0
    sim_rep = sim.get("repeats") or {}
    n_sim = sim_rep.get("n") or 0
    out = {}
    for key in ["output_throughput"] + [f"{m}.{k}" for m in DIST_METRICS for k in DIST_STATS]:
        metric, _, stat = key.partition(".")
        s = sim.get(metric)
        s = (s or {}).get(stat) if stat else s
        r = rep.get(key)
        if r is None or s is None:
            continue
        out[key] = {"spread": r["spread"], "within_range": bool(r["min"] <= s <= r["max"])}
        if r.get("std") is None or not r.get("mean") or n < 2:
            continue
        cv = r["std"] / abs(r["mean"])
        e = out[key]
        e["sem"] = cv / math.sqrt(n)
        sim_std = ((sim_rep.get("metrics") or {}).get(key) or {}).get("std") if n_sim > 1 else None
        sim_cv = sim_std / abs(r["mean"]) if sim_std is not None else 0.0
        if sim_std is not None:
            e["sim_sem"] = sim_cv / math.sqrt(n_sim)
        e["error_sem"] = math.hypot(e["sem"], e.get("sim_sem", 0.0))
        bound = FIGURE_BOUNDS.get(key)
        if bound is not None:
            e.update(bound=bound, resolvable=bool(2 * e["error_sem"] <= bound),
                     repeats_for_bound=max(2, math.ceil((2 * math.hypot(cv, sim_cv) / bound) ** 2 - 1e-9)))
    return out


def unresolved(spread: dict | None) -> dict[str, dict]:
    """The bounded figures of a :func:`real_spread` whose error is not pinned to within the bound (2 standard
    errors of the real and simulated means beyond it): key -> its entry."""
    return {k: v for k, v in (spread or {}).items() if v.get("resolvable") is False}


SENSITIVITY_STEP = 0.05  # the step-time change of the sensitivity runs
# figure -> the bound a simulated figure is held to against the mean of the real repeats
FIGURE_BOUNDS = {"output_throughput": 0.05, "ttft_ms.p50": 0.10, "tpot_ms.p50": 0.10, "e2el_ms.p50": 0.10,
                 "ttft_ms.p99": 0.15, "itl_ms.p99": 0.15, "e2el_ms.p99": 0.15}


def figure(summary: dict, key: str) -> float | None:
    """A summary figure by key: ``output_throughput`` or ``<metric>.<stat>`` (None where missing)."""
    metric, _, stat = key.partition(".")
    v = summary.get(metric)
    v = (v or {}).get(stat) if stat else v
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def sensitivity(as_run: list[dict], slowed: list[dict], step: float = SENSITIVITY_STEP) -> dict:
    """How strongly each figure of :data:`FIGURE_BOUNDS` follows the step times
    (``FORMULAS["sim_error.sensitivity"]``). ``as_run`` and ``slowed``: per-seed summaries of the sim engine
    as run and with every step ``1 + step`` times as long, in the same seed order.

    Raises:
        ValueError: the two lists differ in length or are empty.
    """
    if not as_run or len(as_run) != len(slowed):
        raise ValueError(f"sensitivity needs one slowed run per run, got {len(as_run)} and {len(slowed)}")
    elasticity, need = {}, {}
    for key, bound in FIGURE_BOUNDS.items():
        ratios = [(figure(b, key), figure(s, key)) for b, s in zip(as_run, slowed)]
        ratios = [s / b - 1.0 for b, s in ratios if b and s is not None]
        if not ratios:
            continue
        e = statistics.fmean(ratios) / step
        elasticity[key] = e
        need[key] = bound / abs(e) if e else None
    return {"step_time_change": step, "n_seeds": len(as_run), "elasticity": elasticity,
            "step_error_for_bound": need}


def twin_speed(cost_model, steps) -> dict:
    """The speed the real twin's ``steps`` (``StepRecord``s of every repeat) ran at against ``cost_model``
    without its drift factors (``FORMULAS["sim_error.speed_matched"]``): ``scale_small`` and ``scale_large``
    (None where the twin ran no step of that class) and how many steps each came from."""
    import dataclasses

    from engines.sim.cost_model import SCALE_LARGE_TOKENS, SCALE_SMALL_TOKENS, shape_features

    raw = dataclasses.replace(cost_model, speed_scale=1.0, speed_scale_large=None, speed_elastic=False)
    logs: dict[str, list[float]] = {"small": [], "large": []}
    for s in steps:
        if not s.num_seqs or s.duration <= 0:
            continue
        tokens = s.shape.tokens
        cls = "small" if tokens <= SCALE_SMALL_TOKENS else "large" if tokens >= SCALE_LARGE_TOKENS else None
        pred = raw.predict_features(shape_features(s.shape))
        if cls and pred > 0:
            logs[cls].append(math.log((s.duration + s.overhead) / pred))
    out = {}
    for cls, v in logs.items():
        out[f"scale_{cls}"] = math.exp(statistics.fmean(v)) if v else None
        out[f"n_steps_{cls}"] = len(v)
    return out


def speed_matched_errors(speed: dict, sim_summary: dict, sim_runs: list, real_summary: dict, real_runs: list,
                         cost_model, real_steps: list) -> dict:
    """``sim_error.speed_matched``: ``speed`` (:func:`twin_speed`) with the distribution and request errors of the
    sim engine's run at that speed (``sim_summary``, ``sim_runs``: its per-seed outputs) against its twin, and the
    step level of ``cost_model`` (the one at that speed) on the twin's ``real_steps`` (:func:`step_errors`: the
    shapes' error with the machine's mean speed taken out)."""
    return {**speed, "dist": dist_errors(sim_summary, real_summary), "request": request_errors(sim_runs, real_runs),
            "step": step_errors(cost_model, real_steps)}


def sim_error(cost_model, sim_summary: dict, sim_runs: list, real_name: str, real_summary: dict, real_runs: list,
              real_steps_by_repeat: list[list]) -> dict:
    """The whole ``sim_error`` entry of a sim engine against its real twin ``real_name`` (``*_runs``: each
    repeat's outputs; ``real_steps_by_repeat``: each real repeat's step records)."""
    real_steps = [s for run in real_steps_by_repeat for s in run]
    return {"real_engine": real_name, "step": step_errors(cost_model, real_steps, real_steps_by_repeat),
            "request": request_errors(sim_runs, real_runs), "dist": dist_errors(sim_summary, real_summary),
            "real_spread": real_spread(sim_summary, real_summary)}


def figure_name(key: str) -> str:
    """``tpot_ms.p50`` -> ``TPOT p50``; ``output_throughput`` -> ``throughput``."""
    if key == "output_throughput":
        return "throughput"
    metric, _, stat = key.partition(".")
    return f"{metric.removesuffix('_ms').upper()} {stat}"


def summary_line(err: dict) -> str:
    """One terminal line of a ``sim_error``."""
    def pct(x):
        return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:+.1%}"

    st, rq, d = err["step"], err["request"], err["dist"]
    parts = [f"vs {err['real_engine']}: throughput {pct(d['output_throughput'])}",
             f"TTFT p50 {pct(d['ttft_ms']['p50'])} p99 {pct(d['ttft_ms']['p99'])}",
             f"TPOT p50 {pct(d['tpot_ms']['p50'])}", f"ITL p99 {pct(d['itl_ms']['p99'])}",
             f"E2EL p50 {pct(d['e2el_ms']['p50'])} p99 {pct(d['e2el_ms']['p99'])}"]
    if rq.get("e2el_mape") is not None:
        floor = rq.get("noise_floor") or {}
        real = (f" (real repeats among themselves {floor['ttft_mape']:.1%} / {floor['e2el_mape']:.1%})"
                if None not in (floor.get("ttft_mape"), floor.get("e2el_mape")) else "")
        parts.append(f"per-request MAPE TTFT {rq['ttft_mape']:.1%} E2EL {rq['e2el_mape']:.1%}{real}")
    spread = err.get("real_spread")
    if spread:
        inside = sum(v["within_range"] for v in spread.values())
        parts.append(f"{inside} of {len(spread)} figures within the real repeats' range")
        loose = unresolved(spread)
        if loose:
            parts.append("the repeats do not pin the error to its bound (2 standard errors of the real and sim "
                         "means) for " + ", ".join(
                             f"{figure_name(k)} (+/-{2 * v['error_sem']:.0%}; {v['repeats_for_bound']} repeats would)"
                             for k, v in loose.items()))
    sens = (err.get("sensitivity") or {}).get("elasticity")
    if sens:
        step = err["sensitivity"]["step_time_change"]
        moved = ", ".join(f"{k.replace('_ms', '').replace('.', ' ').replace('output_throughput', 'throughput')} "
                          f"{pct(v * step)}" for k, v in sens.items() if k in ("output_throughput", "ttft_ms.p50",
                                                                              "tpot_ms.p50", "e2el_ms.p50"))
        parts.append(f"{step:.0%} slower steps move {moved}")
    sm = err.get("speed_matched")
    if sm:
        d2 = sm["dist"]
        speed = "/".join("n/a" if sm.get(k) is None else f"{sm[k]:.3f}x" for k in ("scale_small", "scale_large"))
        parts.append(f"at the twin's own speed ({speed} the profile, small/large steps): throughput "
                     f"{pct(d2['output_throughput'])}, TTFT p50 {pct(d2['ttft_ms']['p50'])}, TPOT p50 "
                     f"{pct(d2['tpot_ms']['p50'])}, E2EL p50 {pct(d2['e2el_ms']['p50'])}")
    if st.get("n_steps"):
        nf = st.get("noise_floor")
        shape = st.get("shape_median_mape")
        at_speed = ((err.get("speed_matched") or {}).get("step") or {}).get("shape_median_mape")
        parts.append(f"steps: MAPE {st['mape']:.1%}, per-shape medians {'n/a' if shape is None else f'{shape:.1%}'}"
                     + (f" ({at_speed:.1%} at the twin's own speed)" if at_speed is not None else "")
                     + (f" (noise floor {nf:.1%})" if nf is not None else "")
                     + (f" (against one real repeat: the cost model {st['shape_median_mape_per_repeat']:.1%}, "
                        f"the other repeats {st['repeat_shape_median_mape']:.1%})"
                        if None not in (st.get("repeat_shape_median_mape"), st.get("shape_median_mape_per_repeat"))
                        else ""))
    return "; ".join(parts)


__all__ = ["FIGURE_BOUNDS", "FORMULAS", "SENSITIVITY_STEP", "dist_errors", "figure", "sensitivity", "real_spread", "repeat_shape_errors", "request_errors", "shape_key", "sim_error", "speed_matched_errors", "step_errors", "twin_speed",
           "summary_line", "unresolved", "figure_name"]
