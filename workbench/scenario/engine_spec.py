"""The engines of a scenario: one pydantic model per ``kind``, and :data:`EngineSpec`, their union
discriminated on ``kind``.

Which knobs each kind takes:

* every kind: ``name`` and ``kind``;
* ``paged``, ``static`` and ``sim`` (engines this process builds, :class:`BuiltEngineSpec`): the KV pool
  (``block_size``, ``kv_cache_tokens`` or ``kv_cache_bytes``), ``max_model_len``, ``dtype``,
  ``weight_dtype`` (one vocabulary, each kind taking the values it can run or price), and the knobs
  of their scheduling policy (:data:`POLICY_KNOBS`; a real engine's policy is its kind, a sim engine's is
  its ``policy``):

  - paged: ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``,
    ``enable_chunked_prefill``, ``long_prefill_token_threshold``, ``preemption_mode``,
    ``swap_space_bytes`` (and, simulated, ``swap_bandwidth_bytes_per_s``);
  - static: ``max_batch_size``, ``reservation``, ``completion``;
  - orca (simulated only): ``reservation``, ``max_num_seqs``, ``max_num_batched_tokens`` (iteration-level
    batching over contiguous reservations, see ``engines.core.orca_scheduler``);

* ``paged`` and ``static`` (the real model): ``device``, ``attention_backend``, ``test_step_delay_s``, ``tp``;
* ``sim``: ``policy``, ``cost_model``, ``swap_bandwidth_bytes_per_s`` and the GPU what-if fields
  (``model``, ``hardware``, ``tp``, ``kv_cache_dtype``, ``gpu_memory_utilization``, ...);
* ``openai``: ``base_url``, ``api_key``, ``model`` (the served model's id), ``endpoint`` (``completions`` or
  ``chat``), ``itl_mode`` (``chunk`` or ``token``) and ``launch`` (a server the runner starts and stops); its
  engine knobs are the server's.

A knob written in the scenario for an engine that cannot use it (``reservation`` on a paged engine,
``max_num_batched_tokens`` on a static one or on a sim engine with ``policy: static``) is an error naming
the knob, raised before the engine's fields are validated; a knob left out never is, so defaults cannot
trip it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import Field, SecretStr, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from workbench.scenario.common import BUILTIN_PREFIX, SpecModel, field_error
from workbench.scenario.launch_spec import LaunchSpec

ENGINE_KINDS = ("paged", "static", "sim", "openai")
REAL_KINDS = ("paged", "static")  # the real model under the policy of that name
POLICIES = ("paged", "static", "orca")  # what a sim engine may simulate
ANALYTIC = "analytic"  # cost_model: the roofline model of engines.sim.analytic_cost_model
BUILTIN_COST_MODELS: tuple[str, ...] = ("builtin:ci-reference",)
AUTO = "auto"  # cost_model: this machine's profile, measured once and cached (workbench.calibration)

# The scheduling policies that read each knob (engines.core.config.SchedulerConfig and the policies in
# engines.core); an engine whose policy is not listed cannot be given the knob.
POLICY_KNOBS: dict[str, tuple[str, ...]] = {
    "max_num_seqs": ("paged", "orca"),
    "max_num_batched_tokens": ("paged", "orca"),
    "enable_prefix_caching": ("paged",),
    "enable_chunked_prefill": ("paged",),
    "long_prefill_token_threshold": ("paged",),
    "preemption_mode": ("paged",),
    "swap_space_bytes": ("paged",),
    "swap_bandwidth_bytes_per_s": ("paged",),
    "max_batch_size": ("static",),
    "reservation": ("static", "orca"),
    "completion": ("static",),
}


def policy_knobs(policy: str) -> tuple[str, ...]:
    """The knobs of :data:`POLICY_KNOBS` that scheduling policy ``policy`` reads."""
    return tuple(name for name, policies in POLICY_KNOBS.items() if policy in policies)


class EngineSpecBase(SpecModel):
    """What every engine kind has.

    Attributes:
        name: unique within the scenario; letters, digits, ``_`` and ``-``, not only digits (overrides
            address an engine by its name).
        kind: ``paged`` (continuous batching), ``static`` (static batching baseline), ``sim`` (simulator) or
            ``openai`` (an OpenAI-compatible server at ``base_url``, e.g. ``workbench serve``).
    """

    name: str = Field(min_length=1, max_length=64)
    kind: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", v) or v.isdigit():
            raise ValueError(f"engine name must use letters, digits, _ and - (not only digits), got {v!r}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _knobs_fit(cls, data: Any) -> Any:
        """Refuse a knob this kind (or, for sim, this policy) cannot use, naming it; only the keys the
        scenario writes are looked at, so fields left at their defaults never trip this."""
        kinds = get_args(cls.model_fields["kind"].annotation)
        if not isinstance(data, dict) or len(kinds) != 1:
            return data
        kind = kinds[0]
        policy = (data.get("policy") or "paged") if kind == "sim" else kind
        for key in data:
            if isinstance(key, str):
                problem = misplaced_knob(kind, policy, key)
                if problem:
                    raise field_error(key, problem)
        return data

    @property
    def policy_name(self) -> str | None:
        """The scheduling policy: ``paged``, ``static`` or ``orca``; None for kind openai (the server's)."""
        return self.kind if self.kind in REAL_KINDS else None


class BuiltEngineSpec(EngineSpecBase):
    """The knobs of every engine this process builds (kind paged, static or sim).

    Attributes:
        block_size: tokens per KV block.
        kv_cache_tokens, kv_cache_bytes: KV pool size in tokens or in bytes (at most one; neither: 65,536
            tokens, or for an analytic sim engine what fits in GPU memory).
        max_model_len: longest prompt + output in tokens (None = the model's).
        dtype: ``float32``, ``bfloat16`` or ``auto`` (bfloat16 where the CPU computes it natively, else
            float32; resolved when the scenario loads, so results.json holds the dtype that ran): the real
            model's weights and KV; a measured sim's KV bytes and profile.
        weight_dtype: how the linear weights are stored (``engines.core.config.WEIGHT_DTYPES``). Real
            engines, and a sim over a measured profile (which measured a real engine): ``fp32`` / ``bf16``
            (the dense weights of dtype float32 / bfloat16: must agree with ``dtype``), ``int8`` or ``int4``
            (weight-only, round-to-nearest, ``engines.real.quant``); unset: the dense weights of ``dtype``.
            The profile's fingerprint must have been measured with it. A sim over the analytic cost model:
            ``bf16`` (unset), ``fp8``, ``awq``, ``gptq`` or ``int4`` (what-ifs priced by the roofline).
    """

    block_size: int = Field(16, ge=1)
    kv_cache_tokens: int | None = Field(None, ge=1)
    kv_cache_bytes: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    weight_dtype: Literal["fp32", "bf16", "int8", "int4", "fp8", "awq", "gptq"] | None = None

    @field_validator("dtype")
    @classmethod
    def _resolve_dtype(cls, v: str) -> str:
        from engines.real.cpu_features import resolve_dtype

        return resolve_dtype(v)

    @model_validator(mode="after")
    def _one_pool_size(self) -> "BuiltEngineSpec":
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            raise ValueError("set kv_cache_tokens or kv_cache_bytes, not both")
        return self


class PagedPolicyKnobs(SpecModel):
    """The paged policy's knobs (kind paged; kind sim with policy paged, and the first two with policy orca).

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of one step (tokens).
        enable_prefix_caching: automatic prefix caching of full blocks (default true).
        enable_chunked_prefill: split prompts across steps (default true).
        long_prefill_token_threshold: most prompt tokens of one request per step (0 = no cap).
        preemption_mode: ``recompute`` (default) or ``swap``.
        swap_space_bytes: CPU swap pool for swap preemption, bytes (0 = none: swap falls back to recompute).
    """

    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(0, ge=0)
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_bytes: int = Field(0, ge=0)


class StaticPolicyKnobs(SpecModel):
    """The static policy's knobs (kind static; kind sim with policy static, and ``reservation`` with policy
    orca).

    Attributes:
        max_batch_size: requests per batch.
        reservation: KV reserved per request, contiguously: ``max`` (max_model_len), ``pow2`` (prompt +
            output rounded up to a power of two) or ``oracle`` (prompt + true output).
        completion: when a request's answer is returned, so its finish time and E2EL: ``batch_end``
            (default when unset: when the last member of its batch finishes, as a static-batching server
            answers) or ``own_end`` (its own last token). Left out of :func:`scenario_hash` when unset.
    """

    max_batch_size: int = Field(64, ge=1)
    reservation: Literal["max", "pow2", "oracle"] = "max"
    completion: Literal["batch_end", "own_end"] | None = None


class RealEngineSpec(BuiltEngineSpec):
    """What the real model (kind paged or static) adds: where it runs.

    Attributes:
        device: ``auto`` (default: CUDA when torch sees a GPU, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        attention_backend: ``auto`` (Triton on CUDA, the compiled kernel on CPU), ``torch``, ``cpp`` or
            ``triton``.
        linear_backend: the dense GEMM kernel: ``auto`` (oneDNN with reordered weights on CPU, ``F.linear``
            on CUDA), ``onednn`` or ``torch`` (``engines.real.linear``).
        test_step_delay_s: TEST-ONLY: seconds of busy work added to every step, to slow an engine
            deliberately (regression-gate tests). Not part of :func:`scenario_hash`.
        tp: tensor parallelism: the model split over ``tp`` processes on this machine (default 1;
            ``engines.real.tensor_parallel``; at most the model's KV heads, checked when the engine is built).
    """

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    attention_backend: Literal["auto", "torch", "cpp", "triton"] = "auto"
    linear_backend: Literal["auto", "torch", "onednn"] = "auto"
    test_step_delay_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    tp: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _runs_weight_dtype(self) -> "RealEngineSpec":
        from engines.core.config import real_weight_dtype_problem

        problem = real_weight_dtype_problem(self.weight_dtype, self.dtype)
        if problem:
            raise field_error("weight_dtype", problem)
        return self


# The policy-knob mixins come first among the bases so that the fields read name, kind, the shared knobs,
# then the policy's (pydantic orders fields from the last base of the MRO to the first).
class PagedEngineSpec(PagedPolicyKnobs, RealEngineSpec):
    """``kind: paged``: the real model with continuous batching over paged KV (see the base classes' fields).

    Attributes:
        speculative_model: speculative decoding (``engines.core.spec_decode``): ``ngram`` (prompt lookup over
            each request's own context) or ``layers:N`` (the target's first N layers as the draft); None: off.
        num_speculative_tokens: k, drafts per request per step (needs ``speculative_model``).
        prompt_lookup_min, prompt_lookup_max: ``ngram``: shortest and longest suffix n-gram matched (1 and 4
            when unset).
    """

    kind: Literal["paged"]
    speculative_model: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _spec_decode(self) -> "PagedEngineSpec":
        from engines.core.spec_decode import SpecDecodeConfig

        given = [n for n in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
                 if getattr(self, n) is not None]
        if self.speculative_model is None:
            if given:
                raise field_error(given[0], "needs speculative_model (ngram or layers:N)")
            return self
        try:
            SpecDecodeConfig.parse(self.speculative_model, self.num_speculative_tokens, self.prompt_lookup_min,
                                   self.prompt_lookup_max)
        except ValueError as e:
            raise field_error("speculative_model", str(e)) from None
        return self


class StaticEngineSpec(StaticPolicyKnobs, RealEngineSpec):
    """``kind: static``: the real model with static batching over contiguous KV reservations (see the base
    classes' fields)."""

    kind: Literal["static"]


class SimEngineSpec(StaticPolicyKnobs, PagedPolicyKnobs, BuiltEngineSpec):
    """``kind: sim``: the simulator, running the policy ``policy`` over a cost model. It has every policy's
    knobs; the policy decides which of them the scenario may set (:data:`POLICY_KNOBS`).

    Attributes:
        policy: the scheduling policy simulated: ``paged`` (default; filled in on validation), ``static`` or
            ``orca``.
        cost_model: ``auto`` (default: this machine's profile for the scenario's model and the engine's
            dtype and weight_dtype, measured on first use and cached; ``workbench.calibration``), a profile JSON (relative to
            the scenario's folder), ``builtin:ci-reference`` (a committed profile, for runs that must give the
            same numbers everywhere) or ``analytic`` (the roofline model of
            ``engines.sim.analytic_cost_model``; default when ``hardware`` is set); filled in on validation.
        step_noise: multiply each simulated step by a seeded draw of the profile's measured step-to-step
            spread (default true; false: exact predictions).
        swap_bandwidth_bytes_per_s: policy paged: swap copy bandwidth charged, bytes/s (default 32e9,
            PCIe 4.0 x16).
        model: the catalogue model simulated (default: the scenario's model).
        hardware: catalogue GPU (``cost_model: analytic``).
        tp: tensor-parallel GPUs.
        kv_cache_dtype: ``bf16`` or ``fp8``.
        gpu_memory_utilization: fraction of GPU memory for weights + activations + KV.
        activation_reserve_gib: override of the activation reserve, GiB.
        efficiency: overrides of the analytic cost model's efficiency factors.
        speculative_model, num_speculative_tokens, spec_acceptance_rate: speculative decoding (all three
            or none): the draft model (catalogue; over a measured profile: the real paged engine's ``ngram`` or
            ``layers:N``, policy paged), tokens drafted per step, acceptance rate in [0, 1) (over a measured
            profile: the rate measured on the real engine, e.g. its ``spec_decode.acceptance_rate``).
    """

    kind: Literal["sim"]
    policy: Literal["paged", "static", "orca"] | None = None
    cost_model: str | None = None
    step_noise: bool = True
    swap_bandwidth_bytes_per_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    model: str | None = None
    hardware: str | None = None
    tp: int = Field(1, ge=1)
    kv_cache_dtype: Literal["bf16", "fp8"] = "bf16"
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    activation_reserve_gib: float | None = Field(None, ge=0, allow_inf_nan=False)
    efficiency: dict[str, float] | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1)
    spec_acceptance_rate: float | None = Field(None, ge=0, lt=1)

    @model_validator(mode="after")
    def _defaults_and_whatif(self) -> "SimEngineSpec":
        # policy and cost_model are filled in here (not as field defaults), so that scenario_hash, which
        # leaves defaults out, keeps writing them
        if self.policy is None:
            self.policy = "paged"
        if self.cost_model is None:
            self.cost_model = ANALYTIC if self.hardware else AUTO
        _check_whatif(self)
        if self.cost_model.startswith(BUILTIN_PREFIX) and self.cost_model not in BUILTIN_COST_MODELS:
            raise ValueError(f"cost_model {self.cost_model!r} is unknown; builtin cost models: "
                             f"{', '.join(BUILTIN_COST_MODELS)} (or auto, analytic, or a profile JSON path)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # the other policies' knobs are not this engine's: a dump (results.json, a re-validated copy) leaves
        # them out, as the scenario had to
        data = handler(self)
        policy = self.policy_name
        return {k: v for k, v in data.items() if k not in POLICY_KNOBS or policy in POLICY_KNOBS[k]}

    @property
    def policy_name(self) -> str:
        """The scheduling policy simulated (``paged`` when not validated yet)."""
        return self.policy or "paged"


class OpenAIEngineSpec(EngineSpecBase):
    """``kind: openai``: replay against an OpenAI-compatible endpoint (``workbench serve``, ``vllm serve``);
    its engine knobs are set on the server.

    Attributes:
        base_url: the endpoint's API root, ``http(s)://host:port/v1`` (required).
        api_key: sent as ``Authorization: Bearer <api_key>``; ``env:NAME`` reads ``$NAME`` when the run
            starts. Written masked to results.json.
        model: the model id to request (default: the scenario's model).
        endpoint: ``completions`` (default: ``/completions`` with the trace's prompt token ids) or ``chat``
            (``/chat/completions``, one user message: the trace's prompt text, else its token ids decoded
            with the scenario model's tokenizer; the server's chat template makes prompts longer than the
            trace's).
        itl_mode: ``chunk`` (default, as ``vllm bench serve``: one inter-token latency per output-carrying
            SSE chunk after the first) or ``token`` (a chunk of k tokens contributes k gaps of its gap / k;
            k from the chunk's token_ids, else 1); see ``workbench.metrics.chunk_itls``.
        launch: a server the runner starts before this engine's replay and stops after it
            (:class:`workbench.scenario.launch_spec.LaunchSpec`; None: the server is already running).
    """

    kind: Literal["openai"]
    base_url: str | None = None
    api_key: SecretStr | None = None
    model: str | None = None
    endpoint: Literal["completions", "chat"] = "completions"
    itl_mode: Literal["chunk", "token"] = "chunk"
    launch: LaunchSpec | None = None

    @model_validator(mode="after")
    def _needs_base_url(self) -> "OpenAIEngineSpec":
        if not self.base_url or not re.match(r"https?://", self.base_url):
            raise ValueError(f"kind openai needs base_url: http(s)://host:port/v1, got {self.base_url!r}")
        return self


EngineSpec = Annotated[Union[PagedEngineSpec, StaticEngineSpec, SimEngineSpec, OpenAIEngineSpec],
                       Field(discriminator="kind")]
"""One engine of a scenario: the model of its ``kind`` (annotate with it; check the kind with ``.kind``)."""

# the knobs every engine this process builds has (kind paged, static or sim): its KV pool, max_model_len, dtype
POOL_KNOBS = tuple(n for n in BuiltEngineSpec.model_fields if n not in EngineSpecBase.model_fields)
ENGINE_MODELS: dict[str, type[EngineSpecBase]] = {
    "paged": PagedEngineSpec, "static": StaticEngineSpec, "sim": SimEngineSpec, "openai": OpenAIEngineSpec}
assert tuple(ENGINE_MODELS) == ENGINE_KINDS
# the knobs of an engine this process builds that a served engine has on its server instead
SERVER_KNOBS = frozenset(n for n in set(PagedEngineSpec.model_fields) | set(StaticEngineSpec.model_fields)
                         if n in SimEngineSpec.model_fields and n not in EngineSpecBase.model_fields)


def misplaced_knob(kind: str, policy: str, field: str) -> str | None:
    """Why an engine of ``kind`` (scheduling ``policy``: a real engine's is its kind, a sim engine's its
    ``policy``) cannot take ``field``, in one line; None when it can, or when no kind has such a field (an
    unknown field, reported with the fields allowed) or the policy is not a known one (reported on
    ``policy``)."""
    takers = [k for k, m in ENGINE_MODELS.items() if field in m.model_fields]
    if not takers or (field in ENGINE_MODELS[kind].model_fields and field not in POLICY_KNOBS):
        return None
    if kind == "openai" and field in SERVER_KNOBS:
        return f"{field} is an engine knob, set on the server, not for kind openai"
    if field in POLICY_KNOBS and kind != "openai":
        if policy not in POLICIES:
            return None
        policies = POLICY_KNOBS[field]
        if policy not in policies:
            who = [f"kind {k}" for k in REAL_KINDS if k in policies and k in takers]
            who.append("kind sim with policy " + " or ".join(policies))
            this = f"kind sim, policy {policy}" if kind == "sim" else f"kind {kind}"
            return (f"{field} is only for {'- and '.join(policies)}-policy engines ({', or '.join(who)}; "
                    f"{this})")
    if field in ENGINE_MODELS[kind].model_fields:
        return None
    if takers == list(REAL_KINDS):
        return f"{field} is only for real engines (kind paged or static; kind is {kind})"
    return f"{field} is only for kind {' or '.join(takers)} (kind is {kind})"


def _check_whatif(e: SimEngineSpec) -> None:
    """The GPU what-if fields of a sim engine fit together and name catalogue entries.

    Raises:
        ValueError: an unknown catalogue name or efficiency factor, analytic without hardware, analytic-only
            fields on a measured cost model, a weight_dtype the cost model cannot price or measure, or
            speculative decoding only partly given.
    """
    from engines.core.config import ANALYTIC_WEIGHT_DTYPES, real_weight_dtype_problem
    from engines.sim.analytic_cost_model import Efficiency
    from engines.sim.catalog import CatalogError, get_hardware, get_model

    analytic = e.cost_model == ANALYTIC
    try:
        if e.hardware is not None:
            get_hardware(e.hardware)
        if e.model is not None:
            get_model(e.model)
        if e.speculative_model is not None and analytic:
            get_model(e.speculative_model)
        if e.efficiency is not None:
            Efficiency.default(**e.efficiency)
    except CatalogError as err:
        raise ValueError(str(err)) from None
    if analytic and e.hardware is None:
        raise ValueError("cost_model analytic needs hardware (a catalogue GPU, e.g. h100-sxm)")
    if not analytic and e.speculative_model is not None:  # the real paged engine's speculation, simulated
        from engines.core.spec_decode import SpecDecodeConfig

        if e.policy != "paged":
            raise ValueError(f"speculative_model {e.speculative_model}: the paged policy speculates, not {e.policy}")
        try:
            SpecDecodeConfig.parse(e.speculative_model, e.num_speculative_tokens)
        except ValueError as err:
            raise ValueError(f"{err} (a sim over a measured profile simulates the real engine's ngram or "
                             "layers:N; catalogue drafts need cost_model analytic)") from None
    if not analytic:
        for name in ("hardware", "efficiency"):
            if getattr(e, name) is not None:
                raise ValueError(f"{name} needs cost_model analytic (cost_model is {e.cost_model})")
        if e.tp != 1 or e.kv_cache_dtype != "bf16":
            raise ValueError("tp and kv_cache_dtype need cost_model analytic")
        problem = real_weight_dtype_problem(e.weight_dtype, e.dtype, "a measured profile (of the real engine)")
        if problem:
            raise ValueError(f"{problem} (the analytic cost model's what-ifs need cost_model analytic)")
    elif e.weight_dtype is not None and e.weight_dtype not in ANALYTIC_WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype {e.weight_dtype} is not priced by the analytic cost model "
                         f"({', '.join(ANALYTIC_WEIGHT_DTYPES)}); the real engine runs it (a measured profile: "
                         "cost_model auto)")
    spec = (e.speculative_model, e.num_speculative_tokens, e.spec_acceptance_rate)
    if any(v is not None for v in spec) and any(v is None for v in spec):
        raise ValueError("speculative decoding needs speculative_model, num_speculative_tokens and "
                         "spec_acceptance_rate together")
