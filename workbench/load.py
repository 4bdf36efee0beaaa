"""Offered load relative to capacity: saturation probes and the arrival-time rescaling of ``trace.load``.

A trace replayed at its recorded arrival times measures the offered load whenever an engine keeps up, so
its throughput depends on how fast the machine is. ``trace.load: {engine, factor}`` instead sets the
offered rate to ``factor`` x the named engine's capacity *on this machine*, measured just before the
replay, so every machine runs the scenario at the same relative load.

Capacity here is the **saturation throughput**: a sample of the trace (``probe_requests`` requests,
spread evenly over it, so that its length mix is the trace's) arrives all at once and the engine runs it
to the end; capacity = finished requests / (last finish - first arrival), in req/s. It includes the
drain at the end of the probe (fewer and fewer requests running), so it is a slight underestimate of
the rate the engine sustains with a full queue; the same rule holds on every machine, so the relative
load is comparable. The PagedAttention paper compares systems by the highest rate each sustains under a
latency target; ``workbench capacity`` finds that rate (each probe a whole run), this probe is the cheap
upper-bound-like figure the replay can afford to measure every time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from workbench.traces import TraceRequest, apply_transforms

DEFAULT_PROBE_REQUESTS = 24
METHOD = "saturation_probe"


def probe_sample(trace: list[TraceRequest], n: int | None) -> list[TraceRequest]:
    """``n`` requests (default min(len, 24)) taken at evenly spaced positions of ``trace``, all arriving
    at 0 s, with ids prefixed ``probe-``.

    Raises:
        ValueError: the trace is empty.
    """
    if not trace:
        raise ValueError("trace.load: the trace is empty; nothing to probe the capacity with")
    n = min(n or DEFAULT_PROBE_REQUESTS, len(trace))
    picks = [round(i * (len(trace) - 1) / max(n - 1, 1)) for i in range(n)] if n > 1 else [0]
    return [dataclasses.replace(trace[i], request_id=f"probe-{trace[i].request_id}", arrival_s=0.0)
            for i in picks]


def capacity_from_outputs(outputs) -> dict:
    """Saturation figures of a probe run: ``capacity_req_s`` (finished requests / duration),
    ``output_tok_s``, ``duration_s`` (last finish - first arrival, s), ``num_finished``, ``num_requests``.

    Raises:
        ValueError: no request of the probe finished (the capacity is unknown).
    """
    finished = [o for o in outputs if o.finish_reason in ("stop", "length")]
    if not finished:
        reasons = sorted({o.error or o.finish_reason for o in outputs})[:3]
        raise ValueError(f"trace.load: no request of the capacity probe finished ({'; '.join(reasons)})")
    duration = max(o.finished_time for o in finished) - min(o.arrival_time for o in outputs)
    if duration <= 0:
        raise ValueError("trace.load: the capacity probe took no time; cannot measure a rate")
    return {"capacity_req_s": len(finished) / duration,
            "output_tok_s": sum(len(o.token_ids) for o in finished) / duration,
            "duration_s": duration, "num_finished": len(finished), "num_requests": len(outputs)}


def offered_rate(trace: list[TraceRequest]) -> float | None:
    """The trace's mean arrival rate, (count - 1) / span (req/s); None when all arrive together."""
    span = max(t.arrival_s for t in trace) - min(t.arrival_s for t in trace) if trace else 0.0
    return (len(trace) - 1) / span if span > 0 else None


def apply_load(trace: list[TraceRequest], capacity_req_s: float, factor: float, seed: int = 0
               ) -> tuple[list[TraceRequest], dict]:
    """Rescale ``trace``'s arrivals so that its offered rate is ``factor`` x ``capacity_req_s``.

    Returns the new trace and ``{offered_req_s, recorded_req_s, time_scale}``: ``time_scale`` multiplies
    the recorded inter-arrival times (None when the trace had no timing and arrivals were drawn as a
    Poisson process at the offered rate, as ``request_rate`` does).
    """
    target = factor * capacity_req_s
    before = offered_rate(trace)
    out = apply_transforms(trace, request_rate=target, seed=seed)
    return out, {"offered_req_s": target, "recorded_req_s": before,
                 "time_scale": (before / target) if before else None}


def measure_capacities(run: Callable[[str, list[TraceRequest]], list], names: list[str],
                       sample: list[TraceRequest]) -> dict[str, dict]:
    """Run the saturation probe on each engine of ``names`` (``run(name, sample) -> outputs``) and
    return ``{name: capacity_from_outputs(...)}``, in order."""
    return {name: capacity_from_outputs(run(name, sample)) for name in names}


def paged_static_ratios(capacities: dict[str, dict], policies: dict[str, tuple[str, bool]]) -> dict[str, float]:
    """``{"A/B": capacity(A) / capacity(B)}`` for each paged engine A and static engine B of the same side
    (both real or both simulated); ``policies`` maps a name to ``(policy, is_simulated)``."""
    out = {}
    for a, (pa, sa) in policies.items():
        for b, (pb, sb) in policies.items():
            if pa == "paged" and pb == "static" and sa == sb and a in capacities and b in capacities:
                out[f"{a}/{b}"] = capacities[a]["capacity_req_s"] / capacities[b]["capacity_req_s"]
    return out


__all__ = ["DEFAULT_PROBE_REQUESTS", "METHOD", "apply_load", "capacity_from_outputs", "paged_static_ratios",
           "measure_capacities", "offered_rate", "probe_sample"]
