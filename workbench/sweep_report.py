"""The sweep report: ``sweep.png`` and a self-contained ``sweep_report.html`` (the PNG inline).

Panels, for whichever x axes (:data:`X_AXES`) the sweep varies: against the offered request rate, output
throughput, TTFT p50/p99, E2EL p50/p99 and goodput; against closed-loop users (``trace.max_concurrency``),
the same and ITL p50/p99; against ``block_size``, KV waste (time-weighted, see
``workbench.metrics.FORMULAS``). One line per engine and combination of the other swept axes.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

# (column, dashed column or None, y label, what): a panel plots what against an x axis
THROUGHPUT = ("output_throughput", None, "output throughput (tok/s)", "output throughput")
TTFT = ("ttft_ms_p50", "ttft_ms_p99", "TTFT p50 (solid) / p99 (dashed), ms", "TTFT p50 / p99")
ITL = ("itl_ms_p50", "itl_ms_p99", "ITL p50 (solid) / p99 (dashed), ms", "ITL p50 / p99")
E2EL = ("e2el_ms_p50", "e2el_ms_p99", "E2EL p50 (solid) / p99 (dashed), ms", "E2EL p50 / p99")
GOODPUT = ("goodput", None, "goodput (req/s meeting the SLO)", "goodput")
KV_WASTE = ("kv_waste_frac", None, "KV waste (share of allocated slots)", "KV waste")
TABLE_COLUMNS = ["point", "engine", "kind", "block_size", "max_num_seqs", "request_rate", "max_concurrency",
                 "output_throughput", "goodput", "ttft_ms_p50", "ttft_ms_p99", "e2el_ms_p50", "e2el_ms_p99",
                 "kv_waste_frac", "num_preemptions"]


def _varies(df: pd.DataFrame, col: str) -> bool:
    return col in df and df[col].dropna().nunique() >= 2


def _is_rate_axis(key: str) -> bool:
    return key in ("trace.request_rate", "trace.synthetic.request_rate", "trace.time_scale")


def _wide(x: pd.Series) -> bool:
    """A log2 scale for x values spanning 8x or more."""
    return x.max() / max(x.min(), 1e-9) >= 8


@dataclass(frozen=True)
class XAxis:
    """An x axis of the sweep figure, drawn when its sweep.csv ``column`` varies.

    Attributes:
        column: the sweep.csv column on the x axis.
        label: the x axis' label (with its unit).
        name: ends the panel titles (``... vs <name>``).
        is_axis: whether a swept key is what this x axis shows (then it does not split lines).
        panels: what is plotted against it (see ``THROUGHPUT`` and the others).
        log2: whether the x values (a Series) want a log2 scale.
    """

    column: str
    label: str
    name: str
    is_axis: Callable[[str], bool]
    panels: tuple
    log2: Callable[[pd.Series], bool] = _wide


X_AXES = (
    XAxis("request_rate", "offered request rate (req/s)", "rate", _is_rate_axis, (THROUGHPUT, TTFT, E2EL, GOODPUT)),
    XAxis("max_concurrency", "concurrent users (max_concurrency)", "users", lambda a: a == "trace.max_concurrency",
          (THROUGHPUT, TTFT, ITL, E2EL, GOODPUT)),
    XAxis("block_size", "block_size (tokens)", "block_size", lambda a: a.endswith(".block_size"), (KV_WASTE,),
          lambda x: True),
)


def _num(v) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _series(df: pd.DataFrame, axes: list[str], exclude) -> list[tuple[str, pd.DataFrame]]:
    """Groups of rows for one line each: engine plus every other swept axis (not the x axis)."""
    others = [a for a in axes if a in df and not exclude(a) and a != "engine"]
    out = []
    for key, g in df.groupby(["engine"] + others, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        parts = [str(key[0])] + [f"{a.split('.')[-1]}={_num(v)}" for a, v in zip(others, key[1:])
                                 if not (isinstance(v, float) and math.isnan(v))]
        out.append((" ".join(parts), g))
    return out


def sweep_figure(df: pd.DataFrame, axes: list[str]):
    """The sweep's matplotlib figure (panels as in the module docstring); None when nothing varies."""
    panels = [(xa, p) for xa in X_AXES if _varies(df, xa.column) for p in xa.panels]
    if not panels:
        return None
    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axs = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 3.6 * nrow), squeeze=False)
    for ax in axs.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (xa, (col, col2, label, what)) in zip(axs.flat, panels):
        x = xa.column
        for i, (name, g) in enumerate(_series(df, axes, xa.is_axis)):
            g = g.dropna(subset=[x]).sort_values(x)
            if g.empty:
                continue
            color = f"C{i % 10}"
            ax.plot(g[x], g[col], "o-", color=color, label=name, ms=3)
            if col2:
                ax.plot(g[x], g[col2], "s--", color=color, ms=3)
        ax.set_xlabel(xa.label)
        if xa.log2(df[x].dropna()):
            ax.set_xscale("log", base=2)
        ax.set_ylabel(label, fontsize=8)
        ax.set_title(f"{what} vs {xa.name}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def write_sweep_report(df: pd.DataFrame, axes: list[str], out_dir: Path, title: str = "Sweep") -> tuple[Path, Path | None]:
    """Write ``sweep.png`` (when some axis varies) and ``sweep_report.html``; returns their paths."""
    fig = sweep_figure(df, axes)
    png_path = None
    img = ""
    if fig is not None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        png_path = out_dir / "sweep.png"
        png_path.write_bytes(buf.getvalue())
        img = f'<img alt="sweep curves" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'
    else:
        names = ", ".join(xa.column for xa in X_AXES)
        img = f"<p>No plotted axis ({names}) varies in this sweep; see the table.</p>"
    cols = [c for c in TABLE_COLUMNS if c in df] + [a for a in axes if a in df and a not in TABLE_COLUMNS]

    def cell(c, v):
        if c == "point" and (out_dir / str(v) / "report.html").exists():
            return f'<a href="{html.escape(str(v))}/report.html">{html.escape(str(v))}</a>'
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.4g}"
        return html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{cell(c, r[c])}</td>" for c in cols) + "</tr>" for _, r in df.iterrows())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}} img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{df['point'].nunique()} points, axes: {html.escape(', '.join(axes))}. Rows: one per point and engine
(also in <code>sweep.csv</code>); each point's own report is linked from its id.</p>
{img}
<table><tr>{head}</tr>{body}</table>
</body></html>
"""
    html_path = out_dir / "sweep_report.html"
    html_path.write_text(page)
    return html_path, png_path
