"""Scenario glue for GPU what-if sim engines (issue 7): catalogue names -> analytic cost model -> engine."""

from __future__ import annotations

from typing import Callable

from engines.analytic_cost_model import AnalyticCostModel, Efficiency, SpecDecodeConfig
from engines.catalog import GIB, get_hardware, get_model, model_names
from engines.whatif import build_whatif_engine
from workbench.scenario import EngineSpec, Scenario


def catalog_model_name(scenario: Scenario, spec: EngineSpec) -> str:
    """The catalogue model a sim engine simulates: its ``model``, else the scenario's model.

    Raises:
        ValueError: neither names a catalogue model.
    """
    name = spec.model or scenario.model
    if name.lower() not in model_names():
        raise ValueError(f"engine {spec.name}: model {name!r} is not in the model catalogue; set engines."
                         f"{spec.name}.model to one of {', '.join(model_names())}")
    return name


def analytic_cost_model(scenario: Scenario, spec: EngineSpec) -> AnalyticCostModel:
    """The roofline cost model of an engine with ``cost_model: analytic``."""
    spec_cfg = None
    if spec.speculative_model:
        spec_cfg = SpecDecodeConfig(get_model(spec.speculative_model), spec.num_speculative_tokens,
                                    spec.spec_acceptance_rate)
    return AnalyticCostModel(get_model(catalog_model_name(scenario, spec)), get_hardware(spec.hardware), spec.tp,
                             spec.weight_dtype, spec.kv_cache_dtype, Efficiency.default(**(spec.efficiency or {})),
                             spec_cfg)


def build_whatif_sim(scenario: Scenario, spec: EngineSpec, model_cfg, measured: Callable):
    """The simulated engine of a what-if sim engine spec (analytic cost model, or the ``orca`` policy
    over a measured cost model ``measured()``).

    Raises:
        ValueError (CatalogError): unknown names, or the weights do not fit.
    """
    if spec.cost_model == "analytic":
        cm = analytic_cost_model(scenario, spec)
        model_cfg = cm.model.to_model_config()
    else:
        cm = measured()
    reserve = spec.activation_reserve_gib * GIB if spec.activation_reserve_gib is not None else None
    return build_whatif_engine(
        spec.policy or "paged", cm, model_cfg, block_size=spec.block_size, kv_cache_tokens=spec.kv_cache_tokens,
        kv_cache_bytes=spec.kv_cache_bytes, gpu_memory_utilization=spec.gpu_memory_utilization,
        activation_reserve_bytes=reserve, seed=scenario.seed, max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=spec.max_model_len,
        max_batch_size=spec.max_batch_size, reservation=spec.reservation, completion=spec.completion)
