"""The machine's speed phases: five fixed steps on the real executor, timed in interleaved rounds, one process.

Each round runs a 1-row decode, an 8-row decode at context 320, prefills of 128 and 384 tokens (3 times each)
and a prefill of 8 prompts x 333 tokens (once). Prints each step's median, mean and range, then each round's
mean time of each step over that step's median (the machine's speed, round by round) and the correlation of
those per-round ratios between the steps: shapes that move together say the drift is the machine's, common to
every step, which is what the pilot probes (``engines.sim.profiler.PilotProbe``) rely on. About 5 s a round on
a 2-core CPU. Usage::

    python benchmarks/machine_phases.py [ROUNDS]   # default 15
"""

from __future__ import annotations

import statistics
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
from engines.sim.profiler import GridStep, grid_batch  # noqa: E402

STEPS = {"dec1": GridStep(1, 64), "dec8": GridStep(8, 320), "pre128": GridStep(prefills=((128, 0),)),
         "pre384": GridStep(prefills=((384, 0),)), "big8x333": GridStep(prefills=((333, 0),) * 8)}
RUNS = {"big8x333": 1}  # runs per round (3 for the others)


def main(rounds: int) -> None:
    ex = ModelExecutor(LlamaModel.from_dir(resolve_model("smollm2-135m"), torch.float32), 65536 // 16, 16)
    batches = {k: grid_batch(s, 16, 65536 // 16) for k, s in STEPS.items()}
    for b in batches.values():  # warm-up
        ex.execute(b)
    times: dict[str, list[list[float]]] = {k: [] for k in batches}
    for _ in range(rounds):
        for k, b in batches.items():
            ts = []
            for _ in range(RUNS.get(k, 3)):
                t0 = time.perf_counter()
                ex.execute(b)
                ts.append(time.perf_counter() - t0)
            times[k].append(ts)
    med = {}
    for k, rs in times.items():
        flat = [t for r in rs for t in r]
        med[k] = statistics.median(flat)
        print(f"{k:9s} n={len(flat):3d} median {med[k] * 1e3:8.1f} ms, mean {statistics.fmean(flat) * 1e3:8.1f} ms, "
              f"range {min(flat) * 1e3:.1f}-{max(flat) * 1e3:.1f} ms")
    ratios = {k: [statistics.fmean(r) / med[k] for r in rs] for k, rs in times.items()}
    print("round " + " ".join(f"{k:>9s}" for k in ratios))
    for i in range(rounds):
        print(f"{i:5d} " + " ".join(f"{ratios[k][i]:9.3f}" for k in ratios))
    print("correlation of the per-round ratios between steps:")
    print(np.round(np.corrcoef(np.array(list(ratios.values()))), 2))
    print(f"({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
