"""Print the simulator-fidelity table of the README from ``workbench run --repeat N`` results.

Usage: ``python benchmarks/fidelity_table.py RESULTS.json [LABEL=RESULTS.json ...]``

One markdown row per sim engine with a real twin: the signed errors of ``sim_error.dist`` against the mean of
the real repeats (output throughput; TTFT, TPOT, E2EL p50; TTFT, ITL, E2EL p99), the per-request E2EL MAPE
beside the real repeats' own (``sim_error.request.noise_floor``), the MAPE of per-shape step medians beside the
same figure against one real repeat for the cost model and for the other repeats
(``sim_error.step.shape_median_mape_per_repeat``, ``repeat_shape_median_mape``) and the real steps' noise
floor, the drift factors applied (small / large steps) beside the twin's own speed, and the
throughput / TTFT p50 / TPOT p50 / E2EL p50 errors at the twin's own speed (``sim_error.speed_matched``). A
figure past its bound (``workbench.fidelity.FIGURE_BOUNDS``; 12% for the per-request E2EL MAPE, 5% for the
per-shape step medians: the simulator issue's bounds) is marked X. Then, per real engine, output throughput
(mean of the repeats) and its repeat-to-repeat spread beside the GEMM probe's mean and spread, and the count of
bounded figures met. A figure whose error the repeats do not pin to within its bound (2 standard errors of the
real and simulated means together; ``workbench.fidelity.real_spread``) has that margin beside it (``+/-``), and
the misses among such figures are counted apart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from workbench.fidelity import FIGURE_BOUNDS, figure, real_spread

COLUMNS = tuple(FIGURE_BOUNDS)  # throughput, TTFT / TPOT / E2EL p50, TTFT / ITL / E2EL p99
E2EL_MAPE_BOUND = 0.12
STEP_BOUND = 0.05


def _pct(x: float | None, bound: float | None = None) -> tuple[str, int, int]:
    """(cell, bounded, met) of one signed relative error."""
    if x is None:
        return "n/a", 0, 0
    cell = f"{x:+.1%}"
    if bound is None:
        return cell, 0, 0
    ok = abs(x) <= bound
    return cell + ("" if ok else " X"), 1, int(ok)


def rows(label: str, results: dict) -> tuple[list[str], list[str], int, int, int]:
    """Table rows, real-engine lines, bounded figures, figures met and misses among figures the repeats do not pin
    of one results.json."""
    engines = results["engines"]
    out, real_lines, n, met = [], [], 0, 0
    loose = 0  # missed bounds that the repeats do not pin the error to
    for name, e in engines.items():
        err = (e.get("summary") or {}).get("sim_error")
        if not err:
            continue
        real = err["real_engine"]
        cells = []
        spread = real_spread(e["summary"], engines[real]["summary"]) or {}  # recomputed: older results lack sem
        for key in COLUMNS:
            c, b, m = _pct(figure(err["dist"], key), FIGURE_BOUNDS[key])
            sp = spread.get(key) or {}
            if sp.get("resolvable") is False:  # the means themselves are loose by more than the bound
                c += f" (+/-{2 * sp['error_sem']:.0%})"
                loose += b and not m
            cells.append(c)
            n, met = n + b, met + m
        rq = err["request"]
        floor = (rq.get("noise_floor") or {}).get("e2el_mape")
        c, b, m = _pct(rq.get("e2el_mape"), E2EL_MAPE_BOUND)
        cells.append(c.lstrip("+") + (f" ({floor:.1%})" if floor is not None else ""))
        n, met = n + b, met + m
        st = err["step"]
        c, b, m = _pct(st.get("shape_median_mape"), STEP_BOUND)
        nf, rf, mf = st.get("noise_floor"), st.get("repeat_shape_median_mape"), st.get("shape_median_mape_per_repeat")
        floors = ([f"one repeat: {mf:.1%} vs {rf:.1%}"] if None not in (rf, mf) else []) + (
            [f"step noise {nf:.1%}"] if nf is not None else [])
        cells.append(c.lstrip("+") + (f" ({'; '.join(floors)})" if floors else ""))
        n, met = n + b, met + m
        d = e.get("drift") or {}
        sm = err.get("speed_matched") or {}
        twin = "/".join("n/a" if sm.get(k) is None else f"{sm[k]:.2f}" for k in ("scale_small", "scale_large"))
        cells.append(f"{d.get('scale_small', 1):.2f} / {d.get('scale_large', 1):.2f} ({twin})")
        if sm.get("dist"):
            cells.append(" / ".join(_pct(figure(sm["dist"], k))[0] for k in COLUMNS[:4]))
        else:
            cells.append("n/a")
        out.append(f"| {label} | {name} / {real} | " + " | ".join(cells) + " |")
        rs = engines[real]["summary"]
        rep = (rs.get("repeats") or {})
        thr = (rep.get("metrics") or {}).get("output_throughput") or {}
        gemm = rep.get("gemm_gflops") or {}
        real_lines.append(
            f"- {label} {real}: {rs.get('output_throughput', float('nan')):.1f} tok/s"
            + (f" (spread {thr['spread']:.1%} over {rep.get('n')} repeats" if thr else " (one run")
            + (f"; GEMM probe {gemm['mean']:.0f} GFLOP/s, spread {gemm['spread']:.1%})" if gemm else ")"))
    return out, real_lines, n, met, loose


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    print("| scenario | pair | throughput | TTFT p50 | TPOT p50 | E2EL p50 | TTFT p99 | ITL p99 | E2EL p99 | "
          "request E2EL MAPE (real repeats among themselves) | steps (against one real repeat: the cost model vs "
          "the other repeats; step noise) | drift factors small / large "
          "(twin's own speed) | at the twin's speed |")
    print("|" + "---|" * 13)
    lines, total, total_met, total_loose, machine = [], 0, 0, 0, None
    for arg in argv:
        label, _, path = arg.rpartition("=")
        results = json.loads(Path(path).read_text())
        machine = machine or results.get("machine")
        r, real, n, met, loose = rows(label or Path(path).parent.name, results)
        print("\n".join(r))
        lines += real
        total, total_met, total_loose = total + n, total_met + met, total_loose + loose
    print()
    print("\n".join(lines))
    print(f"\n{total_met} of {total} bounded figures met" + (
        f"; {total_loose} of the misses are figures that the repeats do not pin to their bound (2 standard errors "
        f"of the real and sim means: '+/-')" if total_loose else ""))
    if machine:
        print(f"machine: {machine.get('processor')}, {machine.get('cpu_capability')}, "
              f"{machine.get('torch_threads')} torch threads")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
