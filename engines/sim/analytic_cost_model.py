"""Analytic roofline cost model: a step's time on a GPU this machine does not have (no torch).

A drop-in for ``engines.sim.cost_model.CostModel`` in the simulator's ``CostModelExecutor`` (same
``predict(seqs) -> seconds``). For one step of the target model on one of ``tp`` GPUs::

    t = gemm + attn_decode + attn_prefill + allreduce + step_overhead
    gemm      = max(2 * params/tp * tokens [+ LM head rows]  / (peak * eff.compute) [* dequant],
                    weight bytes/tp                          / (mem_bw * eff.memory))
    attn_X    = max(4 * heads/tp * head_dim * layers * query-key pairs / (bf16 peak * eff.attention_compute),
                    KV bytes read (context tokens x KV bytes/token/GPU)   / (mem_bw * eff.attention_memory))
    allreduce = 2 * layers * (2 (tp-1)/tp * tokens * hidden * 2 B / (link one-way * eff.link) + latency)

(roofline: Williams et al., CACM 2009; ring all-reduce: Patarasuk and Yuan 2009, as NCCL's busbw).
Each component is its own kernel, so each takes the larger of its compute and memory times; the
components add. Peak is FP8 when the weights are fp8 and the GPU has FP8 tensor cores, else BF16;
4-bit weights (AWQ/GPTQ) read 4.6 bits per weight and pay ``dequant_overhead`` on compute.

Speculative decoding (``SpecDecodeConfig``): a decode row runs ``k`` draft-model steps (one token each)
and one target verify pass over ``k + 1`` tokens; prefill rows also run the draft's prefill. The
expected tokens a decode row emits per step is ``(1 - a^(k+1)) / (1 - a)`` (Leviathan et al., ICML
2023, eq. 1, i.i.d. acceptance rate ``a``).

Efficiency factors are data (``engines/sim/data/efficiency.yaml``) with their justification; override
per engine or fit with :meth:`AnalyticCostModel.calibrate`.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace

import yaml

from engines.sim.catalog import (DATA_DIR, CatalogError, HardwareSpec, MemoryPlan, ModelSpec, linear_bytes_per_param,
                                 memory_plan)

ACT_BYTES = 2  # bf16 activations (all-reduce messages)


@functools.lru_cache(maxsize=None)
def default_efficiency_table() -> dict[str, dict]:
    """``{name: {"value": float, "why": str}}`` from ``engines/sim/data/efficiency.yaml``."""
    return yaml.safe_load((DATA_DIR / "efficiency.yaml").read_text())["efficiency"]


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak reached (0-1], fixed costs in seconds, dequantization factor (>= 1).

    Defaults come from ``engines/sim/data/efficiency.yaml`` (see the ``why`` of each entry there).
    """

    compute: float
    memory: float
    attention_compute: float
    attention_memory: float
    link: float
    allreduce_latency_s: float
    step_overhead_s: float
    dequant_overhead: float

    @classmethod
    def default(cls, **overrides: float) -> "Efficiency":
        """The data-file defaults with ``overrides`` applied.

        Raises:
            CatalogError: an unknown factor name or a fraction outside (0, 1].
        """
        vals = {k: float(v["value"]) for k, v in default_efficiency_table().items()}
        for k, v in overrides.items():
            if k not in vals:
                raise CatalogError(f"efficiency: unknown factor {k!r}; known: {', '.join(vals)}")
            vals[k] = float(v)
        eff = cls(**vals)
        for k in ("compute", "memory", "attention_compute", "attention_memory", "link"):
            if not 0 < getattr(eff, k) <= 1:
                raise CatalogError(f"efficiency.{k} must be in (0, 1], got {getattr(eff, k)}")
        if eff.dequant_overhead < 1 or eff.step_overhead_s < 0 or eff.allreduce_latency_s < 0:
            raise CatalogError("efficiency: dequant_overhead must be >= 1 and the *_s times >= 0")
        return eff


@dataclass(frozen=True)
class SpecDecodeConfig:
    """Speculative decoding with a draft model.

    Attributes:
        draft: the draft model's catalogue entry (bf16 weights).
        num_speculative_tokens: ``k`` draft tokens proposed per step.
        acceptance_rate: ``a``, probability that each draft token is accepted (i.i.d.).
        draft_tp: GPUs the draft runs on (1: vLLM's ``draft_tensor_parallel_size=1``; a small draft
            gains nothing from all-reduces).
    """

    draft: ModelSpec
    num_speculative_tokens: int
    acceptance_rate: float
    draft_tp: int = 1

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise CatalogError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 0 <= self.acceptance_rate < 1:
            raise CatalogError(f"spec acceptance rate must be in [0, 1), got {self.acceptance_rate}")

    @property
    def expected_tokens_per_step(self) -> float:
        """(1 - a^(k+1)) / (1 - a): expected tokens emitted per decode step (accepted drafts + 1)."""
        a, k = self.acceptance_rate, self.num_speculative_tokens
        return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class AnalyticCostModel:
    """Roofline step-time model of ``model`` on ``tp`` GPUs of kind ``hardware``.

    Args:
        model: target model (catalogue entry).
        hardware: GPU (catalogue entry).
        tp: tensor-parallel degree (weights, heads and KV heads split ``tp`` ways).
        weight_dtype: ``bf16``, ``fp8``, ``awq``, ``gptq`` or ``int4``.
        kv_dtype: ``bf16`` or ``fp8``.
        efficiency: fractions of peak (defaults: ``Efficiency.default()``).
        spec: speculative decoding, or None.

    Raises:
        CatalogError: tp < 1, or tp larger than the attention heads.
    """

    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    efficiency: Efficiency = field(default_factory=Efficiency.default)
    spec: SpecDecodeConfig | None = None
    # per (model, weight dtype, tp): the step-independent parts of pass_time (see _constants)
    _constants: dict[tuple[int, str, int], tuple[ModelSpec, float, float, int, int, float]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.model.num_attention_heads % self.tp:
            raise CatalogError(f"tp must be >= 1 and divide the {self.model.num_attention_heads} attention heads "
                               f"of {self.model.key}, got {self.tp}")
        linear_bytes_per_param(self.weight_dtype)  # validates

    @property
    def source(self) -> str:
        return (f"analytic roofline: {self.model.key} on {self.tp} x {self.hardware.key}, weights {self.weight_dtype}, "
                f"kv {self.kv_dtype}" + (f", spec {self.spec.draft.key} k={self.spec.num_speculative_tokens} "
                                         f"a={self.spec.acceptance_rate}" if self.spec else ""))

    # -- the interface CostModelExecutor uses ---------------------------------------------------
    def predict_step(self, out) -> float:
        """Predicted seconds of the step ``out`` (``SchedulerOutput``)."""
        return self.predict(out.seqs)

    def predict_overhead(self, num_seqs: int) -> float:
        """0: the per-step overhead is part of ``step_overhead_s`` in :meth:`pass_time`."""
        return 0.0

    def noise(self, seed: int | None) -> None:
        """None: the roofline model has no measured step-to-step spread."""
        return None

    def predict(self, seqs) -> float:
        """Predicted seconds of a step that runs ``seqs`` (``ScheduledSeq`` list; 0 when empty)."""
        return sum(self.breakdown(seqs).values()) if seqs else 0.0

    def breakdown(self, seqs) -> dict[str, float]:
        """Seconds per component of one step (target and, with spec decoding, draft)."""
        if self.spec is None:
            # the common case: pass_time's sums gathered straight from the rows (no per-row tuple)
            tokens = sampled = d_pairs = d_ctx = p_pairs = p_ctx = 0
            for s in seqs:
                n, p = len(s.token_ids), s.start_pos
                tokens += n
                if s.sample and not s.is_padding:
                    sampled += 1
                if n == 1 and p > 0:
                    d_pairs += p + 1
                    d_ctx += p + 1
                else:
                    p_pairs += n * p + n * (n + 1) // 2
                    p_ctx += p + n
            return self._pass_time(self.model, self.weight_dtype, self.tp, tokens, sampled, d_pairs, d_ctx, p_pairs,
                                   p_ctx)
        rows = [(s.num_tokens, s.start_pos, bool(s.sample and not s.is_padding), s.is_decode) for s in seqs]
        k = self.spec.num_speculative_tokens
        # target: every decode row verifies k + 1 tokens (its last token + k drafts)
        target = [((k + 1) if dec else n, p, smp) for n, p, smp, dec in rows]
        out = self.pass_time(self.model, self.weight_dtype, target, self.tp)
        # draft: prefill rows once, then k single-token steps over the decode rows
        draft, dtp = self.spec.draft, self.spec.draft_tp
        parts = [self.pass_time(draft, "bf16", [(n, p, smp) for n, p, smp, dec in rows if not dec], dtp)]
        dec_rows = [(p, smp) for _, p, smp, dec in rows if dec]
        for i in range(k if dec_rows else 0):
            parts.append(self.pass_time(draft, "bf16", [(1, p + i, True) for p, _ in dec_rows], dtp))
        for part in parts:
            for name, t in part.items():
                out["draft_" + name] = out.get("draft_" + name, 0.0) + t
        return out

    # -- roofline of one forward pass -------------------------------------------------------------
    def pass_time(self, m: ModelSpec, weight_dtype: str, rows: list[tuple[int, int, bool]],
                  tp: int = 1) -> dict[str, float]:
        """Seconds per component of one forward pass of ``m`` on ``tp`` GPUs over ``rows`` = ``(new
        tokens, start position, samples)``; a row with 1 token and start > 0 is a decode row. Empty rows -> {}."""
        tokens = sampled = d_pairs = d_ctx = p_pairs = p_ctx = 0  # query x key pairs and context tokens
        for n, p, smp in rows:
            tokens += n
            if smp:
                sampled += 1
            if n == 1 and p > 0:  # a decode row
                d_pairs += p + 1
                d_ctx += p + 1
            else:  # a prefill chunk
                p_pairs += n * p + n * (n + 1) // 2
                p_ctx += p + n
        return self._pass_time(m, weight_dtype, tp, tokens, sampled, d_pairs, d_ctx, p_pairs, p_ctx)

    def _constants_of(self, m: ModelSpec, weight_dtype: str, tp: int) -> tuple[ModelSpec, float, float, int, int, float]:
        """``(m, layer weight bytes/GPU, LM head bytes/GPU, attention heads/GPU, KV bytes/token/GPU, link bytes/s
        one way)``: what :meth:`pass_time` needs of the model and GPU that no step changes, computed once per
        (model, weight dtype, tp). ``m`` is kept in the entry so its ``id`` cannot be reused while cached."""
        key = (id(m), weight_dtype, tp)
        c = self._constants.get(key)
        if c is None:
            c = (m, m.linear_params * linear_bytes_per_param(weight_dtype) / tp, m.lm_head_params * 2.0 / tp,
                 max(1, m.num_attention_heads // tp), self._kv_bytes(m, tp), self.hardware.link_bw_one_way())
            self._constants[key] = c
        return c

    def _pass_time(self, m: ModelSpec, weight_dtype: str, tp: int, tokens: int, sampled: int, d_pairs: int,
                   d_ctx: int, p_pairs: int, p_ctx: int) -> dict[str, float]:
        """:meth:`pass_time` from its rows' sums: tokens, sampled rows, and the query x key pairs and context
        tokens of decode rows (``d_``) and prefill chunks (``p_``)."""
        if tokens == 0:
            return {}
        hw, eff = self.hardware, self.efficiency
        _, layer_bytes, head_bytes, heads, kvb, link = self._constants_of(m, weight_dtype, tp)
        bf16 = hw.bf16_flops
        peak = hw.fp8_flops if weight_dtype == "fp8" and hw.fp8_flops else bf16
        # GEMMs: layer matrices on every token, the LM head (vocab-parallel) on sampled rows
        flops = 2.0 * tokens * m.linear_params / tp + 2.0 * sampled * m.lm_head_params / tp
        wbytes = layer_bytes
        if sampled:
            wbytes += head_bytes
        t_compute = flops / (peak * eff.compute)
        if weight_dtype in ("awq", "gptq", "int4"):
            t_compute *= eff.dequant_overhead
        out = {"gemm": max(t_compute, wbytes / (hw.mem_bw * eff.memory))}
        # attention, decode rows and prefill chunks as separate kernels
        for name, pairs, ctx in (("attn_decode", d_pairs, d_ctx), ("attn_prefill", p_pairs, p_ctx)):
            if ctx:
                a_flops = 4.0 * heads * m.head_dim * m.num_hidden_layers * pairs
                out[name] = max(a_flops / (bf16 * eff.attention_compute), ctx * kvb / (hw.mem_bw * eff.attention_memory))
        if tp > 1:
            msg = tokens * m.hidden_size * ACT_BYTES
            one = 2 * (tp - 1) / tp * msg / (link * eff.link) + eff.allreduce_latency_s
            out["allreduce"] = 2 * m.num_hidden_layers * one
        out["overhead"] = eff.step_overhead_s
        return out

    def _kv_bytes(self, m: ModelSpec, tp: int) -> int:
        return m.kv_bytes_per_token(self.kv_dtype, tp)

    # -- calibration ------------------------------------------------------------------------------
    def calibrate(self, measured: list[tuple[list, float]],
                  names: tuple[str, ...] = ("compute", "memory", "step_overhead_s")) -> "AnalyticCostModel":
        """A copy with efficiency factors fitted to measured steps ``[(seqs, seconds), ...]``.

        Coordinate search (a few passes over a log grid per factor) minimizing the mean squared
        relative error; fractions stay in (0, 1]. Returns a new model; ``self`` is unchanged.

        Raises:
            ValueError: no measured steps.
        """
        if not measured:
            raise ValueError("calibrate needs at least one measured step")

        def err(cm: "AnalyticCostModel") -> float:
            return sum((cm.predict(s) / t - 1.0) ** 2 for s, t in measured) / len(measured)

        best = self
        for _ in range(3):
            for name in names:
                cur = getattr(best.efficiency, name)
                if name.endswith("_s"):
                    grid = [cur * f for f in (0.25, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2, 4)] + [0.0]
                else:
                    grid = [min(1.0, cur * f) for f in (0.5, 0.7, 0.85, 0.95, 1.0, 1.05, 1.2, 1.4, 2)]
                cands = [replace(best, efficiency=replace(best.efficiency, **{name: g})) for g in grid]
                best = min(cands, key=err)
        return best

    def describe(self) -> dict:
        """Plain-data description (for results.json)."""
        d = {"model": self.model.key, "hardware": self.hardware.key, "tp": self.tp, "weight_dtype": self.weight_dtype,
             "kv_dtype": self.kv_dtype, "efficiency": asdict(self.efficiency)}
        if self.spec:
            d["spec"] = {"draft": self.spec.draft.key, "k": self.spec.num_speculative_tokens,
                         "acceptance_rate": self.spec.acceptance_rate,
                         "expected_tokens_per_step": self.spec.expected_tokens_per_step}
        return d


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
