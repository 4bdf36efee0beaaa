"""The scenario's trace: its ``TraceSpec`` mapped onto the loaders and transforms of ``workbench.traces``."""

from __future__ import annotations

from typing import Any

from workbench.scenario.common import resolve_path
from workbench.scenario.schema import Scenario
from workbench.traces import (MOONCAKE_BLOCK_TOKENS, LoadStats, TraceRequest, apply_transforms, ensure_prompt_ids,
                              load_trace)


def load_scenario_trace(scenario: Scenario, tokenizer: Any = None, vocab_lo: int = 100,
                        vocab_hi: int = 49000, with_token_ids: bool = True,
                        stats: LoadStats | None = None) -> list[TraceRequest]:
    """Load and transform the scenario's trace (seeded by ``scenario.seed``).

    Args:
        scenario: a validated scenario.
        tokenizer: for format sharegpt (a transformers tokenizer or a callable text -> list[int]).
        vocab_lo, vocab_hi: id range for synthesized / Mooncake prompt ids (use the model's vocabulary).
        with_token_ids: give every request ``prompt_token_ids`` (see ``workbench.traces.ensure_prompt_ids``).
        stats: filled with what loading and the transforms skipped, changed or re-ordered
            (``workbench.traces.LoadStats``; ``stats.notes()`` are one line each).

    The trace section's ``strict`` makes every row the loader would change, warn
    about or re-order an error.

    Raises:
        workbench.traces.TraceError: the trace file is bad or a transform setting does not fit it.
    """
    t = scenario.trace
    kwargs: dict[str, Any] = {}
    st = stats if stats is not None else LoadStats()
    block_tokens = t.block_tokens or MOONCAKE_BLOCK_TOKENS
    if t.format == "synthetic":
        assert t.synthetic is not None
        kwargs = t.synthetic.model_dump()
        if kwargs["lengths_path"] is not None:
            kwargs["lengths_path"] = resolve_path(kwargs["lengths_path"], scenario.base_dir)
        kwargs["seed"] = scenario.seed
        reqs = load_trace("synthetic", None, stats=st, **kwargs)
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
        if t.strict:
            kwargs["strict"] = True
        reqs = load_trace(t.format, scenario.trace_path(), stats=st, **kwargs)
    reqs = apply_transforms(reqs, limit=t.limit, sample=t.sample, seed=scenario.seed, time_scale=t.time_scale,
                            request_rate=t.request_rate, max_input_tokens=t.max_input_tokens,
                            max_output_tokens=t.max_output_tokens, length_scale=t.length_scale,
                            burstiness=t.burstiness, stats=st, output_tokens=t.output_tokens,
                            repeat=t.repeat, duration_s=t.duration_s, rate_profile=t.rate_profile)
    if with_token_ids:
        reqs = ensure_prompt_ids(reqs, scenario.seed, vocab_lo, vocab_hi, block_tokens)
    return reqs
