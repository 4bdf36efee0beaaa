"""``workbench compare``: runs side by side, per engine and metric, with ratios to the first run.

Also the shared helpers for reading ``results.json`` files and addressing summary metrics by dotted
path (``output_throughput``, ``e2el_ms.p99``, ``kv_breakdown.reserved``), used by ``workbench gate``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The metrics `compare` shows by default (dotted paths into an engine's summary).
DEFAULT_METRICS = [
    "output_throughput", "request_throughput", "goodput", "ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50",
    "tpot_ms.p99", "itl_ms.p50", "e2el_ms.p50", "e2el_ms.p99", "kv_waste_frac", "num_preemptions",
    "num_finished",
]
# Metrics where a higher value is better (the rest are latencies, waste or counts: lower is better or neutral).
HIGHER_IS_BETTER = {"output_throughput", "request_throughput", "total_token_throughput", "goodput", "num_finished",
                    "kv_usage_mean"}


class ResultsError(ValueError):
    """A results file is missing or not a ``workbench run`` results.json; one line naming the file."""


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


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read a ``results.json`` (or a folder holding one).

    Raises:
        ResultsError: no such file, not JSON, or no ``engines`` section.
    """
    p = results_file(path)
    if not p.is_file():
        raise ResultsError(f"{p}: no such results file (pass a results.json or a run folder)")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultsError(f"{p}: not a JSON results file ({e})") from None
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
    """A value for a table cell: 4 significant digits, ``-`` when missing."""
    if v is None:
        return "-"
    if math.isinf(v) or math.isnan(v):
        return str(v)
    return f"{v:.4g}"


def compare_rows(runs: list[Run], metrics: list[str]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the comparison: engine, metric, each run's value, then each later run's ratio
    to the first (value / first value).

    Engines are the union over the runs, in order of first appearance; a missing engine or metric is ``-``.
    """
    headers = ["engine", "metric"] + [r.label for r in runs] + [f"{r.label} / {runs[0].label}" for r in runs[1:]]
    engines: list[str] = []
    for r in runs:
        engines += [e for e in r.engines if e not in engines]
    rows = []
    for e in engines:
        for m in metrics:
            vals = [metric_value(r.engines[e]["summary"], m) if e in r.engines else None for r in runs]
            if all(v is None for v in vals):
                continue
            base = vals[0]
            ratios = [None if v is None or base in (None, 0) else v / base for v in vals[1:]]
            rows.append([e, m] + [fmt(v) for v in vals] + [f"{x:.3f}x" if x is not None else "-" for x in ratios])
    return headers, rows


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (``|`` in cells escaped)."""
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


__all__ = ["DEFAULT_METRICS", "HIGHER_IS_BETTER", "ResultsError", "Run", "check_same_scenario", "compare_rows",
           "flatten", "fmt", "load_run", "markdown_table", "metric_value", "results_file", "unique_labels"]


def compare_command(results: list[str], markdown: str | None, force: bool, metrics: list[str] | None) -> None:
    """``workbench compare``: print the table (rich) and optionally write it as Markdown.

    Exits 2 (one line on stderr) on a missing/bad file, on fewer than two runs, or on runs of different
    scenarios without ``force``.
    """
    from rich.console import Console
    from rich.table import Table

    from workbench.cli_errors import fail

    if len(results) < 2:
        fail("compare needs at least two results.json files (or run folders)")
    try:
        runs = [load_run(p, label) for p, label in zip(results, unique_labels(results))]
    except ResultsError as e:
        fail(str(e))
    mismatch = check_same_scenario(runs)
    if mismatch and not force:
        fail(mismatch)
    headers, rows = compare_rows(runs, metrics or DEFAULT_METRICS)
    title = f"{runs[0].scenario_name}" + (" (different scenarios, --force)" if mismatch else "")
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 2 else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=None if os.isatty(1) else 200).print(table)
    if markdown:
        md = f"### {title}\n\n" + "\n".join(f"- {r.label}: `{r.path}`" for r in runs) + "\n\n" + markdown_table(headers, rows)
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown).write_text(md)
        print(f"markdown: {markdown}")
