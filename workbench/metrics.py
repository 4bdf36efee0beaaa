"""Serving metrics from per-request and per-step records, with ``vllm bench serve``'s definitions.

Every formula used here is listed in ``FORMULAS`` and copied into each ``results.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.stats import percentiles

FORMULAS = {
    "duration_s": "max(finish time) - min(arrival time) over the trace's requests (s)",
    "request_throughput": "finished requests / duration_s (req/s)",
    "output_throughput": "sum(output tokens of finished requests) / duration_s (tok/s)",
    "total_token_throughput": "sum(prompt + output tokens of finished requests) / duration_s (tok/s)",
    "ttft_ms": "first token time - arrival time (ms), finished requests",
    "tpot_ms": "(e2el - ttft) / (output tokens - 1) (ms), requests with > 1 output token; excludes the first token; for a static engine with completion batch_end it includes the wait for the batch's end (the client's view), while itl_ms keeps the token times",
    "itl_ms": "every gap between consecutive output tokens of a request (ms), all requests pooled",
    "e2el_ms": "completion time - arrival time (ms): the last token's time; for a static engine with completion batch_end (its default) the end of the request's batch, when a static-batching server returns the batch's answers (own_end: its own last token)",
    "goodput": "finished requests meeting every SLO limit (ttft, tpot, e2el) / duration_s (req/s), as vllm bench serve --goodput",
    "kv_waste_frac": "1 - sum(step duration * slots holding token states) / sum(step duration * slots allocated): time-weighted",
    "kv_breakdown": "time-weighted shares of allocated slots: token_states, reserved (for tokens a request may still produce), internal_frag (allocated slots it can never use), external_frag (gaps between contiguous allocations) (PagedAttention, SOSP 2023, Fig. 2)",
    "kv_usage_mean": "time-weighted mean of slots allocated / pool slots (vllm:kv_cache_usage_perc as a fraction)",
    "percentiles": "numpy.percentile, linear interpolation (as vllm bench serve)",
    # memory management (memory_summary)
    "prefix_cache_hit_rate": "prefix_cache_hits / prefix_cache_queries: prompt tokens found in the prefix cache over tokens looked up at first admission (vllm:prefix_cache_hits / vllm:prefix_cache_queries); re-admissions after a recompute preemption are not counted",
    "prefix_cache_ideal_hit_rate": "the trace's hit rate under an unlimited prefix cache: requests in arrival order, each hits its longest run of leading full blocks some earlier prompt had, at most prompt length - 1 tokens (workbench.traces.prefix.ideal_prefix_hit_rate)",
    "num_preemptions_recompute": "preemptions that freed the victim's blocks (recomputed later)",
    "num_preemptions_swap": "preemptions that copied the victim's blocks to the CPU swap pool",
    "swap_bytes": "KV bytes copied between the device pool and the CPU swap pool, both directions",
    "swap_time_s": "seconds spent on those copies (measured in the real engine; bytes / swap_bandwidth_bytes_per_s in the simulator)",
    "saturation": "final_queue: requests waiting (not admitted) in the first engine step that starts at or after the last arrival; waiting_time_frac: sum(duration of steps with a non-empty waiting queue) / duration_s. final_queue > 0 or a large waiting_time_frac means the engine did not keep up: throughput is then capacity-bound, not the offered load (None for kind openai: no engine steps client-side)",
    "load": "trace.load: offered_req_s = factor x capacity_req_s of the named engine; the recorded arrival times are rescaled to that mean rate, (count - 1) / span; time_scale = recorded rate / offered rate (workbench.load)",
    "capacity": "saturation probe (workbench.load): probe_requests requests spread evenly over the trace, all arriving at 0 s; capacity_req_s = finished / (last finish - first arrival); ratios = paged capacity / static capacity",
    "repeats": "workbench run --repeat N: real engines run N times, interleaved (A, B, A, B, ...); the summary holds each number's mean over the runs, repeats.metrics its mean, std (n - 1), min, max, spread = (max - min) / mean and the values; repeats.gemm_gflops the GEMM probe timed before each run (the machine's own drift, apart from the engine's variance); a sim engine with step noise runs N times too (noise seeds seed + i), one without runs once (deterministic)",
    "kv_shared_saved_mean": "time-weighted mean of KV slots saved by block sharing: sum over held blocks of (ref count - 1) x block_size (slots the same requests would hold without sharing)",
}


def dist(values_s) -> dict[str, float]:
    """``{mean, p50, p90, p99}`` in milliseconds of an iterable of seconds (zeros when empty).

    Percentiles are :func:`workbench.stats.percentiles` (``numpy.percentile``, linear, as vllm bench serve).
    """
    v = np.asarray(list(values_s), dtype=float) * 1000.0
    if v.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    return {"mean": float(v.mean()), **percentiles(v, (50, 90, 99))}


@dataclass
class RequestMetrics:
    """Latencies of one finished request (seconds)."""

    ttft: float
    tpot: float | None
    e2el: float
    itls: list[float]


def request_metrics(o) -> RequestMetrics | None:
    """TTFT, TPOT, E2EL and ITLs of a finished output (``RequestOutput``-like); None if it produced nothing.

    E2EL ends at the last token, or at the output's ``completion_time`` where the engine reports a later
    one (a static batch's end under completion ``batch_end``); outputs without it (kind openai) end at
    their last token."""
    if o.first_token_time is None or o.finished_time is None or not o.token_ids:
        return None
    ttft = o.first_token_time - o.arrival_time
    end = o.token_times[-1] if o.token_times else o.finished_time
    completion = getattr(o, "completion_time", None)
    if completion is not None:
        end = max(end, completion)
    e2el = max(end, o.first_token_time) - o.arrival_time
    n = len(o.token_ids)
    tpot = (e2el - ttft) / (n - 1) if n > 1 else None
    itls = [b - a for a, b in zip(o.token_times, o.token_times[1:])]
    return RequestMetrics(ttft, tpot, e2el, itls)


def summarize(outputs, steps, num_trace_requests: int, slo: dict | None = None) -> dict:
    """The summary block of one engine in ``results.json``.

    Args:
        outputs: every ``RequestOutput`` of the run (finished, rejected, failed).
        steps: the engine's ``StepRecord`` list.
        num_trace_requests: requests in the trace; the status counts must add up to it.
        slo: ``{"ttft_ms": .., "tpot_ms": .., "e2el_ms": ..}`` limits (any may be None).

    Raises:
        ValueError: the counts of finished, rejected and failed requests do not add up.
    """
    finished = [o for o in outputs if o.finish_reason in ("stop", "length")]
    rejected = [o for o in outputs if o.finish_reason == "rejected"]
    failed = [o for o in outputs if o.finish_reason not in ("stop", "length", "rejected")]
    if len(finished) + len(rejected) + len(failed) != num_trace_requests:
        raise ValueError(f"{len(finished)} finished + {len(rejected)} rejected + {len(failed)} failed "
                         f"!= {num_trace_requests} requests in the trace")
    ends = [o.finished_time for o in outputs if o.finished_time is not None]
    starts = [o.arrival_time for o in outputs]
    duration = max(ends) - min(starts) if ends and starts else 0.0
    ms = [m for m in (request_metrics(o) for o in finished) if m is not None]
    out_tokens = sum(len(o.token_ids) for o in finished)
    in_tokens = sum(len(o.prompt_token_ids) for o in finished)
    good = sum(1 for m in ms if _meets(m, slo or {}))
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary = {
        "duration_s": duration,
        "request_throughput": per_s(len(finished)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + in_tokens),
        "ttft_ms": dist(m.ttft for m in ms),
        "tpot_ms": dist(m.tpot for m in ms if m.tpot is not None),
        "itl_ms": dist(x for m in ms for x in m.itls),
        "e2el_ms": dist(m.e2el for m in ms),
        "goodput": per_s(good),
        "num_preemptions": sum(s.num_preemptions for s in steps),
        "num_finished": len(finished),
        "num_rejected": len(rejected),
        "num_failed": len(failed),
        "num_requests": num_trace_requests,
        "num_steps": len(steps),
        "total_output_tokens": out_tokens,
        "total_input_tokens": in_tokens,
        "reject_reasons": sorted({o.error for o in rejected if o.error})[:10],
    }
    summary.update(kv_summary(steps))
    summary["saturation"] = saturation(outputs, steps, duration)
    summary.update(memory_summary(steps))
    return summary


def memory_summary(steps) -> dict:
    """Prefix-cache, preemption-mode, swap and sharing figures of a run (see ``FORMULAS``)."""
    q = sum(getattr(s, "prefix_cache_queries", 0) for s in steps)
    h = sum(getattr(s, "prefix_cache_hits", 0) for s in steps)
    n_swap = sum(getattr(s, "num_preemptions_swap", 0) for s in steps)
    w = np.array([s.duration for s in steps], dtype=float)
    saved = np.array([getattr(s, "kv_shared_saved", 0) for s in steps], dtype=float)
    return {
        "prefix_cache_queries": int(q),
        "prefix_cache_hits": int(h),
        "prefix_cache_hit_rate": h / q if q else 0.0,
        "num_preemptions_recompute": int(sum(s.num_preemptions for s in steps) - n_swap),
        "num_preemptions_swap": int(n_swap),
        "swap_bytes": int(sum(getattr(s, "swap_bytes", 0) for s in steps)),
        "swap_time_s": float(sum(getattr(s, "swap_time", 0.0) for s in steps)),
        "kv_shared_saved_mean": float((w * saved).sum() / w.sum()) if w.sum() > 0 else 0.0,
    }


def saturation(outputs, steps, duration_s: float) -> dict:
    """Whether the engine kept up (see ``FORMULAS["saturation"]``): ``{final_queue, waiting_time_frac}``
    (requests, fraction of ``duration_s``); both None without engine steps (kind openai)."""
    if not steps or not outputs:
        return {"final_queue": None, "waiting_time_frac": None}
    last_arrival = max(o.arrival_time for o in outputs)
    after = next((s for s in steps if s.start >= last_arrival), None)
    waiting = sum(s.duration for s in steps if s.num_waiting > 0)
    return {"final_queue": int(after.num_waiting) if after is not None else 0,
            "waiting_time_frac": float(min(1.0, waiting / duration_s)) if duration_s > 0 else 0.0}


def _meets(m: RequestMetrics, slo: dict) -> bool:
    checks = [("ttft_ms", m.ttft), ("tpot_ms", m.tpot), ("e2el_ms", m.e2el)]
    return all(slo.get(k) is None or v is None or v * 1000.0 <= slo[k] for k, v in checks)


def kv_summary(steps) -> dict:
    """Time-weighted KV waste, its breakdown and mean usage (see ``FORMULAS``)."""
    w = np.array([s.duration for s in steps], dtype=float)
    alloc = np.array([s.kv_allocated for s in steps], dtype=float)
    if w.sum() <= 0 or (w * alloc).sum() <= 0:
        zero = {"token_states": 0.0, "reserved": 0.0, "internal_frag": 0.0, "external_frag": 0.0}
        return {"kv_waste_frac": 0.0, "kv_breakdown": zero, "kv_usage_mean": 0.0}
    wa = (w * alloc).sum()
    part = {k: float((w * np.array([getattr(s, "kv_" + k) for s in steps], dtype=float)).sum() / wa)
            for k in ("token_states", "reserved", "internal_frag", "external_frag")}
    total = np.array([s.kv_total_slots for s in steps], dtype=float)
    return {"kv_waste_frac": 1.0 - part["token_states"], "kv_breakdown": part,
            "kv_usage_mean": float((w * alloc / np.maximum(total, 1)).sum() / w.sum())}


def relative_error(sim: float, real: float) -> float:
    """(sim - real) / real; 0 when both are 0."""
    if real == 0:
        return 0.0 if sim == 0 else float("inf")
    return (sim - real) / real
