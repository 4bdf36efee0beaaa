"""Discrete-event simulator: the real scheduler and KV manager, a cost model instead of the model.

Only the executor differs from the real engine: ``CostModelExecutor`` returns the cost model's
predicted step duration (advancing a virtual clock) and a placeholder token for each sampling
sequence. Everything else (``LLMEngine``, ``PagedScheduler``/``StaticScheduler``, the KV managers,
step records) is the very code the real engine runs, so simulator-vs-real error measures the cost
model and nothing else.

``simulate`` runs an event heap with a virtual clock, as Vidur does: ``ArrivalEvent`` (a request enters
the scheduler) and ``StepEndEvent`` (the engine finishes a step and may start the next one).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from engines.cost_model import CostModel
from engines.llm_engine import LLMEngine, RequestOutput
from engines.request import Request
from engines.scheduler import Scheduler, SchedulerOutput, StepResult

PLACEHOLDER_TOKEN = 0


class VirtualClock:
    """Seconds of simulated time; advanced only by the simulator."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostModelExecutor:
    """Executor that predicts instead of computing.

    Args:
        cost_model: predicts step seconds from the scheduled batch.
        clock: the virtual clock, advanced by each step's predicted duration.
    """

    def __init__(self, cost_model: CostModel, clock: VirtualClock) -> None:
        self.cost_model, self.clock = cost_model, clock

    def execute(self, out: SchedulerOutput) -> StepResult:
        dt = self.cost_model.predict(out.seqs)
        self.clock.now += dt
        sampled = {s.request_id: PLACEHOLDER_TOKEN for s in out.seqs if s.sample and not s.is_padding}
        return StepResult(sampled, dt)

    def release(self, request_id: str) -> None:
        pass


@dataclass
class Event:
    """An event on the heap, ordered by time, then by insertion order."""

    time: float
    order: int
    request: Request | None = None

    def __lt__(self, other: "Event") -> bool:
        return (self.time, self.order) < (other.time, other.order)


class ArrivalEvent(Event):
    """A request arrives and joins the scheduler's waiting queue."""


class StepEndEvent(Event):
    """The engine finished a step; it starts the next one if it has work."""


def build_sim_engine(policy: str, model_config, cost_model: CostModel, block_size: int = 16,
                     kv_cache_tokens: int | None = None, kv_cache_bytes: int | None = None, dtype_bytes: int = 4,
                     **sched_knobs) -> LLMEngine:
    """A simulated engine with the same knobs as the real one (``policy`` = ``paged`` or ``static``;
    ``sched_knobs`` are ``SchedulerConfig`` fields; ``max_model_len`` defaults to the model's)."""
    from engines.config import CacheConfig, SchedulerConfig
    from engines.llm_engine import DEFAULT_KV_CACHE_TOKENS, build_scheduler

    knobs = {k: v for k, v in sched_knobs.items() if v is not None}
    knobs.setdefault("max_model_len", model_config.max_position_embeddings)
    cache = CacheConfig(block_size, kv_cache_tokens, kv_cache_bytes)
    num_blocks = cache.num_blocks(model_config.kv_bytes_per_token(dtype_bytes), DEFAULT_KV_CACHE_TOKENS)
    return make_sim_engine(build_scheduler(policy, SchedulerConfig(**knobs), num_blocks, block_size), cost_model)


def make_sim_engine(scheduler: Scheduler, cost_model: CostModel) -> LLMEngine:
    """An ``LLMEngine`` over ``scheduler`` whose executor is the cost model on a virtual clock."""
    clock = VirtualClock()
    return LLMEngine(scheduler, CostModelExecutor(cost_model, clock), tokenizer=None, clock=clock)


def simulate(engine: LLMEngine, requests: list[Request]) -> list[RequestOutput]:
    """Replay ``requests`` (``arrival_time`` in seconds) on a simulated engine; returns every output
    (finished and rejected) in completion order. The engine's clock must be a ``VirtualClock``."""
    clock = engine.clock
    if not isinstance(clock, VirtualClock):
        raise TypeError("simulate needs an engine built by make_sim_engine (virtual clock)")
    order = itertools.count()
    heap: list[Event] = [ArrivalEvent(r.arrival_time, next(order), r) for r in requests]
    heapq.heapify(heap)
    outputs: list[RequestOutput] = []
    busy = False
    while heap:
        ev = heapq.heappop(heap)
        clock.now = max(clock.now, ev.time)
        if isinstance(ev, ArrivalEvent):
            _arrive(engine, ev.request, outputs)
        else:
            busy = False
        while heap and isinstance(heap[0], ArrivalEvent) and heap[0].time <= clock.now:
            _arrive(engine, heapq.heappop(heap).request, outputs)  # everything that has arrived by now
        if busy or not engine.has_unfinished():
            continue
        # the engine is idle and has work: run one step; it ends at the advanced clock
        outputs.extend(engine.step())
        if engine.steps[-1].num_seqs == 0:
            continue  # nothing could be scheduled: wait for the next arrival
        busy = True
        heapq.heappush(heap, StepEndEvent(clock.now, next(order)))
    if engine.has_unfinished():
        raise RuntimeError(f"simulation stalled: {len(engine.scheduler.requests)} requests can never be scheduled")
    return outputs


def _arrive(engine: LLMEngine, request: Request, outputs: list[RequestOutput]) -> None:
    rejected = engine.add_request(request)
    if rejected is not None:
        outputs.append(rejected)
