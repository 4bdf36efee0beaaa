"""A scenario's ``cluster:`` section: its engines replicated behind each router, the trace replayed on the
cluster simulator (``engines.sim.cluster``) for sim replicas or in real time on real paged replicas
(``workbench.real_cluster``, with an optional sim twin cluster), and the cluster-wide and per-replica figures
for results.json.

Cluster-wide figures are ``workbench.metrics.summarize`` over every request of the trace and every replica's
steps (so ``prefix_cache_hit_rate`` = all hits / all queries, in tokens; ``kv_usage_mean`` is weighted by
step durations over all replicas). Per replica, ``summarize`` over the requests it served and its own steps:
its throughputs are over its own first arrival to last answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from engines.core.llm_engine import LLMEngine
from engines.core.router import make_router
from engines.factory import EngineConfig, build_engine
from engines.sim.cluster import ClusterRun, simulate_cluster
from workbench.metrics import summarize

REPLICA_METRICS = ("num_requests", "num_finished", "num_rejected", "num_steps", "prefix_cache_hit_rate",
                   "kv_usage_mean", "request_throughput", "output_throughput", "ttft_ms.p99", "tpot_ms.p99",
                   "e2el_ms.p99")


def build_replicas(configs: list[tuple[str, EngineConfig, int]]) -> tuple[list[LLMEngine], list[str]]:
    """``count`` fresh engines of each ``(engine name, config, count)``; returns the engines and each one's
    engine name.

    Raises:
        ValueError, CatalogError: as ``engines.factory.build_engine`` (e.g. the weights do not fit).
    """
    engines, names = [], []
    for name, cfg, count in configs:
        for _ in range(count):
            engines.append(build_engine(cfg))
            names.append(name)
    return engines, names


def is_real(configs: list[tuple[str, EngineConfig, int]]) -> bool:
    """Whether the replica groups are real engines (kind paged or static) rather than simulated ones."""
    return configs[0][1].kind != "sim"


def run_cluster(configs: list[tuple[str, EngineConfig, int]], router: str, requests, max_concurrency: int | None,
                max_imbalance: int) -> ClusterRun:
    """Replay ``requests`` (engine ``Request``s) on fresh replicas behind a fresh ``router``: on the cluster
    simulator for sim replicas; in real time (each replica warmed up first, one thread and one torch thread
    each, ``workbench.real_cluster``) for real ones.

    Raises:
        ValueError: as ``build_engine``; ``max_concurrency`` set on real replicas.
    """
    replicas, _ = build_replicas(configs)
    if not is_real(configs):
        return simulate_cluster(replicas, make_router(router, max_imbalance), requests, max_concurrency)
    from workbench.real_cluster import replay_cluster_realtime
    from workbench.replay import warm_up

    for r in replicas:
        warm_up(r)
    return replay_cluster_realtime(replicas, make_router(router, max_imbalance), requests, max_concurrency)


def cluster_summary(run: ClusterRun, names: list[str], num_requests: int, slo: dict | None) -> dict:
    """``{"summary": cluster-wide summary, "replicas": [per-replica summary + engine name, ...]}``.

    Raises:
        ValueError: the finished, rejected and failed counts do not add up to ``num_requests``.
    """
    steps = [s for r in run.replicas for s in r.steps]
    per = []
    for i, (eng, name) in enumerate(zip(run.replicas, names)):
        outs = run.outputs_of(i)
        s = summarize(outs, eng.steps, len(outs), slo)
        per.append({"replica": i, "engine": name, "summary": s})
    return {"summary": summarize(run.outputs, steps, num_requests, slo), "replicas": per}


def run_scenario_cluster(scenario, configs: list[tuple[str, EngineConfig, int]], trace, eos, out_dir: Path,
                         echo: Callable[[str], None] | None = None,
                         twin_configs: list[tuple[str, EngineConfig, int]] | None = None) -> dict:
    """Run ``scenario.cluster`` once per router on fresh replicas of ``configs`` (``(engine name,
    EngineConfig, count)`` of each replica group, ``workbench.runner.cluster_configs``); write
    ``cluster-<router>/requests.csv`` (with the replica of each request) under ``out_dir``; returns
    results.json's ``cluster`` section (``real``: whether the replicas were real engines).

    A real cluster's router result also holds ``parallel_speedup``: the cores its replicas' threads got just
    before it ran (``workbench.real_cluster.parallel_speedup``; about the replica count when each has a core).

    ``twin_configs``: a real cluster's sim twin (same replica count), run behind each router too:
    ``cluster.twin.routers.<router>`` and ``cluster-twin-<router>/requests.csv``, and ``cluster.twin.error``:
    per router, sim minus real prefix-cache hit rate (points) and sim / real TTFT p99 and output throughput."""
    cl = scenario.cluster
    slo = scenario.slo.model_dump() if scenario.slo else None
    from workbench.traces.prefix import ideal_prefix_hit_rate

    # what one shared cache of unlimited size would hit (the bound no router can beat), at the first group's blocks
    ideal = ideal_prefix_hit_rate([t.prompt_token_ids for t in trace], configs[0][1].block_size)["hit_rate"]
    section = {"replicas": [r.model_dump() for r in cl.replicas], "num_replicas": cl.num_replicas,
               "max_imbalance": cl.max_imbalance, "prefix_cache_ideal_hit_rate": ideal, "real": is_real(configs),
               "routers": {}}
    if twin_configs:
        section["twin"] = {"engine": twin_configs[0][0], "routers": {}, "error": {}}
    for router in cl.router_names:
        label = "real cluster" if section["real"] else "cluster"
        section["routers"][router] = _run_one(scenario, configs, router, trace, eos, slo,
                                              out_dir / f"cluster-{router}", echo, label)
        if twin_configs:
            twin = section["twin"]["routers"][router] = _run_one(
                scenario, twin_configs, router, trace, eos, slo, out_dir / f"cluster-twin-{router}", echo,
                "sim twin")
            section["twin"]["error"][router] = twin_error(twin["summary"], section["routers"][router]["summary"])
    return section


def _run_one(scenario, configs, router: str, trace, eos, slo: dict | None, out: Path,
             echo: Callable[[str], None] | None, label: str) -> dict:
    """One router's cluster run: its summaries, and its requests.csv in ``out``."""
    from workbench.replay import make_requests
    from workbench.report import requests_frame

    names = [n for n, _, c in configs for _ in range(c)]
    speedup = None
    if is_real(configs):  # whether the replicas get a core each right now (other work may share the cores)
        from workbench.real_cluster import parallel_speedup

        speedup = parallel_speedup(len(names))
    run = run_cluster(configs, router, make_requests(trace, eos), scenario.trace.max_concurrency,
                      scenario.cluster.max_imbalance)
    result = cluster_summary(run, names, len(trace), slo)
    if speedup is not None:
        result["parallel_speedup"] = speedup
    rf = requests_frame(run.outputs)
    rf["replica"] = [run.replica_of[o.request_id] for o in run.outputs]
    out.mkdir(parents=True, exist_ok=True)
    rf.to_csv(out / "requests.csv", index=False)
    if echo:
        s = result["summary"]
        p99 = s["ttft_ms"]["p99"]
        echo(f"{label} {router}: {len(names)} replicas, prefix-cache hit rate "
             f"{s['prefix_cache_hit_rate']:.1%}, TTFT p99 " + ("n/a" if p99 is None else f"{p99:.1f} ms")
             + ("" if speedup is None else f" (threads' parallel speed-up before the run {speedup:.2f}x)"))
    return result


def twin_error(sim: dict, real: dict) -> dict:
    """How the sim twin's cluster-wide summary differs from the real cluster's: ``prefix_cache_hit_rate_points``
    = 100 x (sim - real) hit rate; ``ttft_p99_ratio`` and ``output_throughput_ratio`` = sim / real (None where
    a figure is missing or the real one is 0)."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    hs, hr = sim.get("prefix_cache_hit_rate"), real.get("prefix_cache_hit_rate")
    return {"prefix_cache_hit_rate_points": None if hs is None or hr is None else 100.0 * (hs - hr),
            "ttft_p99_ratio": ratio(sim["ttft_ms"]["p99"], real["ttft_ms"]["p99"]),
            "output_throughput_ratio": ratio(sim.get("output_throughput"), real.get("output_throughput"))}
