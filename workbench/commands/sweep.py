"""``workbench sweep``: the Cartesian grid of ``--set`` overrides (``workbench.sweep``), one results folder
per point, ``sweep.csv`` and the sweep report."""

from __future__ import annotations

from workbench.errors import UsageError, usage_errors


def main(scenario: str, items: list[str], jobs: int = 0, executor: str = "local", ray_address: str | None = None,
         out: str | None = None, point_reports: bool = True) -> None:
    """Run the sweep into ``out`` (default ``reports/runs/sweep-<name>-<time>``); print the point and row
    counts and where sweep.csv and the report are.

    Raises:
        UsageError: no axis, a bad axis, point, executor or ``jobs``, or Ray missing for ``--executor ray``.
    """
    import datetime as dt
    from pathlib import Path

    from workbench.sweep import run_sweep

    if not items:
        raise UsageError("sweep needs at least one --set KEY=V1,V2,... axis")
    if jobs < 0:
        raise UsageError(f"--jobs must be >= 0, got {jobs}")
    if executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise UsageError("--executor ray needs Ray: pip install 'llm-serving-workbench[ray]'") from None
    stem = Path(scenario).stem
    out_dir = Path(out) if out else Path("reports/runs") / f"sweep-{stem}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    with usage_errors(ValueError):
        df = run_sweep(scenario, items, out_dir, jobs, executor, ray_address, point_reports)
    print(f"{df['point'].nunique()} points, {len(df)} rows: {out_dir / 'sweep.csv'}")
    print(f"report: {out_dir / 'sweep_report.html'}")
    print(out_dir)
