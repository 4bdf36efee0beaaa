"""Does the real engine come back slower after it has idled? A benchmark, not a test.

    python benchmarks/idle_gap.py [--processes 2] [--rounds 3] [--gap 2.0] [--settings default,active,bind,nogap]

Each round replays two requests on the real paged engine (smollm2-135m, float32, the quickstart's knobs: an
8192-token KV pool, at most 64 sequences): request a at 0 s (100-token prompt, 11 output tokens, done after about 0.4 s) and request b at ``--gap`` seconds
(100-token prompt, 40 output tokens), so the engine idles between them, as in the quickstart trace, whose first
request ends at about 0.4 s and whose second arrives at 2.0 s. Per round: b's prefill over a's (the same shape)
and the mean of the first ten decode steps after b's prefill over the median of a's decode steps before it (the
first two skipped). Settings:

* ``default``: the process as ``workbench run`` starts it;
* ``active``: ``OMP_WAIT_POLICY=active`` (idle OpenMP threads keep spinning);
* ``bind``: ``OMP_PROC_BIND=close OMP_PLACES=cores`` (a thread pinned per core);
* ``nogap``: default, with b arriving at 0.3 s, before a ends (no idle time);
* ``freemem``: ``WORKBENCH_KEEP_FREED_MEMORY=0``: glibc's allocator defaults, under which freed tensors' pages
  go back to the kernel (``engines.real.allocator``), so a virtual machine with free page reporting
  (virtio-balloon) can hand them to its host while the engine idles.

Each setting runs in its own processes (OpenMP reads its settings at start), interleaved (A B C D A B C D ...).
Prints one JSON line per round and, per setting, the mean and range of both ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.thread_placement import child_output, pick_settings  # noqa: E402

SETTINGS = {
    "default": ({}, None),
    "active": ({"OMP_WAIT_POLICY": "active"}, None),
    "bind": ({"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, None),
    "nogap": ({}, 0.3),
    "freemem": ({"WORKBENCH_KEEP_FREED_MEMORY": "0"}, None),
}


def child(gap: float, rounds: int) -> None:
    """One process: ``rounds`` rounds of the two-request replay; one JSON line per round."""
    from engines.core.request import Request
    from engines.core.sampling_params import SamplingParams
    from engines.factory import EngineConfig, build_engine
    from workbench.replay import replay_realtime

    def req(rid, first, max_tokens, at=0.0):
        return Request(rid, list(range(first, first + 100)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_time=at)

    engine = build_engine(EngineConfig(kind="paged", model="smollm2-135m", kv_cache_tokens=8192, max_num_seqs=64,
                                       max_num_batched_tokens=1024, max_model_len=1024))
    replay_realtime(engine, [req("warm-up", 500, 20)])
    for rnd in range(rounds):
        n0 = len(engine.steps)
        replay_realtime(engine, [req(f"a{rnd}", 100, 11), req(f"b{rnd}", 300, 40, gap)])
        steps = [s for s in engine.steps[n0:] if s.num_seqs]
        at = [i for i, s in enumerate(steps) if s.shape.prefill_tokens]  # a's prefill, then b's
        prefills = [steps[i].duration for i in at]
        before = [s.duration for s in steps[at[0] + 1:at[1]] if not s.shape.prefill_tokens]
        before = before[2:] or before  # the first two skipped where more are left
        after = [s.duration for s in steps[at[1] + 1:] if not s.shape.prefill_tokens][:10]
        print(json.dumps({"gap_s": gap, "round": rnd, "prefill_ratio": prefills[1] / prefills[0],
                          "decode_ratio": statistics.fmean(after) / statistics.median(before)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--processes", type=int, default=2, help="processes per setting")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per process")
    ap.add_argument("--gap", type=float, default=2.0, help="request b's arrival, seconds")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of " + ", ".join(SETTINGS))
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        child(a.child, a.rounds)
        return
    names = pick_settings(a.settings, SETTINGS)
    got: dict[str, list[dict]] = {n: [] for n in names}
    for proc in range(a.processes):
        for name in names:
            env_add, gap = SETTINGS[name]
            out = child_output([__file__, "--child", str(gap if gap is not None else a.gap), "--rounds", str(a.rounds)],
                               env_add, f"setting {name}, process {proc}")
            for line in out.splitlines():
                if line.startswith("{"):
                    row = {"setting": name, **json.loads(line)}
                    print(json.dumps(row), flush=True)
                    got[name].append(row)
    for name, rows in got.items():
        for key in ("prefill_ratio", "decode_ratio"):
            xs = [r[key] for r in rows]
            print(f"{name:8s} {key}: mean {statistics.fmean(xs):.3f}, range {min(xs):.3f}-{max(xs):.3f} "
                  f"({len(xs)} rounds)")


if __name__ == "__main__":
    main()
