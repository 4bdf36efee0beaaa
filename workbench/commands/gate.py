"""``workbench gate``: regression gates on run results (``results.json`` files, or runs it makes itself with
``--scenario FILE --repeat N``) against a committed baseline (``workbench.results``) and the bounds of
``workbench.gate``; ``--update-baseline`` writes the results as the new baseline. Every engine must also
have no failed requests (``num_failed == 0``) unless ``allow_failed``."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

from workbench.commands import set_torch_threads, table_console
from workbench.errors import UsageError
from workbench.gate import Check, check_bound, check_no_failed, check_ratio, parse_bound, parse_ratio
from workbench.results import (BASELINE_FORMAT, Samples, load_baseline, results_file, samples_from_results,
                               write_baseline)


def run_repeats(scenario: str, overrides: list[str], n: int, out_dir: Path, echo=print) -> list[Path]:
    """Run the scenario ``n`` times into ``out_dir/run-1..n``; returns the results.json paths.

    Raises:
        UsageError: the scenario or an override is bad, or a run fails on its input.
    """
    from workbench.runner import run_scenario
    from workbench.scenario import load_scenario, parse_overrides

    sc = load_scenario(scenario, overrides=parse_overrides(overrides) if overrides else None)
    set_torch_threads()  # as `workbench run`
    paths = []
    for i in range(1, n + 1):
        d = out_dir / f"run-{i}"
        echo(f"run {i}/{n} of {sc.name} -> {d}")
        try:
            run_scenario(sc, d)
        except ValueError as e:
            raise UsageError(f"{scenario}: {e}") from e
        paths.append(d / "results.json")
    return paths


def refuse_baselines_as_results(paths: list) -> None:
    """Raise when one of the RESULTS ``paths`` is a gate baseline (it has no run summaries to gate).

    Raises:
        UsageError: one line naming the file and saying to pass it as ``--baseline``.
    """
    for p in paths:
        f = results_file(p)
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # missing or not JSON: samples_from_results says so
        if isinstance(data, dict) and data.get("format") == BASELINE_FORMAT:
            raise UsageError(f"{f} is a gate baseline, not a run's results.json: pass it as --baseline FILE and give "
                             f"a run (results.json or run folder) or --scenario FILE to gate")


def require_metrics(s: Samples, what: str) -> None:
    """Raise when ``s`` has no summary metric at all (so that no bound can say anything about it).

    Raises:
        UsageError: one line naming ``what`` (the results or the baseline file).
    """
    if not any(s.metrics.values()):
        raise UsageError(f"{what}: no engine summary metrics (engines: {', '.join(s.kinds) or 'none'}); "
                         f"is it a workbench results.json or gate baseline?")


def main(results: list[str], baseline: str | None = None, max_drop: list[str] = (), max_rise: list[str] = (),
         max_change: list[str] = (), ratio: list[str] = (), scenario: str | None = None, repeat: int = 1,
         overrides: list[str] = (), out: str | None = None, update_baseline: bool = False, force: bool = False,
         show_all: bool = False, allow_failed: bool = False) -> int:
    """Check every bound, and that no engine has failed requests (unless ``allow_failed``); print the
    violated checks (``show_all``: every one) as a table, a line for each one that could not be evaluated
    (a missing value, a zero denominator), and a last line ``gate passed`` / ``gate FAILED``.

    Returns 0 when every check holds (or the baseline was written), 1 when some are violated.

    Raises:
        UsageError: bad options, bounds, results or baseline (a baseline given as RESULTS, a bound that
            checks nothing), a baseline of another scenario without ``force``, or ``update_baseline`` from
            runs with failed requests without ``allow_failed``.
    """
    from rich.table import Table

    if repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {repeat}")
    if scenario is None and (repeat > 1 or overrides):
        raise UsageError("--repeat and --set need --scenario FILE (the gate runs the scenario itself)")
    if scenario is None and not results:
        raise UsageError("give RESULTS (results.json files or run folders) or --scenario FILE to run")
    if update_baseline and not baseline:
        raise UsageError("--update-baseline needs --baseline FILE (where to write it)")
    if not update_baseline and not (max_drop or max_rise or max_change or ratio):
        raise UsageError("no bounds given: use --max-drop, --max-rise, --max-change and/or --ratio")
    if not baseline and (max_drop or max_rise or max_change):
        raise UsageError("--max-drop/--max-rise/--max-change need --baseline FILE")
    refuse_baselines_as_results(list(results))
    paths: list = list(results)
    if scenario is not None:
        stem = Path(scenario).stem
        out_dir = Path(out) if out else Path("reports/runs") / f"gate-{stem}-{dt.datetime.now():%Y%m%d-%H%M%S}"
        paths += run_repeats(scenario, list(overrides), repeat, out_dir, echo=lambda s: print(s, file=sys.stderr))
    new = samples_from_results(paths)
    require_metrics(new, ", ".join(map(str, paths)))
    if update_baseline:
        failed = [e for e, ms in new.metrics.items() if any(v != 0 for v in ms.get("num_failed", []))]
        if failed and not allow_failed:
            raise UsageError(f"not writing {baseline}: engine(s) {', '.join(failed)} of the runs have failed requests "
                             f"(num_failed > 0); fix them or pass --allow-failed")
        p = write_baseline(new, baseline)
        print(f"baseline written: {p} ({new.num_runs} run(s) of {new.scenario_name}, hash {new.scenario_hash})")
        return 0
    base = load_baseline(baseline) if baseline else None
    if base is not None:
        require_metrics(base, f"the baseline {baseline}")
    if base is not None and base.scenario_hash != new.scenario_hash and not force:
        raise UsageError(f"the results are of scenario {new.scenario_name!r} (hash {new.scenario_hash}) but the "
                         f"baseline {baseline} is of {base.scenario_name!r} (hash {base.scenario_hash}); pass "
                         f"--force to gate anyway")
    engines = set(new.metrics) | (set(base.metrics) if base else set())
    checks: list[Check] = []
    for kind, items in (("drop", max_drop), ("rise", max_rise), ("change", max_change)):
        for item in items:
            checks += check_bound(parse_bound(kind, item, engines), base, new)
    for item in ratio:
        checks.append(check_ratio(parse_ratio(item), new, base))
    if not allow_failed:
        checks += check_no_failed(new, base)
    bad = [c for c in checks if not c.ok]
    shown = checks if show_all else bad
    if shown:
        runs = f"{new.num_runs} run(s)" + (f" vs baseline of {base.num_runs}" if base else "")
        table = Table(title=("gate FAILED: violated bounds" if bad else "gate checks") + f" ({runs})")
        for h in ("metric", "engine", "baseline", "value", "bound", "change", "status"):
            table.add_column(h, justify="left" if h in ("metric", "engine", "bound") else "right")
        for c in shown:
            table.add_row(c.metric, c.engine, c.baseline, c.value, c.bound, c.change, "ok" if c.ok else "VIOLATED")
        table_console().print(table)
    for c in bad:
        if c.note:
            print(f"violated: {c.engine} {c.metric}: {c.note}")
    print(f"gate {'FAILED' if bad else 'passed'}: {len(checks) - len(bad)} of {len(checks)} checks hold"
          + (f", {len(bad)} violated" if bad else ""))
    return 1 if bad else 0
