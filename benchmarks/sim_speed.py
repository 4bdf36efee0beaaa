"""Simulator speed: replay the whole Azure 2023 conversation trace (19,366 requests, unscaled lengths)
on the simulated paged engine with the CPU cost model, and time it (a benchmark, not a test).

    python benchmarks/sim_speed.py [--trace PATH] [--limit N]

The trace is read from ``../shared/traces`` at run time (the project ships only a slice).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.core.config import ModelConfig  # noqa: E402
from engines.factory import build_sim_engine  # noqa: E402
from engines.sim.cost_model import CostModel  # noqa: E402
from engines.sim.simulator import simulate  # noqa: E402
from workbench.metrics import summarize  # noqa: E402
from workbench.replay import make_requests  # noqa: E402
from workbench.traces import load_trace  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure-2023-conv" / "AzureLLMInferenceTrace_conv.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--profile", default=str(ROOT / "workbench" / "data" / "profiles" / "ci-reference.json"))
    ap.add_argument("--kv-cache-tokens", type=int, default=1_000_000)
    a = ap.parse_args()
    from engines.real.model_store import resolve_model

    cfg = ModelConfig.from_dir(resolve_model("smollm2-135m"))
    t0 = time.perf_counter()
    trace = load_trace("azure", a.trace, limit=a.limit)
    for r in trace:  # counts only: placeholder prompt ids (no prefix caching here)
        r.prompt_token_ids = [0] * r.prompt_tokens
    reqs = make_requests(trace, None)
    t_load = time.perf_counter() - t0
    engine = build_sim_engine("paged", cfg, CostModel.load(a.profile), kv_cache_tokens=a.kv_cache_tokens,
                              max_model_len=16384, max_num_seqs=256, max_num_batched_tokens=2048)
    t1 = time.perf_counter()
    outs = simulate(engine, reqs)
    t_sim = time.perf_counter() - t1
    s = summarize(outs, engine.steps, len(trace))
    print(json.dumps({"requests": len(trace), "steps": len(engine.steps), "load_s": round(t_load, 2),
                      "simulate_s": round(t_sim, 2), "simulated_duration_s": round(s["duration_s"], 1),
                      "finished": s["num_finished"], "rejected": s["num_rejected"],
                      "output_throughput": round(s["output_throughput"], 1)}, indent=2))


if __name__ == "__main__":
    main()
