"""The peer-concurrency report: reads a ``workbench sweep`` of ``scenarios/peers/concurrency.yaml`` and writes
``reports/peers/concurrency.md`` (table, verdict, commands, versions, machine) and its plots
(``concurrency.png``: output throughput, TTFT p50 and p99, ITL p99 and E2EL p99 against users, one line per
server).

    python benchmarks/peers/concurrency_report.py SWEEP_DIR [SWEEP_DIR ...] [--out reports/peers]

With several sweep folders, a later folder's rows replace an earlier one's for the same server and user count
(a re-run of some servers). The prose of the report (verdict, commands, versions) is kept from an existing
``concurrency.md`` above its ``<!-- tables -->`` marker; the tables below it are rewritten.

Verdict rule (the write-up's claim is that a llama.cpp server's latency climbs steeply at about 5 users while
vLLM holds 50): for each server, the first user count at which TTFT p99 or ITL p99 passes twice its
single-user value, and its output throughput at 50 users relative to its best.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pandas as pd

METRICS = [("output_throughput", "output tok/s"), ("ttft_ms_p50", "TTFT p50 (ms)"), ("ttft_ms_p99", "TTFT p99 (ms)"),
           ("itl_ms_p99", "ITL p99 (ms)"), ("e2el_ms_p99", "E2EL p99 (ms)")]
ORDER = ["wb-paged", "wb-static", "llama-1slot", "llama-nslot", "vllm", "sim-paged", "sim-static"]


def load(sweeps: list[Path]) -> pd.DataFrame:
    frames = []
    for i, sweep in enumerate(sweeps):
        df = pd.read_csv(sweep / "sweep.csv")
        users = "trace.max_concurrency" if "trace.max_concurrency" in df else "max_concurrency"
        frames.append(df.rename(columns={users: "users"}).assign(_order=i, _sweep=str(sweep)))
    df = pd.concat(frames).sort_values("_order").drop_duplicates(["engine", "users"], keep="last")
    return df.sort_values(["engine", "users"])


def first_blowup(g: pd.DataFrame) -> tuple[int | None, str]:
    """The first user count where TTFT p99 or ITL p99 exceeds 2x its single-user value."""
    base = g[g.users == g.users.min()].iloc[0]
    for _, r in g.iterrows():
        for col, name in (("ttft_ms_p99", "TTFT p99"), ("itl_ms_p99", "ITL p99")):
            b, v = base[col], r[col]
            if pd.notna(b) and pd.notna(v) and b > 0 and v > 2 * b:
                return int(r.users), f"{name} {v:.0f} ms vs {b:.0f} ms at 1 user"
    return None, "never (up to the largest user count)"


def plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.6))
    for ax, (col, label) in zip(axes, METRICS):
        for name in [n for n in ORDER if n in set(df.engine)]:
            g = df[df.engine == name]
            ax.plot(g.users, g[col], marker="o", ms=3, label=name, ls="--" if name.startswith("sim") else "-")
        ax.set_xscale("log", base=2)
        if col != "output_throughput":
            ax.set_yscale("log")
        ax.set_xlabel("users (closed-loop concurrency)")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweeps", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=Path("reports/peers"))
    a = ap.parse_args()
    df = load(a.sweeps)
    a.out.mkdir(parents=True, exist_ok=True)
    plot(df, a.out / "concurrency.png")
    any_point = json.loads(next(a.sweeps[0].glob("p*/results.json")).read_text())
    machine = any_point.get("machine", {})
    md = a.out / "concurrency.md"
    marker = "<!-- tables -->"
    head = md.read_text().split(marker)[0].rstrip() + "\n\n" if md.exists() and marker in md.read_text() else \
        "# Users against real servers: does llama.cpp fall over at about 5 users while vLLM holds 50?\n\n"
    lines = [head + marker, ""]
    lines += [f"Machine: {machine.get('processor')}, {machine.get('cpus')} cores, torch CPU capability "
              f"{machine.get('cpu_capability')}; float32 SmolLM2-135M-Instruct everywhere. Rows from: "
              + ", ".join(sorted({f"`{p}`" for p in df._sweep})) + ".", ""]
    lines += ["![throughput and latency against users](concurrency.png)", ""]
    users = sorted(df.users.unique())
    for col, label in METRICS:
        lines += [f"**{label}**", "", "| server | " + " | ".join(str(u) for u in users) + " |",
                  "|---|" + "---|" * len(users)]
        for name in [n for n in ORDER if n in set(df.engine)]:
            g = df[df.engine == name].set_index("users")
            lines.append(f"| {name} | " + " | ".join(fmt(g[col].get(u)) for u in users) + " |")
        lines.append("")
    lines += ["**Where latency passes 2x its single-user value; throughput at 50 users**", "",
              "| server | first users with p99 TTFT or ITL > 2x 1-user | what | tok/s at 50 users | best tok/s |",
              "|---|---|---|---|---|"]
    for name in [n for n in ORDER if n in set(df.engine)]:
        g = df[df.engine == name]
        at, what = first_blowup(g)
        t50 = g[g.users == 50].output_throughput
        lines.append(f"| {name} | {at if at is not None else '-'} | {what} | "
                     f"{fmt(t50.iloc[0]) if len(t50) else 'n/a'} | {fmt(g.output_throughput.max())} |")
    lines.append("")
    md.write_text("\n".join(lines) + "\n")
    print(md)


if __name__ == "__main__":
    main()
