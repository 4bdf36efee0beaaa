"""The noise floor of the step-level fidelity: a run's step shapes timed again on the real executor. A
benchmark, not a test.

    python benchmarks/step_replay.py RUN_DIR [--engine paged] [--repeats 9] [--json out.json]
    python benchmarks/step_replay.py --table out1.json out2.json ...   # a markdown table of earlier replays

``RUN_DIR`` is a ``workbench run`` output folder (``results.json``, ``<engine>/steps.csv`` and, with ``--repeat``,
``<engine>/repeat-N/steps.csv``) whose real ``--engine`` has a sim twin with a measured profile. The run's steps are
grouped as ``sim_error.step`` groups them (``workbench.fidelity.shape_key``: kind x rows x tokens x context per
row x cached context per prefill token, power-of-2 buckets); for each shape seen at least
``workbench.fidelity.MIN_SHAPE_STEPS`` times, its median-time step is rebuilt as a grid step
(``engines.sim.profiler.grid_step_of``) and timed ``--repeats`` times on the real executor (steps under 0.15 s:
at least ``CHEAP_REPEATS``), in shuffled passes with the pilot probes between them, each timing divided by the machine's
speed at its time, exactly as ``workbench profile`` times its grid (``engines.sim.profiler.profile_rows``), with
the run's thread count and model. Per shape, executor seconds only (the engine's own overhead, about 0.1 ms a
step, is left out on every side):

* ``run``: the median over the run's steps of that shape (every repeat pooled, as ``shape_median_mape``);
* ``replay``: the replayed step's median;
* ``model``: the sim twin's cost model (its profile as measured, no drift factor) on the replayed step.

It prints, over the shapes, the MAPE of replay vs run (the noise floor of the same steps on the real executor at
another time), of model vs run (``sim_error.step``'s figure, executor only) and of model vs replay (the cost
model against shapes pinned by many timings), each also after dividing out its level (the geometric mean ratio
over the shapes: the machine's speed then against now, which a drift factor is there to take out), and the same
by step kind. The replayed step keeps the recorded sums, so chunks of unequal length come back with less prefill
attention than they had (``grid_step_of``); ``moved`` counts shapes whose replayed step falls in another bucket.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def read_steps(path: Path) -> list:
    """``StepRecord``s of a run's ``steps.csv`` (the columns are the record's fields)."""
    from engines.core.llm_engine import StepRecord

    out = []
    with path.open() as f:
        for row in csv.DictReader(f):
            kw = {k: (float(v) if "." in v or "e" in v.lower() else int(v)) for k, v in row.items() if v != ""}
            out.append(StepRecord(**kw))
    return out


def twin_profile(results: dict, engine: str) -> tuple[str, dict]:
    """The sim engine whose real twin is ``engine`` and its profile (``results.json`` ``engines[sim].profile``).

    Raises:
        SystemExit: no sim engine with a measured profile has ``engine`` as its twin (one line).
    """
    for name, e in results["engines"].items():
        err = e.get("summary", {}).get("sim_error") or {}
        if e.get("kind") == "sim" and e.get("profile") and err.get("real_engine") == engine:
            return name, e["profile"]
    sys.exit(f"step_replay: no sim engine with a measured profile is the twin of {engine!r} in this run")


def mape(pairs: list[tuple[float, float]], level: float = 1.0) -> float | None:
    """Mean of |a / level - b| / b over ``(a, b)`` pairs (None for none)."""
    return statistics.fmean(abs(a / level - b) / b for a, b in pairs) if pairs else None


def level_of(pairs: list[tuple[float, float]]) -> float:
    """Geometric mean of a / b over ``(a, b)`` pairs."""
    return math.exp(statistics.fmean(math.log(a / b) for a, b in pairs))


def compare(rows: list[dict], a: str, b: str) -> dict:
    """MAPE of ``a`` against ``b`` over ``rows``: as they are, their level (geometric mean ratio) and after
    dividing it out; also by step kind (as they are)."""
    pairs = [(r[a], r[b]) for r in rows]
    lv = level_of(pairs)
    kinds = sorted({r["kind"] for r in rows})
    return {"mape": mape(pairs), "level": lv, "mape_level_matched": mape(pairs, lv),
            "by_kind": {k: mape([(r[a], r[b]) for r in rows if r["kind"] == k]) for k in kinds}}


def table(paths: list[Path]) -> str:
    """A markdown table, one row per replay (``--json`` files): MAPEs as they are and level matched, levels."""
    head = ("| run | engine | shapes | replay vs run | model vs run | model vs replay | level replay/run | "
            "level model/replay |\n|---|---|---|---|---|---|---|---|")
    out = [head]
    for p in paths:
        s = json.loads(p.read_text())["summary"]
        c = [s[n] for n in ("replay_vs_run", "model_vs_run", "model_vs_replay")]
        out.append(f"| {Path(s['run_dir']).name}, {s['threads']} | {s['engine']} | {s['n_shapes']} | "
                   + " | ".join(f"{x['mape']:.1%} ({x['mape_level_matched']:.1%})" for x in c)
                   + f" | {c[0]['level']:.3f} | {c[2]['level']:.3f} |")
    return "\n".join(out)


def run_shapes(run_dir: Path, engine: str) -> dict[tuple, list]:
    """The real ``engine``'s steps of ``run_dir`` (every repeat) that computed something, by shape key, each
    shape's steps sorted by duration; only shapes seen at least ``MIN_SHAPE_STEPS`` times."""
    from workbench.fidelity import MIN_SHAPE_STEPS, shape_key

    edir = run_dir / engine
    groups: dict[tuple, list] = {}
    for f in [edir / "steps.csv"] + sorted(edir.glob("repeat-*/steps.csv")):
        for s in read_steps(f):
            if s.num_seqs and s.duration > 0:
                groups.setdefault(shape_key(s.shape), []).append(s)
    return {k: sorted(v, key=lambda s: s.duration) for k, v in groups.items() if len(v) >= MIN_SHAPE_STEPS}


def replay(shapes: dict[tuple, list], fp: dict, cm, repeats: int) -> tuple[list[dict], float]:
    """Time each shape's median-time step again on a real executor of the profile's fingerprint ``fp`` (model,
    dtype, attention, weight dtype, threads), as ``profile_rows`` times a grid; returns one row per shape (run,
    replay and cost-model executor seconds) and the seconds the timing took."""
    import torch

    from engines.core.step_shape import StepShape
    from engines.real.model_store import resolve_model
    from engines.sim.cost_model import shape_features
    from engines.sim.profiler import CHEAP_REPEATS, PilotProbe, grid_batch, grid_step_of, profile_rows
    from workbench.calibration import profile_executor
    from workbench.fidelity import shape_key

    torch.set_num_threads(fp["threads"])
    ex = profile_executor(resolve_model(fp["model"]), fp)
    keys = list(shapes)
    reps = [shapes[k][(len(shapes[k]) - 1) // 2].shape for k in keys]
    grid = [grid_step_of(r) for r in reps]
    t0 = time.perf_counter()
    timed = profile_rows(ex, grid, repeats, cheap_repeats=max(CHEAP_REPEATS, repeats), pilot=PilotProbe(ex))
    took = time.perf_counter() - t0
    rows = []
    for k, rep, g, (f, seconds, cv) in zip(keys, reps, grid, timed):
        replay_shape = StepShape.of(grid_batch(g, ex.kv.block_size, ex.kv.num_blocks).seqs)
        rows.append({"kind": k[0], "shape": list(k), "n_run_steps": len(shapes[k]),
                     "rows": rep.decode_rows + rep.padding_rows, "tokens": rep.tokens,
                     "run": statistics.median(s.duration for s in shapes[k]), "replay": seconds,
                     "replay_spread": cv, "model": cm.predict_exec(shape_features(replay_shape)),
                     "moved": shape_key(replay_shape) != k,
                     "features": {n: v for n, v in f.items() if v and n != "const"}})
    return rows, took


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--table":
        print(table([Path(a) for a in sys.argv[2:]]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--engine", default="paged", help="the real engine whose steps to replay")
    ap.add_argument("--repeats", type=int, default=9, help="timed passes over the shapes")
    ap.add_argument("--json", type=Path, help="write the per-shape table and the summary here")
    args = ap.parse_args()

    from engines.sim.cost_model import CostModel
    from workbench.fidelity import MIN_SHAPE_STEPS

    results = json.loads((args.run_dir / "results.json").read_text())
    sim, prof = twin_profile(results, args.engine)
    fp = prof["fingerprint"]
    rows, took = replay(run_shapes(args.run_dir, args.engine), fp, CostModel.load(prof["path"]), args.repeats)
    summary = {"run_dir": str(args.run_dir), "engine": args.engine, "sim_engine": sim, "profile": prof["path"],
               "cpu": fp["cpu"], "cpu_capability": fp["cpu_capability"], "threads": fp["threads"],
               "n_shapes": len(rows), "moved": sum(r["moved"] for r in rows), "repeats": args.repeats,
               "seconds": took, "replay_vs_run": compare(rows, "replay", "run"),
               "model_vs_run": compare(rows, "model", "run"), "model_vs_replay": compare(rows, "model", "replay")}
    print(f"{args.run_dir} {args.engine} (twin {sim}): {len(rows)} shapes seen at least {MIN_SHAPE_STEPS} times "
          f"({summary['moved']} replayed in another bucket), {args.repeats} passes, {took:.0f} s, "
          f"{fp['cpu']} ({fp['cpu_capability']}), {fp['threads']} threads")
    print("per shape, its median-time step's rows and tokens; n: the run's steps of that shape")
    print(f"{'kind':8} {'rows':>4} {'tok':>5} {'n':>4} {'run ms':>8} {'replay ms':>9} {'model ms':>8}")
    for r in sorted(rows, key=lambda r: (r["kind"], r["shape"])):
        print(f"{r['kind']:8} {r['rows']:4d} {r['tokens']:5d} {r['n_run_steps']:4d} {r['run'] * 1e3:8.1f} "
              f"{r['replay'] * 1e3:9.1f} {r['model'] * 1e3:8.1f}{' moved' if r['moved'] else ''}")
    for name in ("replay_vs_run", "model_vs_run", "model_vs_replay"):
        c = summary[name]
        kinds = ", ".join(f"{k} {v:.1%}" for k, v in c["by_kind"].items())
        print(f"{name}: MAPE {c['mape']:.1%}, level {c['level']:.3f}, level matched {c['mape_level_matched']:.1%} "
              f"({kinds})")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "shapes": rows}, indent=2))


if __name__ == "__main__":
    main()
