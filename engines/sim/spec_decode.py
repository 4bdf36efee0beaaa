"""The speculative-decoding engine of the simulator (no torch): an executor that draws accepted draft
tokens and an engine loop that appends them. ``engines.factory`` builds it for an analytic cost model with
a draft model (``AnalyticCostModel.spec``); the cost model charges the draft and verify passes.

Speculative decoding in the simulator: each decode row of a step emits ``1 + j`` tokens, where ``j``
(accepted draft tokens, ``0 <= j <= k``) is drawn from a seeded ``random.Random``: draft token ``i``
is accepted with probability ``a`` if all before it were, so ``P(j) = a^j (1 - a)`` for ``j < k`` and
``P(k) = a^k``, whose mean is ``(1 - a^(k+1)) / (1 - a)`` tokens per step. The draws depend on the
seed and the (deterministic) order of steps, so a run is reproducible; over many steps the mean
matches the formula (test: ``tests/test_whatif.py``). Tokens beyond ``max_tokens`` are dropped.
"""

from __future__ import annotations

import random

from engines.core.config import DEFAULT_SWAP_BANDWIDTH
from engines.core.llm_engine import LLMEngine, RequestOutput
from engines.core.request import RequestStatus
from engines.core.scheduler import SchedulerOutput, StepResult
from engines.sim.analytic_cost_model import AnalyticCostModel
from engines.sim.simulator import PLACEHOLDER_TOKEN, CostModelExecutor, VirtualClock


class SpecDecodeExecutor(CostModelExecutor):
    """Cost-model executor that also draws how many draft tokens each decode row gets accepted.

    After ``execute``, ``extra`` maps request id -> accepted draft tokens ``j`` (the sampled token of
    ``StepResult`` is the bonus token). ``seed`` seeds the draws; ``block_bytes`` and
    ``swap_bandwidth_bytes_per_s`` charge swaps as ``CostModelExecutor`` does.
    """

    def __init__(self, cost_model: AnalyticCostModel, clock: VirtualClock, seed: int = 0, block_bytes: int = 0,
                 swap_bandwidth_bytes_per_s: float = DEFAULT_SWAP_BANDWIDTH) -> None:
        super().__init__(cost_model, clock, block_bytes, swap_bandwidth_bytes_per_s)
        if cost_model.spec is None:
            raise ValueError("SpecDecodeExecutor needs a cost model with a spec-decode config")
        self.spec = cost_model.spec
        self.rng = random.Random(seed)
        self.extra: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> StepResult:
        result = super().execute(out)
        a, k = self.spec.acceptance_rate, self.spec.num_speculative_tokens
        self.extra = {}
        for s in out.seqs:
            if s.is_decode and s.request_id in result.sampled:
                j = 0
                while j < k and self.rng.random() < a:
                    j += 1
                self.extra[s.request_id] = j
        return result


class SpecDecodeSimEngine(LLMEngine):
    """``LLMEngine`` whose steps append the executor's accepted draft tokens after the sampled one.

    The accepted tokens' K/V were computed by the verify pass, so ``num_computed_tokens`` advances
    with them and the next step schedules one token per request, as without speculation; the paged
    KV manager grows the request's block table to cover them.
    """

    def step(self) -> list[RequestOutput]:
        finished = super().step()
        done = {o.request_id for o in finished}
        now = self.clock()
        for rid, j in self.executor.extra.items():
            req = self.scheduler.requests.get(rid)
            if req is None or rid in done or req.is_finished:
                continue
            take = min(j, req.sampling_params.max_tokens - req.num_output_tokens)
            for _ in range(take):
                req.append_output(PLACEHOLDER_TOKEN)
                req.num_computed_tokens += 1
                req.token_times.append(now)
            kv = getattr(self.scheduler, "kv", None)
            if take and hasattr(kv, "allocate_slots"):
                kv.allocate_slots(req, 0)  # may fail when full: the next step allocates or preempts
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_LENGTH)
                finished.append(self._finish(req))
        return finished
