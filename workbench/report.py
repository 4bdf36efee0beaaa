"""Run outputs: per-engine CSVs, PNG plots and one self-contained ``report.html`` (images inline)."""

from __future__ import annotations

import base64
import html
import io
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from workbench.metrics import request_metrics  # noqa: E402

REQUEST_COLUMNS = ["request_id", "status", "error", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s",
                   "prompt_tokens", "output_tokens", "num_preemptions", "ttft_ms", "tpot_ms", "e2el_ms", "token_times_s",
                   "output_tokens_estimated", "suspect"]


def requests_frame(outputs) -> pd.DataFrame:
    """One row per request: times in seconds from the run's start, latencies in ms, and every output
    token's time (``token_times_s``, space-separated seconds); kind openai's ``output_tokens_estimated``
    (the count is one per output chunk) and ``suspect`` (why the stream disagrees with its usage; empty
    when it agrees, and for the other kinds)."""
    rows = []
    for o in outputs:
        m = request_metrics(o) if o.finish_reason in ("stop", "length") else None
        rows.append({
            "request_id": o.request_id, "status": o.finish_reason, "error": o.error or "",
            "arrival_s": o.arrival_time, "first_scheduled_s": o.first_scheduled_time,
            "first_token_s": o.first_token_time, "finish_s": o.finished_time,
            "prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.token_ids),
            "num_preemptions": o.num_preemptions,
            "ttft_ms": m.ttft * 1e3 if m else None, "tpot_ms": m.tpot * 1e3 if m and m.tpot is not None else None,
            "e2el_ms": m.e2el * 1e3 if m else None,
            "token_times_s": " ".join(f"{t:.4f}" for t in o.token_times),
            "output_tokens_estimated": bool(getattr(o, "output_tokens_estimated", False)),
            "suspect": getattr(o, "suspect", None) or "",
        })
    return pd.DataFrame(rows, columns=REQUEST_COLUMNS)


def steps_frame(steps) -> pd.DataFrame:
    """One row per engine step (``StepRecord`` fields)."""
    return pd.DataFrame([asdict(s) for s in steps])


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def make_plots(results: dict, frames: dict[str, tuple[pd.DataFrame, pd.DataFrame]]) -> dict[str, bytes]:
    """PNG bytes by file name: throughput, latency CDFs, KV usage, waste breakdown, batch and preemptions."""
    names = list(results["engines"])
    summ = {n: results["engines"][n]["summary"] for n in names}
    plots = {}

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(names, [summ[n]["output_throughput"] for n in names], color="tab:blue")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput")
    ax.tick_params(axis="x", rotation=20)
    plots["throughput.png"] = _png(fig)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, col in zip(axes, ["ttft_ms", "tpot_ms", "e2el_ms"]):
        for n in names:
            v = np.sort(frames[n][0][col].dropna().to_numpy(dtype=float))
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=n)
        ax.set_xlabel(col.replace("_ms", " (ms)").upper())
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    plots["latency_cdf.png"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for n in names:
        st = frames[n][1]
        if len(st):
            ax.plot(st["start"], st["kv_allocated"] / st["kv_total_slots"].clip(lower=1), label=f"{n} allocated")
            ax.plot(st["start"], st["kv_token_states"] / st["kv_total_slots"].clip(lower=1), "--", label=f"{n} token states")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("share of KV pool")
    ax.set_title("KV cache usage over time")
    ax.legend(fontsize=6)
    plots["kv_usage.png"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 3.2))
    bottom = np.zeros(len(names))
    for part, color in [("token_states", "tab:green"), ("reserved", "tab:orange"), ("internal_frag", "tab:red"),
                        ("external_frag", "tab:purple")]:
        vals = np.array([summ[n]["kv_breakdown"][part] for n in names])
        ax.bar(names, vals, bottom=bottom, label=part, color=color)
        bottom += vals
    ax.set_ylabel("share of allocated KV slots")
    ax.set_title("KV waste breakdown (time-weighted)")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", rotation=20)
    plots["kv_waste.png"] = _png(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.2))
    for n in names:
        st = frames[n][1]
        if len(st):
            a1.plot(st["start"], st["num_seqs"] - st["num_padding_seqs"], label=n)
            a2.plot(st["start"], st["num_preemptions"].cumsum(), label=n)
    a1.set_title("Batch size (requests per step)")
    a2.set_title("Preemptions (cumulative)")
    for a in (a1, a2):
        a.set_xlabel("time (s)")
        a.grid(alpha=0.3)
    a1.legend(fontsize=7)
    plots["batch_preemptions.png"] = _png(fig)
    if any(summ[n].get("prefix_cache_hits", 0) or summ[n].get("num_preemptions_swap", 0)
           or summ[n].get("kv_shared_saved_mean", 0) for n in names):  # the memory-management panels, when there is something to show
        plots["memory_management.png"] = memory_plot(names, summ)
    pairs = [(n, summ[n]["sim_error"]["real_engine"]) for n in names if summ[n].get("sim_error")]
    if pairs:
        plots["sim_fidelity.png"] = fidelity_plot(pairs, frames)
    return plots


def fidelity_plot(pairs: list[tuple[str, str]], frames: dict[str, tuple[pd.DataFrame, pd.DataFrame]]) -> bytes:
    """One row per (sim engine, real engine) pair: TTFT and E2EL CDFs of both overlaid, and each request's
    simulated E2EL against its real E2EL (matched by id; the diagonal is a perfect simulator). The real side is
    the engine's first run."""
    fig, axes = plt.subplots(len(pairs), 3, figsize=(12, 3.2 * len(pairs)), squeeze=False)
    for row, (sim, real) in zip(axes, pairs):
        fs, fr = frames[sim][0], frames[real][0]
        for ax, col in zip(row[:2], ("ttft_ms", "e2el_ms")):
            for name, f, style in ((real, fr, "-"), (sim, fs, "--")):
                v = np.sort(f[col].dropna().to_numpy(dtype=float))
                if v.size:
                    ax.plot(v, np.arange(1, v.size + 1) / v.size, style, label=name)
            ax.set_xlabel(col.replace("_ms", " (ms)").upper())
            ax.set_ylabel("CDF")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        m = fr[["request_id", "e2el_ms"]].merge(fs[["request_id", "e2el_ms"]], on="request_id",
                                                 suffixes=("_real", "_sim")).dropna()
        ax = row[2]
        ax.scatter(m["e2el_ms_real"], m["e2el_ms_sim"], s=8)
        if len(m):
            hi = float(max(m["e2el_ms_real"].max(), m["e2el_ms_sim"].max()))
            ax.plot([0, hi], [0, hi], "k:", lw=1)
        ax.set_xlabel(f"{real} E2EL (ms)")
        ax.set_ylabel(f"{sim} E2EL (ms)")
        ax.set_title("per request", fontsize=9)
        ax.grid(alpha=0.3)
    return _png(fig)


def memory_plot(names: list[str], summ: dict) -> bytes:
    """Memory-management panels: prefix-cache hit rate (measured vs the trace's ideal), preemptions by mode, swap
    traffic, and KV memory saved by block sharing."""
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
    x = np.arange(len(names))
    hit = [summ[n].get("prefix_cache_hit_rate", 0.0) for n in names]
    ideal = [summ[n].get("prefix_cache_ideal_hit_rate", 0.0) for n in names]
    axes[0].bar(x - 0.2, hit, 0.4, label="measured")
    axes[0].bar(x + 0.2, ideal, 0.4, label="trace ideal")
    axes[0].set_title("Prefix cache hit rate")
    axes[0].legend(fontsize=7)
    rec = np.array([summ[n].get("num_preemptions_recompute", summ[n]["num_preemptions"]) for n in names])
    swp = np.array([summ[n].get("num_preemptions_swap", 0) for n in names])
    axes[1].bar(x, rec, label="recompute", color="tab:red")
    axes[1].bar(x, swp, bottom=rec, label="swap", color="tab:purple")
    axes[1].set_title("Preemptions by mode")
    axes[1].legend(fontsize=7)
    axes[2].bar(x, [summ[n].get("swap_bytes", 0) / 2**20 for n in names], color="tab:purple")
    axes[2].set_title("Swap traffic (MiB)")
    axes[3].bar(x, [summ[n].get("kv_shared_saved_mean", 0.0) for n in names], color="tab:green")
    axes[3].set_title("KV slots saved by sharing (mean)")
    for a in axes:
        a.set_xticks(x, names, rotation=20, fontsize=7)
    return _png(fig)


def memory_rows(results: dict) -> tuple[list[str], list[list]]:
    """Memory-management table: prefix caching, preemptions by mode, swap traffic, sharing."""
    headers = ["engine", "prefix cache queries", "hits", "hit rate", "trace ideal hit rate", "preemptions recompute",
               "preemptions swap", "swap MiB", "swap time s", "KV slots saved by sharing (mean)"]
    rows = []
    for n, e in results["engines"].items():
        s = e["summary"]
        ideal = s.get("prefix_cache_ideal_hit_rate")
        rows.append([n, s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0),
                     f"{s.get('prefix_cache_hit_rate', 0.0):.1%}", f"{ideal:.1%}" if ideal is not None else "",
                     s.get("num_preemptions_recompute", s["num_preemptions"]), s.get("num_preemptions_swap", 0),
                     s.get("swap_bytes", 0) / 2**20, s.get("swap_time_s", 0.0), s.get("kv_shared_saved_mean", 0.0)])
    return headers, rows


def _table(headers: list[str], rows: list[list]) -> str:
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def _fmt(v) -> str:
    if v is None:  # a latency no request defines (TPOT, ITL of one-token requests)
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def summary_rows(results: dict) -> tuple[list[str], list[list]]:
    headers = ["engine", "kind", "req/s", "output tok/s", "total tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
               "ITL p99 ms", "E2EL p50 ms", "E2EL p99 ms", "goodput req/s", "KV waste", "preemptions", "finished",
               "rejected", "failed"]
    rows = []
    for n, e in results["engines"].items():
        s = e["summary"]
        rows.append([n, e["kind"], s["request_throughput"], s["output_throughput"], s["total_token_throughput"],
                     s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["tpot_ms"]["p50"], s["itl_ms"]["p99"],
                     s["e2el_ms"]["p50"], s["e2el_ms"]["p99"], s["goodput"], f"{s['kv_waste_frac']:.1%}",
                     s["num_preemptions"], s["num_finished"], s["num_rejected"], s["num_failed"]])
    return headers, rows


def load_lines(results: dict) -> list[str]:
    """Plain-text lines on the machine, the relative load the trace ran at and the engines' saturation
    capacities (empty lists of the last two without ``trace.load``)."""
    m = results.get("machine", {})
    lines = [f"machine: {m.get('processor', '?')}, {m.get('cpus', '?')} CPUs, torch CPU kernels "
             f"{m.get('cpu_capability', '?')}, {m.get('torch_threads', '?')} torch threads"]
    load = results.get("load")
    if load:
        ts = f", time scale {load['time_scale']:.3g} of the recorded arrivals" if load.get("time_scale") else ""
        lines.append(f"load: {load['factor']:g} x capacity of {load['engine']} ({load['capacity_req_s']:.3g} req/s, "
                     f"{load['method']} of {load['probe_requests']} requests) = {load['offered_req_s']:.3g} req/s "
                     f"offered{ts}")
    cap = results.get("capacity")
    if cap:
        caps = ", ".join(f"{n} {c['capacity_req_s']:.3g} req/s ({c['output_tok_s']:.4g} out tok/s)"
                         for n, c in cap["engines"].items())
        lines.append(f"saturation capacity: {caps}")
        if cap["ratios"]:
            lines.append("capacity ratio: " + ", ".join(f"{k} {v:.2f}x" for k, v in cap["ratios"].items()))
    for n, e in results["engines"].items():
        sat = e["summary"].get("saturation") or {}
        if sat.get("final_queue") is not None:
            kept = "kept up" if sat["final_queue"] == 0 and sat["waiting_time_frac"] < 0.1 else "saturated"
            lines.append(f"{n}: {kept} (queue at the last arrival {sat['final_queue']:.3g}, waiting queue "
                         f"{sat['waiting_time_frac']:.0%} of the run)")
        rep = e["summary"].get("repeats")
        if rep:
            t = rep["metrics"]["output_throughput"]
            line = (f"{n}: {rep['n']} runs, output throughput mean {t['mean']:.4g} tok/s, std {t['std']:.3g}, "
                    f"range {t['min']:.4g}-{t['max']:.4g} (spread {t['spread']:.1%})")
            if rep.get("gemm_gflops"):
                g = rep["gemm_gflops"]
                line += f"; GEMM probe before each run {g['mean']:.0f} GFLOP/s (spread {g['spread']:.1%})"
            lines.append(line)
    return lines


def _within(spread: dict | None) -> str:
    """``k of n`` distribution figures that lie within the real repeats' range (n/a without repeats)."""
    if not spread:
        return "n/a"
    return f"{sum(v['within_range'] for v in spread.values())} of {len(spread)}"


def _unpinned(spread: dict | None) -> str:
    """The bounded figures whose error the repeats do not pin to within the bound, with the repeats that would
    pin them (``workbench.fidelity.unresolved``); ``none`` or n/a without repeats."""
    from workbench.fidelity import figure_name, unresolved

    if not spread or not any("sem" in v for v in spread.values()):
        return "n/a"
    loose = unresolved(spread)
    return ", ".join(f"{figure_name(k)} ({v['repeats_for_bound']})" for k, v in loose.items()) or "none"


def sim_error_rows(results: dict) -> tuple[list[str], list[list]]:
    """The sim-vs-real error table (``summary.sim_error``, see ``workbench.fidelity``): one row per sim engine,
    signed errors of the distribution, per-request MAPEs (and the real repeats' own, leave one out), the step
    level's per-shape medians (also at the twin's own speed and among the real repeats) and noise floor."""
    def pct(x, signed=True):
        return "n/a" if x is None else (f"{x:+.1%}" if signed else f"{x:.1%}")

    headers = ["sim engine", "vs real engine", "output throughput", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p99",
               "E2EL p50", "E2EL p99", "request TTFT MAPE", "request E2EL MAPE",
               "request E2EL MAPE among the real repeats", "step MAPE",
               "step per-shape median MAPE", "the same at the twin's own speed",
               "the same against one real repeat", "the other real repeats against one", "step noise floor",
               "figures within the real repeats' range",
               "bounds the repeats cannot pin (the repeats that would)"]
    rows = []
    for n, e in results["engines"].items():
        err = e["summary"].get("sim_error")
        if not err:
            continue
        d, rq, st = err["dist"], err["request"], err["step"]
        rows.append([n, err["real_engine"], pct(d["output_throughput"]), pct(d["ttft_ms"]["p50"]),
                     pct(d["ttft_ms"]["p99"]), pct(d["tpot_ms"]["p50"]), pct(d["itl_ms"]["p99"]),
                     pct(d["e2el_ms"]["p50"]), pct(d["e2el_ms"]["p99"]), pct(rq.get("ttft_mape"), False),
                     pct(rq.get("e2el_mape"), False),
                     pct((rq.get("noise_floor") or {}).get("e2el_mape"), False), pct(st.get("mape"), False),
                     pct(st.get("shape_median_mape"), False),
                     pct(((err.get("speed_matched") or {}).get("step") or {}).get("shape_median_mape"), False),
                     pct(st.get("shape_median_mape_per_repeat"), False), pct(st.get("repeat_shape_median_mape"), False),
                     pct(st.get("noise_floor"), False),
                     _within(err.get("real_spread")), _unpinned(err.get("real_spread"))])
    return headers, rows


def cluster_rows(results: dict) -> tuple[list[str], list[list]]:
    """One row per router (cluster-wide, ``replica`` = all) and one per replica of the cluster; a real
    cluster's sim twin follows, its routers marked ``(sim twin)``."""
    headers = ["router", "replica", "engine", "requests", "finished", "rejected", "failed", "steps",
               "prefix hit rate", "KV usage", "req/s", "output tok/s", "TTFT p99 ms", "TPOT p99 ms", "E2EL p99 ms"]
    rows = []
    cl = results.get("cluster") or {}
    runs = [(router, c) for router, c in cl.get("routers", {}).items()]
    runs += [(f"{router} (sim twin)", c) for router, c in (cl.get("twin") or {}).get("routers", {}).items()]
    for router, c in runs:
        for label, engine, s in [("all", "", c["summary"])] + [(str(r["replica"]), r["engine"], r["summary"])
                                                              for r in c["replicas"]]:
            rows.append([router, label, engine, s["num_requests"], s["num_finished"], s["num_rejected"],
                         s["num_failed"], s["num_steps"], f"{s['prefix_cache_hit_rate']:.1%}",
                         f"{s['kv_usage_mean']:.1%}", s["request_throughput"], s["output_throughput"],
                         s["ttft_ms"]["p99"], s["tpot_ms"]["p99"], s["e2el_ms"]["p99"]])
    return headers, rows


def write_html(path: Path, results: dict, plots: dict[str, bytes]) -> None:
    """One self-contained page: summary table, sim-vs-real errors, every plot inline, formulas."""
    imgs = "".join(
        f'<figure><img alt="{html.escape(k)}" src="data:image/png;base64,{base64.b64encode(v).decode()}">'
        f"<figcaption>{html.escape(k)}</figcaption></figure>" for k, v in plots.items())
    sim_h, sim_r = sim_error_rows(results)
    sim = _table(sim_h, sim_r) if sim_r else "<p>No simulated engine with a real engine of the same policy.</p>"
    formulas = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in results["formulas"].items())
    sc = results["scenario"]
    cluster = ""
    if results.get("cluster"):
        c = results["cluster"]
        groups = ", ".join(f"{r['count']} x {r['engine']}" for r in c["replicas"])
        kind = "real engines, one thread each" if c.get("real") else "simulated"
        cluster = (f"<h2>Cluster what-if</h2><p>{c['num_replicas']} replicas ({html.escape(groups)}; {kind}); "
                   f"prefix_aware load bound {c['max_imbalance']} requests; the trace's ideal prefix-cache hit rate (one "
                   f"unlimited shared cache) {c.get('prefix_cache_ideal_hit_rate', 0.0):.1%}</p>"
                   f"{_table(*cluster_rows(results))}")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(sc['name'])} - workbench report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1300px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #bbb;padding:3px 7px;text-align:right}}th{{background:#eee}}td:first-child{{text-align:left}}
figure{{display:inline-block;margin:1em}}img{{max-width:100%}}</style></head><body>
<h1>Scenario {html.escape(sc['name'])}</h1>
<p>hash {html.escape(results['scenario_hash'])} &middot; {results['num_requests']} requests &middot;
model {html.escape(sc['model'])} &middot; {html.escape(results['created'])}</p>
<h2>Load and capacity</h2><ul>{"".join(f"<li>{html.escape(x)}</li>" for x in load_lines(results))}</ul>
<h2>Summary</h2>{_table(*summary_rows(results))}
<h2>Simulator vs real</h2>{sim}
<h2>Memory management</h2>{_table(*memory_rows(results))}{cluster}
<h2>Plots</h2>{imgs}
<h2>Formulas</h2><ul>{formulas}</ul>
<script>/* render self-check, read by the tests through a headless browser */
window.addEventListener("load", () => {{
  const imgs = [...document.images];
  document.body.dataset.imagesRendered = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.imagesTotal = imgs.length;
  document.body.dataset.tableRows = document.querySelectorAll("table tbody tr").length;
}});</script>
</body></html>"""
    path.write_text(page, encoding="utf-8")
