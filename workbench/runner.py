"""``workbench run``: replay a scenario's trace on each of its engines and write the results."""

from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import json
import math
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Callable

from engines.core.config import ModelConfig
from engines.factory import EngineConfig, build_engine
from engines.sim.catalog import GIB
from engines.sim.cost_model import PILOT_ELASTICITY_FLOOR, PILOT_ELASTICITY_FLOOR_TOKENS, PILOT_LARGE_TOKENS, CostModel
from engines.real.cpu_features import cpu_flags, cpu_name, native_bf16
from workbench.fidelity import FORMULAS as FIDELITY_FORMULAS
from workbench.fidelity import SENSITIVITY_STEP
from workbench.metrics import FORMULAS, summarize
from workbench.replay import make_requests, replay_realtime, replay_simulated, warm_up
from workbench.report import make_plots, requests_frame, steps_frame, write_html
from workbench.scenario import (ANALYTIC, AUTO, POOL_KNOBS, BuiltEngineSpec, EngineSpec, OpenAIEngineSpec, Scenario,
                                SimEngineSpec, load_scenario_trace, policy_knobs, scenario_hash)
from workbench.traces.prefix import ideal_prefix_hit_rate

BUILTIN_PROFILES = Path(__file__).parent / "data" / "profiles"


def load_cost_model(scenario: Scenario, spec: SimEngineSpec, model_dir: Path | None = None,
                    echo: Callable[[str], None] | None = None) -> tuple[CostModel, dict]:
    """The sim engine's measured cost model and where it came from (``{path, fingerprint, created}``):
    ``auto`` is this machine's profile for the scenario's model and the engine's dtype and weight dtype (measured now if it is
    not cached, see ``workbench.calibration``); a profile JSON or ``builtin:NAME`` (a committed profile) is
    used as named, with a warning when it was measured on another machine or setup.

    Raises:
        ValueError: the profile file is missing or malformed, or it measured another model, dtype or weight
            dtype.
    """
    from engines.real.model_store import resolve_model
    from workbench.calibration import check_profile, ensure_profile, fingerprint, warn_machine

    model_dir = model_dir or resolve_model(scenario.model)
    if spec.cost_model == AUTO:
        cm, path = ensure_profile(scenario.model, model_dir, spec.dtype, echo=echo, weight_dtype=spec.weight_dtype)
    else:
        path = scenario.cost_model_path(spec) or BUILTIN_PROFILES / f"{spec.cost_model.split(':', 1)[1]}.json"
        cm = CostModel.load(path)
        where = f"engine {spec.name}: cost_model {spec.cost_model}"
        fp = fingerprint(scenario.model, model_dir, spec.dtype, weight_dtype=spec.weight_dtype)
        warn_machine(where, check_profile(cm, fp, where), cm)
    return cm, {"path": str(path), "fingerprint": cm.fingerprint, "created": cm.created, "source": cm.source}


def _knobs(spec: BuiltEngineSpec) -> dict:
    """The ``EngineConfig`` fields (same names) a paged, static or sim engine takes from its spec: the KV
    pool, ``max_model_len``, ``dtype`` and the knobs of its scheduling policy that its kind has (a sim engine's
    ``swap_bandwidth_bytes_per_s`` with policy paged). The other policies' knobs are not on the spec's
    kind, or cannot be set for its policy, so they stay at ``EngineConfig``'s defaults."""
    names = POOL_KNOBS + tuple(n for n in policy_knobs(spec.policy_name) if n in type(spec).model_fields)
    return {name: getattr(spec, name) for name in names}


def catalog_model_name(scenario: Scenario, spec: SimEngineSpec) -> str:
    """The catalogue model an analytic sim engine simulates: its ``model``, else the scenario's model.

    Raises:
        ValueError: neither names a catalogue model.
    """
    from engines.sim.catalog import model_names

    name = spec.model or scenario.model
    if name.lower() not in model_names():
        raise ValueError(f"engine {spec.name}: model {name!r} is not in the model catalogue; set engines."
                         f"{spec.name}.model to one of {', '.join(model_names())}")
    return name


def engine_config(scenario: Scenario, spec: EngineSpec, model_dir: Path | None,
                  model_cfg: ModelConfig | None, cost_model: CostModel | None = None) -> EngineConfig:
    """What ``engines.factory.build_engine`` builds for a scenario engine of kind paged, static or sim:
    every knob of the spec, so that the factory honours each one or refuses it.

    A real engine runs the model in ``model_dir``; a sim engine over a measured cost model (a profile JSON,
    ``auto``, ``builtin:NAME``; ``cost_model`` if given, else :func:`load_cost_model`) simulates ``model_cfg``; one with ``cost_model: analytic`` simulates the catalogue model
    :func:`catalog_model_name` names, on ``tp`` x ``hardware``.

    Raises:
        ValueError: a kind openai engine (an endpoint: nothing to build), an analytic engine's model is not
            in the catalogue, or a profile is missing or malformed.
    """
    if isinstance(spec, OpenAIEngineSpec):
        raise ValueError(f"engine {spec.name}: kind openai is an endpoint; there is no engine to build")
    knobs = {**_knobs(spec), "seed": scenario.seed}
    if spec.kind == "paged":  # speculative decoding: the paged engine's own
        knobs.update({n: getattr(spec, n) for n in ("speculative_model", "num_speculative_tokens",
                                                    "prompt_lookup_min", "prompt_lookup_max")})
    if spec.kind in ("paged", "static"):
        return EngineConfig(kind=spec.kind, model=model_dir, device=spec.device, tp=spec.tp,
                            attention_backend=spec.attention_backend, linear_backend=spec.linear_backend, step_delay_s=spec.test_step_delay_s or 0.0,
                            **knobs)
    assert isinstance(spec, SimEngineSpec)
    reserve = spec.activation_reserve_gib * GIB if spec.activation_reserve_gib is not None else None
    sim = dict(kind="sim", policy=spec.policy, gpu_memory_utilization=spec.gpu_memory_utilization,
               activation_reserve_bytes=reserve, **knobs)
    if spec.cost_model == ANALYTIC:
        return EngineConfig(model=catalog_model_name(scenario, spec), hardware=spec.hardware, tp=spec.tp,
                            kv_cache_dtype=spec.kv_cache_dtype,
                            efficiency=spec.efficiency, speculative_model=spec.speculative_model,
                            num_speculative_tokens=spec.num_speculative_tokens,
                            spec_acceptance_rate=spec.spec_acceptance_rate, **sim)
    cm = cost_model or load_cost_model(scenario, spec, model_dir)[0]
    if spec.speculative_model is not None:  # the real paged engine's speculation, simulated
        sim.update(speculative_model=spec.speculative_model, num_speculative_tokens=spec.num_speculative_tokens,
                   spec_acceptance_rate=spec.spec_acceptance_rate)
    return EngineConfig(model=spec.model, model_config=model_cfg, cost_model=cm, step_noise=spec.step_noise, **sim)


def cluster_configs(scenario: Scenario, model_dir: Path | None, model_cfg: ModelConfig | None,
                    cost_models: dict[str, CostModel]) -> list[tuple[str, EngineConfig, int]]:
    """``(engine name, EngineConfig, count)`` of each replica group of ``scenario.cluster``; ``cost_models``:
    the measured cost models by engine name (analytic engines need none).

    Raises:
        ValueError: as :func:`engine_config`.
    """
    return [(r.engine, engine_config(scenario, scenario.engine(r.engine), model_dir, model_cfg,
                                     cost_models.get(r.engine)), r.count) for r in scenario.cluster.replicas]


def cluster_twin_configs(scenario: Scenario, model_dir: Path | None, model_cfg: ModelConfig | None,
                         cost_models: dict[str, CostModel],
                         echo: Callable[[str], None] | None = None) -> list[tuple[str, EngineConfig, int]] | None:
    """The sim twin of a real cluster (``scenario.cluster.twin``) as one replica group of as many replicas as
    the real cluster has; None without a twin. ``echo`` gets a warning when the twin's measured profile ran
    another torch thread count than a real replica's (1).

    Raises:
        ValueError: as :func:`engine_config`.
    """
    cl = scenario.cluster
    if cl is None or cl.twin is None:
        return None
    cm = cost_models.get(cl.twin)
    threads = (cm.fingerprint or {}).get("threads") if cm is not None else None
    if echo and threads not in (None, 1):
        echo(f"cluster.twin {cl.twin}: its profile was measured with {threads} torch threads, a real replica "
             "runs with 1 (set WORKBENCH_THREADS=1 so that cost_model auto measures the 1-thread profile)")
    cfg = engine_config(scenario, scenario.engine(cl.twin), model_dir, model_cfg, cm)
    return [(cl.twin, cfg, cl.num_replicas)]


def run_engine(scenario: Scenario, spec: EngineSpec, model_dir: Path, model_cfg: ModelConfig, trace, eos,
               on_output: Callable | None = None, runtime: dict | None = None, cost_model: CostModel | None = None,
               probe: bool = False, launch_pool=None, out_dir: Path | None = None):
    """Replay the trace on one engine; returns ``(outputs, steps)``. For a real engine, ``runtime`` (if
    given) gets where it ran: ``device`` (e.g. ``cpu``, ``cuda:0``), ``device_name`` and ``attention``
    (the kernels picked: ``cpp``, ``torch`` or ``triton``), and with ``probe`` the machine probes timed just
    before and just after the replay and the pilot probes between its steps (the replay clock stopped):
    ``probe: {gemm_gflops, steps}`` (``engines.sim.profiler.gemm_probe``, ``speed_probe``, ``PilotProbe``).
    ``cost_model``: a sim engine's measured cost model (default: :func:`load_cost_model`).
    ``trace.max_concurrency`` (closed-loop users) applies to every kind.
    A kind openai engine with a ``launch`` block has its server started first (``workbench.launch``): in
    ``launch_pool`` when given (which keeps it for the next engine that needs the same server) unless its
    ``reuse`` is false, else for this replay only; its log goes under ``out_dir`` (default: the current folder), and ``runtime["server"]`` gets
    the command and the seconds it took to be ready.

    Raises:
        workbench.launch.LaunchError: a launched server exits or is not ready in time (one line)."""
    users = scenario.trace.max_concurrency
    if spec.kind == "openai" and spec.launch is not None:
        from workbench.launch import LaunchPool, plan_for

        plan = plan_for(spec.name, spec.launch, spec.base_url, out_dir or Path.cwd(), users)
        pool = launch_pool if launch_pool is not None else LaunchPool()
        fresh = launch_pool is None or not spec.launch.reuse
        if fresh:
            pool.close()  # whatever it kept: one server at a time, nothing cached carries over
        try:
            server = pool.ensure(plan)
            if runtime is not None:
                runtime["server"] = {"command": plan.argv, "env": plan.env, "ready_s": server.started_s,
                                     "log_file": str(plan.log_file)}
            unlaunched = spec.model_copy(update={"launch": None})
            return run_engine(scenario, unlaunched, model_dir, model_cfg, trace, eos, on_output, runtime,
                              cost_model, probe)
        finally:
            if fresh:
                pool.close()
    if spec.kind == "openai":  # the outputs carry .server_metrics; no engine steps client-side
        from workbench.openai_replay import replay_openai

        tokenizer = None
        if spec.endpoint == "chat":  # chat prompts are text: the trace's, or its token ids decoded
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return replay_openai(spec.base_url, spec.model or scenario.model, trace, api_key=openai_api_key(spec),
                             on_output=on_output, engine_name=spec.name, max_concurrency=users,
                             endpoint=spec.endpoint, itl_mode=spec.itl_mode, tokenizer=tokenizer), []
    requests = make_requests(trace, eos)
    engine = build_engine(engine_config(scenario, spec, model_dir, model_cfg, cost_model))
    if spec.kind == "sim":
        return replay_simulated(engine, requests, on_output, max_concurrency=users), engine.steps
    if runtime is not None:
        runtime.update(engine_runtime(engine))
    try:
        pilot = None
        if probe and runtime is not None:  # before warm_up: the probe's steps write KV blocks no request holds
            from engines.sim.profiler import PilotProbe, gemm_probe, speed_probe

            runtime["probe"] = {"gemm_gflops": gemm_probe(), "steps": speed_probe(engine.executor, phase="before")}
            pilot = PilotProbe(engine.executor)
        warm_up(engine)
        outs = replay_realtime(engine, requests, on_output, max_concurrency=users, pilot=pilot)
        if pilot is not None:  # and after it (the engine is done with its KV blocks)
            runtime["probe"]["steps"] += pilot.records + speed_probe(engine.executor, phase="after")
        return outs, engine.steps
    finally:
        del engine
        gc.collect()


def engine_runtime(engine) -> dict:
    """What a real engine's model ran on and with: ``device``, ``device_name``, ``dtype`` (the element type
    that ran, after ``auto``), the ``attention`` and ``linear`` (GEMM) kernels, the CPU's ``isa`` flags
    (``engines.real.cpu_features.ISA_FLAGS``: avx2, avx512f, avx512_bf16, amx_bf16, amx_int8, ...),
    ``weight_dtype`` (``fp32``, ``bf16``, ``int8``, ``int4``), ``weight_bytes`` (the weights as stored,
    quantization scales included: ``LlamaModel.weight_bytes``) and ``kv_cache_bytes`` (the KV pool as
    allocated, its padding block included)."""
    import torch

    model = engine.executor.model
    dev = model.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return {"device": str(dev), "device_name": name, "dtype": str(model.dtype).removeprefix("torch."),
            "attention": model.attention.name, "linear": model.linear_backend, "isa": list(cpu_flags()),
            "weight_dtype": model.weight_dtype, "weight_bytes": model.weight_bytes(),
            "kv_cache_bytes": engine.executor.kv.nbytes}


def openai_api_key(spec: OpenAIEngineSpec) -> str | None:
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
    """A ``kind: openai`` engine's /metrics deltas (``server_metrics``, None when not served);
    the server's preemption count replaces the client-side 0."""
    sm = getattr(outs, "server_metrics", None)
    summary["server_metrics"] = sm
    if sm and "vllm:num_preemptions_total" in sm["delta"]:
        summary["num_preemptions"] = int(sm["delta"]["vllm:num_preemptions_total"])


DRIFT_MARGIN = 0.01  # rescale a sim engine's profile when the machine probes differ from it by more
# (about the precision of the probes' geometric mean: 7 steps before and after each run, 3 runs timed each)
DRIFT_MAX = 1.5  # ... but not past this factor either way: that is a profile of another machine, not drift


# Where a run has pilot probes, large steps are rescaled by the pilots' ratio alone and small steps by the
# pilots' and the end probes' timings pooled (every timing one sample; the ends' are medians of three): the 4-row
# pilot's single timings are off their run's mean by a median 9% (p90 26%), and over 23 sim engines of ten runs on
# a 2-core AMD EPYC (AVX-512) the pooled ratio came nearer the twin's own small-step speed, mean
# |log(factor / twin's speed)| 0.038 against the pilots' 0.053 (rms 0.046 against 0.065;
# benchmarks/drift_rules.py); for large steps the pilots alone came nearer (0.017 against pooled 0.022)
POOLED_CLASSES = ("small",)


def twin_of(name: str, policy: str, engines: dict) -> str | None:
    """A sim engine's real counterpart: the real engine named like it without the ``sim-`` prefix
    (``sim-paged-nocache`` -> ``paged-nocache``) when there is one of the same policy, else the first real
    engine of the same policy (None: none)."""
    twin = engines.get(name.removeprefix("sim-"))
    if twin is not None and twin["kind"] == policy:
        return name.removeprefix("sim-")
    return next((n for n, r in engines.items() if r["kind"] == policy), None)


def agreed_factor(before: float | None, after: float | None, overall: float | None) -> float:
    """The drift factor of one class of probe steps: the machine's speed ratio (measured / profile) that the
    probes before and after the real runs agree on. Both beyond :data:`DRIFT_MARGIN` on the same side: the
    one nearer 1 (the machine was at least that much off at both ends of the runs); on opposite sides, or
    either within the margin: 1 (not rescaled: a 2-core VM's speed swings by 20-30% within a minute, and a
    few seconds of probes at one end of a run say little about the run). Probes of one phase only (no
    ``phase``): ``overall`` where it is beyond the margin."""
    def off(x):
        return x is not None and abs(x - 1.0) > DRIFT_MARGIN

    if before is None or after is None:
        return overall if off(overall) else 1.0
    if off(before) and off(after) and (before > 1.0) == (after > 1.0):
        return min(before, after, key=lambda x: abs(math.log(x)))
    return 1.0


def during_factor(during: float) -> float:
    """The drift factor of one class of probe steps from the pilot probes timed between the real runs' own
    steps (``engines.sim.profiler.PilotProbe``): their speed ratio where it is beyond :data:`DRIFT_MARGIN`,
    else 1. They sample the phases of the machine the runs were in, which probes at the two ends of a run can
    both miss."""
    return during if abs(during - 1.0) > DRIFT_MARGIN else 1.0


def drift(cm: CostModel, probes: list[dict], source: str | None = None) -> dict:
    """``drift`` of a sim engine's profile against machine probes (``source``: the real engine whose runs
    they came before and after, the sim engine's twin when it has one): ``speed_ratio`` = geometric mean of
    measured / reference (``engines.sim.profiler.probe_reference``: the profile's own timing of the probe
    step, ``reference: baseline``, else its prediction) over every probe step of those runs, and the same
    over the small (memory-bound) and the large (compute-bound) probe steps apart (``speed_ratio_small``,
    ``speed_ratio_large``; ``engines.sim.profiler.probe_ratios``), and each apart for the probes ``before``
    and ``after`` the runs, and ``during`` them (the pilot probes between the runs' own steps; ``n_pilots``
    timings; not in the three ratios above), and ``pooled``: the same over every probe timing of the three
    phases. The factors applied (``scale_small``, ``scale_large``) are, for a class with pilot probes,
    :func:`during_factor` of its reading: the pooled ratio for small steps, the pilots' alone for large ones
    (:data:`POOLED_CLASSES`); else those that the probes before and after agree on (:func:`agreed_factor`);
    ``rescaled`` when either is not 1, unless a ratio is beyond :data:`DRIFT_MAX` either way (``beyond_max``: the
    profile does not describe this machine; it is left as it is and the run says so). A step of more tokens than
    the large pilot takes ``scale_large`` raised to ``engines.sim.cost_model.pilot_elasticity``
    (``pilot_elasticity``: its knots)."""
    from engines.sim.profiler import probe_reference, probe_ratios

    steps = [p for run in probes for p in run["steps"]]
    r = probe_ratios(cm, [p for p in steps if p.get("phase") != "during"])
    phases = {ph: probe_ratios(cm, [p for p in steps if p.get("phase") == ph]) for ph in ("before", "after", "during")}
    pooled = probe_ratios(cm, steps)
    reading = {c: pooled[c] if c in POOLED_CLASSES else phases["during"][c] for c in ("small", "large")}
    scale = {c: during_factor(reading[c]) if phases["during"][c] is not None
             else agreed_factor(phases["before"][c], phases["after"][c], r[c]) for c in ("small", "large")}
    parts = [x for x in (r["small"], r["large"], phases["during"]["small"], phases["during"]["large"]) if x is not None]
    beyond = any(not 1 / DRIFT_MAX <= x <= DRIFT_MAX for x in parts)
    rescaled = any(f != 1.0 for f in scale.values()) and not beyond
    return {"speed_ratio": r["all"], "speed_ratio_small": r["small"], "speed_ratio_large": r["large"],
            "before": phases["before"], "after": phases["after"], "during": phases["during"], "pooled": pooled,
            "n_pilots": sum(p.get("phase") == "during" for p in steps),
            "scale_small": scale["small"] if rescaled else 1.0, "scale_large": scale["large"] if rescaled else 1.0,
            "reference": "baseline" if cm.probe_baseline else "prediction",
            "pilot_elasticity": {"full_tokens": PILOT_LARGE_TOKENS, "floor_tokens": PILOT_ELASTICITY_FLOOR_TOKENS,
                                 "floor": PILOT_ELASTICITY_FLOOR},
            "margin": DRIFT_MARGIN, "max": DRIFT_MAX, "rescaled": rescaled, "probes_of": source,
            "beyond_max": beyond, "n_probe_runs": len(probes),
            "probes": [{"gemm_gflops": run["gemm_gflops"],
                        "steps": [{"features": {k: v for k, v in p["features"].items() if v and k != "const"},
                                   "phase": p.get("phase", ""), "seconds": p["seconds"],
                                   **({"at": p["at"]} if "at" in p else {}),
                                   "reference": probe_reference(cm, p), "predicted": cm.predict_exec(p["features"])}
                                  for p in run["steps"]]} for run in probes]}


def slowed_cost_model(cm: CostModel, change: float) -> CostModel:
    """A copy of ``cm`` whose every prediction (executor and overhead, drift factors included) is
    ``1 + change`` times as long."""
    large = cm.speed_scale_large if cm.speed_scale_large is not None else cm.speed_scale
    return dataclasses.replace(cm, speed_scale=cm.speed_scale * (1 + change), speed_scale_large=large * (1 + change))


def add_sim_errors(results: dict, per_engine: dict, cost_models: dict, slowed: dict | None = None,
                   matched: dict | None = None) -> None:
    """Give each sim engine ``summary.sim_error`` against its real twin (:func:`twin_of`):
    ``workbench.fidelity.sim_error``; the step level needs the sim engine's measured cost model (an analytic
    one simulates another machine: step, request and distribution errors against this one mean nothing, so
    it gets none). ``slowed``: sim engine -> its per-seed summaries with every step slower by
    ``SENSITIVITY_STEP`` (``sim_error.sensitivity``). ``matched``: sim engine -> (speed, per-seed (summary,
    outputs), the cost model at that speed) of its run at its twin's own measured speed, or None
    (``sim_error.speed_matched``)."""
    from workbench.fidelity import sensitivity, sim_error, speed_matched_errors

    engines = results["engines"]
    for name, e in engines.items():
        if e["kind"] != "sim" or name not in cost_models:
            continue
        real = twin_of(name, e["config"].get("policy") or "paged", engines)
        if real is None:
            continue
        runs = per_engine[real]
        e["summary"]["sim_error"] = sim_error(
            cost_models[name], e["summary"], [r[1] for r in per_engine[name]], real, engines[real]["summary"],
            [r[1] for r in runs], [r[2] for r in runs])
        if slowed and name in slowed:
            e["summary"]["sim_error"]["sensitivity"] = sensitivity([r[0] for r in per_engine[name]], slowed[name])
        if matched and matched.get(name):
            speed, at_speed, cm_at_speed = matched[name]
            summ = at_speed[0][0] if len(at_speed) == 1 else mean_summary([r[0] for r in at_speed])
            e["summary"]["sim_error"]["speed_matched"] = speed_matched_errors(
                speed, summ, [r[1] for r in at_speed], engines[real]["summary"], [r[1] for r in runs],
                cm_at_speed, [st for r in runs for st in r[2]])


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "numpy", "pandas", "llm-serving-workbench"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def run_scenario(scenario: Scenario, out_dir: Path, progress=None, plots: bool = True, repeat: int = 1,
                 echo: Callable[[str], None] | None = None, sensitivity: bool = False) -> dict:
    """Run every engine of the scenario, write ``results.json``, per-engine CSVs, PNGs and ``report.html``
    into ``out_dir``; returns the results dict. With a ``cluster`` section, its what-if runs after the engines
    (``workbench.cluster``: results.json ``cluster``, ``cluster-<router>/requests.csv``).

    ``progress`` (optional) is called as ``progress(engine_name, kind, total)`` and must return a
    callback taking each ``RequestOutput``. ``plots=False`` (sweep points) skips the PNGs and report.html.
    ``repeat`` runs the real engines that many times, interleaved (paged, static, paged, static, ...), and
    reports each summary number's mean plus ``summary.repeats`` (spread); a sim engine with step noise runs as
    many times with noise seeds ``seed + i``, one without runs once (it is deterministic). With ``trace.load`` the engines' saturation capacities are probed first (once) and the
    trace is rescaled to the offered load; ``echo`` (optional) gets a line about each probe. ``sensitivity``
    runs each sim engine that has a real twin again with every step 5% slower, same seeds, and reports how
    far each figure moves (``sim_error.sensitivity``: how precise the step times must be for each bound), and
    once more at the speed its twin's own steps ran (``sim_error.speed_matched``: the error left when the
    machine's drift is taken out).

    Raises:
        ValueError: ``repeat`` < 1, a capacity probe in which nothing finished, or a bad trace/engine setting.
    """
    from transformers import AutoTokenizer

    from engines.real.model_store import resolve_model

    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    model_dir = resolve_model(scenario.model)
    model_cfg = ModelConfig.from_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    from workbench.traces import LoadStats

    load_stats = LoadStats()
    trace = load_scenario_trace(scenario, tok, vocab_lo=100, vocab_hi=min(model_cfg.vocab_size, 49000),
                                stats=load_stats)
    if echo:
        for note in load_stats.notes():
            echo(f"trace: {note}")
    eos = model_cfg.eos_token_ids or None
    slo = scenario.slo.model_dump() if scenario.slo else None
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "scenario": scenario.model_dump(mode="json"),
        "scenario_hash": scenario_hash(scenario),
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "versions": _versions(),
        "machine": machine_info(),
        "num_requests": len(trace),
        "trace_load": load_stats.to_dict(),
        "formulas": {**FORMULAS, **FIDELITY_FORMULAS},
        "engines": {},
    }
    sims = [spec for spec in scenario.engines if spec.kind == "sim"]
    # calibrate first (cost_model auto measures this machine's profile once), so that probes and sims share it
    measured = {spec.name: load_cost_model(scenario, spec, model_dir, echo) for spec in sims
                if spec.cost_model != ANALYTIC}
    if measured:
        results["profile"] = next(iter(measured.values()))[1]
    if scenario.trace.load is not None:
        trace, results["load"], results["capacity"] = probe_load(scenario, trace, model_dir, model_cfg, eos, echo,
                                                                 {n: m[0] for n, m in measured.items()})
    per_engine: dict[str, list] = {spec.name: [] for spec in scenario.engines}

    def run_one(spec, label, cost_model=None, sc=scenario):
        cb = progress(label, spec.kind, len(trace)) if progress else None
        runtime: dict = {}
        outs, steps = run_engine(sc, spec, model_dir, model_cfg, trace, eos, cb, runtime, cost_model,
                                 probe=spec.kind in ("paged", "static"), launch_pool=pool, out_dir=out_dir)
        summary = summarize(outs, steps, len(trace), slo)
        if spec.policy_name == "paged":  # the trace's reuse under an unlimited cache
            ideal = ideal_prefix_hit_rate([t.prompt_token_ids for t in trace], spec.block_size)
            summary["prefix_cache_ideal_hit_rate"] = ideal["hit_rate"]
        if spec.kind == "openai":
            add_openai_server_metrics(summary, outs)
        per_engine[spec.name].append((summary, outs, steps, runtime))

    reals = [spec for spec in scenario.engines if spec.kind != "sim"]
    from workbench.launch import held_pool

    with held_pool() as pool:  # launched servers: one at a time, stopped when the real engines are done
        mark = len(pool.launches)  # a sweep's pool lists its earlier points' launches too
        for rep in range(repeat):  # real engines first, interleaved, then the simulator against their probes
            for spec in reals:
                run_one(spec, spec.name + (f" #{rep + 1}" if repeat > 1 else ""))
        if pool.launches[mark:]:
            results["launches"] = pool.launches[mark:]
    def probes_of(names):
        return [r[3]["probe"] for n in names for r in per_engine[n] if "probe" in r[3]]

    all_probes, kinds = probes_of([s.name for s in reals]), {s.name: {"kind": s.kind} for s in reals}
    drifts, slowed, matched = {}, {}, {}

    def speed_matched_run(spec, cm, twin_steps, runs):
        """The sim engine at its twin's own measured speed (``sim_error.speed_matched``): the speed, the
        per-seed (summary, outputs) and the cost model at that speed, or None when the twin ran no step to take
        a speed from."""
        from workbench.fidelity import twin_speed

        speed = twin_speed(cm, twin_steps)
        if speed["scale_small"] is None and speed["scale_large"] is None:
            return None
        small = speed["scale_small"] if speed["scale_small"] is not None else cm.speed_scale
        large = speed["scale_large"] if speed["scale_large"] is not None else (
            cm.speed_scale_large if cm.speed_scale_large is not None else cm.speed_scale)
        at_speed = dataclasses.replace(cm, speed_scale=small, speed_scale_large=large, speed_elastic=False)
        out = []
        for rep in range(runs):
            sc = scenario.model_copy(update={"seed": scenario.seed + rep})
            outs, steps = run_engine(sc, spec, model_dir, model_cfg, trace, eos, cost_model=at_speed,
                                     launch_pool=pool, out_dir=out_dir)
            out.append((summarize(outs, steps, len(trace), slo), outs))
        return speed, out, at_speed

    for spec in sims:
        cm = None
        if spec.name in measured:
            cm = measured[spec.name][0]
            # the machine's speed while the sim engine's real twin ran (its own runs' probes), else all runs'
            twin = twin_of(spec.name, getattr(spec, "policy", None) or "paged", kinds)
            probes, source = (probes_of([twin]), twin) if twin else ([], None)
            if not probes:
                probes, source = all_probes, "all real engines"
            drifts[spec.name] = drift(cm, probes, source) if probes else None
            d = drifts[spec.name]
            if d and d["rescaled"]:
                cm.speed_scale, cm.speed_scale_large = d["scale_small"], d["scale_large"]
                cm.speed_elastic = True  # the probes' reading: steps past the pilot's size follow it only in part
                if echo:
                    echo(f"{spec.name}: the probes before and after the runs agree that this machine runs "
                         f"{cm.speed_scale:.3f}x (small steps) and {cm.speed_scale_large:.3f}x (large ones; past "
                         f"{PILOT_LARGE_TOKENS} tokens in part) the profile's "
                         f"times (margin {DRIFT_MARGIN:.0%}); predictions rescaled")
        # with step noise the simulator is one draw of a noisy machine too: as many runs as the real engines
        # had, noise seeds seed, seed + 1, ..., so that its means compare with theirs
        noisy = cm is not None and spec.step_noise and cm.noise_cv > 0
        for rep in range(repeat if noisy else 1):
            run_one(spec, spec.name + (f" #{rep + 1}" if repeat > 1 and noisy else ""), cm,
                    scenario.model_copy(update={"seed": scenario.seed + rep}))
        if sensitivity and cm is not None and twin:  # cm is set only where twin was looked up
            slow = slowed_cost_model(cm, SENSITIVITY_STEP)
            slowed[spec.name] = []
            for rep in range(repeat if noisy else 1):
                sc = scenario.model_copy(update={"seed": scenario.seed + rep})
                outs, steps = run_engine(sc, spec, model_dir, model_cfg, trace, eos, cost_model=slow, launch_pool=pool,
                                         out_dir=out_dir)
                slowed[spec.name].append(summarize(outs, steps, len(trace), slo))
            matched[spec.name] = speed_matched_run(spec, cm, [st for r in per_engine[twin] for st in r[2]],
                                                   repeat if noisy else 1)
    frames = {}
    for spec in scenario.engines:
        runs = per_engine[spec.name]
        summary = runs[0][0] if len(runs) == 1 else mean_summary([r[0] for r in runs])
        if len(runs) > 1:
            gemm = [r[3]["probe"]["gemm_gflops"] for r in runs if "probe" in r[3]]
            if gemm:
                summary["repeats"]["gemm_gflops"] = {"values": gemm, "mean": sum(gemm) / len(gemm),
                                                     "spread": (max(gemm) - min(gemm)) / (sum(gemm) / len(gemm))}
        runtime = {k: v for k, v in runs[0][3].items() if k != "probe"}
        cfg = spec.model_dump(mode="json", exclude_none=True)
        results["engines"][spec.name] = {"kind": spec.kind, "config": cfg, "summary": summary,
                                         **({"runtime": runtime} if runtime else {})}
        if spec.name in measured:
            results["engines"][spec.name]["profile"] = measured[spec.name][1]
            results["engines"][spec.name]["drift"] = drifts.get(spec.name)
        edir = out_dir / spec.name
        for i, (_, outs, steps, _) in enumerate(runs):
            rdir = edir if i == 0 else edir / f"repeat-{i + 1}"
            rdir.mkdir(parents=True, exist_ok=True)
            rf, sf = requests_frame(outs), steps_frame(steps)
            rf.to_csv(rdir / "requests.csv", index=False)
            sf.to_csv(rdir / "steps.csv", index=False)
            if i == 0:
                frames[spec.name] = (rf, sf)
    if drifts:
        results["drift"] = next((d for d in drifts.values() if d), None)
    add_sim_errors(results, per_engine, {n: m[0] for n, m in measured.items()}, slowed, matched)
    if scenario.cluster is not None:  # the cluster: the sim or real engines replicated behind each router
        from workbench.cluster import run_scenario_cluster

        cms = {n: m[0] for n, m in measured.items()}
        configs = cluster_configs(scenario, model_dir, model_cfg, cms)
        twin = cluster_twin_configs(scenario, model_dir, model_cfg, cms, echo)
        results["cluster"] = run_scenario_cluster(scenario, configs, trace, eos, out_dir, echo, twin)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    if not plots:
        return results
    plots = make_plots(results, frames)
    for name, png in plots.items():
        (out_dir / name).write_bytes(png)
    write_html(out_dir / "report.html", results, plots)
    return results


def machine_info() -> dict:
    """Where the run happened: platform, CPU model, logical CPUs, torch's CPU kernel level (``AVX2``,
    ``AVX512``...), its thread count and the C library allocator's setting (applied here if no real executor
    has applied it yet: :func:`engines.real.allocator.keep_freed_memory`); the figures of a run only mean
    something beside these."""
    import torch

    from engines.real.allocator import allocator_setting, keep_freed_memory

    keep_freed_memory()

    return {"platform": platform.platform(), "processor": cpu_name(), "cpus": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "isa": list(cpu_flags()),
            "native_bf16": native_bf16(), "torch_threads": torch.get_num_threads(), "allocator": allocator_setting()}


def probe_load(scenario: Scenario, trace, model_dir: Path, model_cfg: ModelConfig, eos,
               echo: Callable[[str], None] | None = None,
               cost_models: dict[str, CostModel] | None = None) -> tuple[list, dict, dict]:
    """Measure the saturation capacity of every engine that can be probed (kind paged, static, sim; the
    load's engine first) on one sample of the trace, then rescale the trace to ``factor`` x the load
    engine's capacity. Returns ``(trace, load, capacity)``: the ``results.json`` entries of the same names
    (see ``FORMULAS``). ``cost_models``: the sim engines' measured cost models by engine name.

    Raises:
        ValueError: nothing of a probe finished.
    """
    from workbench.load import METHOD, apply_load, measure_capacities, paged_static_ratios, probe_sample

    load = scenario.trace.load
    sample = probe_sample(trace, load.probe_requests)
    names = [load.engine] + [e.name for e in scenario.engines if e.kind != "openai" and e.name != load.engine]
    # the probe measures the engine, not the clients: all requests at once, no closed-loop cap
    probe_sc = scenario.model_copy(update={"trace": scenario.trace.model_copy(update={"max_concurrency": None})})

    def run(name: str, reqs) -> list:
        spec = scenario.engine(name)
        outs, _ = run_engine(probe_sc, spec, model_dir, model_cfg, reqs, eos,
                             cost_model=(cost_models or {}).get(name))
        if echo:
            finished = [o for o in outs if o.finished_time is not None]
            echo(f"capacity probe {name} ({spec.kind}): {len(reqs)} requests at once, "
                 f"{max((o.finished_time for o in finished), default=0.0):.1f} s")
        return outs

    caps = measure_capacities(run, names, sample)
    cap = caps[load.engine]["capacity_req_s"]
    trace, rates = apply_load(trace, cap, load.factor, scenario.seed)
    policies = {e.name: (e.policy_name, e.kind == "sim") for e in scenario.engines if e.name in caps}
    load_info = {"engine": load.engine, "factor": load.factor, "method": METHOD, "capacity_req_s": cap,
                 **rates, "probe_requests": len(sample)}
    capacity = {"method": METHOD, "probe_requests": len(sample), "engines": caps,
                "ratios": paged_static_ratios(caps, policies)}
    return trace, load_info, capacity


REPEAT_METRICS = ("output_throughput", "request_throughput", "total_token_throughput", "goodput", "duration_s",
                  "ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50", "tpot_ms.p99", "itl_ms.p50", "itl_ms.p99",
                  "e2el_ms.p50", "e2el_ms.p99", "kv_waste_frac", "num_preemptions")


def mean_summary(summaries: list[dict]) -> dict:
    """The mean of several runs' summaries (every number averaged; other values from the first run), with
    ``repeats: {n, metrics: {metric: {mean, std, min, max, spread, values}}}`` for :data:`REPEAT_METRICS`
    (spread = (max - min) / mean)
    (std with n - 1; 0 for one run)."""
    import statistics

    from workbench.results import metric_value

    def avg(vals):
        first = vals[0]
        if isinstance(first, dict):
            return {k: avg([v[k] for v in vals]) for k in first}
        if isinstance(first, (int, float)) and not isinstance(first, bool) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            return sum(vals) / len(vals)
        return first

    out = avg(summaries)
    spread = {}
    for m in REPEAT_METRICS:
        vals = [v for v in (metric_value(s, m) for s in summaries) if v is not None]
        if not vals:
            continue
        mean = sum(vals) / len(vals)
        spread[m] = {"mean": mean, "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                     "min": min(vals), "max": max(vals), "spread": (max(vals) - min(vals)) / mean if mean else 0.0,
                     "values": vals}
    out["repeats"] = {"n": len(summaries), "metrics": spread}
    return out
