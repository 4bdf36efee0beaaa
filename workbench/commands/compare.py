"""``workbench compare``: runs side by side, per engine and metric, with each later run's ratio to the first."""

from __future__ import annotations

from pathlib import Path

from workbench.commands import table_console
from workbench.errors import UsageError
from workbench.results import Run, check_same_scenario, fmt, load_run, metric_value, unique_labels

# The metrics `compare` shows by default (dotted paths into an engine's summary).
DEFAULT_METRICS = [
    "output_throughput", "request_throughput", "goodput", "ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50",
    "tpot_ms.p99", "itl_ms.p50", "e2el_ms.p50", "e2el_ms.p99", "kv_waste_frac", "num_preemptions",
    "num_finished",
]


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


def main(results: list[str], markdown: str | None = None, force: bool = False,
         metrics: list[str] | None = None) -> None:
    """Print the table (rich) and, with ``markdown``, write it there as Markdown too.

    Raises:
        UsageError: fewer than two runs, a missing or bad results file, or runs of different scenarios
            without ``force``.
    """
    from rich.table import Table

    if len(results) < 2:
        raise UsageError("compare needs at least two results.json files (or run folders)")
    runs = [load_run(p, label) for p, label in zip(results, unique_labels(results))]
    mismatch = check_same_scenario(runs)
    if mismatch and not force:
        raise UsageError(mismatch)
    headers, rows = compare_rows(runs, metrics or DEFAULT_METRICS)
    title = f"{runs[0].scenario_name}" + (" (different scenarios, --force)" if mismatch else "")
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 2 else "right")
    for r in rows:
        table.add_row(*r)
    table_console().print(table)
    if markdown:
        md = f"### {title}\n\n" + "\n".join(f"- {r.label}: `{r.path}`" for r in runs) + "\n\n" + markdown_table(headers, rows)
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown).write_text(md)
        print(f"markdown: {markdown}")
