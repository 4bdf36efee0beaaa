"""The speculative-decoding engine of the simulator (no torch): an executor that draws accepted draft
tokens and an engine loop that appends them. ``engines.factory`` builds it for an analytic cost model with
a draft model (``AnalyticCostModel.spec``); the cost model charges the draft and verify passes.

Speculative decoding in the simulator: each decode row of a step emits ``1 + j`` tokens, where ``j``
(accepted draft tokens, ``0 <= j <= k``) is drawn from a seeded ``random.Random``: draft token ``i``
is accepted with probability ``a`` if all before it were, so ``P(j) = a^j (1 - a)`` for ``j < k`` and
``P(k) = a^k``, whose mean is ``(1 - a^(k+1)) / (1 - a)`` tokens per step. The draws depend on the
seed and the (deterministic) order of steps, so a run is reproducible; over many steps the mean
matches the formula (test: ``tests/test_whatif.py``). Tokens beyond ``max_tokens`` are dropped.

Over a measured cost model (this machine's profile) the simulator instead runs the real engine's own
speculative path: the ``PagedScheduler`` with a ``SpecDecodeConfig`` whose ``placeholder_drafts`` is set (it
reserves ``k`` placeholder draft slots per decode row, as for a draft model, since the simulator has no tokens
to look up), and :class:`PagedSpecExecutor`, which draws the acceptances and returns them as
``StepResult.spec_accepted``; ``Scheduler.update`` then advances, appends, counts (``spec_stats``) and trims the
rejected drafts' blocks exactly as on the real engine. See :class:`SimSpecDecode` for what is charged.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from engines.core.config import DEFAULT_SWAP_BANDWIDTH
from engines.core.llm_engine import LLMEngine, RequestOutput
from engines.core.request import RequestStatus
from engines.core.scheduler import Scheduler, ScheduledSeq, SchedulerOutput, StepResult
from engines.core.spec_decode import SpecDecodeConfig as CoreSpecConfig
from engines.core.spec_decode import SpecDecodeStats
from engines.core.step_shape import StepShape
from engines.sim.analytic_cost_model import AnalyticCostModel
from engines.sim.cost_model import CostModel, shape_features
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


# -- speculative decoding over a measured cost model, through the PagedScheduler's own speculative path --------


@dataclass(frozen=True)
class SimSpecDecode:
    """Speculative decoding simulated over a measured cost model.

    Attributes:
        config: the scheduler's ``SpecDecodeConfig`` (``placeholder_drafts`` set): method (``ngram`` or
            ``layers``), k = ``num_speculative_tokens``, N = ``draft_layers``.
        acceptance: per draft position ``i`` (0-based, ``len == k``), ``a_i`` = P(draft ``i`` accepted | drafts
            ``0..i-1`` were). One rate ``a`` for all positions gives ``P(j) = a^j (1 - a)`` for ``j < k``,
            ``P(k) = a^k`` and a mean of ``(1 - a^(k+1)) / (1 - a)`` tokens per verify (bonus token included).
        draft_rate: share of the rows the scheduler gave drafts that really have them (``ngram``: prompt lookup
            finds no match sometimes); a row without drafts is charged as a plain decode row and emits one token.
        num_layers: L, the simulated model's layers (``layers:N`` draft cost).

    What a step is charged (seconds; ``t(shape)`` = the cost model's executor time of a step shape):

    * verify: ``t(shape of the step)``, where a verify row is a prefill chunk of ``1 + k`` tokens after its
      cached context (``engines.core.step_shape``), its ``1 + k`` LM-head rows included; rows drawn as having
      no drafts are priced as 1-token decode rows. Step noise and the engine overhead as ``CostModelExecutor``.
    * ``layers:N`` draft passes: ``k`` sequential decode steps of the drafted rows (draft ``j`` at context
      ``start + j + 1``); each costs ``(N / L) x (t(decode shape) - LM(rows)) + LM(rows)``: the body and the
      attention run N of L layers, the LM head (``LM``, ``CostModel.predict_lm_head``) runs whole, as in
      ``ModelExecutor._fill_drafts``. ``ngram`` drafts cost nothing on the model (the prompt lookup is CPU work
      in the scheduler, part of the measured per-step overhead).
    """

    config: CoreSpecConfig
    acceptance: tuple[float, ...]
    draft_rate: float = 1.0
    num_layers: int = 1

    @classmethod
    def build(cls, speculative_model: str, num_speculative_tokens: int | None, acceptance, num_layers: int,
              draft_rate: float | None = None) -> "SimSpecDecode":
        """From engine fields: ``acceptance`` is one rate or ``k`` per-position conditional rates, each in [0, 1].

        Raises:
            ValueError: a bad method or k (``SpecDecodeConfig.parse``), a missing or bad rate, ``layers:N`` with
                N > L (one line).
        """
        cfg = dataclasses.replace(CoreSpecConfig.parse(speculative_model, num_speculative_tokens),
                                  placeholder_drafts=True)
        k = cfg.num_speculative_tokens
        if acceptance is None:
            raise ValueError(f"speculative_model {speculative_model!r} in the simulator needs spec_acceptance_rate "
                             "(the acceptance rate measured on the real engine)")
        rates = (float(acceptance),) * k if isinstance(acceptance, (int, float)) else tuple(map(float, acceptance))
        if len(rates) != k:
            raise ValueError(f"spec_acceptance_rate: {len(rates)} per-position rates for k = {k} drafts")
        if any(not 0.0 <= a <= 1.0 for a in rates):
            raise ValueError(f"spec_acceptance_rate must be in [0, 1], got {list(rates)}")
        dr = 1.0 if draft_rate is None else float(draft_rate)
        if not 0.0 <= dr <= 1.0:
            raise ValueError(f"spec_draft_rate must be in [0, 1], got {dr}")
        if cfg.method == "layers" and cfg.draft_layers > num_layers:
            raise ValueError(f"speculative_model {speculative_model}: the model has only {num_layers} layers")
        return cls(cfg, rates, dr, num_layers)

    def expected_tokens_per_verify(self) -> float:
        """Mean tokens a drafted row emits per verify: ``1 + sum_i prod_{m <= i} a_m`` (bonus token included)."""
        total, p = 1.0, 1.0
        for a in self.acceptance:
            p *= a
            total += p
        return total


def conditional_rates(stats: SpecDecodeStats | dict, k: int) -> list[float]:
    """Per-position conditional acceptance rates ``a_i`` from a real run's counters (``SpecDecodeStats`` or its
    ``as_dict()``): ``r_i = accepted_per_pos[i] / drafts_per_pos[i]`` is P(draft ``i`` accepted) among rows with
    at least ``i + 1`` drafts, so ``a_0 = r_0`` and ``a_i = r_i / r_(i-1)`` (exact when every row had ``k``
    drafts); positions never drafted repeat the last rate (none: 0)."""
    d = stats.as_dict() if isinstance(stats, SpecDecodeStats) else stats
    r = list(d.get("acceptance_rate_per_pos", []))[:k]
    out, prev = [], 1.0
    for x in r:
        out.append(min(1.0, x / prev) if prev > 0 else 0.0)
        prev = x
    while len(out) < k:
        out.append(out[-1] if out else 0.0)
    return out


class PagedSpecExecutor(CostModelExecutor):
    """Cost-model executor for the ``PagedScheduler``'s speculative rows (see :class:`SimSpecDecode` for the
    charges).

    For each row with ``num_spec`` drafts it draws, from a seeded ``random.Random`` in step and row order (so a
    run is reproducible), whether the row has drafts (``draft_rate``; no draw at 1) and then how many are
    accepted: draft ``i`` with probability ``a_i`` while all before it were. It returns
    ``spec_accepted[id] = [PLACEHOLDER_TOKEN] * j`` and a sampled placeholder (the target's token at the first
    rejection, or the bonus token). ``stats`` counts the rows that really had drafts (``spec_stats`` of the
    scheduler counts every reserved row, those drawn as draft-less as 0 accepted).
    """

    def __init__(self, cost_model: CostModel, clock: VirtualClock, spec: SimSpecDecode, seed: int = 0,
                 block_bytes: int = 0, swap_bandwidth_bytes_per_s: float = DEFAULT_SWAP_BANDWIDTH,
                 noise_seed: int | None = None) -> None:
        super().__init__(cost_model, clock, block_bytes, swap_bandwidth_bytes_per_s, noise_seed)
        self.spec = spec
        self.rng = random.Random(f"spec-decode:{seed}")  # apart from the step-noise stream of the same seed
        self.stats = SpecDecodeStats()
        self.draft_time = 0.0  # seconds charged to layers:N draft passes so far

    def execute(self, out: SchedulerOutput) -> StepResult:
        accepted: dict[str, list[int]] = {}
        priced: list[ScheduledSeq] = []
        drafted: list[ScheduledSeq] = []
        for s in out.seqs:
            if not s.num_spec or not s.sample:
                priced.append(s)
                continue
            if self.spec.draft_rate < 1.0 and self.rng.random() >= self.spec.draft_rate:
                accepted[s.request_id] = []  # no drafts found: a plain decode row
                priced.append(dataclasses.replace(s, token_ids=s.token_ids[:len(s.token_ids) - s.num_spec],
                                                  num_spec=0, drafts_pending=False))
                continue
            j = 0
            while j < s.num_spec and self.rng.random() < self.spec.acceptance[j]:
                j += 1
            accepted[s.request_id] = [PLACEHOLDER_TOKEN] * j
            self.stats.record(s.num_spec, j)
            s.drafts_pending = False
            priced.append(s)
            drafted.append(s)
        step = out if len(drafted) == len(accepted) else dataclasses.replace(out, seqs=priced)
        result = super().execute(step)
        result.spec_accepted = accepted
        if drafted and self.spec.config.method == "layers":
            dt = self.draft_seconds(drafted)
            self.draft_time += dt
            self.clock.now += dt
            result.duration += dt
        return result

    def draft_seconds(self, rows: list[ScheduledSeq]) -> float:
        """Seconds of the ``layers:N`` draft passes over ``rows`` (see :class:`SimSpecDecode`)."""
        frac = self.spec.config.draft_layers / self.spec.num_layers
        total = 0.0
        for j in range(max(s.num_spec for s in rows)):
            step = [ScheduledSeq(s.request_id, [PLACEHOLDER_TOKEN], s.start_pos + j, s.block_table, True,
                                 s.sampling_params) for s in rows if s.num_spec > j]
            full = self.cost_model.predict_exec(shape_features(StepShape.of(step)))
            lm = self.cost_model.predict_lm_head(len(step)) * self.cost_model.scale(len(step))
            total += frac * max(0.0, full - lm) + lm
        return total


def make_paged_spec_sim_engine(scheduler: Scheduler, cost_model: CostModel, spec: SimSpecDecode, seed: int = 0,
                               block_bytes: int = 0, swap_bandwidth_bytes_per_s: float = DEFAULT_SWAP_BANDWIDTH,
                               noise_seed: int | None = None) -> LLMEngine:
    """An ``LLMEngine`` over a ``PagedScheduler`` built with ``spec.config`` and a :class:`PagedSpecExecutor` on a
    virtual clock (``seed``: the acceptance draws; ``noise_seed``: the step noise, None: none).

    Raises:
        ValueError: the scheduler does not reserve placeholder drafts of ``spec.config``.
    """
    if getattr(scheduler, "spec", None) != spec.config:
        raise ValueError("the simulated speculative decoding needs a PagedScheduler built with its SpecDecodeConfig")
    clock = VirtualClock()
    ex = PagedSpecExecutor(cost_model, clock, spec, seed, block_bytes, swap_bandwidth_bytes_per_s, noise_seed)
    return LLMEngine(scheduler, ex, tokenizer=None, clock=clock)
