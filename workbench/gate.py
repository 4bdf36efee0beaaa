"""``workbench gate``: regression gates on run results against a committed baseline.

A gate compares one or more runs of a scenario (``results.json`` files, or runs it makes itself with
``--scenario FILE --repeat N``) against a baseline file and a set of bounds:

- ``--max-drop METRIC=5%``: the value may fall at most 5% below the baseline (throughputs, goodput);
- ``--max-rise METRIC=10%``: the value may rise at most 10% above the baseline (latencies, waste);
- ``--max-change METRIC=0.1%``: either way (``*`` = every numeric summary metric: reproducing a
  deterministic simulator run);
- ``--ratio paged/static:output_throughput>=1.5``: a ratio between two engines of the same run, which
  needs no baseline and holds across machines.

``METRIC`` is a dotted path into an engine's summary (``output_throughput``, ``e2el_ms.p99``), for
every engine that has it, or prefixed with an engine name (``paged.output_throughput``) for one.

With several runs on either side (``--repeat N``, several RESULTS, or a baseline made from several
runs) a bound compares 95% confidence intervals, mean ± t(0.975, n-1)·s/√n (Student's t, see
``workbench.stats.mean_interval``), instead of
single values: a drop is a violation only when the whole interval of the new runs lies below the bound
computed from the low end of the baseline's interval (a rise: mirrored). With one run on each side this
is the plain comparison of values.

Baseline file (JSON, written by ``--update-baseline``)::

    {"format": "workbench-baseline/1", "scenario_name": ..., "scenario_hash": ..., "created": ...,
     "machine": {...}, "num_runs": N,
     "engines": {"paged": {"kind": "paged", "metrics": {"output_throughput": [v1, ..., vN], ...}}}}

A ``results.json`` also works as a baseline (one run).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

from workbench.compare import ResultsError, flatten, fmt, load_run
from workbench.stats import mean_interval, t975

BASELINE_FORMAT = "workbench-baseline/1"
ABS_TOL = 1e-9  # absolute slack so that exact zeros and float round-off never fail a bound


class GateError(ValueError):
    """Bad gate input (bound syntax, unknown metric or engine, unreadable baseline); one line."""


@dataclass
class Interval:
    """Mean and 95% half-width of ``n`` samples (half-width 0 for one sample)."""

    mean: float
    half: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Interval":
        """The 95% interval of the mean of ``values`` (:func:`workbench.stats.mean_interval`).

        Raises:
            ValueError: ``values`` is empty.
        """
        m, half = mean_interval(values, 0.95)
        return cls(m, half, len(values))

    def __str__(self) -> str:
        return fmt(self.mean) if self.n < 2 else f"{fmt(self.mean)} ± {fmt(self.half)}"


# ---------------------------------------------------------------------------------------- samples


@dataclass
class Samples:
    """Per engine, per metric, one value per run. ``kinds`` maps engine -> kind."""

    scenario_name: str
    scenario_hash: str | None
    num_runs: int
    kinds: dict[str, str]
    metrics: dict[str, dict[str, list[float]]]  # engine -> metric -> values


def samples_from_results(paths: list[str | Path]) -> Samples:
    """Pool the summaries of several ``results.json`` files (runs of one scenario) into samples.

    Raises:
        GateError: a file is unreadable, or the files are of different scenarios.
    """
    try:
        runs = [load_run(p) for p in paths]
    except ResultsError as e:
        raise GateError(str(e)) from None
    for r in runs[1:]:
        if r.scenario_hash != runs[0].scenario_hash:
            raise GateError(f"{r.path} is a run of another scenario than {runs[0].path} "
                            f"({r.scenario_hash} vs {runs[0].scenario_hash}); pool only runs of one scenario")
    kinds: dict[str, str] = {}
    metrics: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        for name, e in r.engines.items():
            kinds[name] = e.get("kind", "?")
            for k, v in flatten(e.get("summary", {})).items():
                metrics.setdefault(name, {}).setdefault(k, []).append(v)
    return Samples(runs[0].scenario_name, runs[0].scenario_hash, len(runs), kinds, metrics)


def load_baseline(path: str | Path) -> Samples:
    """Read a baseline file (or a ``results.json`` used as one).

    Raises:
        GateError: missing or malformed file (the message suggests ``--update-baseline``).
    """
    p = Path(path)
    if not p.is_file():
        raise GateError(f"{p}: no such baseline; write one with --update-baseline")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GateError(f"{p}: not a JSON baseline ({e})") from None
    if isinstance(data, dict) and data.get("format") == BASELINE_FORMAT:
        try:
            eng = data["engines"]
            return Samples(data.get("scenario_name", "?"), data.get("scenario_hash"), int(data["num_runs"]),
                           {n: e.get("kind", "?") for n, e in eng.items()},
                           {n: {k: [float(x) for x in v] for k, v in e["metrics"].items()} for n, e in eng.items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise GateError(f"{p}: malformed baseline ({type(e).__name__}: {e})") from None
    return samples_from_results([p])


def write_baseline(samples: Samples, path: str | Path) -> Path:
    """Write ``samples`` as a baseline file (creating folders); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "format": BASELINE_FORMAT,
        "scenario_name": samples.scenario_name,
        "scenario_hash": samples.scenario_hash,
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "num_runs": samples.num_runs,
        "engines": {n: {"kind": samples.kinds.get(n, "?"), "metrics": m} for n, m in samples.metrics.items()},
    }
    p.write_text(json.dumps(data, indent=1) + "\n")
    return p


# ----------------------------------------------------------------------------------------- bounds


@dataclass
class Bound:
    """``kind`` is ``drop``, ``rise`` or ``change``; ``frac`` the allowed relative change (0.05 = 5%);
    ``engine`` None = every engine that has the metric; ``metric`` ``*`` = every metric."""

    kind: str
    metric: str
    frac: float
    engine: str | None = None

    def spec(self) -> str:
        return f"max-{self.kind} {(self.engine + '.') if self.engine else ''}{self.metric}={self.frac:.4g}"


@dataclass
class RatioBound:
    """``num``/``den`` engines' ``metric`` in the same run must be ``op`` (``>=`` or ``<=``) ``value``."""

    num: str
    den: str
    metric: str
    op: str
    value: float


def parse_fraction(text: str, where: str) -> float:
    """``5%`` -> 0.05; a bare number is a fraction (``0.05``). Raises GateError when not >= 0."""
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise GateError(f"{where}: expected a percentage such as 5% (or a fraction such as 0.05), got {text!r}") from None
    if not v >= 0 or math.isinf(v):
        raise GateError(f"{where}: the allowed change must be a finite number >= 0, got {text!r}")
    return v


def parse_bound(kind: str, item: str, engines: set[str]) -> Bound:
    """``[ENGINE.]METRIC=PCT`` -> :class:`Bound`; the first part is an engine when it names one in ``engines``."""
    key, sep, raw = item.partition("=")
    where = f"--max-{kind} {item}"
    if not sep or not key.strip():
        raise GateError(f"{where}: expected METRIC=PERCENT, e.g. output_throughput=5% or paged.e2el_ms.p99=10%")
    key = key.strip()
    head, dot, rest = key.partition(".")
    engine, metric = (head, rest) if dot and head in engines else (None, key)
    return Bound(kind, metric, parse_fraction(raw, where), engine)


_RATIO = re.compile(r"^\s*([\w-]+)\s*/\s*([\w-]+)\s*:\s*([\w.]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")


def parse_ratio(item: str) -> RatioBound:
    """``paged/static:output_throughput>=1.5`` -> :class:`RatioBound`."""
    m = _RATIO.match(item)
    if not m:
        raise GateError(f"--ratio {item}: expected NUM/DEN:METRIC>=VALUE (or <=), e.g. paged/static:output_throughput>=1.5")
    try:
        value = float(m.group(5))
    except ValueError:
        raise GateError(f"--ratio {item}: {m.group(5)!r} is not a number") from None
    return RatioBound(m.group(1), m.group(2), m.group(3), m.group(4), value)


# ----------------------------------------------------------------------------------------- checks


@dataclass
class Check:
    """One evaluated bound: the row of the gate's table."""

    metric: str
    engine: str
    baseline: str
    value: str
    bound: str
    change: str
    ok: bool


def _rel(v: float, b: float) -> str:
    return f"{(v - b) / b:+.2%}" if b else ("+0.00%" if v == b else "n/a")


def check_bound(b: Bound, base: Samples, new: Samples) -> list[Check]:
    """Evaluate one bound on every engine it addresses.

    Raises:
        GateError: the engine or metric exists in neither the baseline nor the results.
    """
    engines = [b.engine] if b.engine else [e for e in new.metrics if e in base.metrics]
    if b.engine and (b.engine not in new.metrics or b.engine not in base.metrics):
        side = "results" if b.engine not in new.metrics else "baseline"
        raise GateError(f"{b.spec()}: no engine {b.engine!r} in the {side}")
    out: list[Check] = []
    for e in engines:
        names = sorted(base.metrics[e]) if b.metric == "*" else [b.metric]
        for m in names:
            if m not in base.metrics[e] or m not in new.metrics[e]:
                if b.metric == "*" or not b.engine:
                    continue
                raise GateError(f"{b.spec()}: engine {e} has no metric {m!r}")
            bi, vi = Interval.of(base.metrics[e][m]), Interval.of(new.metrics[e][m])
            lo = (bi.mean - bi.half) * (1 - b.frac) - ABS_TOL
            hi = (bi.mean + bi.half) * (1 + b.frac) + ABS_TOL
            ok_drop = vi.mean + vi.half >= lo
            ok_rise = vi.mean - vi.half <= hi
            if b.kind == "drop":
                ok, bound = ok_drop, f">= {fmt(lo + ABS_TOL)} (-{b.frac:.4g} rel)"
            elif b.kind == "rise":
                ok, bound = ok_rise, f"<= {fmt(hi - ABS_TOL)} (+{b.frac:.4g} rel)"
            else:
                ok, bound = ok_drop and ok_rise, f"in [{fmt(lo + ABS_TOL)}, {fmt(hi - ABS_TOL)}] (±{b.frac:.4g} rel)"
            out.append(Check(m, e, str(bi), str(vi), bound, _rel(vi.mean, bi.mean), ok))
    if not out and b.metric != "*":
        known = sorted({k for e in new.metrics.values() for k in e})
        raise GateError(f"{b.spec()}: no engine has metric {b.metric!r}; metrics: {', '.join(known)}")
    return out


def check_ratio(r: RatioBound, new: Samples, base: Samples | None = None) -> Check:
    """Evaluate a ratio bound on the per-run ratios of the results (their 95% interval with several runs).

    Raises:
        GateError: an engine or the metric is missing from the results.
    """
    for e in (r.num, r.den):
        if e not in new.metrics:
            raise GateError(f"--ratio {r.num}/{r.den}: no engine {e!r} in the results; engines: {', '.join(new.metrics)}")
        if r.metric not in new.metrics[e]:
            raise GateError(f"--ratio {r.num}/{r.den}:{r.metric}: engine {e} has no metric {r.metric!r}")

    def ratios(s: Samples) -> list[float]:
        return [n / d if d else math.inf for n, d in zip(s.metrics[r.num][r.metric], s.metrics[r.den][r.metric])]

    vi = Interval.of(ratios(new))
    ok = vi.mean + vi.half >= r.value if r.op == ">=" else vi.mean - vi.half <= r.value
    have_base = base is not None and all(e in base.metrics and r.metric in base.metrics[e] for e in (r.num, r.den))
    bstr = str(Interval.of(ratios(base))) if have_base else "-"
    return Check(f"{r.metric} ratio", f"{r.num}/{r.den}", bstr, str(vi), f"{r.op} {r.value:g}", "", ok)


__all__ = ["BASELINE_FORMAT", "Bound", "Check", "GateError", "Interval", "RatioBound", "Samples", "check_bound",
           "check_ratio", "load_baseline", "parse_bound", "parse_fraction", "parse_ratio", "samples_from_results",
           "t975", "write_baseline"]


def run_repeats(scenario: str, overrides: list[str], n: int, out_dir: Path, echo=print) -> list[Path]:
    """Run the scenario ``n`` times into ``out_dir/run-1..n``; returns the results.json paths.

    Raises:
        GateError: the scenario or an override is bad, or a run fails on its input.
    """
    from workbench.runner import run_scenario
    from workbench.scenario import ScenarioError, load_scenario, parse_overrides
    from workbench.traces import TraceError

    try:
        sc = load_scenario(scenario, overrides=parse_overrides(overrides) if overrides else None)
    except ScenarioError as e:
        raise GateError(str(e)) from None
    if os.environ.get("WORKBENCH_THREADS"):  # as `workbench run`
        import torch

        torch.set_num_threads(int(os.environ["WORKBENCH_THREADS"]))
    paths = []
    for i in range(1, n + 1):
        d = out_dir / f"run-{i}"
        echo(f"run {i}/{n} of {sc.name} -> {d}")
        try:
            run_scenario(sc, d)
        except (TraceError, ValueError) as e:
            raise GateError(f"{scenario}: {e}") from None
        paths.append(d / "results.json")
    return paths


def gate_command(results: list[str], baseline: str | None, max_drop: list[str], max_rise: list[str],
                 max_change: list[str], ratio: list[str], scenario: str | None, repeat: int, overrides: list[str],
                 out: str | None, update_baseline: bool, force: bool, show_all: bool) -> int:
    """``workbench gate``: returns the exit code (0 all bounds hold, 1 some violated); bad input exits 2."""
    import sys

    from rich.console import Console
    from rich.table import Table

    from workbench.cli_errors import fail

    console = Console(width=None if sys.stdout.isatty() else 200)
    if repeat < 1:
        fail(f"--repeat must be >= 1, got {repeat}")
    if scenario is None and (repeat > 1 or overrides):
        fail("--repeat and --set need --scenario FILE (the gate runs the scenario itself)")
    if scenario is None and not results:
        fail("give RESULTS (results.json files or run folders) or --scenario FILE to run")
    try:
        paths: list = list(results)
        if scenario is not None:
            stem = Path(scenario).stem
            out_dir = Path(out) if out else Path("reports/runs") / f"gate-{stem}-{dt.datetime.now():%Y%m%d-%H%M%S}"
            paths += run_repeats(scenario, overrides, repeat, out_dir, echo=lambda s: print(s, file=sys.stderr))
        new = samples_from_results(paths)
        if update_baseline:
            if not baseline:
                fail("--update-baseline needs --baseline FILE (where to write it)")
            p = write_baseline(new, baseline)
            print(f"baseline written: {p} ({new.num_runs} run(s) of {new.scenario_name}, hash {new.scenario_hash})")
            return 0
        base = load_baseline(baseline) if baseline else None
        if base is None and (max_drop or max_rise or max_change):
            fail("--max-drop/--max-rise/--max-change need --baseline FILE")
        if not (max_drop or max_rise or max_change or ratio):
            fail("no bounds given: use --max-drop, --max-rise, --max-change and/or --ratio")
        if base is not None and base.scenario_hash != new.scenario_hash and not force:
            fail(f"the results are of scenario {new.scenario_name!r} (hash {new.scenario_hash}) but the baseline "
                 f"{baseline} is of {base.scenario_name!r} (hash {base.scenario_hash}); pass --force to gate anyway")
        engines = set(new.metrics) | (set(base.metrics) if base else set())
        checks: list[Check] = []
        for kind, items in (("drop", max_drop), ("rise", max_rise), ("change", max_change)):
            for item in items:
                checks += check_bound(parse_bound(kind, item, engines), base, new)
        for item in ratio:
            checks.append(check_ratio(parse_ratio(item), new, base))
    except GateError as e:
        fail(str(e))
    bad = [c for c in checks if not c.ok]
    shown = checks if show_all else bad
    if shown:
        runs = f"{new.num_runs} run(s)" + (f" vs baseline of {base.num_runs}" if base else "")
        table = Table(title=("gate FAILED: violated bounds" if bad else "gate checks") + f" ({runs})")
        for h in ("metric", "engine", "baseline", "value", "bound", "change", "status"):
            table.add_column(h, justify="left" if h in ("metric", "engine", "bound") else "right")
        for c in shown:
            table.add_row(c.metric, c.engine, c.baseline, c.value, c.bound, c.change, "ok" if c.ok else "VIOLATED")
        console.print(table)
    print(f"gate {'FAILED' if bad else 'passed'}: {len(checks) - len(bad)} of {len(checks)} checks hold"
          + (f", {len(bad)} violated" if bad else ""))
    return 1 if bad else 0
