"""The highest request rate at which a scenario's SLO holds on one engine (``workbench capacity``).

The rate is ``trace.request_rate`` (``workbench.traces.apply_transforms``: a recorded trace's arrival
times are rescaled so that its mean rate, (count - 1) / span, is the target; a synthetic trace's arrivals
likewise). The SLO holds at a rate when every limit of the scenario's ``slo`` section (or those chosen
with ``--metric``) holds for the p99 of that metric (TTFT, TPOT, E2EL, as ``vllm bench serve`` defines
them) and no request failed.

Search: bracket by doubling (or halving) from the start rate until one rate passes and the next fails,
then bisect until (fail - pass) / pass <= tolerance. The SLO need not be exactly monotonic in the rate on
a finite trace; the answer is then *a* rate that passes with a failing rate just above it, both printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from workbench.results import metric_value
from workbench.scenario import Scenario, ScenarioError

SLO_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}
SHOWN = ["output_throughput", "request_throughput", "goodput", "ttft_ms.p99", "tpot_ms.p99", "e2el_ms.p99",
         "num_finished", "num_rejected", "num_preemptions"]


@dataclass
class Probe:
    """One run at ``rate`` req/s: whether the SLO held, the violated limits, and the main metrics."""

    rate: float
    ok: bool
    violations: list[str]
    metrics: dict[str, float] = field(default_factory=dict)


def slo_limits(scenario: Scenario, metrics: list[str]) -> dict[str, float]:
    """``{"ttft_ms": limit, ...}`` of the SLO limits to hold at p99.

    Raises:
        ScenarioError: no slo section, an unknown metric, or a metric the slo section does not set.
    """
    if scenario.slo is None:
        raise ScenarioError(f"scenario {scenario.name}: capacity needs an slo section (ttft_ms, tpot_ms, e2el_ms)")
    slo = scenario.slo.model_dump()
    keys = []
    for m in metrics:
        key = SLO_METRICS.get(m.removesuffix("_ms").lower())
        if key is None:
            raise ScenarioError(f"--metric {m}: expected one of ttft, tpot, e2el")
        if slo.get(key) is None:
            raise ScenarioError(f"--metric {m}: the scenario's slo section sets no {key}")
        keys.append(key)
    return {k: v for k, v in slo.items() if v is not None and (not keys or k in keys)}


def evaluate(summary: dict, limits: dict[str, float], rate: float) -> Probe:
    """A :class:`Probe` from an engine summary: p99 of each limited metric <= its limit, and no failures.
    A metric no request defines (p99 None: TPOT when every request has one output token) meets its limit."""
    bad = [f"{k} p99 {summary[k]['p99']:.4g} > {lim:g}" for k, lim in limits.items()
           if summary[k]["p99"] is not None and summary[k]["p99"] > lim]
    if summary.get("num_failed"):
        bad.append(f"{summary['num_failed']} requests failed")
    if not summary.get("num_finished"):
        bad.append("no request finished")
    return Probe(rate, not bad, bad, {m: metric_value(summary, m) for m in SHOWN})


class EngineProber:
    """Runs one engine of a scenario at a given request rate (model, config and tokenizer loaded once)."""

    def __init__(self, scenario: Scenario, engine: str, limits: dict[str, float]):
        from transformers import AutoTokenizer

        from engines.core.config import ModelConfig
        from engines.real.model_store import resolve_model

        self.scenario, self.spec, self.limits = scenario, scenario.engine(engine), limits
        self.model_dir = resolve_model(scenario.model)
        self.model_cfg = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)

    def __call__(self, rate: float) -> Probe:
        from workbench.metrics import summarize
        from workbench.runner import run_engine
        from workbench.scenario import load_scenario_trace

        # the probe sets the rate itself; dropping trace.load keeps the copy a valid scenario (the schema
        # allows request_rate or load, not both; nothing below reads load)
        trace = self.scenario.trace.model_copy(update={"request_rate": rate, "load": None})
        sc = self.scenario.model_copy(update={"trace": trace, "engines": [self.spec]})
        trace = load_scenario_trace(sc, self.tokenizer, vocab_lo=100, vocab_hi=min(self.model_cfg.vocab_size, 49000))
        eos = self.model_cfg.eos_token_ids or None
        outs, steps = run_engine(sc, self.spec, self.model_dir, self.model_cfg, trace, eos)
        return evaluate(summarize(outs, steps, len(trace), self.limits), self.limits, rate)


@dataclass
class CapacityResult:
    """``last_pass``: the highest passing rate found; ``first_fail``: the lowest failing rate above it
    (either None when the search found none within its range); ``probes``: every run, in order."""

    last_pass: Probe | None
    first_fail: Probe | None
    probes: list[Probe]


def find_capacity(probe: Callable[[float], Probe], start: float, tolerance: float = 0.02, max_rate: float = 1024.0,
                  min_rate: float | None = None, on_probe: Callable[[Probe], None] | None = None) -> CapacityResult:
    """Bracket (doubling up from ``start`` while the SLO holds, halving down while it fails), then bisect.

    Args:
        probe: runs the engine at a rate (req/s) and says whether the SLO holds.
        start: first rate (req/s), > 0.
        tolerance: stop when (fail - pass) / pass <= tolerance.
        max_rate, min_rate: bracketing range (default min: start / 1024).

    Raises:
        ValueError: start, tolerance or the range is not positive.
    """
    if not (start > 0 and tolerance > 0 and max_rate > 0):
        raise ValueError(f"start ({start}), tolerance ({tolerance}) and max rate ({max_rate}) must be > 0")
    min_rate = min_rate or start / 1024
    probes: list[Probe] = []

    def run(rate: float) -> Probe:
        p = probe(rate)
        probes.append(p)
        if on_probe:
            on_probe(p)
        return p

    first = run(start)
    lo, hi = (first, None) if first.ok else (None, first)
    rate = start
    while lo is None or hi is None:
        rate = rate * 2 if hi is None else rate / 2
        if rate > max_rate or rate < min_rate:
            return CapacityResult(lo, hi, probes)
        p = run(rate)
        if p.ok:
            lo = p
        else:
            hi = p
    while (hi.rate - lo.rate) / lo.rate > tolerance:
        p = run((lo.rate + hi.rate) / 2)
        if p.ok:
            lo = p
        else:
            hi = p
    return CapacityResult(lo, hi, probes)


def capacity_ratios(capacities: dict[str, float | None]) -> dict[str, float | None]:
    """``{"B/A": capacity(B) / capacity(A)}`` for each engine B after the first one A (None when either
    has no passing rate)."""
    names = list(capacities)
    if len(names) < 2:
        return {}
    a = names[0]
    return {f"{b}/{a}": (capacities[b] / capacities[a] if capacities[a] and capacities[b] else None)
            for b in names[1:]}


__all__ = ["CapacityResult", "EngineProber", "Probe", "capacity_ratios", "evaluate", "find_capacity", "slo_limits"]
