"""A simulated day on a cluster: N replicas of a GPU what-if engine behind a router, a day of requests
synthesized from the Azure 2023 conversation trace, streamed through the cluster simulator (a benchmark, not
a test).

    python benchmarks/cluster_day.py [--requests 1000000] [--replicas 8] [--model llama-3.1-70b]
        [--hardware h100-sxm] [--tp 4] [--router least_outstanding] [--duration-s 86400] [--out FILE] [--native]

The day: ``workbench.traces.day.synthesize_day`` over the trace (arrivals a gamma renewal process with the
trace's mean rate and gap CV, each request's prompt and output lengths drawn together from the trace, seed 0),
its arrival times scaled so that ``--requests`` requests arrive over ``--duration-s`` seconds. The trace gives
lengths only: request i gets its own prompt token ids (distinct first blocks, as ``sim_speed.py``), made when it
arrives and dropped when it ends, so memory holds only the requests in flight. Outputs and step records are
streamed (``on_output`` / ``on_steps``) into running aggregates: TTFT, TPOT and E2EL per request and every ITL
(float32) are kept for exact percentiles; steps are counted, not kept.

Prints one JSON object: wall and CPU seconds, steps (all replicas), microseconds of CPU per replica step,
peak resident memory (``ru_maxrss``), and the cluster's metrics (``vllm bench serve`` names; ms).
The trace is read from ``../shared/traces`` at run time (the project ships only a slice).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from array import array
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--native" in sys.argv:  # before anything imports engines: the compiled copy (workbench/native.py)
    from workbench import native

    native.activate()

from engines.core.request import Request  # noqa: E402
from engines.core.router import make_router  # noqa: E402
from engines.core.sampling_params import SamplingParams  # noqa: E402
from engines.factory import EngineConfig, build_engine  # noqa: E402
from engines.sim.cluster import simulate_cluster  # noqa: E402
from workbench.traces import load_trace  # noqa: E402
from workbench.traces.day import synthesize_day  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure-2023-conv" / "AzureLLMInferenceTrace_conv.csv"
TOKEN_LO, TOKEN_SPAN, TOKEN_STRIDE = 100, 48900, 7919  # as benchmarks/sim_speed.py


def day_requests(source, n: int, duration_s: float, seed: int = 0):
    """``n`` engine requests over ``duration_s`` seconds, made one at a time in arrival order: a synthesized
    day at the source's rate, its times scaled by ``duration_s`` / (n / rate)."""
    rate = (len(source) - 1) / (source[-1].arrival_s - source[0].arrival_s)
    span = n / rate  # seconds the source's rate needs for n requests
    scale = duration_s / span
    for i, t in enumerate(synthesize_day(source, span * 1.05, seed=seed)):
        if i >= n:
            return
        off = i * TOKEN_STRIDE
        prompt = [TOKEN_LO + (off + k) % TOKEN_SPAN for k in range(t.prompt_tokens)]
        yield Request(f"day-{i}", prompt, SamplingParams(max_tokens=t.output_tokens, temperature=0.0, ignore_eos=True),
                      arrival_time=t.arrival_s * scale)


class DayMetrics:
    """Running aggregates of a day's outputs and step records (nothing per step is kept)."""

    def __init__(self) -> None:
        self.ttft, self.tpot, self.e2el, self.itl = array("d"), array("d"), array("d"), array("f")
        self.finished = self.rejected = self.output_tokens = 0
        self.first_arrival, self.last_finish = float("inf"), 0.0
        self.steps = self.preemptions = 0
        self.busy_s = 0.0
        self.t0 = time.perf_counter()

    def output(self, o) -> None:
        """Take one ``RequestOutput``: a rejection is counted, a finished request's latencies kept (s); every
        100,000 outputs a progress line (wall s, simulated s, steps so far) goes to stderr."""
        if (self.finished + self.rejected) % 100_000 == 0 and self.finished + self.rejected:
            print(f"{self.finished + self.rejected} requests ended, {time.perf_counter() - self.t0:.0f} s wall, "
                  f"simulated {o.finished_time:.0f} s, {self.steps} steps drained, "
                  f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB", file=sys.stderr, flush=True)
        if o.finish_reason == "rejected":
            self.rejected += 1
            return
        self.finished += 1
        tt = o.token_times
        self.output_tokens += len(tt)
        self.first_arrival = min(self.first_arrival, o.arrival_time)
        self.last_finish = max(self.last_finish, o.finished_time)
        self.ttft.append(o.first_token_time - o.arrival_time)
        self.e2el.append(o.finished_time - o.arrival_time)
        if len(tt) > 1:
            self.tpot.append((tt[-1] - tt[0]) / (len(tt) - 1))
            self.itl.extend(np.diff(np.asarray(tt, dtype=np.float64)).astype(np.float32))

    def step_records(self, records) -> None:
        """Take a batch of ``StepRecord``s: counted, their durations and preemptions summed."""
        self.steps += len(records)
        for r in records:
            self.busy_s += r.duration
            self.preemptions += r.num_preemptions

    def summary(self) -> dict:
        """Throughput and the mean, p50, p90, p99 of TTFT, TPOT, ITL and E2EL (ms), as ``vllm bench serve``."""
        def pct(a, dtype):
            x = np.frombuffer(a, dtype=dtype) * 1e3 if len(a) else np.zeros(1)
            return {"mean": round(float(x.mean()), 2), **{f"p{q}": round(float(np.percentile(x, q)), 2)
                                                         for q in (50, 90, 99)}}
        dur = self.last_finish - self.first_arrival
        return {"finished": self.finished, "rejected": self.rejected, "duration_s": round(dur, 1),
                "output_throughput": round(self.output_tokens / dur, 1) if dur > 0 else None,
                "ttft_ms": pct(self.ttft, np.float64), "tpot_ms": pct(self.tpot, np.float64),
                "itl_ms": pct(self.itl, np.float32), "e2el_ms": pct(self.e2el, np.float64),
                "num_preemptions": self.preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--native", action="store_true",
                    help="run the engines' hot modules compiled by mypyc (workbench/native.py; same code, same results)")
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--duration-s", type=float, default=86400.0)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--router", default="least_outstanding")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()

    source = load_trace("azure", a.trace)
    cfg = EngineConfig(kind="sim", policy="paged", model=a.model, hardware=a.hardware, tp=a.tp,
                       max_num_seqs=a.max_num_seqs, max_num_batched_tokens=2048, max_model_len=16384)
    replicas = [build_engine(cfg) for _ in range(a.replicas)]
    m = DayMetrics()
    t0, c0 = time.perf_counter(), time.process_time()
    run = simulate_cluster(replicas, make_router(a.router), day_requests(source, a.requests, a.duration_s),
                           on_output=m.output, on_steps=m.step_records)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for r in replicas:  # the records still on the engines
        m.step_records(r.steps)
    served = [0] * a.replicas
    for i in run.replica_of.values():
        served[i] += 1
    res = {"requests": a.requests, "native": a.native, "day_s": a.duration_s, "replicas": a.replicas, "model": a.model,
           "hardware": a.hardware, "tp": a.tp, "router": a.router,
           "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "steps": m.steps,
           "us_per_replica_step": round(1e6 * cpu / max(m.steps, 1), 1),
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "served_per_replica": served, **m.summary()}
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
