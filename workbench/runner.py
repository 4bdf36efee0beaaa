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
from workbench.prefix_workload import ideal_prefix_hit_rate
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
                max_model_len=spec.max_model_len, max_batch_size=spec.max_batch_size, reservation=spec.reservation,
                # issue 5
                enable_prefix_caching=spec.enable_prefix_caching, enable_chunked_prefill=spec.enable_chunked_prefill,
                long_prefill_token_threshold=spec.long_prefill_token_threshold,
                preemption_mode=spec.preemption_mode, swap_space_bytes=spec.swap_space_bytes)


def run_engine(scenario: Scenario, spec: EngineSpec, model_dir: Path, model_cfg: ModelConfig, trace, eos,
               on_output: Callable | None = None, runtime: dict | None = None):
    """Replay the trace on one engine; returns ``(outputs, steps)``. For a real engine, ``runtime`` (if
    given) gets where it ran: ``device`` (e.g. ``cpu``, ``cuda:0``), ``device_name`` and ``attention``
    (the kernels picked: ``cpp``, ``torch`` or ``triton``)."""
    if spec.kind == "openai":  # issue 6: the outputs carry .server_metrics; no engine steps client-side
        from workbench.openai_replay import replay_openai

        return replay_openai(spec.base_url, spec.model or scenario.model, trace, api_key=openai_api_key(spec),
                             on_output=on_output, engine_name=spec.name), []
    requests = make_requests(trace, eos)
    if spec.kind == "sim" and (spec.cost_model == "analytic" or spec.policy == "orca"):  # issue 7: GPU what-if
        from workbench.whatif import build_whatif_sim

        engine = build_whatif_sim(scenario, spec, model_cfg, lambda: load_cost_model(scenario, spec))
        return replay_simulated(engine, requests, on_output), engine.steps
    if spec.kind == "sim":
        from engines.simulator import build_sim_engine

        dtype_bytes = 2 if spec.dtype == "bfloat16" else 4
        engine = build_sim_engine(spec.policy or "paged", model_cfg, load_cost_model(scenario, spec),
                                  dtype_bytes=dtype_bytes, swap_bandwidth_bytes_per_s=spec.swap_bandwidth_bytes_per_s,
                                  **_knobs(spec))
        return replay_simulated(engine, requests, on_output), engine.steps
    from engines.llm_engine import LLM

    llm = LLM(model_dir, engine=spec.kind, dtype=spec.dtype, seed=scenario.seed,
              step_delay_s=spec.test_step_delay_s or 0.0, **_knobs(spec),  # issue 4: test-only knob
              device=spec.device, attention_backend=spec.attention_backend)  # issue 7
    if runtime is not None:  # issue 7
        runtime.update(engine_runtime(llm))
    try:
        warm_up(llm)
        outs = replay_realtime(llm.engine, requests, on_output)
        return outs, llm.engine.steps
    finally:
        del llm
        gc.collect()


def engine_runtime(llm) -> dict:
    """Issue 7: ``{"device", "device_name", "attention"}`` of a real engine's model."""
    import torch

    model = llm.engine.executor.model
    dev = model.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return {"device": str(dev), "device_name": name, "attention": model.attention.name}


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def warm_up(llm) -> None:
    """Issue 4: run one short request untimed before a replay, then forget its step records, so that the
    first engine of a run does not pay one-time costs (loading the compiled kernels, first-call allocations;
    0.2-0.4 s per step measured on the tiny model) that later engines in the same process skip."""
    from engines.sampling_params import SamplingParams

    llm.generate([[100 + i for i in range(16)]], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.steps.clear()


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
    """Give each sim engine ``sim_error`` against its real counterpart in this run: the real engine named
    like it without the ``sim-`` prefix (``sim-paged-nocache`` -> ``paged-nocache``) when there is one of
    the same policy, else the first real engine of the same policy."""
    engines = results["engines"]
    for name, e in engines.items():
        if e["kind"] != "sim":
            continue
        policy = e["config"].get("policy") or "paged"
        twin = engines.get(name.removeprefix("sim-"))
        real = name.removeprefix("sim-") if twin is not None and twin["kind"] == policy else None
        real = real or next((n for n, r in engines.items() if r["kind"] == policy), None)
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


def run_scenario(scenario: Scenario, out_dir: Path, progress=None, plots: bool = True) -> dict:
    """Run every engine of the scenario, write ``results.json``, per-engine CSVs, PNGs and ``report.html``
    into ``out_dir``; returns the results dict.

    ``progress`` (optional) is called as ``progress(engine_name, kind, total)`` and must return a
    callback taking each ``RequestOutput``. ``plots=False`` (issue 4: sweep points) skips the PNGs and
    report.html.
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
        "machine": {"platform": platform.platform(), "processor": cpu_name(), "cpus": os.cpu_count()},
        "num_requests": len(trace),
        "formulas": FORMULAS,
        "engines": {},
    }
    frames = {}
    for spec in scenario.engines:
        cb = progress(spec.name, spec.kind, len(trace)) if progress else None
        runtime: dict = {}
        outs, steps = run_engine(scenario, spec, model_dir, model_cfg, trace, eos, cb, runtime)
        summary = summarize(outs, steps, len(trace), slo)
        if (spec.policy or spec.kind) == "paged":  # issue 5: the trace's reuse under an unlimited cache
            ideal = ideal_prefix_hit_rate([t.prompt_token_ids for t in trace], spec.block_size)
            summary["prefix_cache_ideal_hit_rate"] = ideal["hit_rate"]
        if spec.kind == "openai":  # issue 6
            add_openai_server_metrics(summary, outs)
        cfg = spec.model_dump(mode="json", exclude_none=True)
        results["engines"][spec.name] = {"kind": spec.kind, "config": cfg, "summary": summary,
                                         **({"runtime": runtime} if runtime else {})}
        rf, sf = requests_frame(outs), steps_frame(steps)
        edir = out_dir / spec.name
        edir.mkdir(exist_ok=True)
        rf.to_csv(edir / "requests.csv", index=False)
        sf.to_csv(edir / "steps.csv", index=False)
        frames[spec.name] = (rf, sf)
    add_sim_errors(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    if not plots:
        return results
    plots = make_plots(results, frames)
    for name, png in plots.items():
        (out_dir / name).write_bytes(png)
    write_html(out_dir / "report.html", results, plots)
    return results
