"""The scenario schema but its engines (``engine_spec``): the trace to replay (:class:`TraceSpec`, with
:class:`SyntheticSpec` and :class:`LoadSpec`), the latency targets (:class:`SLOSpec`) and the whole
:class:`Scenario`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import Field, PrivateAttr, field_validator, model_validator

from engines.core.router import DEFAULT_MAX_IMBALANCE, ROUTERS
from workbench.scenario.common import BUILTIN_PREFIX, SpecModel, field_error, resolve_path
from workbench.scenario.engine_spec import ANALYTIC, AUTO, EngineSpec
from workbench.traces import FORMATS

RouterName = Literal["round_robin", "least_outstanding", "least_kv", "prefix_aware"]
assert get_args(RouterName) == ROUTERS
TraceFormat = Literal["azure", "mooncake", "burstgpt", "sharegpt", "vidur", "apex", "synthetic"]
assert set(get_args(TraceFormat)) == set(FORMATS)


class SyntheticSpec(SpecModel):
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


class LoadSpec(SpecModel):
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


class TraceSpec(SpecModel):
    """Which trace to replay and how to cut and rescale it.

    Attributes:
        format: a loader format (``azure``, ``mooncake``, ``burstgpt``, ``sharegpt``, ``vidur``, ``apex``,
            ``synthetic``).
        path: trace file, relative to the scenario file's folder, or ``builtin:<file>`` for the slices in
            ``workbench/data/traces/``. Required unless format is synthetic (not allowed then).
        limit, sample, time_scale, request_rate, burstiness, max_input_tokens, max_output_tokens,
            length_scale, output_tokens (a fixed output length): see ``workbench.traces.apply_transforms``
            (rates in req/s, lengths in tokens).
        max_concurrency: closed-loop users (as ``vllm bench serve --max-concurrency``): at most this many
            requests in flight (sent and not yet ended); a request is sent at the later of its arrival time
            and the moment one of the users' previous requests ends, and its latencies are measured from
            then. None = open loop (every request sent at its arrival time).
        block_tokens: mooncake only: tokens per prefix block in the replay (512 = as recorded).
        default_output_tokens: sharegpt only: output length when a conversation has no reply.
        burstgpt_model, burstgpt_log_type: burstgpt only: row filters.
        synthetic: settings for format synthetic (required then, not allowed otherwise).
        strict: a row the loader would skip, change or warn about (rows out of arrival order, a 0-token
            output, Mooncake block counts that disagree with the input length) is an error naming the file
            and line instead of a counted note.
        load: offered load relative to an engine's measured capacity (:class:`LoadSpec`); sets the
            arrival rate, so it excludes ``request_rate`` and ``time_scale``.
        repeat: replay the (cut) trace this many times back to back, copy k shifted by k x (its duration
            plus its mean gap), with new request ids; gaps and lengths inside a copy are the recorded ones
            (see ``workbench.traces.day``).
        duration_s: instead of the recorded requests, a stationary trace of this many seconds synthesized
            from the trace's mean rate, gap CV and joint lengths (seeded by ``seed``); excludes ``repeat``.
        rate_profile: with ``duration_s``: relative arrival rates over equal slices of that day (e.g. 24
            hourly values), scaled to mean 1 so the day's mean rate stays the trace's.
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
    output_tokens: int | None = Field(None, ge=1)
    length_scale: float | None = Field(None, gt=0, allow_inf_nan=False)
    block_tokens: int | None = Field(None, ge=1)
    default_output_tokens: int | None = Field(None, ge=1)
    burstgpt_model: str | None = None
    burstgpt_log_type: str | None = None
    synthetic: SyntheticSpec | None = None
    strict: bool = False
    load: LoadSpec | None = None
    repeat: int | None = Field(None, ge=1, le=1_000_000)
    duration_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    rate_profile: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "TraceSpec":
        if self.repeat is not None and self.duration_s is not None:
            raise ValueError("repeat and duration_s both make a day from the trace: set one of them")
        if self.rate_profile is not None:
            if self.duration_s is None:
                raise ValueError("rate_profile shapes a synthesized day: it needs duration_s")
            if sum(self.rate_profile) <= 0:
                raise ValueError("rate_profile: at least one relative rate must be > 0")
        if self.duration_s is not None and self.format == "synthetic":
            raise ValueError("duration_s is not for format synthetic (set synthetic.num_requests and request_rate)")
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


class ReplicaSpec(SpecModel):
    """``count`` replicas of the scenario's engine named ``engine``, a sim engine or a real paged one (each a
    fresh engine: its own KV pool, prefix cache and clock)."""

    engine: str = Field(min_length=1)
    count: int = Field(1, ge=1, le=4096)


class ClusterSpec(SpecModel):
    """A cluster what-if: replicas of the scenario's engines behind a router, replaying the whole trace; sim
    replicas on the cluster simulator (``engines.sim.cluster``), real paged replicas in real time in one
    process (``workbench.real_cluster``: a thread and one torch thread per replica).

    Attributes:
        replicas: groups of replicas (:class:`ReplicaSpec`), all sim (mixed hardware allowed) or all real
            paged.
        twin: real replicas only: a sim engine whose replicas (as many as the real ones) also run behind each
            router, on the cluster simulator, to check it against the real cluster.
        router: the router (``engines.core.router.ROUTERS``), or
        routers: several, each run on fresh replicas (one cluster result per router); default round_robin.
        max_imbalance: prefix_aware's load bound, requests: only replicas with at most this many more
            requests in flight than the least loaded one are considered.
    """

    replicas: list[ReplicaSpec] = Field(min_length=1)
    router: RouterName | None = None
    routers: list[RouterName] | None = Field(None, min_length=1)
    max_imbalance: int = Field(DEFAULT_MAX_IMBALANCE, ge=0)
    twin: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        if self.router is not None and self.routers is not None:
            raise field_error("routers", "set router (one) or routers (several), not both")
        if self.routers is not None and len(set(self.routers)) != len(self.routers):
            raise field_error("routers", f"a router is listed twice: {', '.join(self.routers)}")
        return self

    @property
    def router_names(self) -> list[str]:
        """The routers to run, in order."""
        return list(self.routers or [self.router or "round_robin"])

    @property
    def num_replicas(self) -> int:
        return sum(r.count for r in self.replicas)


class SLOSpec(SpecModel):
    """Latency targets in milliseconds: time to first token, time per output token, end-to-end latency."""

    ttft_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    e2el_ms: float | None = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check(self) -> "SLOSpec":
        if self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None:
            raise ValueError("set at least one of ttft_ms, tpot_ms, e2el_ms (or leave slo out)")
        return self


class Scenario(SpecModel):
    """A trace replayed on engines. ``base_dir`` (set by ``load_scenario``) anchors relative paths.

    Attributes:
        name: the scenario's name (reports, results.json).
        model: the model the real engines run and measured sim engines simulate (a known name or a folder).
        seed: seeds trace sampling, synthesized prompt ids and sampling.
        trace: what to replay (:class:`TraceSpec`).
        engines: one or more engines (:data:`EngineSpec`), names unique.
        slo: latency targets for goodput (:class:`SLOSpec`), or None.
        cluster: a cluster of sim or real paged engine replicas behind routers (:class:`ClusterSpec`), or None.
        description: free text.
    """

    name: str = Field(min_length=1)
    model: str = "smollm2-135m"
    seed: int = Field(0, ge=0)
    trace: TraceSpec
    engines: list[EngineSpec] = Field(min_length=1)
    slo: SLOSpec | None = None
    cluster: ClusterSpec | None = None
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

    @model_validator(mode="after")
    def _check_cluster(self) -> "Scenario":
        if self.cluster is None:
            return self
        kinds = {e.name: e.kind for e in self.engines}
        cl = self.cluster
        for i, r in enumerate(cl.replicas):
            if r.engine not in kinds:
                raise field_error(f"cluster.replicas.{i}.engine",
                                  f"no engine named {r.engine!r}; engines: {', '.join(kinds)}")
            if kinds[r.engine] not in ("sim", "paged"):
                raise field_error(f"cluster.replicas.{i}.engine", f"{r.engine} is kind {kinds[r.engine]}; "
                                  "a cluster replicates sim engines or real paged engines")
            if kinds[r.engine] != kinds[cl.replicas[0].engine]:
                raise field_error(f"cluster.replicas.{i}.engine", f"{r.engine} is kind {kinds[r.engine]}, "
                                  f"replicas.0 kind {kinds[cl.replicas[0].engine]}; a cluster is all sim or all real")
        real = kinds[cl.replicas[0].engine] == "paged"
        if cl.twin is not None:
            if not real:
                raise field_error("cluster.twin", "a twin is for a cluster of real replicas (kind paged)")
            if kinds.get(cl.twin) != "sim":
                raise field_error("cluster.twin", f"{cl.twin!r} is not a sim engine of this scenario")
        if real and self.trace.max_concurrency is not None:
            raise field_error("trace.max_concurrency", "closed-loop users are not supported on a real cluster")
        return self

    @property
    def base_dir(self) -> Path:
        """The folder relative paths are resolved against (the scenario file's folder)."""
        return self._base_dir

    def engine(self, name: str) -> EngineSpec:
        """The engine called ``name``.

        Raises:
            KeyError: no engine has that name (the message lists the names).
        """
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(f"no engine named {name!r}; engines: {', '.join(e.name for e in self.engines)}")

    def trace_path(self) -> Path | None:
        """The trace file, resolved (``builtin:`` or relative to :attr:`base_dir`); None for synthetic."""
        return resolve_path(self.trace.path, self._base_dir) if self.trace.path else None

    def cost_model_path(self, engine: EngineSpec) -> Path | None:
        """A sim engine's profile JSON, resolved; None for an auto, builtin or analytic cost model, or an engine
        of another kind."""
        if engine.kind != "sim":
            return None
        cm = engine.cost_model
        if cm is None or cm.startswith(BUILTIN_PREFIX) or cm in (ANALYTIC, AUTO):
            return None
        return resolve_path(cm, self._base_dir)
