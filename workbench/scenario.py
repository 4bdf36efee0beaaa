"""Scenario files for ``workbench run scenario.yaml``: one trace replayed against one or more engines.

A scenario YAML looks like::

    name: azure-conv-small
    model: smollm2-135m
    seed: 0
    trace:
      format: azure
      path: builtin:azure_conv_slice.csv     # or a path relative to this file's folder
      limit: 100
      request_rate: 2.0
      max_input_tokens: 1024
    engines:
      - {name: paged, kind: paged, kv_cache_tokens: 16384}
      - {name: static, kind: static, reservation: max, max_batch_size: 16}
      - {name: sim-paged, kind: sim, policy: paged, cost_model: builtin:cpu}
    slo: {ttft_ms: 2000, tpot_ms: 200}

:func:`load_scenario` validates it (unknown fields are errors, so typos are caught) and raises
:class:`ScenarioError` with one line ``<file>: <field path>: <what is wrong / what is allowed> (line N)``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Union, get_args, get_origin

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, ValidationInfo,
                      field_validator,
                      model_validator)

from workbench.traces import BUILTIN_TRACE_DIR, FORMATS, TraceRequest, apply_transforms, ensure_prompt_ids, load_trace

BUILTIN_PREFIX = "builtin:"
BUILTIN_COST_MODELS: tuple[str, ...] = ("builtin:cpu",)

TraceFormat = Literal["azure", "mooncake", "burstgpt", "sharegpt", "vidur", "synthetic"]
assert set(get_args(TraceFormat)) == set(FORMATS)


class ScenarioError(ValueError):
    """A scenario file is unusable; the message is one line naming the file and the field."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bools(cls, v: Any, info: ValidationInfo) -> Any:
        # only bool fields take booleans: reject YAML true/false/yes/no instead of reading them as 1/0
        if isinstance(v, bool) and cls.model_fields[info.field_name].annotation is not bool:
            raise ValueError(f"expected a value of this field's type, got a boolean ({str(v).lower()})")
        return v


class SyntheticSpec(_Model):
    """Settings of ``trace.format: synthetic`` (see ``workbench.traces.load_synthetic``).

    Attributes:
        num_requests: how many requests.
        request_rate: mean arrival rate, req/s (``.inf`` = all at once).
        burstiness: gamma shape of inter-arrival times; 1.0 = Poisson, < 1 burstier.
        lengths: ``fixed``, ``uniform``, ``lognormal`` or ``file``.
        input_tokens, output_tokens: the lengths (fixed) or their means (lognormal), tokens.
        input_range, output_range: [lo, hi] token bounds, inclusive (uniform).
        input_sigma, output_sigma: log-space sigma (lognormal).
        input_min, input_max, output_min, output_max: clip bounds in tokens (lognormal, file).
        lengths_path: lengths CSV (file); relative to the scenario's folder, or ``builtin:<name>``.
    """

    num_requests: int = Field(ge=1)
    request_rate: float = Field(gt=0)
    burstiness: float = Field(1.0, gt=0, allow_inf_nan=False)
    lengths: Literal["fixed", "uniform", "lognormal", "file"] = "fixed"
    input_tokens: int = Field(256, ge=1)
    output_tokens: int = Field(128, ge=1)
    input_range: tuple[int, int] | None = None
    output_range: tuple[int, int] | None = None
    input_sigma: float = Field(0.5, ge=0, allow_inf_nan=False)
    output_sigma: float = Field(0.5, ge=0, allow_inf_nan=False)
    input_min: int = Field(1, ge=1)
    input_max: int | None = Field(None, ge=1)
    output_min: int = Field(1, ge=1)
    output_max: int | None = Field(None, ge=1)
    lengths_path: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "SyntheticSpec":
        if self.lengths == "uniform":
            for name in ("input_range", "output_range"):
                r = getattr(self, name)
                if r is None or not 1 <= r[0] <= r[1]:
                    raise ValueError(f"lengths uniform needs {name}: [lo, hi] with 1 <= lo <= hi, got {r}")
        if self.lengths == "file" and not self.lengths_path:
            raise ValueError("lengths file needs lengths_path (a lengths CSV)")
        if self.lengths != "file" and self.lengths_path:
            raise ValueError(f"lengths_path is only for lengths: file (lengths is {self.lengths})")
        for side in ("input", "output"):
            lo, hi = getattr(self, f"{side}_min"), getattr(self, f"{side}_max")
            if hi is not None and hi < lo:
                raise ValueError(f"{side}_max ({hi}) must be >= {side}_min ({lo})")
        return self


class LoadSpec(_Model):
    """Offered load relative to an engine's capacity on this machine (``trace.load``).

    The trace's arrival times are rescaled (as ``request_rate`` does) so that its offered request rate is
    ``factor`` x the capacity of the engine named ``engine``, measured before the replay by a saturation
    probe (``workbench.load``): ``probe_requests`` requests of the trace, spread evenly over it, all
    arriving at once; capacity = finished requests / the probe's duration (req/s). Every machine then runs
    the scenario at the same relative load, whatever its speed.

    Attributes:
        engine: name of an engine of the scenario (kind paged, static or sim).
        factor: offered rate / capacity (1.0 = as fast as the engine can go; > 1 overloads it).
        probe_requests: requests in the saturation probe (default: min(trace length, 24)).
    """

    engine: str = Field(min_length=1)
    factor: float = Field(gt=0, allow_inf_nan=False)
    probe_requests: int | None = Field(None, ge=1)


class TraceSpec(_Model):
    """Which trace to replay and how to cut and rescale it.

    Attributes:
        format: a loader format (``azure``, ``mooncake``, ``burstgpt``, ``sharegpt``, ``vidur``, ``synthetic``).
        path: trace file, relative to the scenario file's folder, or ``builtin:<file>`` for the slices in
            ``workbench/data/traces/``. Required unless format is synthetic (not allowed then).
        limit, sample, time_scale, request_rate, burstiness, max_input_tokens, max_output_tokens,
            length_scale: see ``workbench.traces.apply_transforms`` (rates in req/s, lengths in tokens).
        max_concurrency: closed-loop users (as ``vllm bench serve --max-concurrency``): at most this many
            requests in flight (sent and not yet ended); a request is sent at the later of its arrival time
            and the moment one of the users' previous requests ends, and its latencies are measured from
            then. None = open loop (every request sent at its arrival time).
        block_tokens: mooncake only: tokens per prefix block in the replay (512 = as recorded).
        default_output_tokens: sharegpt only: output length when a conversation has no reply.
        burstgpt_model, burstgpt_log_type: burstgpt only: row filters.
        synthetic: settings for format synthetic (required then, not allowed otherwise).
        load: offered load relative to an engine's measured capacity (:class:`LoadSpec`); sets the
            arrival rate, so it excludes ``request_rate`` and ``time_scale``.
    """

    format: TraceFormat
    path: str | None = None
    limit: int | None = Field(None, ge=1)
    sample: int | None = Field(None, ge=1)
    time_scale: float | None = Field(None, ge=0, allow_inf_nan=False)
    request_rate: float | None = Field(None, gt=0)
    burstiness: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_concurrency: int | None = Field(None, ge=1)
    max_input_tokens: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)
    length_scale: float | None = Field(None, gt=0, allow_inf_nan=False)
    block_tokens: int | None = Field(None, ge=1)
    default_output_tokens: int | None = Field(None, ge=1)
    burstgpt_model: str | None = None
    burstgpt_log_type: str | None = None
    synthetic: SyntheticSpec | None = None
    load: LoadSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> "TraceSpec":
        if self.load is not None:
            for name in ("request_rate", "time_scale"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} and load both set the arrival rate: set one of them")
        if self.format == "synthetic":
            if self.synthetic is None:
                raise ValueError("format synthetic needs a 'synthetic' section (num_requests, request_rate, ...)")
            if self.path is not None:
                raise ValueError("path is not used by format synthetic (use synthetic.lengths_path)")
        else:
            if self.synthetic is not None:
                raise ValueError(f"'synthetic' settings are only for format synthetic (format is {self.format})")
            if not self.path:
                raise ValueError(f"format {self.format} needs a path (a file, or builtin:<name>)")
        only = {"block_tokens": "mooncake", "default_output_tokens": "sharegpt", "burstgpt_model": "burstgpt",
                "burstgpt_log_type": "burstgpt"}
        for name, fmt in only.items():
            if getattr(self, name) is not None and self.format != fmt:
                raise ValueError(f"{name} is only for format {fmt} (format is {self.format})")
        if self.burstiness is not None and self.request_rate is None:
            raise ValueError("burstiness needs request_rate")
        return self


class EngineSpec(_Model):
    """One engine to run the trace on.

    Attributes:
        name: unique within the scenario; letters, digits, ``_`` and ``-`` (overrides address it by name).
        kind: ``paged`` (continuous batching), ``static`` (static batching baseline), ``sim`` (simulator) or
            ``openai`` (an OpenAI-compatible server at ``base_url``, e.g. ``workbench serve``).
        block_size: tokens per KV block.
        kv_cache_tokens, kv_cache_bytes: KV pool size in tokens or in bytes (at most one).
        max_num_seqs, max_num_batched_tokens: paged step limits (requests, tokens).
        max_model_len: longest prompt + output in tokens (None = the model's).
        max_batch_size: static batch size (requests).
        reservation: static KV reservation ``max``, ``pow2`` or ``oracle``.
        completion: static-policy engines only (kind static, or kind sim with policy static): when a request's
            answer is returned, so its finish time and E2EL: ``batch_end`` (default when unset: when the last
            member of its batch finishes, as a static-batching server answers) or ``own_end`` (its own last
            token).
        dtype: ``float32`` or ``bfloat16``.
        policy: sim only: the scheduling policy simulated, ``paged`` (default) or ``static``.
        cost_model: sim only: a profile JSON (relative to the scenario's folder), ``builtin:cpu`` (default)
            or ``analytic`` (the roofline model of ``engines.sim.analytic_cost_model``; default when
            ``hardware`` is set).
        test_step_delay_s: TEST-ONLY, real engines only: seconds of busy work added to every step, to slow
            an engine deliberately (regression-gate tests). Not part of :func:`scenario_hash`.
        enable_prefix_caching: automatic prefix caching (default true; false turns it off).
        enable_chunked_prefill: split prompts across steps (default true).
        long_prefill_token_threshold: most prompt tokens of one request per step (0 = no cap).
        preemption_mode: ``recompute`` (default) or ``swap``.
        swap_space_bytes: CPU swap pool for swap preemption, bytes (0 = none: swap falls back to recompute).
        swap_bandwidth_bytes_per_s: sim only: swap copy bandwidth charged (default 32e9, PCIe 4.0 x16).
        (GPU what-if; sim only) model: catalogue model simulated (default: the scenario's
            model; for kind openai, the model id to request); hardware: catalogue GPU; tp: tensor-parallel GPUs; weight_dtype: ``bf16``, ``fp8``,
            ``awq``, ``gptq``, ``int4``; kv_cache_dtype: ``bf16`` or ``fp8``; gpu_memory_utilization:
            fraction of GPU memory for weights + activations + KV; activation_reserve_gib: override the
            activation reserve; efficiency: overrides of the cost model's efficiency factors;
            speculative_model, num_speculative_tokens, spec_acceptance_rate: speculative decoding.
        device: real engines only: ``auto`` (default: CUDA when torch sees a GPU, else CPU), ``cpu``,
            ``cuda`` or ``cuda:N``. attention_backend: real engines only: ``auto`` (Triton on CUDA, the compiled
            kernel on CPU), ``torch``, ``cpp`` or ``triton``.
        base_url: openai only: the endpoint's API root, e.g. ``http://127.0.0.1:8000/v1`` (required).
        api_key: openai only: sent as ``Authorization: Bearer <api_key>``; ``env:NAME`` reads ``$NAME`` when
            the run starts. Written masked to results.json.
    """

    name: str = Field(min_length=1, max_length=64)
    kind: Literal["paged", "static", "sim", "openai"]
    block_size: int = Field(16, ge=1)
    kv_cache_tokens: int | None = Field(None, ge=1)
    kv_cache_bytes: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    max_batch_size: int = Field(64, ge=1)
    reservation: Literal["max", "pow2", "oracle"] = "max"
    completion: Literal["batch_end", "own_end"] | None = None  # None: batch_end (left out of scenario_hash)
    dtype: Literal["float32", "bfloat16"] = "float32"
    policy: Literal["paged", "static", "orca"] | None = None
    cost_model: str | None = None
    # test-only slowdown knob (regression-gate tests)
    test_step_delay_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    # prefix caching, chunked prefill, preemption modes (paged policy; sim too)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(0, ge=0)
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_bytes: int = Field(0, ge=0)
    swap_bandwidth_bytes_per_s: float | None = Field(None, gt=0, allow_inf_nan=False)

    # -- GPU what-if (catalogue hardware/model, analytic cost model, tp, quantization, spec decode)
    model: str | None = None
    hardware: str | None = None
    tp: int = Field(1, ge=1)
    weight_dtype: Literal["bf16", "fp8", "awq", "gptq", "int4"] = "bf16"
    kv_cache_dtype: Literal["bf16", "fp8"] = "bf16"
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    activation_reserve_gib: float | None = Field(None, ge=0, allow_inf_nan=False)
    efficiency: dict[str, float] | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1)
    spec_acceptance_rate: float | None = Field(None, ge=0, lt=1)

    # where a real engine runs, and its attention kernels
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    attention_backend: Literal["auto", "torch", "cpp", "triton"] = "auto"

    # kind openai (replay against an OpenAI-compatible endpoint; `model` above names the served model)
    base_url: str | None = None
    api_key: SecretStr | None = None  # results.json shows it masked; "env:NAME" reads $NAME at run time

    @model_validator(mode="after")
    def _check_test_knobs(self) -> "EngineSpec":
        if self.test_step_delay_s is not None and self.kind not in ("paged", "static"):
            raise ValueError("test_step_delay_s is only for real engines (kind paged or static)")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", v) or v.isdigit():
            raise ValueError(f"engine name must use letters, digits, _ and - (not only digits), got {v!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "EngineSpec":
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            raise ValueError("set kv_cache_tokens or kv_cache_bytes, not both")
        if self.kind == "sim":
            if self.policy is None:
                self.policy = "paged"
            if self.cost_model is None:
                self.cost_model = ANALYTIC if self.hardware else "builtin:cpu"
            _check_whatif(self)
            if self.cost_model.startswith(BUILTIN_PREFIX) and self.cost_model not in BUILTIN_COST_MODELS:
                raise ValueError(f"cost_model {self.cost_model!r} is unknown; builtin cost models: "
                                 f"{', '.join(BUILTIN_COST_MODELS)} (or analytic, or a profile JSON path)")
        else:
            for name in ("policy", "cost_model", "swap_bandwidth_bytes_per_s") + WHATIF_FIELDS:
                if name == "model" and self.kind == "openai":
                    continue  # the served model's id
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is only for kind sim (kind is {self.kind})")
            if self.tp != 1:
                raise ValueError(f"tp is only for kind sim (kind is {self.kind})")
            for name in ("weight_dtype", "kv_cache_dtype", "gpu_memory_utilization"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"{name} is only for kind sim (kind is {self.kind})")
        if self.kind not in ("paged", "static"):
            for name in ("device", "attention_backend"):
                if getattr(self, name) != "auto":
                    raise ValueError(f"{name} is only for real engines (kind paged or static; kind is {self.kind})")
        # kind openai: an endpoint, not an engine to configure
        if self.kind == "openai":
            if not self.base_url or not re.match(r"https?://", self.base_url):
                raise ValueError(f"kind openai needs base_url: http(s)://host:port/v1, got {self.base_url!r}")
            knobs = self.model_fields_set & {"block_size", "kv_cache_tokens", "kv_cache_bytes", "max_num_seqs",
                                             "max_num_batched_tokens", "max_model_len", "max_batch_size",
                                             "reservation", "dtype"}
            if knobs:
                raise ValueError(f"{', '.join(sorted(knobs))}: engine knobs are set on the server, not for kind openai")
        else:
            for name in ("base_url", "api_key"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is only for kind openai (kind is {self.kind})")
        return self

    @model_validator(mode="after")
    def _check_completion(self) -> "EngineSpec":
        static = self.kind == "static" or (self.kind == "sim" and self.policy == "static")
        if self.completion is not None and not static:
            where = f"kind {self.kind}" + (f", policy {self.policy}" if self.kind == "sim" else "")
            raise ValueError(f"completion is only for static-policy engines (kind static, or kind sim with "
                             f"policy static; {where})")
        return self


# -- GPU what-if checks of a sim engine
ANALYTIC = "analytic"
WHATIF_FIELDS = ("model", "hardware", "activation_reserve_gib", "efficiency", "speculative_model",
                 "num_speculative_tokens", "spec_acceptance_rate")


def _check_whatif(e: EngineSpec) -> None:
    from engines.sim.analytic_cost_model import Efficiency
    from engines.sim.catalog import CatalogError, get_hardware, get_model

    analytic = e.cost_model == ANALYTIC
    try:
        if e.hardware is not None:
            get_hardware(e.hardware)
        if e.model is not None:
            get_model(e.model)
        if e.speculative_model is not None:
            get_model(e.speculative_model)
        if e.efficiency is not None:
            Efficiency.default(**e.efficiency)
    except CatalogError as err:
        raise ValueError(str(err)) from None
    if analytic and e.hardware is None:
        raise ValueError("cost_model analytic needs hardware (a catalogue GPU, e.g. h100-sxm)")
    if not analytic:
        for name in ("hardware", "efficiency", "speculative_model"):
            if getattr(e, name) is not None:
                raise ValueError(f"{name} needs cost_model analytic (cost_model is {e.cost_model})")
        if e.tp != 1 or e.weight_dtype != "bf16" or e.kv_cache_dtype != "bf16":
            raise ValueError("tp, weight_dtype and kv_cache_dtype need cost_model analytic")
    spec = (e.speculative_model, e.num_speculative_tokens, e.spec_acceptance_rate)
    if any(v is not None for v in spec) and any(v is None for v in spec):
        raise ValueError("speculative decoding needs speculative_model, num_speculative_tokens and "
                         "spec_acceptance_rate together")


class SLOSpec(_Model):
    """Latency targets in milliseconds: time to first token, time per output token, end-to-end latency."""

    ttft_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    e2el_ms: float | None = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check(self) -> "SLOSpec":
        if self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None:
            raise ValueError("set at least one of ttft_ms, tpot_ms, e2el_ms (or leave slo out)")
        return self


class Scenario(_Model):
    """A trace replayed on engines. ``base_dir`` (set by :func:`load_scenario`) anchors relative paths."""

    name: str = Field(min_length=1)
    model: str = "smollm2-135m"
    seed: int = Field(0, ge=0)
    trace: TraceSpec
    engines: list[EngineSpec] = Field(min_length=1)
    slo: SLOSpec | None = None
    description: str | None = None

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @field_validator("engines")
    @classmethod
    def _unique(cls, v: list[EngineSpec]) -> list[EngineSpec]:
        first: dict[str, int] = {}
        for i, e in enumerate(v):
            if e.name in first:
                raise ValueError(f"engine names must be unique: {e.name!r} is engines.{first[e.name]} and engines.{i}")
            first[e.name] = i
        return v

    @model_validator(mode="after")
    def _check_load(self) -> "Scenario":
        load = self.trace.load
        if load is not None:
            kinds = {e.name: e.kind for e in self.engines}
            if load.engine not in kinds:
                raise ValueError(f"trace.load.engine: no engine named {load.engine!r}; engines: {', '.join(kinds)}")
            if kinds[load.engine] == "openai":
                raise ValueError(f"trace.load.engine: {load.engine} is kind openai; the capacity probe runs an "
                                 "engine of kind paged, static or sim")
        return self

    @property
    def base_dir(self) -> Path:
        """The folder relative paths are resolved against (the scenario file's folder)."""
        return self._base_dir

    def engine(self, name: str) -> EngineSpec:
        """The engine called ``name``; KeyError listing the names when there is none."""
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(f"no engine named {name!r}; engines: {', '.join(e.name for e in self.engines)}")

    def trace_path(self) -> Path | None:
        """The trace file, resolved (``builtin:`` or relative to :attr:`base_dir`); None for synthetic."""
        return resolve_path(self.trace.path, self._base_dir) if self.trace.path else None

    def cost_model_path(self, engine: EngineSpec) -> Path | None:
        """A sim engine's profile JSON, resolved; None for a builtin cost model or a non-sim engine."""
        if engine.cost_model is None or engine.cost_model.startswith(BUILTIN_PREFIX) or engine.cost_model == ANALYTIC:
            return None
        return resolve_path(engine.cost_model, self._base_dir)


# ------------------------------------------------------------------------------------------- functions


def resolve_path(path: str, base_dir: str | Path) -> Path:
    """``builtin:<name>`` -> ``workbench/data/traces/<name>``; a relative path -> under ``base_dir``."""
    if path.startswith(BUILTIN_PREFIX):
        return BUILTIN_TRACE_DIR / path[len(BUILTIN_PREFIX):]
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def builtin_traces() -> list[str]:
    """Names usable as ``builtin:<name>``."""
    return sorted(p.name for p in BUILTIN_TRACE_DIR.iterdir() if p.is_file() and not p.name.endswith(".md"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_line(text: str, loc: tuple) -> int | None:
    """1-based line of the deepest node along ``loc`` that the YAML text has (None when unknown)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None)
            if nxt is None:
                break
            line = next(k for k, v in node.value if v is nxt).start_mark.line + 1
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _fields_at(loc: tuple) -> list[str] | None:
    """The field names of the model found at ``loc`` inside :class:`Scenario` (None when not a model)."""
    model: Any = Scenario
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        while get_origin(ann) in (Union, list) or (get_origin(ann) is not None and type(None) in get_args(ann)):
            ann = next(a for a in get_args(ann) if a is not type(None))
        model = ann
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return None


def _describe(err: Mapping[str, Any]) -> tuple[str, str]:
    """(dotted field path, message) for one pydantic error."""
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        allowed = _fields_at(loc[:-1])
        where = ".".join(str(p) for p in loc)
        return where, "unknown field" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    msg = err.get("msg", "invalid")
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    elif kind == "missing":
        msg = "required field is missing"
    elif "input" in err and not isinstance(err["input"], (dict, list)):
        msg = f"{msg}, got {err['input']!r}"
    return (".".join(str(p) for p in loc) or "(scenario)"), msg


def _error(file: Path | str, field: str, msg: str, line: int | None = None, engine: str = "") -> ScenarioError:
    where = ", ".join(x for x in (f"engine {engine}" if engine else "", f"line {line}" if line else "") if x)
    text = f"{file}: {field}: {msg}" + (f" ({where})" if where else "")
    return ScenarioError(" ".join(text.split()))


def validate_scenario(data: Any, file: str | Path = "<scenario>", text: str | None = None,
                      base_dir: str | Path | None = None, check_files: bool = True) -> Scenario:
    """Validate a scenario mapping; ``file``/``text`` only improve the error message.

    With ``check_files`` the trace file, a synthetic lengths file and sim cost-model files must exist.

    Raises:
        ScenarioError: ``<file>: <field path>: <what is wrong / what is allowed> (line N)``.
    """
    if not isinstance(data, dict):
        raise _error(file, "(top level)", f"expected a mapping of scenario fields, got {type(data).__name__}")
    try:
        sc = Scenario.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field, msg = _describe(err)
        loc = tuple(err.get("loc", ()))
        raise _error(file, field, msg, _yaml_line(text, loc) if text else None, _engine_name(data, loc)) from None
    sc._base_dir = Path(base_dir) if base_dir is not None else Path(file).parent if file != "<scenario>" else Path.cwd()
    if check_files:
        checks: list[tuple[tuple, str | None]] = [(("trace", "path"), sc.trace.path)]
        if sc.trace.synthetic is not None:
            checks.append((("trace", "synthetic", "lengths_path"), sc.trace.synthetic.lengths_path))
        for i, eng in enumerate(sc.engines):
            if eng.cost_model and not eng.cost_model.startswith(BUILTIN_PREFIX) and eng.cost_model != ANALYTIC:
                checks.append((("engines", i, "cost_model"), eng.cost_model))
        for loc, value in checks:
            if value is None:
                continue
            p = resolve_path(value, sc._base_dir)
            if not p.is_file():
                hint = f"; builtin traces: {', '.join(builtin_traces())}" if value.startswith(BUILTIN_PREFIX) else ""
                raise _error(file, ".".join(map(str, loc)), f"no such file: {p}{hint}",
                             _yaml_line(text, loc) if text else None, _engine_name(data, loc))
        # a real engine's device must exist on this machine (before any engine starts)
        for i, eng in enumerate(sc.engines):
            if eng.kind in ("paged", "static") and eng.device not in ("auto", "cpu"):
                from engines.real.model import resolve_device

                try:
                    resolve_device(eng.device)
                except ValueError as err:
                    loc = ("engines", i, "device")
                    raise _error(file, f"engines.{i}.device", str(err), _yaml_line(text, loc) if text else None,
                                 eng.name) from None
    return sc


def _engine_name(data: Any, loc: tuple) -> str:
    """The engine's name when ``loc`` points into ``engines[i]`` and that engine has one, else ``""``."""
    if len(loc) >= 2 and loc[0] == "engines" and isinstance(loc[1], int) and isinstance(data, dict):
        engines = data.get("engines")
        if isinstance(engines, list) and loc[1] < len(engines) and isinstance(engines[loc[1]], dict):
            name = engines[loc[1]].get("name")
            if isinstance(name, str) and name:
                return name
    return ""


def load_scenario(path: str | Path, overrides: Mapping[str, Any] | None = None,
                  check_files: bool = True) -> Scenario:
    """Read and validate a scenario YAML file; relative paths inside resolve against its folder.

    Args:
        path: the YAML file.
        overrides: dotted-path settings applied before validation (see :func:`apply_overrides`).
        check_files: require the trace (and cost-model) files to exist.

    Raises:
        ScenarioError: one line ``<file>: <field path>: <what is wrong / what is allowed>``: missing file,
            YAML syntax error or duplicate key (``line N: ...``), validation error (the first one, with
            a dotted path such as ``engines.1.reservation`` and the YAML line), bad override.
    """
    p = Path(path)
    if not p.is_file():
        raise _error(p, "(file)", "no such file" if not p.exists() else "not a regular file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _error(p, "(file)", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        where = f"line {mark.line + 1}" if mark is not None else "(yaml)"
        detail = f"{problem} ({context})" if context else problem
        col = f" column {mark.column + 1}" if mark is not None else ""
        raise _error(p, where + col, f"YAML syntax error: {detail}") from None
    if data is None:
        raise _error(p, "(top level)", "file is empty; expected a mapping with name, trace, engines")
    if overrides:
        if not isinstance(data, dict):
            raise _error(p, "(top level)", f"expected a mapping of scenario fields, got {type(data).__name__}")
        try:
            data = apply_overrides(data, overrides)
        except ScenarioError as e:
            raise ScenarioError(f"{p}: {e}") from None
        text = None  # line numbers no longer match the file
    return validate_scenario(data, p, text, p.parent, check_files)


def scenario_hash(scenario: Scenario) -> str:
    """First 16 hex digits of the sha256 of the scenario's canonical JSON (sorted keys, fields left at
    their defaults omitted, so that adding a schema field with a default keeps existing hashes).

    Paths hash as written (not resolved), so a scenario keeps its hash when the project moves. Test-only
    knobs (``test_step_delay_s``) are left out: a deliberately slowed run is still the same scenario.
    """
    data = scenario.model_dump(mode="json", exclude_defaults=True)
    for eng in data.get("engines", []):  # test-only knobs do not change what a scenario is
        eng.pop("test_step_delay_s", None)
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def apply_overrides(scenario_dict: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """A deep copy of ``scenario_dict`` with dotted-path settings replaced.

    Keys are dotted paths; ``engines.<name>.<field>`` addresses an engine by its name (or by its index).
    Missing intermediate mappings are created (``slo.ttft_ms`` works without an ``slo`` section); a value
    of None removes the field. Validate the result with :func:`validate_scenario` (typos are caught there).

    Example: ``apply_overrides(d, {"engines.paged.max_num_seqs": 16, "trace.request_rate": 2})``.

    Raises:
        ScenarioError: ``override <key>: <why>`` (no such engine, a path through a non-mapping, empty key).
    """
    out = copy.deepcopy(dict(scenario_dict))
    for key, value in overrides.items():
        parts = str(key).split(".")
        if not key or any(not p for p in parts):
            raise ScenarioError(f"override {key!r}: expected a dotted field path such as trace.request_rate")
        node: Any = out
        for depth, part in enumerate(parts[:-1]):
            here = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                idx = _engine_index(node, part) if depth >= 1 and parts[depth - 1] == "engines" else None
                if idx is None:
                    idx = int(part) if part.isdigit() and int(part) < len(node) else None
                if idx is None:
                    names = [e.get("name") for e in node if isinstance(e, dict)]
                    raise ScenarioError(f"override {key}: no engine named {part!r} at {here}; engines: "
                                        f"{', '.join(map(str, names)) or '(none)'}")
                node = node[idx]
            elif isinstance(node, dict):
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
            else:
                raise ScenarioError(f"override {key}: {'.'.join(parts[:depth])} is not a mapping")
            if not isinstance(node, (dict, list)):
                raise ScenarioError(f"override {key}: {here} is a value ({node!r}), not a mapping")
        last = parts[-1]
        if isinstance(node, list):
            idx = int(last) if last.isdigit() and int(last) < len(node) else None
            if idx is None:
                raise ScenarioError(f"override {key}: no item {last!r} in the list")
            node[idx] = value
        elif value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return out


def _engine_index(engines: list, name: str) -> int | None:
    for i, e in enumerate(engines):
        if isinstance(e, dict) and e.get("name") == name:
            return i
    return None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["engines.paged.max_num_seqs=16", "trace.request_rate=2.5"]`` -> a dict; values parse as YAML.

    Raises:
        ScenarioError: an item without ``=`` or with a value that is not valid YAML.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(f"override {item!r}: expected KEY=VALUE, e.g. trace.request_rate=2")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise ScenarioError(f"override {item!r}: value is not valid YAML") from None
    return out


def load_scenario_trace(scenario: Scenario, tokenizer: Any = None, vocab_lo: int = 100,
                        vocab_hi: int = 49000, with_token_ids: bool = True) -> list[TraceRequest]:
    """Load and transform the scenario's trace (seeded by ``scenario.seed``).

    Args:
        scenario: a validated scenario.
        tokenizer: for format sharegpt (a transformers tokenizer or a callable text -> list[int]).
        vocab_lo, vocab_hi: id range for synthesized / Mooncake prompt ids (use the model's vocabulary).
        with_token_ids: give every request ``prompt_token_ids`` (see ``workbench.traces.ensure_prompt_ids``).

    Raises:
        workbench.traces.TraceError: the trace file is bad or a transform setting does not fit it.
    """
    t = scenario.trace
    kwargs: dict[str, Any] = {}
    block_tokens = t.block_tokens or 512
    if t.format == "synthetic":
        assert t.synthetic is not None
        kwargs = t.synthetic.model_dump()
        if kwargs["lengths_path"] is not None:
            kwargs["lengths_path"] = resolve_path(kwargs["lengths_path"], scenario.base_dir)
        kwargs["seed"] = scenario.seed
        reqs = load_trace("synthetic", None, **kwargs)
    else:
        if t.format == "mooncake":
            kwargs = {"seed": scenario.seed, "block_tokens": block_tokens, "token_ids": False,
                      "vocab_lo": vocab_lo, "vocab_hi": vocab_hi}
        elif t.format == "sharegpt":
            kwargs = {"tokenizer": tokenizer}
            if t.default_output_tokens is not None:
                kwargs["default_output_tokens"] = t.default_output_tokens
        elif t.format == "burstgpt":
            kwargs = {"model": t.burstgpt_model, "log_type": t.burstgpt_log_type}
        if t.limit is not None:
            kwargs["limit"] = t.limit
        reqs = load_trace(t.format, scenario.trace_path(), **kwargs)
    reqs = apply_transforms(reqs, limit=t.limit, sample=t.sample, seed=scenario.seed, time_scale=t.time_scale,
                            request_rate=t.request_rate, max_input_tokens=t.max_input_tokens,
                            max_output_tokens=t.max_output_tokens, length_scale=t.length_scale,
                            burstiness=t.burstiness)
    if with_token_ids:
        reqs = ensure_prompt_ids(reqs, scenario.seed, vocab_lo, vocab_hi, block_tokens)
    return reqs


__all__ = [
    "EngineSpec", "SLOSpec", "Scenario", "ScenarioError", "SyntheticSpec", "TraceSpec", "apply_overrides",
    "builtin_traces", "load_scenario", "load_scenario_trace", "parse_overrides", "resolve_path",
    "scenario_hash", "validate_scenario",
]
