"""``workbench paper-check``: sweep a scenario's request rate on its sim engines and find, for each,
the highest rate it sustains before normalized latency blows up (PagedAttention paper, Fig. 12).

Normalized latency (the paper's metric, Sec. 6.1): the mean over finished requests of end-to-end
latency divided by output tokens (s/token). A system "sustains" a rate while its normalized latency
stays at or below ``threshold``; the crossing between two swept rates is linearly interpolated.
"""

from __future__ import annotations

import sys
from pathlib import Path

from engines.sim.simulator import simulate
from workbench.errors import usage_errors
from workbench.replay import make_requests
from workbench.scenario import Scenario, apply_overrides, load_scenario, load_scenario_trace, validate_scenario


def _at_rate(scenario: Scenario, rate: float) -> Scenario:
    data = apply_overrides(scenario.model_dump(mode="json", exclude_none=True), {"trace.synthetic.request_rate": rate}
                           if scenario.trace.format == "synthetic" else {"trace.request_rate": rate})
    return validate_scenario(data, "<paper-check>", base_dir=scenario.base_dir, check_files=False)


def normalized_latency(outputs) -> float:
    """Mean of E2EL / output tokens over finished requests (s/token); inf when none finished."""
    vals = [(o.finished_time - o.arrival_time) / len(o.token_ids) for o in outputs
            if o.finish_reason in ("stop", "length") and o.token_ids]
    return sum(vals) / len(vals) if vals else float("inf")


def sweep(scenario: Scenario, rates: list[float], progress=None) -> list[dict]:
    """One row per (rate, sim engine): normalized latency (s/token), finished/rejected counts, KV blocks.

    Raises:
        ValueError: the scenario has no sim engine, or an engine cannot be built.
    """
    from engines.factory import build_engine
    from workbench.runner import engine_config

    engines = [e for e in scenario.engines if e.kind == "sim"]
    if not engines:
        raise ValueError("paper-check needs sim engines")
    rows = []
    for rate in rates:
        sc = _at_rate(scenario, rate)
        trace = load_scenario_trace(sc, None)
        for spec in sc.engines:
            if spec.kind != "sim":
                continue
            eng = build_engine(engine_config(sc, spec, None, None))
            outs = simulate(eng, make_requests(trace, None))
            fin = [o for o in outs if o.finish_reason in ("stop", "length")]
            rows.append({"rate": rate, "engine": spec.name, "normalized_latency_s_per_token": normalized_latency(outs),
                         "finished": len(fin), "rejected": len(outs) - len(fin),
                         "kv_blocks": getattr(eng.scheduler.kv, "num_blocks", None),
                         "mean_running": sum(s.num_running for s in eng.steps) / max(1, len(eng.steps))})
            if progress:
                progress(rows[-1])
    return rows


def sustained_rates(rows: list[dict], threshold: float) -> dict[str, float | None]:
    """Per engine: the rate where normalized latency crosses ``threshold`` (interpolated between swept
    rates); the highest swept rate if it never crosses; None if even the lowest rate exceeds it."""
    out: dict[str, float | None] = {}
    for name in dict.fromkeys(r["engine"] for r in rows):
        pts = sorted((r["rate"], r["normalized_latency_s_per_token"]) for r in rows if r["engine"] == name)
        out[name] = pts[-1][0]
        if pts[0][1] > threshold:
            out[name] = None
            continue
        for (r0, y0), (r1, y1) in zip(pts, pts[1:]):
            if y1 > threshold:
                out[name] = r0 + (r1 - r0) * (threshold - y0) / (y1 - y0) if y1 != float("inf") else r0
                break
    return out


def write_outputs(rows: list[dict], sustained: dict, threshold: float, out_dir: Path, title: str) -> list[Path]:
    """``sweep.csv``, ``sustained.csv`` and ``normalized_latency.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    df.to_csv(out_dir / "sweep.csv", index=False)
    pd.DataFrame([{"engine": k, "sustained_rate": v} for k, v in sustained.items()]).to_csv(
        out_dir / "sustained.csv", index=False)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, g in df.groupby("engine", sort=False):
        ax.plot(g.rate, g.normalized_latency_s_per_token.clip(upper=threshold * 3), "o-", ms=3, label=name)
    ax.axhline(threshold, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)", ylim=(0, threshold * 1.5), title=title)
    ax.title.set_fontsize(8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "normalized_latency.png", dpi=110)
    plt.close(fig)
    return [out_dir / "sweep.csv", out_dir / "sustained.csv", out_dir / "normalized_latency.png"]


def main(scenario: str, rates: str = "0.5,1,1.25,1.5,1.75,2,2.5,3,3.5,4,5", threshold: float = 0.1,
         out: str = "reports/runs/paper-check") -> None:
    """Sweep ``rates`` (comma-separated req/s) on the scenario's sim engines, print each rate's normalized
    latency (stderr) and then the rate each engine sustains and its ratio to the first engine's; write
    :func:`write_outputs` into ``out``.

    Raises:
        UsageError: a bad scenario, rate list or engine setting, or no sim engine.
    """
    sc = load_scenario(scenario)
    with usage_errors(ValueError):
        rs = sorted(float(x) for x in rates.split(",") if x.strip())
        rows = sweep(sc, rs, lambda r: print(f"rate {r['rate']:g}  {r['engine']:12s}  "
                                             f"{r['normalized_latency_s_per_token']:.3f} s/token", file=sys.stderr))
    sus = sustained_rates(rows, threshold)
    write_outputs(rows, sus, threshold, Path(out), f"{sc.name}: normalized latency vs rate")
    first = next(iter(sus))
    print(f"sustained rate (normalized latency <= {threshold} s/token):")
    for name, v in sus.items():
        ratio = f"{sus[first] / v:.2f}x" if v and sus[first] else "-"
        print(f"  {name:12s} {v if v is None else round(v, 3)} req/s   {first} / {name}: {ratio}")
    print(out)
