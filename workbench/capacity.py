"""``workbench capacity``: the highest request rate at which a scenario's SLO holds on one engine.

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

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

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
    """A :class:`Probe` from an engine summary: p99 of each limited metric <= its limit, and no failures."""
    from workbench.compare import metric_value

    bad = [f"{k} p99 {summary[k]['p99']:.4g} > {lim:g}" for k, lim in limits.items() if summary[k]["p99"] > lim]
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

        # the probe sets the rate itself: a trace.load section (a rate relative to a measured capacity) gives
        # way to it
        trace = self.scenario.trace.model_copy(update={"request_rate": rate, "load": None})
        sc = self.scenario.model_copy(update={"trace": trace, "engines": [self.spec]})
        trace = load_scenario_trace(sc, self.tokenizer, vocab_lo=100, vocab_hi=min(self.model_cfg.vocab_size, 49000))
        eos = self.model_cfg.eos_token_ids[0] if self.model_cfg.eos_token_ids else None
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


def _line(p: Probe) -> str:
    m = p.metrics
    return (f"{p.rate:.4g} req/s: TTFT p99 {m['ttft_ms.p99']:.1f} ms, TPOT p99 {m['tpot_ms.p99']:.1f} ms, "
            f"E2EL p99 {m['e2el_ms.p99']:.1f} ms, output {m['output_throughput']:.4g} tok/s, goodput "
            f"{m['goodput']:.4g} req/s, {m['num_finished']:.0f} finished")


def capacity_command(scenario: str, engines: list[str], metric: list[str], start: float | None, tolerance: float,
                     max_rate: float, overrides: list[str], as_json: bool) -> None:
    """``workbench capacity``: for each engine, prints each probe, then the capacity with the metrics at the
    last passing rate and at the first failing rate above it; with several engines, the ratio of each
    capacity to the first engine's. Real engines: each probe is a whole real run, so the time budget is
    printed before starting. Exit 0 when every engine has a passing rate, 1 when the SLO failed at every
    rate tried for some engine, 2 on bad input."""
    import json
    import os
    import sys

    import typer

    from workbench.cli_errors import fail
    from workbench.scenario import load_scenario, parse_overrides
    from workbench.traces import TraceError

    if os.environ.get("WORKBENCH_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["WORKBENCH_THREADS"]))
    if isinstance(engines, str):
        engines = [engines]
    results: dict[str, CapacityResult] = {}
    try:
        sc = load_scenario(scenario, overrides=parse_overrides(overrides) if overrides else None)
        for name in engines:
            try:
                sc.engine(name)
            except KeyError as e:
                raise ScenarioError(f"{scenario}: --engine: {e.args[0]}") from None
        if len(set(engines)) != len(engines):
            raise ScenarioError(f"{scenario}: --engine: an engine is named twice ({', '.join(engines)})")
        limits = slo_limits(sc, metric)
        begin = start if start is not None else sc.trace.request_rate or 1.0
        if not (begin > 0 and math.isfinite(begin)):
            raise ScenarioError(f"--start must be a finite rate > 0 req/s, got {begin}")
        log = (lambda p: print(f"  {'pass' if p.ok else 'FAIL'} {_line(p)}" + ("" if p.ok else f"  [{'; '.join(p.violations)}]"),
                               file=sys.stderr, flush=True))
        for name in engines:
            prober = EngineProber(sc, name, limits)
            print(f"capacity of {name} ({sc.engine(name).kind}) in {sc.name}: SLO p99 "
                  + ", ".join(f"{k} <= {v:g}" for k, v in limits.items()), file=sys.stderr)
            if sc.engine(name).kind in ("paged", "static", "openai"):
                print(f"  time budget: each probe is a real run of the whole trace ({_trace_size(prober)}); "
                      f"about {_probe_budget(tolerance)} probes", file=sys.stderr)
            results[name] = find_capacity(prober, begin, tolerance, max_rate, on_probe=log)
    except (ScenarioError, TraceError, ValueError) as e:
        fail(str(e))
    ratios = capacity_ratios({n: r.last_pass.rate if r.last_pass else None for n, r in results.items()})
    if as_json:
        doc = {n: _result_json(r) for n, r in results.items()}
        if len(engines) == 1:
            print(json.dumps({"engine": engines[0], "scenario": sc.name, "slo_p99": limits, **doc[engines[0]]}, indent=2))
        else:
            print(json.dumps({"engines": engines, "scenario": sc.name, "slo_p99": limits, "capacity": doc,
                              "ratios": ratios}, indent=2))
    else:
        for name, res in results.items():
            _print_result(name, res, max_rate)
        for k, v in ratios.items():
            print(f"capacity ratio {k}: " + ("n/a (no passing rate)" if v is None else f"{v:.2f}x"))
    if any(r.last_pass is None for r in results.values()):
        raise typer.Exit(1)


def capacity_ratios(capacities: dict[str, float | None]) -> dict[str, float | None]:
    """``{"B/A": capacity(B) / capacity(A)}`` for each engine B after the first one A (None when either
    has no passing rate)."""
    names = list(capacities)
    if len(names) < 2:
        return {}
    a = names[0]
    return {f"{b}/{a}": (capacities[b] / capacities[a] if capacities[a] and capacities[b] else None)
            for b in names[1:]}


def _trace_size(prober: "EngineProber") -> str:
    t = prober.scenario.trace
    return f"{t.limit or t.sample or 'all'} requests of {t.path or t.format}"


def _probe_budget(tolerance: float) -> str:
    """A rough count of probes: a few doublings or halvings to bracket, then log2(1 / tolerance) bisections."""
    bisect = math.ceil(math.log2(1 / tolerance))
    return f"{2 + bisect}-{5 + bisect}"


def _result_json(res: CapacityResult) -> dict:
    return {"capacity_rate": res.last_pass.rate if res.last_pass else None,
            "last_pass": asdict(res.last_pass) if res.last_pass else None,
            "first_fail": asdict(res.first_fail) if res.first_fail else None,
            "probes": [asdict(p) for p in res.probes]}


def _print_result(engine: str, res: CapacityResult, max_rate: float) -> None:
    if res.last_pass is None:
        print(f"the SLO fails at every rate tried, down to {res.first_fail.rate:.4g} req/s ({engine})")
        return
    print(f"capacity: {res.last_pass.rate:.4g} req/s ({engine}, {len(res.probes)} runs)")
    print(f"  holds at {_line(res.last_pass)}")
    if res.first_fail is not None:
        print(f"  fails at {_line(res.first_fail)}  [{'; '.join(res.first_fail.violations)}]")
    else:
        print(f"  the SLO holds at every rate tried, up to --max-rate {max_rate:g} req/s")


__all__ = ["CapacityResult", "EngineProber", "Probe", "capacity_ratios", "evaluate", "find_capacity", "slo_limits"]
