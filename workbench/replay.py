"""Trace replay on an engine: real time for the real engines, the event heap for the simulator."""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from typing import Callable

from engines.core.llm_engine import LLMEngine, RequestOutput
from engines.core.request import Request, RequestStatus
from engines.core.sampling_params import SamplingParams
from engines.sim.simulator import requests_in_flight, simulate
from workbench.traces import TraceRequest


def make_requests(trace: list[TraceRequest], eos_token_id: int | tuple[int, ...] | None) -> list[Request]:
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

    def stopped_for(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` with the clock stopped: the seconds it takes do not count."""
        t = time.perf_counter()
        fn()
        self.t0 += time.perf_counter() - t


class _Users:
    """``limit`` closed-loop users of a real-time replay; each free user remembers when it became free
    (seconds on the replay clock). ``limit`` None: open loop, a user is always free since forever."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"max_concurrency must be >= 1 (or None), got {limit}")
        self.limit = limit
        self.free: deque[float] = deque([-math.inf] * (limit or 0))

    def available(self) -> bool:
        return self.limit is None or bool(self.free)

    def send(self, request: Request) -> None:
        """Give ``request`` the earliest free user: it is sent at max(its arrival time, when that user freed)."""
        if self.limit is not None:
            request.arrival_time = max(request.arrival_time, self.free.popleft())

    def sync(self, engine: LLMEngine, now: float) -> None:
        """Free the users whose requests ended (finished, rejected, failed) by ``now``."""
        if self.limit is not None:
            ended = self.limit - requests_in_flight(engine) - len(self.free)
            self.free.extend([now] * ended)


def replay_realtime(engine: LLMEngine, requests: list[Request],
                    on_output: Callable[[RequestOutput], None] | None = None,
                    max_concurrency: int | None = None, pilot=None) -> list[RequestOutput]:
    """Feed each request at its ``arrival_time`` (seconds from now, wall clock) and step the engine
    until all have ended. A step that raises fails every unfinished request (status FAILED, with the
    error as reason) instead of losing them. Returns one output per request.

    ``max_concurrency`` (requests): closed-loop users: at most that many requests in the engine at once
    (added and not yet ended); a request is added at max(its arrival time, when a user's previous request
    ended), and that moment becomes its ``arrival_time``. A rejected request ends at once.

    ``pilot``: an ``engines.sim.profiler.PilotProbe``, run after a step that computed something once it is
    ``due()``, with the replay clock stopped (the run's times do not count it); never while the engine idles,
    which would change what the machine does in an idle gap.

    Raises:
        ValueError: ``max_concurrency`` < 1.
    """
    users = _Users(max_concurrency)
    pending = deque(sorted(requests, key=lambda r: r.arrival_time))
    outputs: list[RequestOutput] = []
    # Like vLLM after start-up: move everything alive now out of the collector's reach, so that a big
    # heap left by earlier work (a test session, a previous engine) does not slow every step's GC.
    gc.collect()
    gc.freeze()
    engine.clock = _RelativeClock()  # time 0 is when the first step can run, as on the simulator's clock
    try:
        _replay_loop(engine, pending, outputs, on_output, users, pilot)
    finally:
        gc.unfreeze()
    return outputs


def _replay_loop(engine: LLMEngine, pending: deque, outputs: list[RequestOutput],
                 on_output: Callable[[RequestOutput], None] | None, users: _Users, pilot=None) -> None:

    def emit(outs):
        for o in outs:
            outputs.append(o)
            if on_output:
                on_output(o)

    while pending or engine.has_unfinished():
        now = engine.clock()
        users.sync(engine, now)
        while pending and pending[0].arrival_time <= now and users.available():
            req = pending.popleft()
            users.send(req)
            r = engine.add_request(req)
            emit([r] if r is not None else [])
            users.sync(engine, engine.clock())  # a rejected request frees its user at once
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
            if engine.steps and engine.steps[-1].num_seqs == 0 and pending and users.available():
                time.sleep(max(0.0, pending[0].arrival_time - engine.clock()))
            elif pilot is not None and engine.steps and engine.steps[-1].num_seqs and pilot.due():
                engine.clock.stopped_for(lambda: pilot(engine.clock()))
        elif pending:
            time.sleep(max(0.0, pending[0].arrival_time - engine.clock()))


def _fail_all(engine: LLMEngine, reason: str) -> list[RequestOutput]:
    """Outputs of every request still in the engine after a failed step: answers held for a static batch's
    end are returned as they finished; every other request fails with ``reason``."""
    outs = [engine._finish(r) for r in engine.scheduler.release_held()]
    for rid in list(engine.scheduler.requests):
        req = engine.scheduler.finish_request(rid, RequestStatus.FAILED)
        req.reject_reason = reason
        outs.append(engine._finish(req))
    return outs


def replay_simulated(engine: LLMEngine, requests: list[Request],
                     on_output: Callable[[RequestOutput], None] | None = None,
                     max_concurrency: int | None = None) -> list[RequestOutput]:
    """Replay on a simulated engine (virtual clock, event heap); ``max_concurrency`` as in
    :func:`replay_realtime`, on the virtual clock."""
    outs = simulate(engine, requests, max_concurrency)
    if on_output:
        for o in outs:
            on_output(o)
    return outs


def warm_up(engine) -> None:
    """Run one short request untimed on a real engine before a replay, then forget its step records, so that
    the first engine of a run does not pay one-time costs (loading the compiled kernels, first-call
    allocations; 0.2-0.4 s per step measured on the tiny model) that later engines in the same process skip.

    It also builds oneDNN's GEMM primitive of every row bucket the engine's steps can reach
    (``LlamaModel.warm_gemms``: up to the step token budget, or ``ONEDNN_WARM_MAX_ROWS`` for the static
    policy, whose batch prefills have no budget), as the profile's grid steps are warmed before they are timed:
    otherwise each new batch size pays for its primitive inside a timed step (on a 2-core AMD EPYC the first
    step of the quickstart's capacity probe, 1,024 tokens of 14 prompts, took 761-938 ms against 693 predicted;
    warming every bucket to 4,096 rows took 1.8 s there)."""
    from engines.core.request import Request
    from engines.core.sampling_params import SamplingParams
    from engines.core.static_scheduler import StaticScheduler
    from engines.real.linear import ONEDNN_WARM_MAX_ROWS

    model = getattr(engine.executor, "model", None)
    if hasattr(model, "warm_gemms"):
        cfg = engine.scheduler.config
        static = isinstance(engine.scheduler, StaticScheduler)
        model.warm_gemms(ONEDNN_WARM_MAX_ROWS if static else cfg.max_num_batched_tokens,
                         cfg.max_batch_size if static else cfg.max_num_seqs)

    engine.add_request(Request("warm-up", [100 + i for i in range(16)], SamplingParams(max_tokens=4, ignore_eos=True),
                               arrival_time=engine.clock()))
    engine.run_to_completion()
    engine.steps.clear()
