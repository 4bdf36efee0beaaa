"""``workbench capacity``: for each ``--engine``, the highest ``trace.request_rate`` at which the scenario's
p99 SLO holds (``workbench.capacity.find_capacity``), and with several engines the ratio of their
capacities."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict

from workbench.capacity import CapacityResult, EngineProber, Probe, capacity_ratios, find_capacity, slo_limits
from workbench.commands import set_torch_threads
from workbench.errors import UsageError, usage_errors


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"


def _line(p: Probe) -> str:
    m = p.metrics
    return (f"{p.rate:.4g} req/s: TTFT p99 {_ms(m['ttft_ms.p99'])}, TPOT p99 {_ms(m['tpot_ms.p99'])}, "
            f"E2EL p99 {_ms(m['e2el_ms.p99'])}, output {m['output_throughput']:.4g} tok/s, goodput "
            f"{m['goodput']:.4g} req/s, {m['num_finished']:.0f} finished")


def main(scenario: str, engines: list[str], metrics: list[str] = (), start: float | None = None,
         tolerance: float = 0.02, max_rate: float = 1024.0, overrides: list[str] = (),
         as_json: bool = False) -> int:
    """For each engine, print each probe (stderr), then the capacity with the metrics at the last passing
    rate and at the first failing rate above it; with several engines, the ratio of each capacity to the
    first engine's. Real engines: each probe is a whole real run, so the time budget is printed before
    starting.

    Returns 0 when every engine has a passing rate, 1 when the SLO failed at every rate tried for some engine.

    Raises:
        UsageError: a bad scenario, override, engine name, metric, start rate or engine setting.
    """
    from workbench.scenario import load_scenario, parse_overrides

    set_torch_threads()
    sc = load_scenario(scenario, overrides=parse_overrides(overrides) if overrides else None)
    for name in engines:
        try:
            sc.engine(name)
        except KeyError as e:
            raise UsageError(f"{scenario}: --engine: {e.args[0]}") from None
    if len(set(engines)) != len(engines):
        raise UsageError(f"{scenario}: --engine: an engine is named twice ({', '.join(engines)})")
    limits = slo_limits(sc, list(metrics))
    begin = start if start is not None else sc.trace.request_rate or 1.0
    if not (begin > 0 and math.isfinite(begin)):
        raise UsageError(f"--start must be a finite rate > 0 req/s, got {begin}")
    results: dict[str, CapacityResult] = {}
    for name in engines:
        with usage_errors(ValueError):
            prober = EngineProber(sc, name, limits)
            print(f"capacity of {name} ({sc.engine(name).kind}) in {sc.name}: SLO p99 "
                  + ", ".join(f"{k} <= {v:g}" for k, v in limits.items()), file=sys.stderr)
            if sc.engine(name).kind in ("paged", "static", "openai"):
                print(f"  time budget: each probe is a real run of the whole trace ({_trace_size(prober)}); "
                      f"about {_probe_budget(tolerance)} probes", file=sys.stderr)
            results[name] = find_capacity(prober, begin, tolerance, max_rate, on_probe=_log)
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
    return 1 if any(r.last_pass is None for r in results.values()) else 0


def _log(p: Probe) -> None:
    print(f"  {'pass' if p.ok else 'FAIL'} {_line(p)}" + ("" if p.ok else f"  [{'; '.join(p.violations)}]"),
          file=sys.stderr, flush=True)


def _trace_size(prober: EngineProber) -> str:
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
