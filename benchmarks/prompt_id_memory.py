"""Memory of the engine requests a length-only trace becomes (a benchmark, not a test): how many bytes each
request costs once ``ensure_prompt_ids`` has synthesized its prompt token ids and ``make_requests`` has built
its ``Request``, per request and per prompt token, and that figure for a day of 1,000,000 requests.

    python benchmarks/prompt_id_memory.py [--trace PATH] [--requests N]

Measures the resident memory (``VmRSS``) before and after each stage on the first N requests of the Azure
2023 conversation trace (read from ``../shared/traces`` at run time). The requests that the simulator holds
all at once are the whole trace (``engines.sim.simulator.simulate`` takes a list), so the per-request figure
times the trace's length is what a replay needs for its prompts.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.replay import make_requests  # noqa: E402
from workbench.traces import ensure_prompt_ids, load_trace  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure-2023-conv" / "AzureLLMInferenceTrace_conv.csv"
DAY = 1_000_000  # requests in the day the figures are scaled to


def rss_bytes() -> int:
    """Resident memory now (bytes, Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="an Azure 2023 CSV (lengths only)")
    ap.add_argument("--requests", type=int, default=5000, help="requests measured (the trace's first N)")
    a = ap.parse_args()
    trace = load_trace("azure", a.trace, limit=a.requests)
    n, tokens = len(trace), sum(r.prompt_tokens for r in trace)
    gc.collect()
    r0, t0 = rss_bytes(), time.perf_counter()
    with_ids = ensure_prompt_ids(trace, 0)
    r1, t1 = rss_bytes(), time.perf_counter()
    reqs = make_requests(with_ids, None)
    gc.collect()
    r2, t2 = rss_bytes(), time.perf_counter()
    total = r2 - r0
    print(json.dumps({
        "requests": n, "mean_prompt_tokens": tokens / n,
        "ensure_prompt_ids": {"s": t1 - t0, "bytes_per_request": (r1 - r0) / n},
        "make_requests": {"s": t2 - t1, "bytes_per_request": (r2 - r1) / n},
        "total_bytes_per_request": total / n, "total_bytes_per_prompt_token": total / tokens,
        f"gib_for_{DAY}_requests": total / n * DAY / 2**30, "kept": len(reqs),
    }, indent=2))


if __name__ == "__main__":
    main()
