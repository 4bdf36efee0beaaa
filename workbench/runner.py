"""``workbench run``: replay a scenario's trace on each of its engines and write the results."""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Callable

from engines.config import ModelConfig
from engines.cost_model import CostModel
from workbench.metrics import FORMULAS, relative_error, summarize
from workbench.replay import make_requests, replay_realtime, replay_simulated
from workbench.report import make_plots, requests_frame, steps_frame, write_html
from workbench.scenario import EngineSpec, Scenario, load_scenario_trace, scenario_hash

BUILTIN_PROFILES = Path(__file__).parent / "data" / "profiles"


def load_cost_model(scenario: Scenario, spec: EngineSpec) -> CostModel:
    """The sim engine's cost model: a profile JSON, or ``builtin:cpu`` (this project's CPU profile).

    Raises:
        ValueError: the profile file is missing or malformed.
    """
    path = scenario.cost_model_path(spec)
    if path is None:
        path = BUILTIN_PROFILES / f"{(spec.cost_model or 'builtin:cpu').split(':', 1)[1]}.json"
    return CostModel.load(path)


def _knobs(spec: EngineSpec) -> dict:
    return dict(block_size=spec.block_size, kv_cache_tokens=spec.kv_cache_tokens, kv_cache_bytes=spec.kv_cache_bytes,
                max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                max_model_len=spec.max_model_len, max_batch_size=spec.max_batch_size, reservation=spec.reservation)


def run_engine(scenario: Scenario, spec: EngineSpec, model_dir: Path, model_cfg: ModelConfig, trace, eos,
               on_output: Callable | None = None):
    """Replay the trace on one engine; returns ``(outputs, steps)``."""
    if spec.kind == "openai":  # issue 6: the outputs carry .server_metrics; no engine steps client-side
        from workbench.openai_replay import replay_openai

        return replay_openai(spec.base_url, spec.model or scenario.model, trace, api_key=openai_api_key(spec),
                             on_output=on_output, engine_name=spec.name), []
    requests = make_requests(trace, eos)
    if spec.kind == "sim":
        from engines.simulator import build_sim_engine

        dtype_bytes = 2 if spec.dtype == "bfloat16" else 4
        engine = build_sim_engine(spec.policy or "paged", model_cfg, load_cost_model(scenario, spec),
                                  dtype_bytes=dtype_bytes, **_knobs(spec))
        return replay_simulated(engine, requests, on_output), engine.steps
    from engines.llm_engine import LLM

    llm = LLM(model_dir, engine=spec.kind, dtype=spec.dtype, seed=scenario.seed, **_knobs(spec))
    try:
        outs = replay_realtime(llm.engine, requests, on_output)
        return outs, llm.engine.steps
    finally:
        del llm
        gc.collect()


def openai_api_key(spec: EngineSpec) -> str | None:
    """The API key of a ``kind: openai`` engine; ``env:NAME`` reads ``$NAME``.

    Raises:
        ValueError: ``env:NAME`` names an unset variable.
    """
    if spec.api_key is None:
        return None
    key = spec.api_key.get_secret_value()
    if key.startswith("env:"):
        if key[4:] not in os.environ:
            raise ValueError(f"engine {spec.name}: api_key {key} names an unset environment variable")
        return os.environ[key[4:]]
    return key


def add_openai_server_metrics(summary: dict, outs) -> None:
    """issue 6: a ``kind: openai`` engine's /metrics deltas (``server_metrics``, None when not served);
    the server's preemption count replaces the client-side 0."""
    sm = getattr(outs, "server_metrics", None)
    summary["server_metrics"] = sm
    if sm and "vllm:num_preemptions_total" in sm["delta"]:
        summary["num_preemptions"] = int(sm["delta"]["vllm:num_preemptions_total"])


def add_sim_errors(results: dict) -> None:
    """Give each sim engine ``sim_error`` against the first real engine of the same policy in this run."""
    engines = results["engines"]
    for name, e in engines.items():
        if e["kind"] != "sim":
            continue
        policy = e["config"].get("policy") or "paged"
        real = next((n for n, r in engines.items() if r["kind"] == policy), None)
        if real is None:
            continue
        s, r = e["summary"], engines[real]["summary"]
        s["sim_error"] = {
            "real_engine": real,
            "output_throughput": relative_error(s["output_throughput"], r["output_throughput"]),
            "e2el_p50": relative_error(s["e2el_ms"]["p50"], r["e2el_ms"]["p50"]),
            "e2el_p99": relative_error(s["e2el_ms"]["p99"], r["e2el_ms"]["p99"]),
        }


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "numpy", "pandas", "llm-serving-workbench"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def run_scenario(scenario: Scenario, out_dir: Path, progress=None) -> dict:
    """Run every engine of the scenario, write ``results.json``, per-engine CSVs, PNGs and ``report.html``
    into ``out_dir``; returns the results dict.

    ``progress`` (optional) is called as ``progress(engine_name, kind, total)`` and must return a
    callback taking each ``RequestOutput``.
    """
    from transformers import AutoTokenizer

    from engines.model_store import resolve_model

    model_dir = resolve_model(scenario.model)
    model_cfg = ModelConfig.from_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trace = load_scenario_trace(scenario, tok, vocab_lo=100, vocab_hi=min(model_cfg.vocab_size, 49000))
    eos = model_cfg.eos_token_ids[0] if model_cfg.eos_token_ids else None
    slo = scenario.slo.model_dump() if scenario.slo else None
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "scenario": scenario.model_dump(mode="json"),
        "scenario_hash": scenario_hash(scenario),
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "versions": _versions(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "num_requests": len(trace),
        "formulas": FORMULAS,
        "engines": {},
    }
    frames = {}
    for spec in scenario.engines:
        cb = progress(spec.name, spec.kind, len(trace)) if progress else None
        outs, steps = run_engine(scenario, spec, model_dir, model_cfg, trace, eos, cb)
        summary = summarize(outs, steps, len(trace), slo)
        if spec.kind == "openai":  # issue 6
            add_openai_server_metrics(summary, outs)
        cfg = spec.model_dump(mode="json", exclude_none=True)
        results["engines"][spec.name] = {"kind": spec.kind, "config": cfg, "summary": summary}
        rf, sf = requests_frame(outs), steps_frame(steps)
        edir = out_dir / spec.name
        edir.mkdir(exist_ok=True)
        rf.to_csv(edir / "requests.csv", index=False)
        sf.to_csv(edir / "steps.csv", index=False)
        frames[spec.name] = (rf, sf)
    add_sim_errors(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    plots = make_plots(results, frames)
    for name, png in plots.items():
        (out_dir / name).write_bytes(png)
    write_html(out_dir / "report.html", results, plots)
    return results
