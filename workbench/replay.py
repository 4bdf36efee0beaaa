"""Trace replay on an engine: real time for the real engines, the event heap for the simulator."""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Callable

from engines.llm_engine import LLMEngine, RequestOutput
from engines.request import Request, RequestStatus
from engines.sampling_params import SamplingParams
from engines.simulator import simulate
from workbench.traces import TraceRequest


def make_requests(trace: list[TraceRequest], eos_token_id: int | None) -> list[Request]:
    """Engine requests for a trace: greedy, exactly the trace's output length (EOS ignored)."""
    return [
        Request(
            request_id=t.request_id,
            prompt_token_ids=list(t.prompt_token_ids or []),
            sampling_params=SamplingParams(max_tokens=t.output_tokens, temperature=0.0, ignore_eos=True),
            arrival_time=t.arrival_s,
            eos_token_id=eos_token_id,
        )
        for t in trace
    ]


class _RelativeClock:
    """Wall-clock seconds since construction."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


def replay_realtime(engine: LLMEngine, requests: list[Request],
                    on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
    """Feed each request at its ``arrival_time`` (seconds from now, wall clock) and step the engine
    until all have ended. A step that raises fails every unfinished request (status FAILED, with the
    error as reason) instead of losing them. Returns one output per request."""
    engine.clock = _RelativeClock()
    pending = deque(sorted(requests, key=lambda r: r.arrival_time))
    outputs: list[RequestOutput] = []
    # Like vLLM after start-up: move everything alive now out of the collector's reach, so that a big
    # heap left by earlier work (a test session, a previous engine) does not slow every step's GC.
    gc.collect()
    gc.freeze()
    try:
        _replay_loop(engine, pending, outputs, on_output)
    finally:
        gc.unfreeze()
    return outputs


def _replay_loop(engine: LLMEngine, pending: deque, outputs: list[RequestOutput],
                 on_output: Callable[[RequestOutput], None] | None) -> None:

    def emit(outs):
        for o in outs:
            outputs.append(o)
            if on_output:
                on_output(o)

    while pending or engine.has_unfinished():
        now = engine.clock()
        while pending and pending[0].arrival_time <= now:
            r = engine.add_request(pending.popleft())
            emit([r] if r is not None else [])
        if engine.has_unfinished():
            try:
                emit(engine.step())
            except Exception as e:  # keep every request accounted for
                emit(_fail_all(engine, f"engine step failed: {type(e).__name__}: {e}"))
                for r in pending:
                    r.status, r.reject_reason = RequestStatus.FAILED, "engine stopped after a failed step"
                emit([engine._output(r) for r in pending])
                pending.clear()
                break
            if engine.steps and engine.steps[-1].num_seqs == 0 and pending:
                time.sleep(max(0.0, pending[0].arrival_time - engine.clock()))
        elif pending:
            time.sleep(max(0.0, pending[0].arrival_time - engine.clock()))


def _fail_all(engine: LLMEngine, reason: str) -> list[RequestOutput]:
    outs = []
    for rid in list(engine.scheduler.requests):
        req = engine.scheduler.finish_request(rid, RequestStatus.FAILED)
        req.reject_reason = reason
        outs.append(engine._finish(req))
    return outs


def replay_simulated(engine: LLMEngine, requests: list[Request],
                     on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
    """Replay on a simulated engine (virtual clock, event heap)."""
    outs = simulate(engine, requests)
    if on_output:
        for o in outs:
            on_output(o)
    return outs
