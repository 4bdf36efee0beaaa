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
      - {name: sim-paged, kind: sim, policy: paged, cost_model: auto}
    slo: {ttft_ms: 2000, tpot_ms: 200}

:func:`load_scenario` validates it (unknown fields are errors, so typos are caught; so is a knob an
engine's kind or policy cannot use) and raises :class:`ScenarioError` with one line
``<file>: <field path>: <what is wrong / what is allowed> (engine NAME, line N)``.

The modules: ``schema`` (trace, SLO, the scenario), ``engine_spec`` (one model per engine kind and
:data:`EngineSpec`, their union discriminated on ``kind``), ``load`` (YAML with line numbers, validation,
errors, file and device checks), ``overrides`` (``--set``), ``hashing`` (:func:`scenario_hash`), ``trace``
(:func:`load_scenario_trace`), ``common`` (the error type, the base model, ``builtin:`` paths). Import
from ``workbench.scenario``.
"""

from workbench.scenario.common import BUILTIN_PREFIX, ScenarioError, builtin_traces, resolve_path
from workbench.scenario.engine_spec import (ANALYTIC, AUTO, BUILTIN_COST_MODELS, ENGINE_KINDS, ENGINE_MODELS, POLICIES,
                                            POLICY_KNOBS, POOL_KNOBS, REAL_KINDS, BuiltEngineSpec, EngineSpec,
                                            EngineSpecBase, OpenAIEngineSpec, PagedEngineSpec, PagedPolicyKnobs,
                                            RealEngineSpec, SimEngineSpec, StaticEngineSpec, StaticPolicyKnobs,
                                            policy_knobs)
from workbench.scenario.hashing import scenario_hash
from workbench.scenario.load import load_scenario, validate_scenario
from workbench.scenario.overrides import apply_overrides, parse_overrides
from workbench.scenario.schema import (ClusterSpec, LoadSpec, ReplicaSpec, RouterName, Scenario, SLOSpec, SyntheticSpec,
                                       TraceFormat, TraceSpec)
from workbench.scenario.trace import load_scenario_trace

__all__ = [
    "ANALYTIC",
    "AUTO",
    "BUILTIN_COST_MODELS",
    "BUILTIN_PREFIX",
    "BuiltEngineSpec",
    "ClusterSpec",
    "ENGINE_KINDS",
    "ENGINE_MODELS",
    "EngineSpec",
    "EngineSpecBase",
    "LoadSpec",
    "OpenAIEngineSpec",
    "POLICIES",
    "POLICY_KNOBS",
    "POOL_KNOBS",
    "PagedEngineSpec",
    "PagedPolicyKnobs",
    "REAL_KINDS",
    "ReplicaSpec",
    "RouterName",
    "RealEngineSpec",
    "SLOSpec",
    "Scenario",
    "ScenarioError",
    "SimEngineSpec",
    "StaticEngineSpec",
    "StaticPolicyKnobs",
    "SyntheticSpec",
    "TraceFormat",
    "TraceSpec",
    "apply_overrides",
    "builtin_traces",
    "load_scenario",
    "load_scenario_trace",
    "parse_overrides",
    "policy_knobs",
    "resolve_path",
    "scenario_hash",
    "validate_scenario",
]
