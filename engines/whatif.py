"""What-if simulated engines: catalogue hardware and models, the analytic cost model, the Orca policy
and speculative decoding, on the simulator's virtual clock (no torch).

``build_whatif_engine`` sizes the KV pool from GPU memory (``engines.catalog.memory_plan``) unless
``kv_cache_tokens``/``kv_cache_bytes`` is given, builds the policy (``paged``, ``static`` or ``orca``)
and the executor.

Speculative decoding in the simulator: each decode row of a step emits ``1 + j`` tokens, where ``j``
(accepted draft tokens, ``0 <= j <= k``) is drawn from a seeded ``random.Random``: draft token ``i``
is accepted with probability ``a`` if all before it were, so ``P(j) = a^j (1 - a)`` for ``j < k`` and
``P(k) = a^k``, whose mean is ``(1 - a^(k+1)) / (1 - a)`` tokens per step. The draws depend on the
seed and the (deterministic) order of steps, so a run is reproducible; over many steps the mean
matches the formula (test: ``tests/test_whatif.py``). Tokens beyond ``max_tokens`` are dropped.
"""

from __future__ import annotations

import random

from engines.analytic_cost_model import AnalyticCostModel
from engines.catalog import CatalogError, MemoryPlan, memory_plan
from engines.config import SchedulerConfig
from engines.kv_cache_manager import ContiguousKVCacheManager
from engines.llm_engine import DEFAULT_KV_CACHE_TOKENS, LLMEngine, RequestOutput, build_scheduler
from engines.orca_scheduler import OrcaScheduler
from engines.request import RequestStatus
from engines.scheduler import SchedulerOutput, StepResult
from engines.simulator import PLACEHOLDER_TOKEN, CostModelExecutor, VirtualClock

POLICIES = ("paged", "static", "orca")


class SpecDecodeExecutor(CostModelExecutor):
    """Cost-model executor that also draws how many draft tokens each decode row gets accepted.

    After ``execute``, ``extra`` maps request id -> accepted draft tokens ``j`` (the sampled token of
    ``StepResult`` is the bonus token).
    """

    def __init__(self, cost_model: AnalyticCostModel, clock: VirtualClock, seed: int = 0) -> None:
        super().__init__(cost_model, clock)
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


def plan_memory(cm: AnalyticCostModel, block_size: int = 16, gpu_memory_utilization: float = 0.9,
                activation_reserve_bytes: float | None = None, max_num_batched_tokens: int = 2048,
                max_num_seqs: int = 256) -> MemoryPlan:
    """Memory split of one GPU for the cost model's deployment; a draft model (run on one GPU, as
    vLLM's ``draft_tensor_parallel_size=1``) adds its bf16 weights and its KV per token."""
    plan = memory_plan(cm.model, cm.hardware, cm.tp, cm.weight_dtype, cm.kv_dtype, gpu_memory_utilization,
                       block_size, activation_reserve_bytes, max_num_batched_tokens, max_num_seqs)
    if cm.spec is not None:
        d = cm.spec.draft
        plan.weights += d.weight_bytes("bf16") / cm.spec.draft_tp
        plan.kv_bytes_per_token += d.kv_bytes_per_token(cm.kv_dtype, cm.spec.draft_tp)
    return plan


def build_whatif_engine(policy: str, cost_model, model_config, block_size: int = 16,
                        kv_cache_tokens: int | None = None, kv_cache_bytes: int | None = None,
                        gpu_memory_utilization: float = 0.9, activation_reserve_bytes: float | None = None,
                        seed: int = 0, **sched_knobs) -> LLMEngine:
    """A simulated engine: ``policy`` (``paged``, ``static``, ``orca``) over ``cost_model`` (an
    ``AnalyticCostModel`` or a measured ``CostModel``).

    KV pool: ``kv_cache_tokens``, else ``kv_cache_bytes`` (per GPU), else, for an analytic model, what
    fits in memory (:func:`plan_memory`), else the real engine's default (65,536 tokens).
    ``max_model_len`` defaults to the model's ``max_position_embeddings``.

    Raises:
        CatalogError: the weights do not fit the GPUs, or an unknown policy.
    """
    if policy not in POLICIES:
        raise CatalogError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    knobs = {k: v for k, v in sched_knobs.items() if v is not None}
    knobs.setdefault("max_model_len", model_config.max_position_embeddings)
    cfg = SchedulerConfig(**knobs)
    analytic = isinstance(cost_model, AnalyticCostModel)
    if kv_cache_tokens is not None:
        num_blocks = kv_cache_tokens // block_size
    elif kv_cache_bytes is not None:
        per_tok = (cost_model.model.kv_bytes_per_token(cost_model.kv_dtype, cost_model.tp) if analytic
                   else model_config.kv_bytes_per_token(2))
        num_blocks = kv_cache_bytes // per_tok // block_size
    elif analytic:
        plan = plan_memory(cost_model, block_size, gpu_memory_utilization, activation_reserve_bytes,
                           cfg.max_num_batched_tokens, cfg.max_num_seqs)
        if not plan.weights_fit:
            raise CatalogError(
                f"{cost_model.model.key} ({cost_model.weight_dtype}) does not fit {cost_model.tp} x "
                f"{cost_model.hardware.key}: weights {plan.weights / 2**30:.1f} GiB + activation reserve "
                f"{plan.activation_reserve / 2**30:.1f} GiB per GPU > {plan.usable / 2**30:.1f} GiB usable")
        num_blocks = plan.num_blocks
    else:
        num_blocks = DEFAULT_KV_CACHE_TOKENS // block_size
    num_blocks = max(1, num_blocks)
    if policy == "orca":
        sched = OrcaScheduler(cfg, ContiguousKVCacheManager(num_blocks, block_size))
    else:
        sched = build_scheduler(policy, cfg, num_blocks, block_size)
    clock = VirtualClock()
    if analytic and cost_model.spec is not None:
        return SpecDecodeSimEngine(sched, SpecDecodeExecutor(cost_model, clock, seed), tokenizer=None, clock=clock)
    return LLMEngine(sched, CostModelExecutor(cost_model, clock), tokenizer=None, clock=clock)
