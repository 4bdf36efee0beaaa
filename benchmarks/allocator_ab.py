"""Step time and page faults with glibc's allocator defaults against memory kept in the process. A benchmark, not a test.

    python benchmarks/allocator_ab.py [--rounds 4] [--threads 2]

One process, one real executor (smollm2-135m, float32, a 65,536-token pool of 16-token blocks). Four steps
(``engines.sim.profiler.grid_batch`` shapes: 16 prompts of 640 tokens, 4 of 512, a decode of 16 rows at context
512 and one of 4 rows at 128) run under the two allocator settings in turn, ``--rounds`` rounds (A B, B A, A B,
...), each step once untimed and twice timed per round. ``default``: glibc's defaults (blocks over the mmap
threshold mapped afresh and unmapped when freed, the heap trimmed); ``kept``: what the real executor sets
(``engines.real.allocator.keep_freed_memory``: every block from the heap, the heap never trimmed). Both run in one
process so the machine's drift hits both alike; the setting can be switched back and forth with ``mallopt``.
Prints per step the median milliseconds and minor page faults of each setting and their ratio (kept / default).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.real.allocator import M_MMAP_MAX, M_TRIM_THRESHOLD  # noqa: E402 (after the path)

GLIBC_DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}  # malloc.h's DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD
KEPT = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}  # engines.real.allocator.keep_freed_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ["WORKBENCH_KEEP_FREED_MEMORY"] = "0"  # the executor leaves the setting to this script
    import torch

    from engines.real.cpu_features import cpu_name
    from engines.real.model import LlamaModel
    from engines.real.model_runner import ModelExecutor
    from engines.real.model_store import resolve_model
    from engines.sim.profiler import GridStep, grid_batch

    libc = ctypes.CDLL("libc.so.6")
    torch.set_num_threads(args.threads)
    ex = ModelExecutor(LlamaModel.from_dir(resolve_model("smollm2-135m"), torch.float32), 65536 // 16, 16)
    steps = {"16 prompts x 640 tokens": GridStep(prefills=((640, 0),) * 16),
             "4 prompts x 512 tokens": GridStep(prefills=((512, 0),) * 4),
             "decode 16 rows, ctx 512": GridStep(16, 512), "decode 4 rows, ctx 128": GridStep(4, 128)}
    batches = {k: grid_batch(s, 16, 65536 // 16) for k, s in steps.items()}
    times = {(k, m): [] for k in steps for m in ("default", "kept")}
    faults = {key: [] for key in times}
    for r in range(args.rounds):
        for m in ("default", "kept") if r % 2 == 0 else ("kept", "default"):
            for param, value in (GLIBC_DEFAULTS if m == "default" else KEPT).items():
                libc.mallopt(param, value)
            if m == "default":
                libc.malloc_trim(0)  # hand back what the kept setting held, as glibc would have
            for k, b in batches.items():
                ex.execute(b)
                for _ in range(2):
                    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                    ex.execute(b)
                    times[(k, m)].append(time.perf_counter() - t0)
                    faults[(k, m)].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(f"{cpu_name()}, torch CPU {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
          f"{args.rounds} rounds, medians of {2 * args.rounds} runs per step and setting")
    for k in steps:
        d, kept = (statistics.median(times[(k, m)]) for m in ("default", "kept"))
        fd, fk = (statistics.median(faults[(k, m)]) for m in ("default", "kept"))
        print(f"{k:24s} default {d * 1e3:9.1f} ms ({fd:,.0f} faults)  kept {kept * 1e3:9.1f} ms ({fk:,.0f} faults)  "
              f"kept/default {kept / d:.3f}")


if __name__ == "__main__":
    main()
