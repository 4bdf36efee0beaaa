"""One factory for every engine: an engine description (``EngineConfig``) in, policy + executor + clock out.

``build_engine`` is the only place an engine is assembled. The offline ``LLM`` (and so ``workbench serve``
and ``workbench generate``), the workbench runner (scenario engines, and through it sweeps, capacity
searches, load probes and gates), ``paper-check`` and ``spec-sweep`` all call it, so a knob reaches every
engine that accepts it, and a knob an engine cannot honour is an error rather than a silent default.

What each kind is made of:

* ``paged`` / ``static``: ``PagedScheduler`` / ``StaticScheduler`` + ``ModelExecutor`` (``engines.real``: the
  forward pass over paged KV tensors) + the wall clock.
* ``sim``: the ``policy`` (``paged``, ``static`` or ``orca``) + ``CostModelExecutor`` over a measured
  ``CostModel`` or an ``AnalyticCostModel`` (``SpecDecodeExecutor`` in a ``SpecDecodeSimEngine`` when the
  analytic model has a draft model) + a virtual clock.

Sizing, the same for every kind:

* KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x element bytes: the element is
  ``dtype`` (float32 4 B, bfloat16 2 B) for the real model and for a sim over a measured cost model; for
  the analytic model it is ``kv_cache_dtype`` and the KV heads are one GPU's share (``tp``).
* KV pool = ``kv_cache_tokens``, else ``kv_cache_bytes`` / KV bytes per token, else (analytic cost model)
  what fits in GPU memory after the weights and the activation reserve, else 65,536 tokens; whole blocks.
* CPU swap pool (paged policy, ``preemption_mode: swap``) = ``swap_space_bytes`` / (KV bytes per token x
  ``block_size``) blocks; a simulated swap costs its blocks x block bytes / ``swap_bandwidth_bytes_per_s``.
* ``max_model_len`` defaults to the model's ``max_position_embeddings``.

No torch is imported here at module level: the real executor is imported when a real engine is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.core.config import (ANALYTIC_DEFAULT_WEIGHT_DTYPE, ANALYTIC_WEIGHT_DTYPES, DEFAULT_SWAP_BANDWIDTH,
                                 DTYPE_BYTES, CacheConfig, ModelConfig, SchedulerConfig, real_weight_dtype,
                                 real_weight_dtype_problem)
from engines.core.kv_cache_manager import ContiguousKVCacheManager, PagedKVCacheManager
from engines.core.llm_engine import LLMEngine
from engines.core.orca_scheduler import OrcaScheduler
from engines.core.paged_scheduler import PagedScheduler
from engines.core.scheduler import Scheduler
from engines.core.static_scheduler import StaticScheduler
from engines.sim.analytic_cost_model import AnalyticCostModel, Efficiency, SpecDecodeConfig, plan_memory
from engines.sim.catalog import CatalogError, get_hardware, get_model
from engines.sim.simulator import VirtualClock, make_sim_engine
from engines.sim.spec_decode import SimSpecDecode, SpecDecodeExecutor, SpecDecodeSimEngine, make_paged_spec_sim_engine

DEFAULT_KV_CACHE_TOKENS = 65536
KINDS = ("paged", "static", "sim")  # paged and static run the real model
POLICIES = ("paged", "static", "orca")  # what a sim engine may simulate
RESERVATIONS = ("max", "pow2", "oracle")

# knobs only some engines honour; setting one elsewhere (to other than its default) is an error
REAL_ONLY = ("device", "attention_backend", "linear_backend", "step_delay_s")
SIM_ONLY = ("policy", "cost_model", "model_config", "swap_bandwidth_bytes_per_s", "spec_draft_rate")
CATALOGUE = ("hardware", "tp", "kv_cache_dtype", "efficiency", "speculative_model",
             "num_speculative_tokens", "spec_acceptance_rate")  # what an analytic cost model is built from
# (and weight_dtype, which every kind takes: see EngineConfig)
SPEC_REAL = ("speculative_model", "num_speculative_tokens")  # the real paged engine speculates too
REAL_TP = ("tp",)  # real engines split the model over tp processes (engines.real.tensor_parallel)
# a sim over a measured cost model speculates through the paged policy (engines.sim.spec_decode.SimSpecDecode)
SPEC_MEASURED = ("speculative_model", "num_speculative_tokens", "spec_acceptance_rate", "spec_draft_rate")
PROMPT_LOOKUP = ("prompt_lookup_min", "prompt_lookup_max")  # the real engine's ngram proposer only
MEMORY = ("gpu_memory_utilization", "activation_reserve_bytes")  # the analytic model's memory plan


@dataclass
class EngineConfig:
    """What an engine is, as plain data (``workbench`` maps a scenario's ``EngineSpec`` onto it; ``LLM``
    takes its fields as keyword arguments).

    Attributes:
        kind: ``paged`` or ``static`` (the real model under that policy) or ``sim`` (the simulator).
        policy: sim only: ``paged`` (default), ``static`` or ``orca``.
        model: real engines: a known model name or a local Llama-family folder. Sim engines with an
            analytic model built from the catalogue (``hardware`` set): the catalogue model simulated.
        model_config: sim over a measured cost model: the simulated model's architecture (KV bytes per
            token, default ``max_model_len``).
        cost_model: sim: a measured ``CostModel`` or an ``AnalyticCostModel``; None with ``hardware`` set
            builds the analytic model from ``model``, ``hardware``, ``tp``, ``weight_dtype``,
            ``kv_cache_dtype``, ``efficiency`` and the ``speculative_*`` fields.
        dtype: ``float32``, ``bfloat16`` or ``auto`` (``engines.real.cpu_features.resolve_dtype``): the real
            model's weights and KV; a measured sim's KV bytes.
        seed: the real engine's sampling generator; the simulated draft-token acceptance draws.
        block_size, kv_cache_tokens, kv_cache_bytes: KV blocks and pool size (at most one of the two).
        max_num_seqs, max_num_batched_tokens, max_model_len, max_batch_size, reservation, completion,
            enable_prefix_caching, enable_chunked_prefill, long_prefill_token_threshold, preemption_mode:
            the policy's knobs (``engines.core.config.SchedulerConfig``); ``completion`` is for the static
            policy only (None: ``batch_end``).
        swap_space_bytes: CPU swap pool for swap preemption (paged policy; 0 = none: swap falls back to
            recompute).
        swap_bandwidth_bytes_per_s: sim only: host-device copy bandwidth a swap is charged at (default
            32e9, PCIe 4.0 x16 one way).
        step_noise: sim over a measured cost model: multiply each step by a draw (seeded by ``seed``) of the
            profile's measured step-to-step spread (``CostModel.noise_cv``); False: exact predictions.
        device, attention_backend: real only: where the model runs and its attention kernels.
        linear_backend: real only: the dense GEMM kernel, ``auto`` (oneDNN with reordered weights on CPU),
            ``onednn`` or ``torch`` (``F.linear``; ``engines.real.linear``).
        step_delay_s: real only, test-only: busy work added to every step.
        weight_dtype: how the linear weights are stored (``engines.core.config.WEIGHT_DTYPES``). Real
            engines: ``fp32``/``bf16`` (the dense weights of ``dtype``, which they must agree with), ``int8``
            or ``int4`` (weight-only quantized, ``engines.real.quant``); None: the dense weights of
            ``dtype``. A sim over a measured cost model: the same vocabulary (the profile measured a real
            engine with it; informational here, the profile's fingerprint is checked where it is loaded).
            Analytic sim: ``bf16`` (None), ``fp8``, ``awq``, ``gptq`` or ``int4``.
        hardware, tp, kv_cache_dtype, efficiency, speculative_model,
            num_speculative_tokens, spec_acceptance_rate: sim only: the analytic model's deployment.
        tp: also real engines (paged, static): tensor parallelism over ``tp`` processes on this machine
            (``engines.real.tensor_parallel``: heads split by whole GQA groups, at most the model's KV heads;
            ``kv_cache_*`` size the pool over all ranks together). Sim engines: the analytic model's GPUs.
        speculative_model, num_speculative_tokens, spec_acceptance_rate, spec_draft_rate: a sim over a measured
            cost model, paged policy: the real engine's speculative path with placeholder drafts
            (``engines.sim.spec_decode.SimSpecDecode``): ``ngram`` or ``layers:N``, k, the acceptance rate (one,
            or k per-position conditional rates) and the share of decode rows that get drafts (default 1).
        speculative_model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max: on the real paged
            engine, its own speculative decoding: ``ngram`` (prompt lookup over the request's context) or
            ``layers:N`` (the target's first N layers as the draft), k drafts per step
            (``engines.core.spec_decode``).
        gpu_memory_utilization, activation_reserve_bytes: analytic sim only: the memory plan that sizes
            the KV pool when neither ``kv_cache_tokens`` nor ``kv_cache_bytes`` is given.
    """

    kind: str = "paged"
    policy: str | None = None
    model: str | Path | None = None
    model_config: ModelConfig | None = None
    cost_model: Any = None
    dtype: str = "float32"
    seed: int = 0
    step_noise: bool = True
    block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_batch_size: int = 64
    reservation: str = "max"
    completion: str | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 0
    swap_bandwidth_bytes_per_s: float | None = None
    device: str = "auto"
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    step_delay_s: float = 0.0
    hardware: str | None = None
    tp: int = 1
    weight_dtype: str | None = None
    kv_cache_dtype: str = "bf16"
    efficiency: dict[str, float] | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    spec_acceptance_rate: float | list[float] | None = None
    spec_draft_rate: float | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float | None = None

    @property
    def policy_name(self) -> str:
        """The scheduling policy: ``kind`` for a real engine, ``policy`` (default paged) for a sim one."""
        return (self.policy or "paged") if self.kind == "sim" else self.kind

    def __post_init__(self):
        if self.dtype == "auto":  # bfloat16 where this CPU (or a CUDA device) computes it natively
            from engines.real.cpu_features import resolve_dtype

            self.dtype = resolve_dtype("auto", "cuda" if str(self.device).startswith("cuda") else "cpu")

    @property
    def analytic(self) -> bool:
        """A sim engine over the analytic cost model (given, or built from the catalogue)."""
        return self.kind == "sim" and (isinstance(self.cost_model, AnalyticCostModel) or self.hardware is not None)

    def changed(self) -> set[str]:
        """Fields set to other than their default."""
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    def problems(self) -> list[str]:
        """Why this engine cannot be built as described, one line each (empty: it can)."""
        if self.kind not in KINDS:
            return [f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}"]
        set_ = self.changed()
        bad = []
        if self.kind == "sim":
            bad += [f"{n} is only for real engines (kind paged or static; kind is sim)"
                    for n in REAL_ONLY if n in set_]
            if self.policy_name not in POLICIES:
                bad.append(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
            bad += self._cost_model_problems(set_)
            bad += [f"{n} is for the real paged engine's ngram proposer (kind paged)" for n in PROMPT_LOOKUP
                    if n in set_]
        else:
            bad += [f"{n} is only for kind sim (kind is {self.kind})" for n in SIM_ONLY + CATALOGUE + MEMORY
                    if n in set_ and n not in SPEC_REAL + REAL_TP]
            bad += self._spec_problems(set_)
            if self.model is None:
                bad.append(f"a {self.kind} engine runs a model: set model (a known name or a folder)")
        bad += self._weight_dtype_problems()
        if self.dtype not in DTYPE_BYTES:
            bad.append(f"dtype must be float32, bfloat16 or auto, got {self.dtype!r}")
        if not isinstance(self.tp, int) or self.tp < 1:
            bad.append(f"tp must be an integer >= 1, got {self.tp!r}")
        if self.reservation not in RESERVATIONS:
            bad.append(f"reservation must be max, pow2 or oracle, got {self.reservation!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            bad.append("set kv_cache_tokens or kv_cache_bytes, not both")
        if self.completion is not None and self.policy_name != "static":
            bad.append(f"completion is only for the static engine (engine is {self.kind!r})" if self.kind != "sim"
                       else f"completion is only for the static policy (policy is {self.policy_name!r})")
        sched = self.scheduler_config(1).validate()
        if sched:
            bad.append(sched)
        return bad

    def _spec_problems(self, set_: set[str]) -> list[str]:
        """A real engine's speculative decoding (``engines.core.spec_decode.SpecDecodeConfig.parse``)."""
        if not set_ & set(SPEC_REAL + PROMPT_LOOKUP):
            return []
        if self.kind != "paged":
            return [f"speculative decoding runs on the paged engine, not {self.kind}"]
        if self.speculative_model is None:
            return ["num_speculative_tokens / prompt_lookup_min / prompt_lookup_max need speculative_model "
                    "(ngram or layers:N)"]
        try:
            self.spec_config()
        except ValueError as e:
            return [str(e)]
        return []

    def spec_config(self):
        """A real paged engine's ``SpecDecodeConfig`` (None: no speculative decoding).

        Raises:
            ValueError: a bad ``speculative_model`` or k (one line).
        """
        from engines.core.spec_decode import SpecDecodeConfig

        if self.kind == "sim" or self.speculative_model is None:
            return None
        return SpecDecodeConfig.parse(self.speculative_model, self.num_speculative_tokens, self.prompt_lookup_min,
                                      self.prompt_lookup_max)

    def _sim_spec_problems(self, set_: set[str]) -> list[str]:
        """A sim over a measured cost model's speculative decoding (see :meth:`sim_spec`)."""
        if not set_ & set(SPEC_MEASURED):
            return []
        if self.speculative_model is None:
            return ["num_speculative_tokens / spec_acceptance_rate / spec_draft_rate need speculative_model "
                    "(ngram or layers:N)"]
        if self.policy_name != "paged":
            return [f"speculative decoding runs on the paged policy, not {self.policy_name}"]
        if self.model_config is None:
            return []  # reported as missing model_config
        try:
            self.sim_spec()
        except ValueError as e:
            return [str(e)]
        return []

    def sim_spec(self) -> SimSpecDecode | None:
        """A sim over a measured cost model's speculative decoding (None: none, or not that kind of engine).

        Raises:
            ValueError: a bad method, k or rate (one line).
        """
        if self.kind != "sim" or self.analytic or self.speculative_model is None:
            return None
        return SimSpecDecode.build(self.speculative_model, self.num_speculative_tokens, self.spec_acceptance_rate,
                                   self.model_config.num_hidden_layers, self.spec_draft_rate)

    def _weight_dtype_problems(self) -> list[str]:
        """``weight_dtype`` against what this kind runs (see the field's description), one line each."""
        wd = self.weight_dtype
        if wd is None:
            return []
        if self.analytic:
            cm_wd = getattr(self.cost_model, "weight_dtype", None)
            if cm_wd is not None and wd != cm_wd:
                return [f"weight_dtype {wd}: the analytic cost model is given, with weight_dtype {cm_wd}"]
            if wd not in ANALYTIC_WEIGHT_DTYPES:
                return [f"weight_dtype {wd} is not priced by the analytic cost model "
                        f"({', '.join(ANALYTIC_WEIGHT_DTYPES)}); the real engine runs it"]
            return []
        who = "the real engine" if self.kind != "sim" else "a measured profile (of the real engine)"
        problem = real_weight_dtype_problem(wd, self.dtype, who) if self.dtype in DTYPE_BYTES else None
        return [f"engine {self.kind}: {problem}"] if problem else []

    @property
    def real_weight_dtype(self) -> str:
        """The weight dtype a real engine (or the profile of a measured sim) runs: ``weight_dtype``, else the
        dense weights of ``dtype``."""
        return real_weight_dtype(self.weight_dtype, self.dtype)

    def _cost_model_problems(self, set_: set[str]) -> list[str]:
        if self.cost_model is None and self.hardware is None:
            return ["a sim engine needs cost_model (a measured CostModel or an AnalyticCostModel) or hardware "
                    "(a catalogue GPU, for the analytic model)"]
        if self.cost_model is not None and self.hardware is not None:
            return ["set cost_model or hardware, not both (hardware builds the analytic cost model)"]
        bad = []
        if not self.analytic:  # a measured cost model: the architecture comes from model_config
            if self.model_config is None:
                bad.append("a sim engine over a measured cost model needs model_config (the simulated architecture)")
            given = [n for n in ("model",) + CATALOGUE + MEMORY if n in set_ and n not in SPEC_MEASURED]
            bad += self._sim_spec_problems(set_)
            if given:
                bad.append(f"{', '.join(given)}: only for the analytic cost model (set hardware)")
            return bad
        if "dtype" in set_:
            bad.append("dtype is the real model's element type; the analytic cost model's KV is kv_cache_dtype")
        if "model_config" in set_:
            bad.append("model_config: the analytic cost model simulates its own catalogue model")
        if "spec_draft_rate" in set_:
            bad.append("spec_draft_rate: only for a sim over a measured cost model (the analytic model drafts every row)")
        if self.cost_model is None and self.model is None:
            bad.append("hardware needs model (the catalogue model simulated)")
        given = [n for n in ("model",) + CATALOGUE if n in set_] if self.cost_model is not None else []
        if given:
            bad.append(f"{', '.join(given)}: the cost model is given, so these come from it")
        return bad

    def check(self) -> None:
        """Raises ValueError naming every problem (see :meth:`problems`)."""
        bad = self.problems()
        if bad:
            raise ValueError("; ".join(bad))

    def scheduler_config(self, default_max_model_len: int) -> SchedulerConfig:
        """The policy's knobs; ``max_model_len`` defaults to ``default_max_model_len``."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len or default_max_model_len, max_batch_size=self.max_batch_size,
            reservation=self.reservation, enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold, preemption_mode=self.preemption_mode,
            completion=self.completion or "batch_end")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.kv_cache_tokens, self.kv_cache_bytes, self.swap_space_bytes)


def build_engine(config: EngineConfig) -> LLMEngine:
    """The engine ``config`` describes (see the module docstring for what each kind is made of).

    Raises:
        ValueError: a knob the engine does not take or a bad value (every problem in one message).
        CatalogError (a ValueError): unknown catalogue names, or the weights do not fit the GPUs.
        ModelNotFoundError (a ValueError): a real engine's model is neither a known name nor a folder.
    """
    config.check()
    if config.kind == "sim":
        return _build_sim(config)
    return _build_real(config)


def build_scheduler(policy: str, sched_cfg: SchedulerConfig, num_blocks: int, block_size: int,
                    num_cpu_blocks: int = 0, spec=None) -> Scheduler:
    """The policy ``paged``, ``static`` or ``orca`` over its KV manager (``num_blocks`` of
    ``block_size`` tokens). ``num_cpu_blocks``: the paged policy's CPU swap pool; prefix caching follows
    ``sched_cfg.enable_prefix_caching``; ``spec``: the paged policy's speculative decoding
    (``SpecDecodeConfig``, None: off).

    Raises:
        ValueError: unknown policy, or a bad knob.
    """
    if policy == "paged":
        kv = PagedKVCacheManager(num_blocks, block_size, enable_caching=sched_cfg.enable_prefix_caching,
                                 num_cpu_blocks=num_cpu_blocks)
        return PagedScheduler(sched_cfg, kv, spec)
    if policy == "static":
        return StaticScheduler(sched_cfg, ContiguousKVCacheManager(num_blocks, block_size))
    if policy == "orca":
        return OrcaScheduler(sched_cfg, ContiguousKVCacheManager(num_blocks, block_size))
    raise ValueError(f"engine must be 'paged' or 'static' (or, simulated, 'orca'), got {policy!r}")


def analytic_cost_model(config: EngineConfig) -> AnalyticCostModel:
    """The analytic cost model ``config`` describes: its own, or one built from its catalogue fields.

    Raises:
        CatalogError: unknown names or bad values.
    """
    if isinstance(config.cost_model, AnalyticCostModel):
        return config.cost_model
    spec = None
    if config.speculative_model:
        spec = SpecDecodeConfig(get_model(config.speculative_model), config.num_speculative_tokens,
                                config.spec_acceptance_rate)
    weight_dtype = config.weight_dtype or ANALYTIC_DEFAULT_WEIGHT_DTYPE
    return AnalyticCostModel(get_model(config.model), get_hardware(config.hardware), config.tp, weight_dtype,
                             config.kv_cache_dtype, Efficiency.default(**(config.efficiency or {})), spec)


def _build_sim(config: EngineConfig) -> LLMEngine:
    cm = analytic_cost_model(config) if config.analytic else config.cost_model
    analytic = isinstance(cm, AnalyticCostModel)
    model_config = cm.model.to_model_config() if analytic else config.model_config
    sched_cfg = config.scheduler_config(model_config.max_position_embeddings)
    per_token = (cm.model.kv_bytes_per_token(cm.kv_dtype, cm.tp) if analytic
                 else model_config.kv_bytes_per_token(DTYPE_BYTES[config.dtype]))
    cache = config.cache_config()
    if analytic and config.kv_cache_tokens is None and config.kv_cache_bytes is None:
        num_blocks = max(1, _planned_blocks(cm, config, sched_cfg))
    else:
        num_blocks = cache.num_blocks(per_token, DEFAULT_KV_CACHE_TOKENS)
    policy = config.policy_name
    num_cpu_blocks = cache.num_cpu_blocks(per_token) if policy == "paged" else 0
    sim_spec = None if analytic else config.sim_spec()
    sched = build_scheduler(policy, sched_cfg, num_blocks, config.block_size, num_cpu_blocks,
                            sim_spec.config if sim_spec else None)
    swap = dict(block_bytes=per_token * config.block_size,
                swap_bandwidth_bytes_per_s=config.swap_bandwidth_bytes_per_s or DEFAULT_SWAP_BANDWIDTH)
    if analytic and cm.spec is not None:
        clock = VirtualClock()
        return SpecDecodeSimEngine(sched, SpecDecodeExecutor(cm, clock, config.seed, **swap), tokenizer=None,
                                   clock=clock)
    if sim_spec is not None:
        return make_paged_spec_sim_engine(sched, cm, sim_spec, config.seed, **swap,
                                          noise_seed=config.seed if config.step_noise else None)
    return make_sim_engine(sched, cm, **swap, seed=config.seed if config.step_noise else None)


def _planned_blocks(cm: AnalyticCostModel, config: EngineConfig, sched_cfg: SchedulerConfig) -> int:
    plan = plan_memory(cm, config.block_size, config.gpu_memory_utilization, config.activation_reserve_bytes,
                       sched_cfg.max_num_batched_tokens, sched_cfg.max_num_seqs)
    if not plan.weights_fit:
        raise CatalogError(
            f"{cm.model.key} ({cm.weight_dtype}) does not fit {cm.tp} x {cm.hardware.key}: weights "
            f"{plan.weights / 2**30:.1f} GiB + activation reserve {plan.activation_reserve / 2**30:.1f} GiB per "
            f"GPU > {plan.usable / 2**30:.1f} GiB usable")
    return plan.num_blocks


def _build_real(config: EngineConfig) -> LLMEngine:
    import torch
    from transformers import AutoTokenizer

    from engines.real.model import LlamaModel, resolve_device
    from engines.real.model_runner import ModelExecutor
    from engines.real.model_store import resolve_model

    resolve_device(config.device)  # a bad device fails before a model is pulled or its weights load
    model_dir = resolve_model(config.model)
    mc = ModelConfig.from_dir(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sched_cfg = config.scheduler_config(mc.max_position_embeddings)
    per_token = mc.kv_bytes_per_token(DTYPE_BYTES[config.dtype])
    cache = config.cache_config()
    num_blocks = cache.num_blocks(per_token, DEFAULT_KV_CACHE_TOKENS)
    num_cpu_blocks = cache.num_cpu_blocks(per_token) if config.kind == "paged" else 0
    spec = config.spec_config()
    if config.tp > 1:  # rank 0 here, tp - 1 worker processes (engines.real.tensor_parallel)
        from engines.real.tensor_parallel import TPModelExecutor

        executor = TPModelExecutor(model_dir, config.tp, num_blocks, config.block_size, getattr(torch, config.dtype),
                                   config.attention_backend, config.device, config.real_weight_dtype,
                                   config.linear_backend, seed=config.seed, step_delay_s=config.step_delay_s,
                                   num_cpu_blocks=num_cpu_blocks, draft_layers=spec.draft_layers if spec else 0)
        return LLMEngine(build_scheduler(config.kind, sched_cfg, num_blocks, config.block_size, num_cpu_blocks,
                                         spec), executor, tokenizer)
    model = LlamaModel.from_dir(model_dir, getattr(torch, config.dtype), config.attention_backend, config.device,
                                weight_dtype=config.real_weight_dtype, linear_backend=config.linear_backend)
    executor = ModelExecutor(model, num_blocks, config.block_size, seed=config.seed, step_delay_s=config.step_delay_s,
                             num_cpu_blocks=num_cpu_blocks, draft_layers=spec.draft_layers if spec else 0)
    return LLMEngine(build_scheduler(config.kind, sched_cfg, num_blocks, config.block_size, num_cpu_blocks, spec),
                     executor, tokenizer)


def build_sim_engine(policy: str, model_config: ModelConfig, cost_model, **knobs) -> LLMEngine:
    """``build_engine`` for a sim engine over ``cost_model`` simulating ``model_config``; ``knobs`` are
    ``EngineConfig`` fields (None values are left at their defaults)."""
    return build_engine(EngineConfig(kind="sim", policy=policy, model_config=model_config, cost_model=cost_model,
                                     **{k: v for k, v in knobs.items() if v is not None}))


def build_whatif_engine(policy: str, cost_model, model_config: ModelConfig | None = None, **knobs) -> LLMEngine:
    """``build_engine`` for a sim engine over ``cost_model`` (an ``AnalyticCostModel``, whose catalogue
    model is simulated, or a measured ``CostModel`` with ``model_config``); ``knobs`` are ``EngineConfig``
    fields (None values are left at their defaults)."""
    if isinstance(cost_model, AnalyticCostModel):
        model_config = None  # the analytic model's own architecture
    return build_sim_engine(policy, model_config, cost_model, **knobs)
