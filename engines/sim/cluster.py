"""Cluster simulation: N simulated engine replicas behind a router, on one event heap.

Each replica is a whole simulated engine (``engines.factory.build_engine`` kind sim: its own scheduler, KV
manager with its prefix cache, cost model and ``VirtualClock``), so replicas may be of mixed hardware. One
heap orders every ``ArrivalEvent`` and every replica's step end by simulated time (seconds); a replica's
clock is moved to an event's time when the event concerns it, so every clock follows heap time. At each
arrival the router (``engines.core.router``) picks the replica that gets the request.

Timing (as in ``engines.sim.simulator.simulate``): a step is computed when it starts, advancing its replica's
clock to the step's end. A router asked while a replica is mid-step therefore sees that replica as it will
be at the end of its current step (at most one step ahead: requests that finish in that step are already
gone, its new KV blocks already cached).

With one replica (any router) the event sequence is that of ``simulate``, so the outputs and step records
are identical. ``max_concurrency`` (closed-loop users) counts requests in flight over all replicas.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterable

from engines.core.llm_engine import LLMEngine, RequestOutput
from engines.core.request import Request
from engines.sim.simulator import (ArrivalEvent, ClosedLoopUsers, Event, OutputSink, StepEndEvent, VirtualClock, drain_steps,
                                   push, without_cycle_collection)


@dataclass(slots=True)
class ReplicaStepEnd(StepEndEvent):
    """Replica ``replica`` finished a step."""

    replica: int = 0


@dataclass
class ClusterRun:
    """What :func:`simulate_cluster` returns.

    Attributes:
        outputs: every request's output (finished and rejected), in completion order, with its request id.
        replica_of: request id -> index of the replica the router sent it to.
        replicas: the replica engines (their ``steps`` are the per-replica step records).
    """

    outputs: list[RequestOutput]
    replica_of: dict[str, int]
    replicas: list[LLMEngine] = field(default_factory=list)
    # streaming (see simulate_cluster): where step records go, and every how many steps of a replica
    on_steps: Callable[[list], None] | None = field(default=None, repr=False)
    steps_window: int = 4096

    def outputs_of(self, replica: int) -> list[RequestOutput]:
        """The outputs of the requests replica ``replica`` served."""
        return [o for o in self.outputs if self.replica_of[o.request_id] == replica]


class _FleetLoad:
    """Requests in flight over all replicas, shaped as ``ClosedLoopUsers.send`` reads an engine
    (``engine.scheduler.num_unanswered()``)."""

    def __init__(self, replicas: list[LLMEngine]) -> None:
        self.replicas = replicas

    @property
    def scheduler(self) -> "_FleetLoad":
        return self  # a property, not an attribute: no reference cycle (the run pauses the cycle collector)

    def num_unanswered(self) -> int:
        return sum(r.scheduler.num_unanswered() for r in self.replicas)


@without_cycle_collection
def simulate_cluster(replicas: list[LLMEngine], router, requests: Iterable[Request],
                     max_concurrency: int | None = None, on_output: Callable[[RequestOutput], None] | None = None,
                     on_steps: Callable[[list], None] | None = None, steps_window: int = 4096) -> ClusterRun:
    """Replay ``requests`` (``arrival_time`` in seconds) on simulated ``replicas`` behind ``router``
    (``router.choose(request, replicas) -> index``, called at each arrival when there are several replicas).

    ``requests``: a list, or an iterable in arrival order read lazily (``engines.sim.simulator.ClosedLoopUsers``).
    For a simulated day: ``on_output`` takes each output as it ends (``ClusterRun.outputs`` stays empty), and
    ``on_steps`` takes each replica's step records every ``steps_window`` of its steps (all but its last; the
    rest stay on the replicas), as ``engines.sim.simulator.simulate`` does.

    Raises:
        ValueError: no replicas, the same engine twice, or ``max_concurrency`` < 1. TypeError: a replica
            without a ``VirtualClock``. IndexError: the router returned no replica's index.
        RuntimeError: requests are left that can never be scheduled.
    """
    _check(replicas)
    order = itertools.count()
    heap: list[tuple[float, int, Event]] = []
    fleet = _FleetLoad(replicas)
    users = ClosedLoopUsers(requests, max_concurrency)
    users.send(fleet, 0.0, heap, order)
    run = ClusterRun(OutputSink(on_output), {}, replicas)
    run.on_steps, run.steps_window = on_steps, steps_window
    busy = [False] * len(replicas)
    pop = heapq.heappop
    while heap:
        ev = pop(heap)[2]
        if type(ev) is ReplicaStepEnd and not (heap and heap[0][0] <= ev.time and isinstance(heap[0][2], ArrivalEvent)):
            # the common event, a step end with no arrival at the same time: what the general path below does
            i, clock = ev.replica, replicas[ev.replica].clock
            if clock.now < ev.time:
                clock.now = ev.time
            busy[i] = _start_step(i, replicas, run, users, fleet, heap, order)
            continue
        touched = []
        if isinstance(ev, ArrivalEvent):
            touched.append(_route(ev, router, replicas, run, users, fleet, heap, order))
        else:
            replicas[ev.replica].clock.now = max(replicas[ev.replica].clock.now, ev.time)
            busy[ev.replica] = False
            touched.append(ev.replica)
        while heap and heap[0][0] <= ev.time and isinstance(heap[0][2], ArrivalEvent):
            touched.append(_route(heapq.heappop(heap)[2], router, replicas, run, users, fleet, heap, order))
        for i in dict.fromkeys(touched):  # each touched replica once, in order
            busy[i] = busy[i] or _start_step(i, replicas, run, users, fleet, heap, order)
    stuck = sum(len(r.scheduler.requests) for r in replicas if r.has_unfinished())
    if stuck:
        raise RuntimeError(f"cluster simulation stalled: {stuck} requests can never be scheduled")
    run.outputs = list(run.outputs)
    return run


def _check(replicas: list[LLMEngine]) -> None:
    if not replicas:
        raise ValueError("simulate_cluster needs at least one replica")
    if len({id(r) for r in replicas}) != len(replicas):
        raise ValueError("simulate_cluster: the same engine is listed twice; build one engine per replica")
    for i, r in enumerate(replicas):
        if not isinstance(r.clock, VirtualClock):
            raise TypeError(f"replica {i} is not a simulated engine: its clock must be a VirtualClock")


def _route(ev: Event, router, replicas: list[LLMEngine], run: ClusterRun, users: ClosedLoopUsers,
           fleet: _FleetLoad, heap: list[tuple[float, int, Event]], order) -> int:
    """Send an arriving request to the replica the router picks; returns that replica's index."""
    req = ev.request
    i = router.choose(req, replicas) if len(replicas) > 1 else 0  # one replica: nothing to choose
    if not 0 <= i < len(replicas):
        raise IndexError(f"router {getattr(router, 'name', router)!r} chose replica {i} of {len(replicas)}")
    eng = replicas[i]
    eng.clock.now = max(eng.clock.now, ev.time)
    run.replica_of[req.request_id] = i
    users.arrived()
    rejected = eng.add_request(req)
    if rejected is not None:
        run.outputs.append(rejected)
        users.send(fleet, eng.clock(), heap, order)  # a rejected request ends at once and frees its user
    elif users.lazy and users.limit is None:
        users.send(fleet, eng.clock(), heap, order)  # read the next arrival
    return i


def _start_step(i: int, replicas: list[LLMEngine], run: ClusterRun, users: ClosedLoopUsers, fleet: _FleetLoad,
                heap: list[tuple[float, int, Event]], order) -> bool:
    """Run one step on idle replica ``i`` if it has work; returns whether it is now busy."""
    eng = replicas[i]
    if not eng.has_unfinished():
        return False
    run.outputs.extend(eng.step())
    users.send(fleet, eng.clock.now, heap, order)  # requests that ended in the step free their users
    if run.on_steps is not None and len(eng.steps) > run.steps_window:
        drain_steps(eng, run.on_steps)
    if eng.steps[-1].num_seqs == 0:
        return False  # nothing could be scheduled: wait for the next arrival
    push(heap, ReplicaStepEnd(eng.clock.now, next(order), replica=i))
    return True
