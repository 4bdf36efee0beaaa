"""Discrete-event simulator: the real scheduler and KV manager, a cost model instead of the model.

Only the executor differs from the real engine: ``CostModelExecutor`` returns the cost model's
predicted step duration (advancing a virtual clock) and a placeholder token for each sampling
sequence. Everything else (``LLMEngine``, ``PagedScheduler``/``StaticScheduler``, the KV managers,
step records) is the very code the real engine runs, so simulator-vs-real error measures the cost
model and nothing else.

Beam search runs the real ``BeamSearch`` bookkeeping on synthetic candidates: every beam proposes
the same 2W log-probabilities -1, -2, ..., -2W for the placeholder token (never EOS), so each step decodes
``beam_width`` sequences until ``max_tokens``, the best beam forks (sharing blocks, copy-on-write of its
partly filled block) and the others are freed. What it models: W decode rows per step and their KV blocks
and copies; what it does not: which beams a real model keeps (real beams fork less often) or EOS ending a
search early, and block copies are not charged (a copy-on-write copy is one block).

``simulate`` runs an event heap with a virtual clock, as Vidur does: ``ArrivalEvent`` (a request enters
the scheduler) and ``StepEndEvent`` (the engine finishes a step and may start the next one). With
``max_concurrency`` (closed-loop users) a request's ``ArrivalEvent`` is pushed only when a user is free,
at max(now, its arrival time).
"""

from __future__ import annotations

import functools
import gc
import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from engines.core.config import DEFAULT_SWAP_BANDWIDTH
from engines.core.llm_engine import LLMEngine, RequestOutput
from engines.core.request import Request
from engines.core.scheduler import Scheduler
from engines.sim.cost_model import CostModel
from engines.sim.executor import PLACEHOLDER_TOKEN, CostModelExecutor, VirtualClock  # noqa: F401  (importable from here)


@dataclass(slots=True)
class Event:
    """An event on the heap, ordered by time, then by insertion order."""

    time: float
    order: int
    request: Request | None = None

    def __lt__(self, other: "Event") -> bool:
        return (self.time, self.order) < (other.time, other.order)


def push(heap: list[tuple[float, int, Event]], event: Event) -> None:
    """Put ``event`` on ``heap`` as ``(time, order, event)``: the heap compares the tuples' first two items
    in C (``order`` is unique, so events themselves are never compared), much cheaper than ``Event.__lt__``."""
    heapq.heappush(heap, (event.time, event.order, event))


class ArrivalEvent(Event):
    """A request arrives and joins the scheduler's waiting queue."""

    __slots__ = ()


class StepEndEvent(Event):
    """The engine finished a step; it starts the next one if it has work."""

    __slots__ = ()


def make_sim_engine(scheduler: Scheduler, cost_model: CostModel, block_bytes: int = 0,
                    swap_bandwidth_bytes_per_s: float = DEFAULT_SWAP_BANDWIDTH, seed: int | None = None) -> LLMEngine:
    """An ``LLMEngine`` over ``scheduler`` whose executor is the cost model on a virtual clock (the
    simulator's executor and clock around any policy; ``engines.factory.build_engine`` builds whole sim
    engines, policy included, from an engine description). ``seed``: draws of the cost model's step noise
    (``CostModel.noise_cv``; None: none)."""
    clock = VirtualClock()
    ex = CostModelExecutor(cost_model, clock, block_bytes, swap_bandwidth_bytes_per_s, seed)
    return LLMEngine(scheduler, ex, tokenizer=None, clock=clock)


def requests_in_flight(engine: LLMEngine) -> int:
    """Requests added to ``engine`` and not yet answered (``Scheduler.num_unanswered``: waiting, running,
    preempted or swapped, or finished and held until their static batch ends), a request with
    parallel-sampling or beam sequences counted once."""
    return engine.scheduler.num_unanswered()


class ClosedLoopUsers:
    """Sends requests onto the event heap: all at their arrival times (open loop, ``limit`` None), or as
    ``limit`` closed-loop users: at most ``limit`` requests sent and not yet ended, and when one ends the
    next pending request (in arrival order) is sent at max(now, its arrival time), which becomes its
    ``arrival_time`` (seconds).

    ``requests`` is a list (sorted here; every open-loop arrival goes on the heap at once) or any other
    iterable, read lazily in the order given, which must be arrival order: one open-loop arrival is on the
    heap at a time, and the next is read when it arrives (a day-long trace never has all its requests in
    memory). Both give the same events: arrivals at one instant are all admitted before the next step.

    Raises:
        ValueError: ``limit`` < 1; (lazy) a request that arrives before the one read before it.
    """

    def __init__(self, requests: Iterable[Request], limit: int | None = None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"max_concurrency must be >= 1 (or None), got {limit}")
        self.lazy = not isinstance(requests, list)
        self.source: Iterator[Request] | None = iter(requests) if self.lazy else None
        self.pending = deque() if self.lazy else deque(sorted(requests, key=lambda r: r.arrival_time))
        self.last_read: tuple[str, float] | None = None  # lazy: (id, arrival s) of the last request read
        self.limit = limit
        self.sent = 0  # ArrivalEvents on the heap that have not arrived yet

    def _read(self, n: int) -> None:
        """Lazy: read requests until ``n`` are pending (fewer when the source ends)."""
        while len(self.pending) < n:
            r = next(self.source, None)
            if r is None:
                return
            last = self.last_read
            if last is not None and r.arrival_time < last[1]:
                raise ValueError(f"request {r.request_id}: arrives at {r.arrival_time:.6f} s, before request "
                                 f"{last[0]} ({last[1]:.6f} s) read before it: a lazily read trace must be in "
                                 "arrival order")
            self.last_read = (r.request_id, r.arrival_time)  # closed loop may move arrival_time later
            self.pending.append(r)

    def send(self, engine: LLMEngine, now: float, heap: list[tuple[float, int, Event]], order) -> None:
        """Push an ArrivalEvent for every free user (every pending request in open loop; lazily, the next
        one when none is on the heap)."""
        if self.limit is None:
            free = (0 if self.sent else 1) if self.lazy else len(self.pending)
        else:
            free = self.limit - self.sent - requests_in_flight(engine)
        if self.lazy and free > 0:
            self._read(free)
        for _ in range(min(free, len(self.pending))):
            r = self.pending.popleft()
            if self.limit is not None:
                r.arrival_time = max(now, r.arrival_time)
            push(heap, ArrivalEvent(r.arrival_time, next(order), r))
            self.sent += 1

    def arrived(self) -> None:
        self.sent -= 1


class OutputSink(list):
    """Where ``simulate`` puts the outputs: kept in the list, or handed to ``on_output`` one by one."""

    def __init__(self, on_output: Callable[[RequestOutput], None] | None) -> None:
        super().__init__()
        self.on_output = on_output

    def append(self, out: RequestOutput) -> None:
        if self.on_output is None:
            super().append(out)
        else:
            self.on_output(out)

    def extend(self, outs) -> None:
        for o in outs:
            self.append(o)


def without_cycle_collection(fn):
    """Run ``fn`` with Python's cyclic garbage collector paused (``gc.disable``; restored after, also on an error).

    A simulated step allocates objects per scheduled row (its ``ScheduledSeq``, token slices, dictionaries), so with
    the collector on a generation-0 pass ran every few steps and full passes walked every live request and record:
    about a fifth of a compiled run of the Azure trace's first 6,000 requests (``benchmarks/sim_speed.py --native
    --limit 6000``, collector on and off run side by side, 0.75x and 0.81x the time off, on a 2-core AVX2 EPYC). Nothing is lost: the engine loop makes no reference cycles (reference counting frees every step's
    objects; ``tests/test_simulator_gc.py`` checks that a mix of workloads leaves none but the one a finished beam
    search's output makes by listing itself in ``outputs``, one per request), and a cycle made anyway is collected
    once the collector is back on.
    """

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@without_cycle_collection
def simulate(engine: LLMEngine, requests: Iterable[Request], max_concurrency: int | None = None,
             on_output: Callable[[RequestOutput], None] | None = None,
             on_steps: Callable[[list], None] | None = None, steps_window: int = 4096) -> list[RequestOutput]:
    """Replay ``requests`` (``arrival_time`` in seconds) on a simulated engine; returns every output
    (finished and rejected) in completion order. The engine's clock must be a ``VirtualClock``.

    ``requests``: a list, or an iterable in arrival order read lazily (see :class:`ClosedLoopUsers`).
    ``max_concurrency`` (requests): closed-loop users, see :class:`ClosedLoopUsers`; a request's arrival is
    rescheduled to when a user frees (a finished or rejected request ends at once), not polled.
    For runs too long to keep every record (a simulated day): ``on_output`` takes each output as it ends
    (then none is returned), and ``on_steps`` takes the engine's step records every ``steps_window`` steps
    (all but the last, which are then dropped from ``engine.steps``; the rest stay there at the end).

    Raises:
        TypeError: the engine has no virtual clock. ValueError: ``max_concurrency`` < 1; a lazily read request
            out of arrival order. RuntimeError: requests are left that can never be scheduled.
    """
    clock = engine.clock
    if not isinstance(clock, VirtualClock):
        raise TypeError("simulate needs a simulated engine (engines.factory.build_engine with kind sim, or "
                        "make_sim_engine): its clock must be a VirtualClock")
    order = itertools.count()
    heap: list[tuple[float, int, Event]] = []
    users = ClosedLoopUsers(requests, max_concurrency)
    users.send(engine, clock.now, heap, order)
    outputs = OutputSink(on_output)
    busy = False
    while heap:
        ev = heapq.heappop(heap)[2]
        clock.now = max(clock.now, ev.time)
        if isinstance(ev, ArrivalEvent):
            _arrive(engine, ev.request, outputs, users, heap, order)
        else:
            busy = False
        while heap and heap[0][0] <= clock.now and isinstance(heap[0][2], ArrivalEvent):
            _arrive(engine, heapq.heappop(heap)[2].request, outputs, users, heap, order)  # all arrived by now
        if busy or not engine.has_unfinished():
            continue
        # the engine is idle and has work: run one step; it ends at the advanced clock
        outputs.extend(engine.step())
        users.send(engine, clock.now, heap, order)  # requests that ended in the step free their users
        if on_steps is not None and len(engine.steps) > steps_window:
            drain_steps(engine, on_steps)
        if engine.steps[-1].num_seqs == 0:
            continue  # nothing could be scheduled: wait for the next arrival
        busy = True
        push(heap, StepEndEvent(clock.now, next(order)))
    if engine.has_unfinished():
        raise RuntimeError(f"simulation stalled: {len(engine.scheduler.requests)} requests can never be scheduled")
    return list(outputs)


def drain_steps(engine: LLMEngine, on_steps: Callable[[list], None]) -> None:
    """Hand ``engine.steps`` but the last record to ``on_steps`` and drop them from the engine."""
    done = engine.steps[:-1]
    del engine.steps[:-1]
    on_steps(done)


def _arrive(engine: LLMEngine, request: Request, outputs: list[RequestOutput], users: ClosedLoopUsers,
            heap: list[tuple[float, int, Event]], order) -> None:
    users.arrived()
    rejected = engine.add_request(request)
    if rejected is not None:
        outputs.append(rejected)
        users.send(engine, engine.clock(), heap, order)  # a rejected request ends at once and frees its user
    elif users.lazy and users.limit is None:
        users.send(engine, engine.clock(), heap, order)  # read the next arrival
