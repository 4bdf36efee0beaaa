"""The simulator's executor: a cost model's predicted step time on a virtual clock, placeholder tokens.

Its own module so that ``workbench/native.py`` can compile it with the engine loop (it loops over every row of
every step); ``engines.sim.simulator`` re-exports it.
"""

from __future__ import annotations

from typing import Callable, Protocol

from engines.core.beam_search import num_candidates, synthetic_candidates
from engines.core.config import DEFAULT_SWAP_BANDWIDTH
from engines.core.scheduler import SchedulerOutput, StepResult

try:  # compiled by mypyc (workbench/native.py): the spec-decoding executors subclass CostModelExecutor
    from mypy_extensions import mypyc_attr
except ImportError:  # plain Python: the decorator does nothing
    def mypyc_attr(*attrs: str, **kwattrs: object):  # type: ignore[misc]
        return lambda cls: cls

PLACEHOLDER_TOKEN = 0


class StepCostModel(Protocol):
    """What ``CostModelExecutor`` asks of a cost model (``engines.sim.cost_model.CostModel``, the analytic
    ``AnalyticCostModel``)."""

    def predict_step(self, out: SchedulerOutput) -> float: ...

    def predict_overhead(self, num_seqs: int) -> float: ...

    def noise(self, seed: int | None) -> Callable[[float], float] | None: ...


class VirtualClock:
    """Seconds of simulated time; advanced only by the simulator."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@mypyc_attr(allow_interpreted_subclasses=True)  # engines.sim.spec_decode
class CostModelExecutor:
    """Executor that predicts instead of computing.

    Only the tokens a step computes are charged: a prefix-cache hit shortens the scheduled chunk
    (``ScheduledSeq.token_ids``), so the cost model sees fewer tokens, while attention to the cached prefix
    is still charged through ``start_pos``. Swapped blocks cost ``bytes / swap_bandwidth_bytes_per_s``. A step
    lasts the cost model's executor time (times a seeded noise draw of the spread at the step's tokens when the
    model has a measured spread) plus its prediction of the engine's own per-step work
    (``CostModel.predict_overhead``).

    Args:
        cost_model: predicts step seconds from the scheduled batch.
        clock: the virtual clock, advanced by each step's predicted duration.
        block_bytes: bytes of one KV block over all layers (K and V), for swap traffic.
        swap_bandwidth_bytes_per_s: host-device copy bandwidth charged for swaps (default 32e9,
            PCIe 4.0 x16 one direction).
        seed: seeds the step-noise draws (None: no noise).
    """

    def __init__(self, cost_model: StepCostModel, clock: VirtualClock, block_bytes: int = 0,
                 swap_bandwidth_bytes_per_s: float = DEFAULT_SWAP_BANDWIDTH, seed: int | None = None) -> None:
        self.cost_model, self.clock = cost_model, clock
        self.block_bytes = block_bytes
        self.swap_bandwidth = swap_bandwidth_bytes_per_s
        self.noise: Callable[[float], float] | None = cost_model.noise(seed)

    def execute(self, out: SchedulerOutput) -> StepResult:
        n_swap = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        swap_time = n_swap * self.block_bytes / self.swap_bandwidth if n_swap else 0.0
        dt = self.cost_model.predict_step(out)
        if out.seqs:
            if self.noise is not None:
                dt *= self.noise(out.shape.tokens)
            dt += self.cost_model.predict_overhead(len(out.seqs))
        dt += swap_time
        self.clock.now += dt
        sampled: dict[str, int] = {}
        beams: dict[str, list[tuple[int, float]]] = {}
        for s in out.seqs:
            if not s.sample or s.is_padding:
                continue
            if s.sampling_params.use_beam_search:  # synthetic candidates (see engines.sim.simulator's docstring)
                beams[s.request_id] = synthetic_candidates(num_candidates(s.sampling_params.beam_width),
                                                           PLACEHOLDER_TOKEN)
                continue
            sampled[s.request_id] = PLACEHOLDER_TOKEN
            if s.fork_ids:
                sampled.update((cid, PLACEHOLDER_TOKEN) for cid in s.fork_ids)
        return StepResult(sampled, dt, swap_time, beam_candidates=beams)

    def release(self, request_id: str) -> None:
        pass
