"""Does a step's time depend on the step before it? Small and large steps timed after small and after large ones.

Each round runs, in a shuffled order, every (before, after) pair of the steps below: the ``before`` step once
(untimed), then the ``after`` step once (timed). A step whose time after a large step is well above its time
after a small one pays for what the large step left behind (the CPU's clock after wide vector work, caches, the
allocator); a cost model that prices each step alone misses it, and a drift probe timed right after a large step
reads the machine slower than it is. Prints, per ``after`` step, the median time after each ``before`` step and
the ratio to its median after the smallest step. About 2.5 minutes for 10 rounds on a 2-core CPU. On a 2-core
Intel Xeon with AMX (2026-12-08, two threads, 8 rounds) every timed step ran 0.98-1.06x after the larger steps
of its time after a 1-row decode, where the same machine's engines ran their small steps right after a large
one 1.02-1.44x (``engines.sim.profiler.SETTLE_TOKENS``): what slows them comes with the engines' runs, not with
the step before alone. Usage::

    python benchmarks/step_order.py [ROUNDS]   # default 10
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engines.real.model import LlamaModel  # noqa: E402
from engines.real.model_runner import ModelExecutor  # noqa: E402
from engines.real.model_store import resolve_model  # noqa: E402
from engines.sim.profiler import GridStep, grid_batch  # noqa: E402

STEPS = {"dec1": GridStep(1, 64), "dec4": GridStep(4, 64, scratch=True), "dec32": GridStep(32, 256),
         "pre128": GridStep(prefills=((128, 0),), scratch=True), "pre512": GridStep(prefills=((512, 0),)),
         "pre1024": GridStep(prefills=((1024, 0),)),
         "pre8x128": GridStep(prefills=((128, 0),) * 8), "mix45": GridStep(45, 320, ((640, 0),))}
AFTER = ("dec1", "dec4", "dec32", "pre128")  # the timed steps
BEFORE = tuple(STEPS)  # the steps run just before them


def main(rounds: int) -> None:
    ex = ModelExecutor(LlamaModel.from_dir(resolve_model("smollm2-135m"), torch.float32), 65536 // 16, 16)
    batches = {k: grid_batch(s, 16, 65536 // 16) for k, s in STEPS.items()}
    for b in batches.values():  # warm-up
        ex.execute(b)
    pairs = [(b, a) for a in AFTER for b in BEFORE]
    times: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(pairs)
        for b, a in pairs:
            ex.execute(batches[b])
            t0 = time.perf_counter()
            ex.execute(batches[a])
            times[(b, a)].append(time.perf_counter() - t0)
    print(f"{torch.get_num_threads()} threads, {rounds} rounds; median ms of the timed step (ratio to after dec1)")
    print("after \\ before " + " ".join(f"{b:>14s}" for b in BEFORE))
    for a in AFTER:
        ref = statistics.median(times[("dec1", a)])
        cells = [f"{statistics.median(times[(b, a)]) * 1e3:7.1f} ({statistics.median(times[(b, a)]) / ref:4.2f})"
                 for b in BEFORE]
        print(f"{a:14s} " + " ".join(f"{c:>14s}" for c in cells))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
