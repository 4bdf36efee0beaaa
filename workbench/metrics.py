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
    "ttft_ms": "first token time - arrival time (ms), finished requests; kind openai: the first token time is the arrival of the first streamed chunk that carries output (non-empty text or content, a reasoning_content / reasoning or tool_calls delta, or non-empty token_ids): a role-only or empty chunk is not a token",
    "tpot_ms": "(e2el - ttft) / (output tokens - 1) (ms), requests with > 1 output token; excludes the first token; undefined for a one-token request, which is left out of the mean and percentiles (count: requests that define it; mean and percentiles null when none does); for a static engine with completion batch_end it includes the wait for the batch's end (the client's view), while itl_ms keeps the token times",
    "itl_ms": "gaps between a request's consecutive outputs (ms), all requests pooled; none from a request with 1 output token (count: gaps pooled; mean and percentiles null when there is none). In-process engines: every gap between consecutive output token times (a step that emits several tokens, simulated speculative decoding, gives 0-ms gaps). kind openai with itl_mode chunk (the default, as vllm bench serve): one gap per output-carrying chunk after the first, t_i - t_(i-1) for chunk arrival times t_0 < t_1 < ...; itl_mode token: chunk i >= 1 carrying k_i tokens contributes k_i gaps of (t_i - t_(i-1)) / k_i, k_i = len(token_ids) of the chunk (at least 1) when the server streams token ids, else 1; the first chunk contributes none (its wait is ttft)",
    "e2el_ms": "completion time - arrival time (ms): the last token's time (kind openai: the arrival of the last output-carrying chunk); for a static engine with completion batch_end (its default) the end of the request's batch, when a static-batching server returns the batch's answers (own_end: its own last token)",
    "goodput": "finished requests meeting every SLO limit (ttft, tpot, e2el; an undefined tpot meets its limit) / duration_s (req/s), as vllm bench serve --goodput; suspect requests (kind openai, see suspect) never count",
    "output_tokens": "a request's output token count; kind openai: usage.completion_tokens when the server sends it, else the streamed token ids when every output chunk carries token_ids, else an estimate, one per output chunk (len(token_ids) for a chunk that has them): the request is then output_tokens_estimated, and num_output_tokens_estimated counts such finished requests",
    "suspect": "kind openai: a finished request whose stream disagrees with its usage (workbench.openai_replay.suspect_reason): with U = usage.completion_tokens, every output chunk carrying token_ids and U != their total count; or U < sum over output chunks of (len(token_ids), or 1 for a chunk without token_ids), since a chunk without them carries at least one token; or U > 0 with no output chunk; or U > max_tokens sent. Kept in every figure but goodput; num_suspect counts them, suspect_reasons lists up to 10 reasons",
    "kv_waste_frac": "1 - sum(step duration * slots holding token states) / sum(step duration * slots allocated): time-weighted",
    "kv_breakdown": "time-weighted shares of allocated slots: token_states, reserved (for tokens a request may still produce), internal_frag (allocated slots it can never use), external_frag (gaps between contiguous allocations) (PagedAttention, SOSP 2023, Fig. 2)",
    "kv_usage_mean": "time-weighted mean of slots allocated / pool slots (vllm:kv_cache_usage_perc as a fraction)",
    "percentiles": "numpy.percentile, linear interpolation (as vllm bench serve)",
    # memory management (memory_summary)
    "prefix_cache_hit_rate": "prefix_cache_hits / prefix_cache_queries: prompt tokens found in the prefix cache over tokens looked up at first admission (vllm:prefix_cache_hits / vllm:prefix_cache_queries); re-admissions after a recompute preemption are not counted",
    "prefix_cache_ideal_hit_rate": "the trace's hit rate under an unlimited prefix cache: requests in arrival order, each hits its longest run of leading full blocks some earlier prompt had, at most prompt length - 1 tokens (workbench.traces.prefix.ideal_prefix_hit_rate)",
    "spec_decode": "speculative decoding (vllm:spec_decode_* counters): num_drafts = request-steps that verified drafts, num_draft_tokens = drafts verified, num_accepted_tokens = drafts kept; acceptance_rate = num_accepted_tokens / num_draft_tokens; mean_acceptance_length = 1 + num_accepted_tokens / num_drafts (tokens emitted per verify, the bonus token included); present only when some step drafted",
    "comm_time_s": "tensor parallelism: seconds of the steps spent in collective communication on rank 0 (all-reduces and the logits gather); comm_time_frac = comm_time_s / sum of step durations; present only when nonzero",
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


def dist(values_s) -> dict[str, float | int | None]:
    """``{mean, p50, p90, p99, count}`` of an iterable of seconds: mean and percentiles in milliseconds,
    ``count`` the number of values; mean and percentiles are None when there is no value (a metric no
    request defines, e.g. TPOT when every request has one output token), never 0.

    Percentiles are :func:`workbench.stats.percentiles` (``numpy.percentile``, linear, as vllm bench serve).
    """
    v = np.asarray(list(values_s), dtype=float) * 1000.0
    if v.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}
    return {"mean": float(v.mean()), **percentiles(v, (50, 90, 99)), "count": int(v.size)}


def chunk_itls(times: list[float], tokens: list[int | None] | None = None, mode: str = "chunk") -> list[float]:
    """Inter-token latencies (seconds) of a streamed request from its output-carrying chunks.

    Args:
        times: arrival time of each output-carrying chunk (s), in stream order: t_0, t_1, ...
        tokens: tokens each chunk carries, k_i (None, or a None entry, where unknown).
        mode: ``chunk``: one gap t_i - t_(i-1) per chunk i >= 1, as ``vllm bench serve``; ``token``: chunk
            i >= 1 contributes k_i gaps of (t_i - t_(i-1)) / k_i, k_i at least 1 and 1 where unknown.
            The first chunk contributes none in either mode (its wait is the TTFT).

    Raises:
        ValueError: ``mode`` is neither ``chunk`` nor ``token``.
    """
    if mode not in ("chunk", "token"):
        raise ValueError(f"itl mode must be chunk or token, got {mode!r}")
    out: list[float] = []
    for i in range(1, len(times)):
        gap = times[i] - times[i - 1]
        if mode == "chunk":
            out.append(gap)
        else:
            k = max(1, (tokens[i] if tokens is not None and i < len(tokens) else None) or 1)
            out.extend([gap / k] * k)
    return out


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
    their last token. A streamed output (kind openai) has ``chunk_times`` (arrival of each output-carrying
    chunk, s), ``chunk_tokens`` and ``itl_mode``: it ends at its last chunk and its ITLs are
    :func:`chunk_itls`. TPOT = (E2EL - TTFT) / (n - 1) for n = len(token_ids) output tokens; TPOT is None
    and there are no ITLs when n == 1."""
    if o.first_token_time is None or o.finished_time is None or not o.token_ids:
        return None
    ttft = o.first_token_time - o.arrival_time
    n = len(o.token_ids)
    chunks = getattr(o, "chunk_times", None)
    if chunks:
        end = chunks[-1]
        itls = chunk_itls(chunks, getattr(o, "chunk_tokens", None), getattr(o, "itl_mode", "chunk"))
    else:
        end = o.token_times[-1] if o.token_times else o.finished_time
        itls = [b - a for a, b in zip(o.token_times, o.token_times[1:])]
    completion = getattr(o, "completion_time", None)
    if completion is not None:
        end = max(end, completion)
    e2el = max(end, o.first_token_time) - o.arrival_time
    tpot = (e2el - ttft) / (n - 1) if n > 1 else None
    return RequestMetrics(ttft, tpot, e2el, itls if n > 1 else [])


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
    pairs = [(o, m) for o, m in ((o, request_metrics(o)) for o in finished) if m is not None]
    ms = [m for _, m in pairs]
    suspect = [o for o in finished if getattr(o, "suspect", None)]
    out_tokens = sum(len(o.token_ids) for o in finished)
    in_tokens = sum(len(o.prompt_token_ids) for o in finished)
    good = sum(1 for o, m in pairs if not getattr(o, "suspect", None) and _meets(m, slo or {}))
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
        "num_output_tokens_estimated": sum(1 for o in finished if getattr(o, "output_tokens_estimated", False)),
        "num_suspect": len(suspect),
        "suspect_reasons": sorted({str(o.suspect) for o in suspect})[:10],
    }
    summary.update(kv_summary(steps))
    summary["saturation"] = saturation(outputs, steps, duration)
    summary.update(memory_summary(steps))
    summary.update(spec_summary(steps))
    return summary


def spec_summary(steps) -> dict:
    """Speculative decoding's and tensor parallelism's figures of a run (see ``FORMULAS``): present only when
    some step drafted tokens (``spec_decode``) or communicated (``comm_time_s``)."""
    out: dict = {}
    drafts = sum(getattr(s, "spec_drafts", 0) for s in steps)
    if drafts:
        d = sum(s.spec_draft_tokens for s in steps)
        a = sum(s.spec_accepted_tokens for s in steps)
        out["spec_decode"] = {"num_drafts": int(drafts), "num_draft_tokens": int(d), "num_accepted_tokens": int(a),
                              "acceptance_rate": a / d if d else 0.0, "mean_acceptance_length": 1.0 + a / drafts}
    comm = sum(getattr(s, "comm_time", 0.0) for s in steps)
    if comm:
        busy = sum(s.duration for s in steps)
        out["comm_time_s"] = float(comm)
        out["comm_time_frac"] = float(comm / busy) if busy else 0.0
    return out


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
