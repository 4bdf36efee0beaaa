"""A scenario's ``cluster:`` what-if: its sim engines replicated behind each router, the trace replayed on the
cluster simulator (``engines.sim.cluster``), and the cluster-wide and per-replica figures for results.json.

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


def run_cluster(configs: list[tuple[str, EngineConfig, int]], router: str, requests, max_concurrency: int | None,
                max_imbalance: int) -> ClusterRun:
    """Replay ``requests`` (engine ``Request``s) on fresh replicas behind a fresh ``router``."""
    replicas, _ = build_replicas(configs)
    return simulate_cluster(replicas, make_router(router, max_imbalance), requests, max_concurrency)


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
                         echo: Callable[[str], None] | None = None) -> dict:
    """Run ``scenario.cluster`` once per router on fresh replicas of ``configs`` (``(engine name,
    EngineConfig, count)`` of each replica group, ``workbench.runner.cluster_configs``); write
    ``cluster-<router>/requests.csv`` (with the replica of each request) under ``out_dir``; returns
    results.json's ``cluster`` section."""
    from workbench.replay import make_requests
    from workbench.report import requests_frame

    cl = scenario.cluster
    slo = scenario.slo.model_dump() if scenario.slo else None
    from workbench.traces.prefix import ideal_prefix_hit_rate

    # what one shared cache of unlimited size would hit (the bound no router can beat), at the first group's blocks
    ideal = ideal_prefix_hit_rate([t.prompt_token_ids for t in trace], configs[0][1].block_size)["hit_rate"]
    section = {"replicas": [r.model_dump() for r in cl.replicas], "num_replicas": cl.num_replicas,
               "max_imbalance": cl.max_imbalance, "prefix_cache_ideal_hit_rate": ideal, "routers": {}}
    for router in cl.router_names:
        run = run_cluster(configs, router, make_requests(trace, eos), scenario.trace.max_concurrency,
                          cl.max_imbalance)
        names = [n for n, _, c in configs for _ in range(c)]
        section["routers"][router] = cluster_summary(run, names, len(trace), slo)
        rf = requests_frame(run.outputs)
        rf["replica"] = [run.replica_of[o.request_id] for o in run.outputs]
        d = out_dir / f"cluster-{router}"
        d.mkdir(parents=True, exist_ok=True)
        rf.to_csv(d / "requests.csv", index=False)
        if echo:
            s = section["routers"][router]["summary"]
            p99 = s["ttft_ms"]["p99"]
            echo(f"cluster {router}: {cl.num_replicas} replicas, prefix-cache hit rate "
                 f"{s['prefix_cache_hit_rate']:.1%}, TTFT p99 " + ("n/a" if p99 is None else f"{p99:.1f} ms"))
    return section
