"""Reading ``results.json`` files and gate baselines, and addressing their summary metrics.

A run's ``results.json`` (written by ``workbench run``) holds, per engine, its kind, config and summary;
a metric is a dotted path into a summary (``output_throughput``, ``e2el_ms.p99``,
``kv_breakdown.reserved``). A *baseline* pools several runs of one scenario: per engine and metric, one
value per run (:class:`Samples`). ``workbench compare``, ``workbench gate``, ``workbench capacity``,
sweeps and ``workbench run --repeat`` read results through this module.

Baseline file (JSON, written by ``workbench gate --update-baseline``)::

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.errors import UsageError

BASELINE_FORMAT = "workbench-baseline/1"


class ResultsError(UsageError):
    """A results file or baseline is missing or malformed; one line naming the file."""


@dataclass
class Run:
    """One loaded run: its label, file, scenario name and hash, and each engine's summary."""

    label: str
    path: Path
    scenario_name: str
    scenario_hash: str | None
    engines: dict[str, dict]  # engine name -> {"kind": ..., "summary": {...}}


def results_file(path: str | Path) -> Path:
    """``path`` itself, or ``path/results.json`` when ``path`` is a results folder."""
    p = Path(path)
    return p / "results.json" if p.is_dir() else p


def _read_json(p: Path, what: str, missing: str) -> Any:
    """The JSON document in ``p``.

    Raises:
        ResultsError: ``p`` is not a file (``missing`` says what to do) or not JSON.
    """
    if not p.is_file():
        raise ResultsError(f"{p}: no such {what}{missing}")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultsError(f"{p}: not a JSON {what} ({e})") from None


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read a ``results.json`` (or a folder holding one).

    Raises:
        ResultsError: no such file, not JSON, or no ``engines`` section.
    """
    p = results_file(path)
    data = _read_json(p, "results file", " (pass a results.json or a run folder)")
    if not isinstance(data, dict) or not isinstance(data.get("engines"), dict):
        raise ResultsError(f"{p}: not a workbench results file (no 'engines' section)")
    sc = data.get("scenario") or {}
    name = sc.get("name") if isinstance(sc, dict) else None
    return Run(label or p.parent.name or str(p), p, name or data.get("scenario_name") or "?",
               data.get("scenario_hash"), data["engines"])


def flatten(summary: dict, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a summary as ``{dotted.path: value}`` (booleans and strings left out)."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def metric_value(summary: dict, metric: str) -> float | None:
    """The value at dotted path ``metric`` in a summary (``e2el_ms.p99``); None when absent or not a number."""
    node: Any = summary
    for part in metric.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def unique_labels(paths: list[str]) -> list[str]:
    """Short labels for runs: each run folder's name, made unique with ``#2``, ``#3``..."""
    labels, seen = [], {}
    for p in paths:
        f = results_file(p)
        base = f.parent.name or f.name
        seen[base] = seen.get(base, 0) + 1
        labels.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return labels


def check_same_scenario(runs: list[Run]) -> str | None:
    """None when every run has the first run's ``scenario_hash``; otherwise a one-line explanation."""
    first = runs[0]
    for r in runs[1:]:
        if r.scenario_hash != first.scenario_hash:
            return (f"runs are of different scenarios: {first.path} is {first.scenario_name!r} (hash "
                    f"{first.scenario_hash}) but {r.path} is {r.scenario_name!r} (hash {r.scenario_hash}); "
                    f"pass --force to compare them anyway")
    return None


def fmt(v: float | None) -> str:
    """A metric value for a table cell: 4 significant digits, ``-`` when missing."""
    if v is None:
        return "-"
    if math.isinf(v) or math.isnan(v):
        return str(v)
    return f"{v:.4g}"


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
        ResultsError: a file is unreadable, or the files are of different scenarios.
    """
    runs = [load_run(p) for p in paths]
    for r in runs[1:]:
        if r.scenario_hash != runs[0].scenario_hash:
            raise ResultsError(f"{r.path} is a run of another scenario than {runs[0].path} "
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
        ResultsError: missing or malformed file (the message suggests ``--update-baseline``).
    """
    p = Path(path)
    data = _read_json(p, "baseline", "; write one with --update-baseline")
    if isinstance(data, dict) and data.get("format") == BASELINE_FORMAT:
        try:
            eng = data["engines"]
            return Samples(data.get("scenario_name", "?"), data.get("scenario_hash"), int(data["num_runs"]),
                           {n: e.get("kind", "?") for n, e in eng.items()},
                           {n: {k: [float(x) for x in v] for k, v in e["metrics"].items()} for n, e in eng.items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ResultsError(f"{p}: malformed baseline ({type(e).__name__}: {e})") from None
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


__all__ = ["BASELINE_FORMAT", "ResultsError", "Run", "Samples", "check_same_scenario", "flatten", "fmt",
           "load_baseline", "load_run", "metric_value", "results_file", "samples_from_results", "unique_labels",
           "write_baseline"]
