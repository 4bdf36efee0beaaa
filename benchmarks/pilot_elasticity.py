"""How far steps of each size move with the pilot probes: a benchmark, not a test.

The drift correction (``workbench.runner.drift``) and the profile's pilot normalization
(``engines.sim.profiler.PilotProbe.speed_at``) scale every step of at least ``SCALE_LARGE_TOKENS`` tokens by the
large pilot's speed ratio, the 128-token prefill's: they assume a step of 3,000 tokens slows down with the
machine exactly as much as that pilot does (an elasticity of 1). This measures it. Rounds of ``SUBJECTS`` steps
on the real executor (smollm2-135m, float32), each step followed by the pilot pair (``PILOT_PROBES``), for
``--seconds``; then per subject:

- median ms and the spread of single runs (standard deviation of log seconds);
- ``slope k=K``: the least-squares slope of the subject's log seconds, averaged over windows of K rounds, on the
  large pilot's log seconds averaged over the same windows (each centred on its mean), and their correlation.
  Averaging takes the pilots' own run-to-run noise out, which flattens the slope of single runs (k=1): the slope
  at large k is the elasticity of the subject's time to the machine's phases as the pilot reads them;
- ``sd after /pilot^e``: the spread of single runs after dividing each by the speed of the pilots next to it
  (the round's mean pilot, nearest before and after, as ``speed_at``) raised to e, for e = 0 (raw), 0.5 and 1:
  whether the profile's normalization (e = 1) takes noise out of that size of step or adds it.

Usage::

    python benchmarks/pilot_elasticity.py [--seconds 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engines.real.model import LlamaModel  # noqa: E402
from engines.real.model_runner import ModelExecutor  # noqa: E402
from engines.real.model_store import resolve_model  # noqa: E402
from engines.sim.profiler import PILOT_PROBES, PROBE_GRID, GridStep, grid_batch  # noqa: E402
from workbench.runner import machine_info  # noqa: E402

# steps of 32 to 2,664 tokens, all in the large drift class (at least SCALE_LARGE_TOKENS tokens)
SUBJECTS = {"decode 32 rows": GridStep(32, 256), "prefill 128": GridStep(prefills=((128, 0),)),
            "prefill 512": GridStep(prefills=((512, 0),)), "prefill 2x512": GridStep(prefills=((512, 0),) * 2),
            "prefill 8x333": GridStep(prefills=((333, 0),) * 8)}
WINDOWS = (1, 2, 4, 8)
EXPONENTS = (0.0, 0.5, 1.0)


def measure(seconds: float) -> dict[str, list[float]]:
    """``{subject or "pilot small" / "pilot large": [seconds of each run]}``, one run of each subject per round,
    each followed by one run of each pilot probe, after one untimed run of every step (warm-up)."""
    ex = ModelExecutor(LlamaModel.from_dir(resolve_model("smollm2-135m"), torch.float32), 65536 // 16, 16)
    batches = {k: grid_batch(s, 16, 65536 // 16) for k, s in SUBJECTS.items()}
    pilots = {name: grid_batch(PROBE_GRID[i], 16, 65536 // 16) for name, i in zip(("pilot small", "pilot large"),
                                                                                   PILOT_PROBES)}
    rec: dict[str, list[float]] = {k: [] for k in (*batches, *pilots)}

    def timed(b) -> float:
        t0 = time.perf_counter()
        ex.execute(b)
        return time.perf_counter() - t0

    for b in (*batches.values(), *pilots.values()):
        timed(b)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for k, b in batches.items():
            rec[k].append(timed(b))
            for name, p in pilots.items():
                rec[name].append(timed(p))
    return rec


def analyse(rec: dict[str, list[float]]) -> dict:
    """Per subject: median, spread, slope and correlation on the large pilot per window size, and the spread
    after the pilot normalization per exponent (see the module docstring)."""
    n_sub = len(SUBJECTS)
    pil = np.log(rec["pilot large"])
    rounds = len(pil) // n_sub
    # the large pilot's timings by round, one after each subject: pil_r[round, subject]
    pil_r = pil[: rounds * n_sub].reshape(rounds, n_sub)
    x_round = pil_r.mean(axis=1)
    out = {}
    for j, k in enumerate(SUBJECTS):
        y = np.log(rec[k][:rounds])
        # the pilot runs nearest before and after each run of the subject (flat index i: the one right after it)
        i = np.arange(rounds) * n_sub + j
        near = np.where(i > 0, (pil[np.maximum(i - 1, 0)] + pil[i]) / 2, pil[i])
        row = {"median_ms": float(np.median(np.exp(y)) * 1e3), "sd_log": float(y.std()), "windows": {},
               "sd_after_normalization": {}}
        for w in WINDOWS:
            m = rounds // w
            if m < 3:
                continue
            xs = x_round[: m * w].reshape(m, w).mean(1)
            ys = y[: m * w].reshape(m, w).mean(1)
            row["windows"][w] = {"n": m, "slope": float(np.polyfit(xs, ys, 1)[0]),
                                 "corr": float(np.corrcoef(xs, ys)[0, 1])}
        yc, nc = y - y.mean(), near - near.mean()
        for e in EXPONENTS:
            row["sd_after_normalization"][e] = float(np.std(yc - e * nc))
        out[k] = row
    return {"rounds": rounds, "subjects": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="how long to measure (default 300)")
    ap.add_argument("--json", type=Path, help="write the timings and the analysis to this file")
    args = ap.parse_args()
    rec = measure(args.seconds)
    res = analyse(rec)
    m = machine_info()
    print(f"{res['rounds']} rounds; {m['processor']}, torch CPU capability {m.get('cpu_capability')}, "
          f"{torch.get_num_threads()} threads")
    head = " ".join(f"slope k={w:<2d}" for w in WINDOWS)
    print(f"{'subject':15s} {'median ms':>9s} {'sd':>6s}  {head}  sd after /pilot^e ({', '.join(map(str, EXPONENTS))})")
    for k, r in res["subjects"].items():
        sl = " ".join(f"{r['windows'][w]['slope']:4.2f} ({r['windows'][w]['corr']:+.2f})" if w in r["windows"]
                      else f"{'n/a':>11s}" for w in WINDOWS)
        sd = " ".join(f"{r['sd_after_normalization'][e]:.3f}" for e in EXPONENTS)
        print(f"{k:15s} {r['median_ms']:9.1f} {r['sd_log']:6.3f}  {sl}  {sd}")
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "timings": rec, **res}, indent=1))


if __name__ == "__main__":
    main()
