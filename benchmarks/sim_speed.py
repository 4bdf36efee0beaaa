"""Simulator speed: replay the whole Azure 2023 conversation trace (19,366 requests, unscaled lengths)
on the simulated paged engine with the committed CPU cost model, and time it (a benchmark, not a test).

    python benchmarks/sim_speed.py [--trace PATH] [--limit N] [--every K] [--no-prefix-caching] [--shared-prompts K] [--native]
        [--profile-out FILE]
        [--hardware h100-sxm --model llama-3.1-70b --tp 4]

The Azure trace carries lengths only. Each request gets its own prompt token ids (request i's prompt is
``100 + (i * 7919 + k) % 48900`` for position k: no two requests share a first block, so nothing is a
prefix-cache hit, as with the random prompts ``workbench run`` gives a length-only trace), and prefix caching
is on, the paged engine's default: the benchmark times the block hashing and lookups a real run pays.
``--no-prefix-caching`` turns caching off explicitly. ``--shared-prompts K`` gives request i the prompt of
``i % K`` instead (cut to its own length), so requests share prefixes and blocks as a system prompt or a
conversation's history makes them (prefix-cache hits, blocks held by several requests). ``--every K`` keeps every K-th request (one replica's share
of K). ``--hardware`` simulates a catalogue model (``--model``, ``--tp``) on a catalogue GPU with the analytic
cost model instead of the CPU profile. Prints the simulated figures, the wall time, the
microseconds per engine step and the peak resident memory (``ru_maxrss``). ``--profile-out`` writes a
cProfile of the simulation.

The trace is read from ``../shared/traces`` at run time (the project ships only a slice).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--native" in sys.argv:  # before anything imports engines: the compiled copy (workbench/native.py)
    from workbench import native

    native.activate()

from engines.core.config import ModelConfig  # noqa: E402
from engines.factory import EngineConfig, build_engine, build_sim_engine  # noqa: E402
from engines.sim.cost_model import CostModel  # noqa: E402
from engines.sim.simulator import simulate  # noqa: E402
from workbench.metrics import summarize  # noqa: E402
from workbench.replay import make_requests  # noqa: E402
from workbench.traces import load_trace  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure-2023-conv" / "AzureLLMInferenceTrace_conv.csv"
TOKEN_LO, TOKEN_SPAN, TOKEN_STRIDE = 100, 48900, 7919  # SmolLM2's vocabulary is 49,152; 7919 is prime


def distinct_prompt(i: int, n: int) -> list[int]:
    """Request ``i``'s ``n`` prompt token ids: distinct first blocks for every i < TOKEN_SPAN."""
    off = i * TOKEN_STRIDE
    return [TOKEN_LO + (off + k) % TOKEN_SPAN for k in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--native", action="store_true",
                    help="run the engines' hot modules compiled by mypyc (workbench/native.py; same code, same results)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--profile", default=str(ROOT / "workbench" / "data" / "profiles" / "ci-reference.json"))
    ap.add_argument("--kv-cache-tokens", type=int, default=1_000_000)
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile-out", default=None, help="write a cProfile of the simulation here")
    ap.add_argument("--every", type=int, default=1, help="keep every K-th request of the trace")
    ap.add_argument("--shared-prompts", type=int, default=None,
                    help="request i takes prompt i %% K: prefixes shared among the requests (prefix-cache hits)")
    ap.add_argument("--hardware", default=None, help="a catalogue GPU: the analytic cost model instead of --profile")
    ap.add_argument("--model", default="llama-3.1-70b", help="with --hardware: the catalogue model")
    ap.add_argument("--tp", type=int, default=4, help="with --hardware: GPUs per replica")
    a = ap.parse_args()
    from engines.real.model_store import resolve_model

    cfg = ModelConfig.from_dir(resolve_model("smollm2-135m"))
    t0 = time.perf_counter()
    trace = load_trace("azure", a.trace, limit=a.limit)[:: a.every]
    for i, r in enumerate(trace):
        r.prompt_token_ids = distinct_prompt(i % a.shared_prompts if a.shared_prompts else i, r.prompt_tokens)
    reqs = make_requests(trace, None)
    t_load = time.perf_counter() - t0
    if a.hardware:
        engine = build_engine(EngineConfig(kind="sim", policy="paged", model=a.model, hardware=a.hardware, tp=a.tp,
                                           max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=16384,
                                           enable_prefix_caching=a.prefix_caching))
    else:
        engine = build_sim_engine("paged", cfg, CostModel.load(a.profile), kv_cache_tokens=a.kv_cache_tokens,
                                  max_model_len=16384, max_num_seqs=256, max_num_batched_tokens=2048,
                                  enable_prefix_caching=a.prefix_caching)
    prof = None
    if a.profile_out:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t1, c1 = time.perf_counter(), time.process_time()
    outs = simulate(engine, reqs)
    t_sim, c_sim = time.perf_counter() - t1, time.process_time() - c1
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.profile_out)
    s = summarize(outs, engine.steps, len(trace))
    print(json.dumps({"requests": len(trace), "prefix_caching": a.prefix_caching,
                      "shared_prompts": a.shared_prompts, "native": a.native, "steps": len(engine.steps),
                      "load_s": round(t_load, 2), "simulate_s": round(t_sim, 2),
                      "simulate_cpu_s": round(c_sim, 2),
                      "us_per_step": round(1e6 * t_sim / max(len(engine.steps), 1), 1),
                      "rows_per_step": round(sum(r.num_seqs for r in engine.steps) / max(len(engine.steps), 1), 1),
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "simulated_duration_s": round(s["duration_s"], 1), "finished": s["num_finished"],
                      "rejected": s["num_rejected"], "output_throughput": round(s["output_throughput"], 1),
                      "prefix_cache_hit_rate": s.get("prefix_cache_hit_rate")}, indent=2))


if __name__ == "__main__":
    main()
