"""Is the slowdown after idling the engine's or the machine's? A benchmark, not a test.

    python benchmarks/idle_machine.py [--idle 1.6] [--rounds 6] [--threads 2]

``benchmarks/idle_gap.py`` shows that the real engine's first steps after it has idled for 1.6 s run 1.1-1.2x
slower. This check takes the engine away piece by piece. Two workloads, each in ``--rounds`` rounds: twelve
back-to-back runs (the median of the last ten is the round's reference), ``--idle`` seconds of sleep, then ten
more runs. Printed per workload: the first run after the sleep over the reference and the mean of the ten over
it (mean and range over rounds).

* ``executor 1-row decode``: ``ModelExecutor.execute`` of a 1-row decode at context 64 (smollm2-135m, float32),
  no scheduler, no engine loop;
* ``plain GEMV chain``: 180 float32 ``[1, 576] x [576, 1536]`` products over distinct random weights (637 MB,
  read once per run: memory-bound like a decode), torch only, none of this project's code.

``--idle 0`` is the control. When the plain chain slows down after the sleep as the executor does, the
slowdown is the machine's (how the host runs an idle virtual CPU), not the engine's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, n: int) -> list[float]:
    """Seconds of ``n`` back-to-back calls of ``fn``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=float, default=1.6, help="seconds of sleep between the two halves of a round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from engines.real.cpu_features import cpu_name
    from engines.real.model import LlamaModel
    from engines.real.model_runner import ModelExecutor
    from engines.real.model_store import resolve_model
    from engines.sim.profiler import GridStep, grid_batch

    torch.set_num_threads(args.threads)
    ex = ModelExecutor(LlamaModel.from_dir(resolve_model("smollm2-135m"), torch.float32), 8192 // 16, 16)
    batch = grid_batch(GridStep(1, 64), 16, 8192 // 16)
    weights = [torch.randn(1536, 576) for _ in range(180)]
    x = torch.randn(1, 576)

    def gemv_chain():
        for w in weights:
            torch.nn.functional.linear(x, w)

    print(f"{cpu_name()}, torch CPU {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
          f"idle {args.idle} s, {args.rounds} rounds")
    for name, fn in (("executor 1-row decode", lambda: ex.execute(batch)), ("plain GEMV chain", gemv_chain)):
        first, ten = [], []
        for _ in range(args.rounds):
            ref = statistics.median(timed(fn, 12)[2:])
            time.sleep(args.idle)
            after = timed(fn, 10)
            first.append(after[0] / ref)
            ten.append(statistics.mean(after) / ref)
        print(f"{name}: first run after the sleep {statistics.mean(first):.3f}x (range {min(first):.2f}-"
              f"{max(first):.2f}); mean of the first ten {statistics.mean(ten):.3f}x (range {min(ten):.2f}-"
              f"{max(ten):.2f})")


if __name__ == "__main__":
    main()
