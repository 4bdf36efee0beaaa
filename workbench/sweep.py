"""Run a scenario over the Cartesian grid of overrides (``workbench sweep``).

``--set trace.request_rate=0.5,1,2 --set engines.paged.max_num_seqs=8,16`` gives 3 x 2 = 6 points. Each
point is one ``workbench run`` of the scenario with that point's overrides, in its own folder
(``p000/``, ``p001/``...). Values parse as YAML, so ``--set trace.synthetic.input_range=[8,60],[16,120]``
sweeps lists. One pseudo-axis: ``engine=NAME1,NAME2`` runs only that engine at each point, and
overrides of the other engines (``engines.OTHER.*``) are dropped there, so the points that then coincide
are run once: ``--set engine=sim-paged,paged --set trace.request_rate=1,2,4
--set engines.sim-paged.block_size=8,16,32,64`` is 12 simulator points and 3 real ones.

Launched servers (a ``kind: openai`` engine's ``launch:`` block): the real points share one server at a time
(``workbench.launch.keep_servers``), so a server is started once for consecutive points that need the same
command; put ``engine=...`` first among the axes to run each engine's points one after another.

Scheduling: a point is *real* if any of its engines is not a sim engine (kind paged, static or openai). Real points
never run concurrently with each other or with anything else on one machine (they would disturb each
other's wall-clock timings): the local executor runs the simulator points in ``--jobs`` worker processes
first, then the real points one by one in the parent process; the Ray executor gives each real point a
whole node's CPUs and each simulator point one CPU.

Outputs in the sweep folder: ``sweep.csv`` (one row per point x engine: the point's override values,
the engine's block_size / max_num_seqs / offered request rate / closed-loop users (``trace.max_concurrency``),
and its summary metrics), ``sweep.json`` (axes and points), ``sweep.png`` and ``sweep_report.html``
(self-contained; see :mod:`workbench.sweep_report`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from workbench.results import metric_value
from workbench.scenario import Scenario, ScenarioError, load_scenario

ENGINE_AXIS = "engine"
METRIC_COLUMNS = {
    "output_throughput": "output_throughput", "request_throughput": "request_throughput",
    "total_token_throughput": "total_token_throughput", "goodput": "goodput",
    "ttft_ms_p50": "ttft_ms.p50", "ttft_ms_p99": "ttft_ms.p99", "tpot_ms_p50": "tpot_ms.p50",
    "tpot_ms_p99": "tpot_ms.p99", "itl_ms_p50": "itl_ms.p50", "itl_ms_p99": "itl_ms.p99", "e2el_ms_p50": "e2el_ms.p50",
    "e2el_ms_p99": "e2el_ms.p99", "kv_waste_frac": "kv_waste_frac", "kv_usage_mean": "kv_usage_mean",
    "num_preemptions": "num_preemptions", "num_finished": "num_finished", "num_rejected": "num_rejected",
    "num_failed": "num_failed", "duration_s": "duration_s",
}


@dataclass
class Point:
    """One grid point: its id (folder name), overrides, the engine it is limited to, and whether it is real."""

    id: str
    overrides: dict[str, Any]
    engine: str | None = None
    real: bool = False
    engines: list[str] = field(default_factory=list)


def parse_axes(items: list[str]) -> list[tuple[str, list]]:
    """``["a.b=1,2", "c=x,y"]`` -> ``[("a.b", [1, 2]), ("c", ["x", "y"])]``; values parse as a YAML list.

    Raises:
        ScenarioError: an item without ``=``, a repeated key, or values that are not valid YAML.
    """
    axes: list[tuple[str, list]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not raw.strip():
            raise ScenarioError(f"--set {item!r}: expected KEY=V1,V2,..., e.g. trace.request_rate=0.5,1,2")
        if any(k == key for k, _ in axes):
            raise ScenarioError(f"--set {key}: given twice; list all its values in one --set")
        try:
            values = yaml.safe_load(f"[{raw}]")
        except yaml.YAMLError:
            raise ScenarioError(f"--set {item!r}: values are not a valid YAML list") from None
        if any(v is None for v in values):
            raise ScenarioError(f"--set {item!r}: an empty value (two commas in a row?)")
        axes.append((key, values))
    return axes


def _engine_of(key: str) -> str | None:
    parts = key.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "engines" else None


def expand_grid(axes: list[tuple[str, list]]) -> list[tuple[dict[str, Any], str | None]]:
    """The Cartesian product of the axes as ``(overrides, engine)`` pairs, in order, duplicates removed.

    With the ``engine`` axis a point keeps only its engine's ``engines.<name>.*`` overrides.
    """
    keys = [k for k, _ in axes]
    seen, out = set(), []
    for combo in itertools.product(*[v for _, v in axes]):
        ov = dict(zip(keys, combo))
        engine = ov.pop(ENGINE_AXIS, None)
        if engine is not None:
            engine = str(engine)
            ov = {k: v for k, v in ov.items() if _engine_of(k) in (None, engine)}
        sig = json.dumps([engine, sorted(ov.items())], sort_keys=True, default=str)
        if sig not in seen:
            seen.add(sig)
            out.append((ov, engine))
    return out


def point_scenario(scenario_path: str | Path, overrides: dict[str, Any], engine: str | None) -> Scenario:
    """The scenario of one point: overrides applied, then only ``engine`` kept (when given).

    Raises:
        ScenarioError: a bad override, or no engine of that name.
    """
    sc = load_scenario(scenario_path, overrides=overrides or None)
    if engine is None:
        return sc
    try:
        spec = sc.engine(engine)
    except KeyError as e:
        raise ScenarioError(f"{scenario_path}: engine axis: {e.args[0]}") from None
    return sc.model_copy(update={"engines": [spec]})


def plan(scenario_path: str | Path, items: list[str]) -> tuple[list[tuple[str, list]], list[Point]]:
    """Parse the axes and validate every point's scenario (before anything runs).

    Raises:
        ScenarioError: naming the point's overrides when one is invalid.
    """
    axes = parse_axes(items)
    points = []
    for i, (ov, engine) in enumerate(expand_grid(axes)):
        try:
            sc = point_scenario(scenario_path, ov, engine)
        except ScenarioError as e:
            where = ", ".join(f"{k}={v}" for k, v in ov.items()) + (f", engine={engine}" if engine else "")
            raise ScenarioError(f"sweep point {where}: {e}") from None
        points.append(Point(f"p{i:03d}", ov, engine, any(e.kind != "sim" for e in sc.engines),
                            [e.name for e in sc.engines]))
    return axes, points


def offered_rate(results: dict, out_dir: Path) -> float:
    """The offered request rate of a run (req/s): ``trace.request_rate``, else the synthetic rate, else the
    replayed arrivals' (count - 1) / span read from the first engine's requests.csv (NaN if unknown; also
    with closed-loop users, ``trace.max_concurrency``, whose arrivals are send times that follow the
    engine, not the offered schedule)."""
    tr = results.get("scenario", {}).get("trace", {})
    if tr.get("request_rate") is not None:
        return float(tr["request_rate"])
    if (tr.get("synthetic") or {}).get("request_rate") is not None:
        return float(tr["synthetic"]["request_rate"])
    if tr.get("max_concurrency") is not None:
        return math.nan
    import pandas as pd

    for name in results.get("engines", {}):
        f = out_dir / name / "requests.csv"
        if f.is_file():
            a = pd.read_csv(f)["arrival_s"]
            span = a.max() - a.min()
            return float((len(a) - 1) / span) if span > 0 else math.inf
    return math.nan


def point_rows(point: Point, results: dict, out_dir: Path) -> list[dict]:
    """One sweep.csv row per engine of the point's results."""
    rate = offered_rate(results, out_dir)
    users = results.get("scenario", {}).get("trace", {}).get("max_concurrency")
    rows = []
    for name, e in results["engines"].items():
        cfg, s = e.get("config", {}), e["summary"]
        row = {"point": point.id, **point.overrides}
        if point.engine is not None:
            row[ENGINE_AXIS + "_axis"] = point.engine
        row.update({"engine": name, "kind": e["kind"], "policy": cfg.get("policy") or e["kind"],
                    "block_size": cfg.get("block_size"), "max_num_seqs": cfg.get("max_num_seqs"),
                    "request_rate": rate, "max_concurrency": math.nan if users is None else users})
        row.update({col: metric_value(s, path) for col, path in METRIC_COLUMNS.items()})
        row["dir"] = point.id
        rows.append(row)
    return rows


def run_point(scenario_path: str, overrides: dict, engine: str | None, out_dir: str, threads: int | None,
              plots: bool = True) -> dict:
    """Run one point (in a worker process, a Ray task or the parent); returns its results dict.

    ``threads`` sets torch's intra-op threads (1 for simulator points running side by side; None: the
    ``WORKBENCH_THREADS`` environment variable when set, as ``workbench run``). ``plots=False`` skips the
    point's PNGs and report.html (about a second per point).
    """
    threads = threads or int(os.environ.get("WORKBENCH_THREADS", "0")) or None
    if threads:
        import torch

        torch.set_num_threads(threads)
    from workbench.runner import run_scenario

    sc = point_scenario(scenario_path, overrides, engine)
    return run_scenario(sc, Path(out_dir), plots=plots)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _describe(p: Point) -> str:
    ov = ", ".join(f"{k}={v}" for k, v in p.overrides.items())
    return f"{p.id} [{'real' if p.real else 'sim'}] {ov}{(' engine=' + p.engine) if p.engine else ''}"


def run_local(scenario_path: str, points: list[Point], out: Path, jobs: int, plots: bool = True) -> dict[str, dict]:
    """Simulator points in ``jobs`` spawned worker processes, then real points one at a time here."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    results: dict[str, dict] = {}
    sims = [p for p in points if not p.real]
    reals = [p for p in points if p.real]
    if sims:
        if jobs <= 1 or len(sims) == 1:
            for p in sims:
                results[p.id] = run_point(scenario_path, p.overrides, p.engine, str(out / p.id), 1, plots)
                _log(f"done {_describe(p)}")
        else:
            with ProcessPoolExecutor(max_workers=min(jobs, len(sims)), mp_context=mp.get_context("spawn")) as pool:
                futs = {pool.submit(run_point, scenario_path, p.overrides, p.engine, str(out / p.id), 1, plots): p
                        for p in sims}
                for f in as_completed(futs):
                    p = futs[f]
                    results[p.id] = f.result()
                    _log(f"done {_describe(p)}")
    from workbench.launch import keep_servers

    with keep_servers():  # a launched server stays up while consecutive points need the same one
        for p in reals:  # serially, with nothing else running
            results[p.id] = run_point(scenario_path, p.overrides, p.engine, str(out / p.id), None, plots)
            _log(f"done {_describe(p)}")
    return results


def run_ray(scenario_path: str, points: list[Point], out: Path, jobs: int, address: str | None,
            plots: bool = True) -> dict[str, dict]:
    """The same grid as Ray tasks: one CPU per simulator point, a whole node's CPUs per real point (so a
    real point never shares its node). A local Ray instance with ``jobs`` CPUs when ``address`` is None.

    Results folders are written by the workers (on a cluster without a shared file system only
    ``results.json`` is written back here).

    Raises:
        ImportError: Ray is not installed (``pip install 'llm-serving-workbench[ray]'``).
    """
    import ray

    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
    try:
        node_cpus = [n["Resources"].get("CPU", 1) for n in ray.nodes() if n.get("Alive")]
        whole = max(1, int(min(node_cpus))) if node_cpus else 1
        task = ray.remote(run_point)
        refs = {}
        for p in points:
            opts = {"num_cpus": whole} if p.real else {"num_cpus": 1}
            refs[task.options(**opts).remote(str(Path(scenario_path).resolve()), p.overrides, p.engine,
                                             str((out / p.id).resolve()), None if p.real else 1, plots)] = p
        results: dict[str, dict] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            p = refs[done[0]]
            results[p.id] = ray.get(done[0])
            f = out / p.id / "results.json"
            if not f.exists():
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(json.dumps(results[p.id], indent=2))
            _log(f"done {_describe(p)}")
        return results
    finally:
        if started:
            ray.shutdown()


def calibrate_points(scenario_path: str, points: list[Point]) -> None:
    """Measure (or find cached) this machine's profile of every ``cost_model: auto`` sim engine the points run,
    here, before the points fan out to single-threaded workers; the workers find it by fingerprint, which names
    the thread count the real engines run with (``WORKBENCH_PROFILE_THREADS``, which :func:`run_sweep` sets for
    them)."""
    from workbench.calibration import ensure_profile
    from workbench.scenario import AUTO

    done = set()
    for p in points:
        sc = point_scenario(scenario_path, p.overrides, p.engine)
        for spec in sc.engines:
            if spec.kind == "sim" and spec.cost_model == AUTO and (sc.model, spec.dtype) not in done:
                from engines.real.model_store import resolve_model

                ensure_profile(sc.model, resolve_model(sc.model), spec.dtype, echo=_log)
                done.add((sc.model, spec.dtype))


def run_sweep(scenario_path: str | Path, items: list[str], out: Path, jobs: int = 0, executor: str = "local",
              ray_address: str | None = None, point_reports: bool = True) -> "Any":
    """Plan, run every point, write sweep.csv / sweep.json / sweep.png / sweep_report.html into ``out``.

    Returns the sweep DataFrame (one row per point x engine).

    Raises:
        ScenarioError: a bad axis or point; ValueError: a bad executor.
    """
    import pandas as pd

    from workbench.sweep_report import write_sweep_report

    if executor not in ("local", "ray"):
        raise ValueError(f"--executor must be local or ray, got {executor!r}")
    axes, points = plan(scenario_path, items)
    jobs = jobs or os.cpu_count() or 1
    out.mkdir(parents=True, exist_ok=True)
    n_real = sum(p.real for p in points)
    _log(f"sweep: {len(points)} points ({len(points) - n_real} simulator, {n_real} real) -> {out}")
    t0 = time.perf_counter()
    import torch

    before = os.environ.get("WORKBENCH_PROFILE_THREADS")
    os.environ["WORKBENCH_PROFILE_THREADS"] = before or str(torch.get_num_threads())
    try:
        calibrate_points(str(scenario_path), points)
        if executor == "ray":
            results = run_ray(str(scenario_path), points, out, jobs, ray_address, point_reports)
        else:
            results = run_local(str(scenario_path), points, out, jobs, point_reports)
    finally:
        if before is None:
            os.environ.pop("WORKBENCH_PROFILE_THREADS", None)
    rows = [r for p in points for r in point_rows(p, results[p.id], out / p.id)]
    df = pd.DataFrame(rows)
    df.to_csv(out / "sweep.csv", index=False)
    meta = {"scenario": str(scenario_path), "axes": [[k, v] for k, v in axes], "executor": executor, "jobs": jobs,
            "wall_s": time.perf_counter() - t0, "points": [asdict(p) for p in points]}
    (out / "sweep.json").write_text(json.dumps(meta, indent=2, default=str))
    name = next(iter(results.values()))["scenario"]["name"] if results else Path(scenario_path).stem
    write_sweep_report(df, [k for k, _ in axes], out, title=f"Sweep of {name}")
    return df


__all__ = ["ENGINE_AXIS", "Point", "calibrate_points", "expand_grid", "offered_rate", "parse_axes", "plan", "point_rows",
           "point_scenario", "run_local", "run_point", "run_ray", "run_sweep"]
