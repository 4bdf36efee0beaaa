"""``workbench run``: replay a scenario's trace on each of its engines, print the summary table, and say
where results.json, the CSVs, PNGs and report.html are."""

from __future__ import annotations

from workbench.commands import set_torch_threads, table_console
from workbench.errors import UsageError, usage_errors

SIM_ERROR_NOTE = 0.15  # a simulator this far off its real engine gets the note on refitting its cost model


def main(scenario: str, out: str | None = None, overrides: list[str] = (), repeat: int = 1,
         sensitivity: bool = True) -> None:
    """Load the scenario (with ``--set`` overrides), run it into ``out`` (default
    ``reports/runs/<name>-<time>``) with a progress bar per engine, then print the summary table, the load
    and capacity lines, each simulator's error against its real engine (with ``sensitivity``: and how far
    its figures move with 5% slower steps, and its error at its twin's own speed), and the report's path.

    Raises:
        UsageError: a bad scenario, override, trace or engine setting, or ``repeat`` < 1.
    """
    import datetime as dt
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from workbench.runner import run_scenario
    from workbench.scenario import load_scenario, parse_overrides

    set_torch_threads()
    sc = load_scenario(scenario, overrides=parse_overrides(overrides) if overrides else None)
    if repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {repeat}")
    out_dir = Path(out) if out else Path("reports/runs") / f"{sc.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description:18s}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[tps]}"), TimeElapsedColumn(), console=console) as prog:
        def progress(name, kind, total):
            task = prog.add_task(f"{name} ({kind})", total=total, tps="")
            toks, start = [0], [None]

            def on_output(o):  # output tok/s since the replay's first arrival (not counting model load)
                toks[0] += len(o.token_ids)
                start[0] = o.arrival_time if start[0] is None else min(start[0], o.arrival_time)
                el = (o.finished_time or o.arrival_time) - start[0]
                prog.update(task, advance=1, tps=f"{toks[0] / el:.0f} out tok/s so far" if kind != "sim" and el > 0 else "")
            return on_output

        with usage_errors(ValueError):
            results = run_scenario(sc, out_dir, progress, repeat=repeat, echo=lambda m: prog.console.print(m),
                                   sensitivity=sensitivity)
    print_summary(sc.name, results)
    print(f"report: {out_dir / 'report.html'}")
    print(out_dir)


def print_summary(name: str, results: dict) -> None:
    """The summary table (rich; 200 columns when not on a terminal), the load lines and the simulators'
    errors against their real engines."""
    from rich.table import Table

    from workbench.report import load_lines, summary_rows

    table = Table(title=f"{name}: {results['num_requests']} requests")
    headers, rows = summary_rows(results)
    keep = [0, 1, 3, 5, 7, 9, 10, 12, 13, 14, 15, 16]
    for i in keep:
        table.add_column(headers[i], justify="right")
    for r in rows:
        table.add_row(*[f"{r[i]:.4g}" if isinstance(r[i], float) else str(r[i]) for i in keep])
    table_console().print(table)
    for line in load_lines(results):
        print(line)
    if results.get("cluster"):
        print_cluster(results)
    from workbench.fidelity import summary_line

    for n, e in results["engines"].items():
        err = e["summary"].get("sim_error")
        if err:
            print(f"sim {n} {summary_line(err)}")
        d = e.get("drift")
        if d and d.get("speed_ratio") is not None:
            print(drift_line(n, d))
    errs = [abs(v) for e in results["engines"].values() for v in
            [((e["summary"].get("sim_error") or {}).get("dist") or {}).get("output_throughput")] if v is not None]
    if any(v > SIM_ERROR_NOTE for v in errs):
        print(f"note: a simulator's output throughput is more than {SIM_ERROR_NOTE:.0%} off its real engine; "
              "if it names a profile of another machine, use cost_model: auto (this machine's profile)")


def drift_line(name: str, d: dict) -> str:
    """One line on sim engine ``name``'s ``drift`` (``workbench.runner.drift``): the probes' speed against the
    profile, per class, before and after the runs and from the pilot probes during them, and what was done."""
    from engines.sim.cost_model import SCALE_LARGE_TOKENS, SCALE_SMALL_TOKENS

    def x(v):
        return "n/a" if v is None else f"{v:.3f}x"

    if d["rescaled"]:
        how = f"rescaled by {d.get('scale_small', 1.0):.3f}x small, {d.get('scale_large', 1.0):.3f}x large steps"
    elif d.get("beyond_max"):
        how = f"not rescaled: beyond {d['max']:g}x, the profile does not describe this machine"
    elif d.get("n_pilots"):
        how = f"not rescaled: the pilot probes are within {d['margin']:.0%}"
    else:
        how = f"not rescaled: before and after do not agree beyond {d['margin']:.0%}"
    parts = ""
    small, large = d.get("speed_ratio_small"), d.get("speed_ratio_large")
    if small is not None and large is not None:
        parts = (f" (small probes, {SCALE_SMALL_TOKENS} tokens or fewer, {small:.3f}x; large ones, "
                 f"{SCALE_LARGE_TOKENS} or more, {large:.3f}x")
        b, a = d.get("before") or {}, d.get("after") or {}
        if b.get("all") is not None and a.get("all") is not None:
            parts += f"; before the runs {x(b['small'])} / {x(b['large'])}, after {x(a['small'])} / {x(a['large'])}"
        du = d.get("during") or {}
        if d.get("n_pilots"):
            parts += f"; {d['n_pilots']} pilot probes during them {x(du.get('small'))} / {x(du.get('large'))}"
        parts += ")"
    ref = "its own timing of them" if d.get("reference") == "baseline" else "its predictions"
    return f"sim {name} profile drift: probe steps at {d['speed_ratio']:.3f}x {ref}{parts} ({how})"


def print_cluster(results: dict) -> None:
    """The cluster what-if's table: each router's cluster-wide row, then its replicas' rows."""
    from rich.table import Table

    from workbench.report import cluster_rows

    headers, rows = cluster_rows(results)
    table = Table(title=f"cluster what-if: {results['cluster']['num_replicas']} replicas")
    for h in headers:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*[f"{c:.4g}" if isinstance(c, float) else "n/a" if c is None else str(c) for c in r])
    table_console().print(table)
