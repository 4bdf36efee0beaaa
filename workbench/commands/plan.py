"""``workbench plan``: the fewest replicas of each hardware x tp choice that meet an SLO on a scenario's trace
(``workbench.plan``), as a table, ``plan.json`` and ``plan.csv``."""

from __future__ import annotations

import csv
import datetime as dt
import json
import sys
from dataclasses import asdict
from pathlib import Path

from workbench.commands import table_console
from workbench.errors import UsageError, usage_errors


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{what} {text!r}: expected comma-separated integers >= 1, e.g. 1,2,4")
    return vals


def template_engine(sc, engine: str | None):
    """The sim engine the replicas copy: ``engine``, else the cluster section's first replica engine, else
    the scenario's first sim engine with ``cost_model: analytic``.

    Raises:
        UsageError: no such engine, or it is not an analytic sim engine.
    """
    if engine is None:
        if sc.cluster is not None:
            engine = sc.cluster.replicas[0].engine
        else:
            engine = next((e.name for e in sc.engines if e.kind == "sim" and e.cost_model == "analytic"), None)
        if engine is None:
            raise UsageError(f"scenario {sc.name}: plan needs a sim engine with cost_model: analytic (the GPU "
                             "what-if); none found (or name one with --engine)")
    try:
        spec = sc.engine(engine)
    except KeyError as e:
        raise UsageError(f"--engine: {e.args[0]}") from None
    if spec.kind != "sim" or spec.cost_model != "analytic":
        raise UsageError(f"--engine {engine}: plan sizes GPU what-ifs; the engine must be kind sim with "
                         "cost_model: analytic")
    return spec


def main(scenario: str, slo: list[str], hardware: str, tp: str, model: str | None = None, router: str | None = None,
         max_replicas: int = 64, workers: int = 1, ray: bool = False, engine: str | None = None,
         overrides: list[str] = (), out: str | None = None) -> int:
    """Size every ``--hardware`` x ``--tp`` choice, print the table (progress on stderr), write ``plan.json``
    and ``plan.csv`` into ``out`` (default ``reports/runs/plan-<name>-<time>``). Returns 0 when some
    choice meets the SLO, 1 otherwise.

    Raises:
        UsageError: a bad scenario, SLO, hardware, tp, model, router or engine.
    """
    from engines.core.router import ROUTERS
    from engines.sim.catalog import hardware_names, model_names
    from workbench.plan import PlanTask, parse_slo, result_rows, run_plan
    from workbench.scenario import load_scenario, parse_overrides

    sc = load_scenario(scenario, overrides=parse_overrides(overrides) if overrides else None)
    with usage_errors(ValueError):
        limits = parse_slo(slo) if slo else {f"{k}.p99": v for k, v in (sc.slo.model_dump() if sc.slo else {}).items()
                                             if v is not None}
    if not limits:
        raise UsageError(f"{scenario}: no SLO: pass --slo METRIC=LIMIT (e.g. ttft_ms.p99=2000) or add an slo section")
    hws = [h.strip() for h in hardware.split(",") if h.strip()]
    bad = [h for h in hws if h.lower() not in hardware_names()]
    if not hws or bad:
        raise UsageError(f"--hardware {hardware!r}: unknown {', '.join(bad) or 'nothing'}; known: {', '.join(hardware_names())}")
    tps = _ints(tp, "--tp")
    if model is not None and model.lower() not in model_names():
        raise UsageError(f"--model {model!r}: not in the model catalogue; known: {', '.join(model_names())}")
    router = router or (sc.cluster.router_names[0] if sc.cluster else "least_outstanding")
    if router not in ROUTERS:
        raise UsageError(f"--router {router!r}: expected one of {', '.join(ROUTERS)}")
    if max_replicas < 1 or workers < 1:
        raise UsageError(f"--max-replicas ({max_replicas}) and --workers ({workers}) must be >= 1")
    spec = template_engine(sc, engine)
    tasks, trace_note = _tasks(sc, spec, model, hws, tps, limits, router, max_replicas, PlanTask)
    print(f"plan {sc.name}: {trace_note}; SLO " + ", ".join(f"{k} <= {v:g}" for k, v in limits.items())
          + f"; router {router}; {len(tasks)} choices", file=sys.stderr)

    def log(r):
        tried = ", ".join(f"{p.replicas} {'ok' if p.ok else 'fail'}" for p in r.points)
        what = f"{r.replicas} replicas" if r.replicas else r.reason
        print(f"  {r.hardware} tp{r.tp}: {what}" + (f" (tried {tried})" if tried else ""), file=sys.stderr, flush=True)

    with usage_errors(ValueError):
        results = run_plan(tasks, workers, ray, on_result=log)
    rows = result_rows(results, limits)
    out_dir = Path(out) if out else Path("reports/runs") / f"plan-{sc.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    _write(out_dir, sc, tasks[0], limits, router, results, rows, trace_note)
    _print(sc.name, rows, limits)
    print(out_dir)
    return 0 if any(r.replicas for r in results) else 1


def _tasks(sc, spec, model, hws, tps, limits, router, max_replicas, task_cls):
    from transformers import AutoTokenizer

    from engines.core.config import ModelConfig
    from engines.real.model_store import resolve_model
    from workbench.runner import engine_config
    from workbench.scenario import load_scenario_trace

    with usage_errors(ValueError):
        cfg = engine_config(sc, spec, None, None)
    if model is not None:
        cfg.model = model
    model_dir = resolve_model(sc.model)  # the tokenizer whose vocabulary synthesized prompt ids come from
    mc = ModelConfig.from_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trace = load_scenario_trace(sc, tok, vocab_lo=100, vocab_hi=min(mc.vocab_size, 49000))
    span = max(t.arrival_s for t in trace) - min(t.arrival_s for t in trace) if trace else 0.0
    note = f"{len(trace)} requests over {span:.0f} s of {sc.trace.path or sc.trace.format}, model {cfg.model}"
    cl = sc.cluster
    tasks = [task_cls(h, t, cfg, trace, mc.eos_token_ids or None, limits, router,
                      cl.max_imbalance if cl else 8, max_replicas, sc.trace.max_concurrency) for h in hws for t in tps]
    return tasks, note


def _write(out_dir: Path, sc, task, limits, router, results, rows, trace_note) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"scenario": sc.name, "trace": trace_note, "model": task.engine.model, "slo": limits, "router": router,
           "max_replicas": task.max_replicas, "created": dt.datetime.now().isoformat(timespec="seconds"),
           "engine": {k: v for k, v in asdict(task.engine).items()  # the template; hardware and tp per choice
                      if v is not None and k not in ("cost_model", "hardware", "tp")},
           "cost_model": "analytic roofline with efficiency factors (engines.sim.analytic_cost_model); the "
                         "efficiency factors are not checked on a GPU",
           "results": [asdict(r) for r in results]}
    (out_dir / "plan.json").write_text(json.dumps(doc, indent=2, default=str))
    with open(out_dir / "plan.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _print(name: str, rows: list[dict], limits: dict) -> None:
    from rich.table import Table

    table = Table(title=f"plan {name}: fewest replicas meeting " + ", ".join(f"{k} <= {v:g}" for k, v in limits.items()))
    cols = ["hardware", "tp", "replicas", "gpus"] + list(limits) + [c for c in ("output_throughput", "goodput")
                                                                      if c not in limits] + ["tried", "reason"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("hardware", "reason", "tried") else "right")
    for r in rows:
        table.add_row(*[_cell(r[c]) for c in cols])
    table_console().print(table)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
