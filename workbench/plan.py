"""Capacity planning (``workbench plan``): for each hardware x tensor-parallel choice, the fewest replicas
that meet a latency SLO on a scenario's trace, found with the cluster simulator.

Each replica is the scenario's analytic sim engine (its knobs kept) with ``hardware``, ``tp`` (and
optionally ``model``) replaced; a replica uses ``tp`` GPUs. A choice whose weights do not fit its GPUs
(``engines.sim.catalog.memory_plan``, as the factory checks it) is reported infeasible with the reason.

The SLO holds at N replicas when every ``METRIC=LIMIT`` (a dotted summary metric such as ``ttft_ms.p99``,
as ``vllm bench serve`` names them, in its unit) is at most its limit over the whole trace, no request was
rejected or failed, and some request finished.

Search: N = 1, 2, 4, ... doubling (the last try capped at ``max_replicas``) until the SLO holds, then
bisection between the last failing and the first passing N. It assumes more replicas never break an SLO
that fewer met, which a load-balancing router makes likely but does not guarantee on a finite trace; every
N tried is kept in the output.

Choices run in parallel: ``workers`` local processes, or Ray tasks (one CPU each).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from engines.factory import EngineConfig

DEFAULT_MAX_REPLICAS = 64
SHOWN = ("ttft_ms.p99", "tpot_ms.p99", "itl_ms.p99", "e2el_ms.p99", "output_throughput", "goodput",
         "prefix_cache_hit_rate", "kv_usage_mean", "num_finished", "num_rejected")


@dataclass
class PlanTask:
    """One hardware x tp choice to size: the template engine, the trace and the SLO (plain data, picklable).

    Attributes:
        hardware, tp: the catalogue GPU and tensor-parallel degree of every replica.
        engine: the template ``EngineConfig`` (analytic sim); ``hardware``/``tp`` replace its own.
        trace: ``TraceRequest`` list (arrival seconds, token ids, output tokens).
        eos: end-of-sequence token ids (ignored by trace replays, which run to each request's length).
        slo: ``{dotted metric: limit}``.
        router, max_imbalance: the cluster's router and prefix_aware's load bound (requests).
        max_replicas: the largest N tried.
        max_concurrency: closed-loop users (None: open loop).
    """

    hardware: str
    tp: int
    engine: EngineConfig
    trace: list
    eos: object
    slo: dict[str, float]
    router: str
    max_imbalance: int
    max_replicas: int
    max_concurrency: int | None = None


@dataclass
class PlanPoint:
    """The cluster at ``replicas`` replicas: whether the SLO held, what broke it, the :data:`SHOWN` metrics."""

    replicas: int
    ok: bool
    violations: list[str]
    metrics: dict[str, float | None]


@dataclass
class PlanResult:
    """One choice's answer: ``replicas`` (None: infeasible, or not met up to ``max_replicas``), ``gpus`` =
    replicas x tp, the metrics at that size, why it is infeasible, and every N tried."""

    hardware: str
    tp: int
    feasible: bool
    replicas: int | None = None
    gpus: int | None = None
    metrics: dict[str, float | None] = field(default_factory=dict)
    reason: str = ""
    points: list[PlanPoint] = field(default_factory=list)


def parse_slo(items: list[str]) -> dict[str, float]:
    """``["ttft_ms.p99=2000", ...]`` -> ``{"ttft_ms.p99": 2000.0}``.

    Raises:
        ValueError: an item without ``=``, a limit that is not a positive number, or a metric given twice.
    """
    out: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        try:
            limit = float(raw)
        except ValueError:
            limit = math.nan
        if not sep or not key or not (limit > 0 and math.isfinite(limit)):
            raise ValueError(f"--slo {item!r}: expected METRIC=LIMIT with a limit > 0, e.g. ttft_ms.p99=2000")
        if key in out:
            raise ValueError(f"--slo {key}: given twice")
        out[key] = limit
    return out


def evaluate(summary: dict, slo: dict[str, float], replicas: int) -> PlanPoint:
    """A :class:`PlanPoint` from a cluster-wide summary (a metric no request defines meets its limit)."""
    from workbench.results import metric_value

    bad = []
    for metric, limit in slo.items():
        v = metric_value(summary, metric)
        if v is not None and v > limit:
            bad.append(f"{metric} {v:.4g} > {limit:g}")
    for what in ("num_rejected", "num_failed"):
        if summary.get(what):
            bad.append(f"{summary[what]} requests {what.removeprefix('num_')}")
    if not summary.get("num_finished"):
        bad.append("no request finished")
    return PlanPoint(replicas, not bad, bad, {m: metric_value(summary, m) for m in SHOWN})


def min_replicas(probe: Callable[[int], PlanPoint], max_replicas: int) -> tuple[PlanPoint | None, list[PlanPoint]]:
    """The fewest replicas whose probe passes (doubling, then bisection; see the module docstring): the
    passing point (None: none up to ``max_replicas``) and every point tried, in order.

    Raises:
        ValueError: ``max_replicas`` < 1.
    """
    if max_replicas < 1:
        raise ValueError(f"--max-replicas must be >= 1, got {max_replicas}")
    points: list[PlanPoint] = []

    def run(n: int) -> PlanPoint:
        points.append(probe(n))
        return points[-1]

    fail, ok, n = 0, None, 1
    while ok is None:
        p = run(n)
        if p.ok:
            ok = p
        elif n >= max_replicas:
            return None, points
        else:
            fail, n = n, min(2 * n, max_replicas)
    while ok.replicas - fail > 1:
        p = run((fail + ok.replicas) // 2)
        if p.ok:
            ok = p
        else:
            fail = p.replicas
    return ok, points


def request_limits(slo: dict[str, float]) -> dict[str, float]:
    """The per-request limits behind ``slo`` for goodput (``workbench.metrics``: a request counts when its own
    TTFT, TPOT and E2EL meet them): ``ttft_ms.p99=2000`` -> ``ttft_ms: 2000``; other metrics are left out."""
    return {k.split(".")[0]: v for k, v in slo.items() if k.split(".")[0] in ("ttft_ms", "tpot_ms", "e2el_ms")}


def replica_config(template: EngineConfig, hardware: str, tp: int) -> EngineConfig:
    """``template`` on ``tp`` x ``hardware``."""
    return dataclasses.replace(template, hardware=hardware, tp=tp)


def plan_choice(task: PlanTask) -> PlanResult:
    """Size one hardware x tp choice (runs in a worker process or a Ray task)."""
    from engines.factory import build_engine
    from workbench.cluster import cluster_summary, run_cluster
    from workbench.replay import make_requests

    cfg = replica_config(task.engine, task.hardware, task.tp)
    try:
        build_engine(cfg)  # the factory's memory plan: weights + activation reserve must fit each GPU
    except ValueError as e:  # CatalogError included
        return PlanResult(task.hardware, task.tp, False, reason=str(e))

    per_request = request_limits(task.slo)

    def probe(n: int) -> PlanPoint:
        run = run_cluster([("replica", cfg, n)], task.router, make_requests(task.trace, task.eos),
                          task.max_concurrency, task.max_imbalance)
        summary = cluster_summary(run, ["replica"] * n, len(task.trace), per_request)["summary"]
        return evaluate(summary, task.slo, n)

    best, points = min_replicas(probe, task.max_replicas)
    if best is None:
        return PlanResult(task.hardware, task.tp, True, reason=f"SLO not met with {task.max_replicas} replicas",
                          points=points, metrics=points[-1].metrics)
    return PlanResult(task.hardware, task.tp, True, best.replicas, best.replicas * task.tp, best.metrics,
                      points=points)


def run_plan(tasks: list[PlanTask], workers: int = 1, ray: bool = False,
             on_result: Callable[[PlanResult], None] | None = None) -> list[PlanResult]:
    """Every task's :class:`PlanResult`, in task order: in this process (``workers`` 1), in ``workers``
    spawned processes, or as Ray tasks on a local Ray instance of ``workers`` CPUs (``ray``).

    Raises:
        ImportError: ``ray`` without Ray installed.
    """
    results: dict[int, PlanResult] = {}

    def done(i: int, r: PlanResult) -> None:
        results[i] = r
        if on_result:
            on_result(r)

    if ray:
        _run_ray(tasks, max(1, workers), done)
    elif workers <= 1 or len(tasks) == 1:
        for i, t in enumerate(tasks):
            done(i, plan_choice(t))
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=mp.get_context("spawn")) as pool:
            futs = {pool.submit(plan_choice, t): i for i, t in enumerate(tasks)}
            for f in as_completed(futs):
                done(futs[f], f.result())
    return [results[i] for i in range(len(tasks))]


def _run_ray(tasks: list[PlanTask], cpus: int, done: Callable[[int, PlanResult], None]) -> None:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=1)(plan_choice)
        refs = {remote.remote(t): i for i, t in enumerate(tasks)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            done(refs[ready[0]], ray.get(ready[0]))
    finally:
        if started:
            ray.shutdown()


def result_rows(results: list[PlanResult], slo: dict[str, float]) -> list[dict]:
    """One flat row per choice (for the CSV and the table): hardware, tp, replicas, gpus, the SLO metrics
    and the other :data:`SHOWN` metrics at that size, and the reason when there is no answer."""
    rows = []
    for r in results:
        row = {"hardware": r.hardware, "tp": r.tp, "feasible": r.feasible, "replicas": r.replicas, "gpus": r.gpus}
        for m in list(slo) + [m for m in SHOWN if m not in slo]:
            row[m] = r.metrics.get(m) if r.replicas is not None else None
        row["tried"] = " ".join(f"{p.replicas}{'+' if p.ok else '-'}" for p in r.points)
        row["reason"] = r.reason
        rows.append(row)
    return rows


__all__ = ["PlanPoint", "PlanResult", "PlanTask", "evaluate", "min_replicas", "parse_slo", "plan_choice",
           "replica_config", "result_rows", "run_plan"]
