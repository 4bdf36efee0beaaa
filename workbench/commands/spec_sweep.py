"""``workbench spec-sweep``: speculative-decoding what-if, the predicted per-request latency with and
without a draft model over batch sizes.

Each point simulates ``batch`` requests arriving together (prompt ``prompt_tokens``, exactly
``output_tokens`` outputs) on the paged policy with ``max_num_seqs = batch``, once on the plain
target and once with speculative decoding; latency is the mean E2EL of the batch.

Two modes:

* GPU what-if (default): the analytic roofline cost model of ``model`` on ``tp`` x ``hardware`` with a
  catalogue ``draft`` model (``engines.sim.spec_decode.SpecDecodeExecutor``).
* This machine (``profile``: ``auto``, this machine's measured profile of ``model``, measured once and cached
  by ``workbench.calibration``; or a profile JSON): the real paged engine's own speculative path with
  placeholder drafts (``engines.sim.spec_decode.PagedSpecExecutor``): ``draft`` is ``ngram`` (default) or
  ``layers:N``, ``acceptance`` the per-token acceptance rate measured on the real engine (e.g. by
  ``benchmarks/spec_decode.py``), ``draft_rate`` the share of decode rows that get drafts.
"""

from __future__ import annotations

from pathlib import Path

from engines.core.request import Request
from engines.core.sampling_params import SamplingParams
from engines.factory import build_whatif_engine
from engines.sim.analytic_cost_model import AnalyticCostModel, SpecDecodeConfig
from engines.sim.catalog import get_hardware, get_model
from engines.sim.simulator import simulate
from workbench.errors import UsageError

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def _mean_e2el(cm: AnalyticCostModel, batch: int, prompt_tokens: int, output_tokens: int, seed: int) -> tuple[float, float]:
    eng = build_whatif_engine("paged", cm, cm.model.to_model_config(), max_num_seqs=batch,
                              max_num_batched_tokens=max(2048, prompt_tokens * batch),
                              max_model_len=prompt_tokens + output_tokens, seed=seed)
    # distinct prompts: identical ones would hit the prefix cache and shrink the prefill cost
    reqs = [Request(str(i), [1 + (i * prompt_tokens + j) % 30000 for j in range(prompt_tokens)],
                    SamplingParams(max_tokens=output_tokens, ignore_eos=True))
            for i in range(batch)]
    outs = simulate(eng, reqs)
    e2el = [o.finished_time - o.arrival_time for o in outs]
    steps = [s for s in eng.steps if s.num_decode_tokens]
    return sum(e2el) / len(e2el), len(steps)


def spec_sweep(model: str = "llama-3.1-70b", draft: str = "qwen2.5-0.5b", hardware: str = "h100-sxm", tp: int = 4,
               k: int = 5, acceptance_rate: float = 0.7, batches=DEFAULT_BATCHES, prompt_tokens: int = 512,
               output_tokens: int = 256, seed: int = 0) -> list[dict]:
    """One row per batch size: mean E2EL (s) without and with speculative decoding, and their ratio.

    Raises:
        CatalogError: unknown names, or the deployment does not fit.
    """
    m, hw = get_model(model), get_hardware(hardware)
    base = AnalyticCostModel(m, hw, tp)
    spec = AnalyticCostModel(m, hw, tp, spec=SpecDecodeConfig(get_model(draft), k, acceptance_rate))
    rows = []
    for b in batches:
        t0, s0 = _mean_e2el(base, b, prompt_tokens, output_tokens, seed)
        t1, s1 = _mean_e2el(spec, b, prompt_tokens, output_tokens, seed)
        rows.append({"batch": b, "e2el_s": t0, "e2el_spec_s": t1, "speedup": t0 / t1, "decode_steps": s0,
                     "decode_steps_spec": s1, "tokens_per_step_expected": spec.spec.expected_tokens_per_step})
    return rows


def write_sweep(rows: list[dict], out_dir: Path, title: str) -> tuple[Path, Path]:
    """``spec_sweep.csv`` and ``spec_sweep.png`` (speedup and latencies against batch size) in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    csv = out_dir / "spec_sweep.csv"
    df.to_csv(csv, index=False)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(df.batch, df.e2el_s, "o-", label="target only")
    a1.plot(df.batch, df.e2el_spec_s, "s-", label="with draft")
    a1.set(xscale="log", xlabel="batch size (concurrent requests)", ylabel="mean E2EL (s)")
    a1.legend()
    a2.plot(df.batch, df.speedup, "o-")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set(xscale="log", xlabel="batch size (concurrent requests)", ylabel="latency speedup (x)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    png = out_dir / "spec_sweep.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return csv, png


def spec_sweep_profile(model: str = "smollm2-135m", profile: str = "auto", draft: str = "ngram", k: int = 4,
                       acceptance: float = 0.7, batches=DEFAULT_BATCHES, prompt_tokens: int = 512,
                       output_tokens: int = 256, seed: int = 0, draft_rate: float = 1.0,
                       cost_model=None) -> list[dict]:
    """As :func:`spec_sweep`, on a measured profile of this machine (``profile``: ``auto`` or a profile JSON;
    ``cost_model``: a ``CostModel`` to use instead) simulating the real engine's ``model`` with
    ``draft`` = ``ngram`` or ``layers:N``. Rows add ``draft_time_s`` (seconds of ``layers:N`` draft passes).

    Raises:
        UsageError: ``model`` is no model the real engine runs, or a bad profile, draft, k or rate (one line).
    """
    from engines.core.config import ModelConfig
    from engines.real.model_store import ModelNotFoundError, resolve_model
    from engines.sim.cost_model import CostModel
    from engines.sim.spec_decode import SimSpecDecode

    try:
        model_dir = resolve_model(model)
    except ModelNotFoundError as e:
        raise UsageError(f"--profile simulates a model the real engine runs: {e}") from None
    mc = ModelConfig.from_dir(model_dir)
    if cost_model is None:
        try:
            if profile == "auto":
                from workbench.calibration import ensure_profile

                cost_model, _ = ensure_profile(model, model_dir, "float32", echo=print)
            else:
                cost_model = CostModel.load(profile)
        except ValueError as e:
            raise UsageError(str(e)) from None
    try:
        sp = SimSpecDecode.build(draft, k, acceptance, mc.num_hidden_layers, draft_rate)
    except ValueError as e:
        raise UsageError(str(e)) from None
    rows = []
    for b in batches:
        knobs = dict(kind="sim", cost_model=cost_model, model_config=mc, max_num_seqs=b, step_noise=False,
                     max_num_batched_tokens=max(2048, prompt_tokens * b), max_model_len=prompt_tokens + output_tokens,
                     kv_cache_tokens=b * (prompt_tokens + output_tokens) + 1024, seed=seed)
        t0, s0, _ = _measured_e2el(knobs, b, prompt_tokens, output_tokens)
        t1, s1, eng = _measured_e2el(dict(knobs, speculative_model=draft, num_speculative_tokens=k,
                                          spec_acceptance_rate=acceptance, spec_draft_rate=draft_rate),
                                     b, prompt_tokens, output_tokens)
        rows.append({"batch": b, "e2el_s": t0, "e2el_spec_s": t1, "speedup": t0 / t1, "decode_steps": s0,
                     "decode_steps_spec": s1, "tokens_per_step_expected": sp.expected_tokens_per_verify(),
                     "draft_time_s": eng.executor.draft_time})
    return rows


def _measured_e2el(knobs: dict, batch: int, prompt_tokens: int, output_tokens: int):
    """Mean E2EL (s), steps that decoded (plain decode rows or verify rows) and the engine, on a measured sim."""
    from engines.factory import EngineConfig, build_engine

    try:
        eng = build_engine(EngineConfig(**knobs))
    except ValueError as e:
        raise UsageError(str(e)) from None
    reqs = [Request(str(i), [1 + (i * prompt_tokens + j) % 30000 for j in range(prompt_tokens)],
                    SamplingParams(max_tokens=output_tokens, ignore_eos=True))
            for i in range(batch)]
    outs = simulate(eng, reqs)
    e2el = [o.finished_time - o.arrival_time for o in outs]
    steps = [s for s in eng.steps if s.num_decode_tokens or s.spec_drafts]
    return sum(e2el) / len(e2el), len(steps), eng


def parse_batches(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``.

    Raises:
        UsageError: not comma-separated positive integers.
    """
    try:
        bs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        bs = []
    if not bs or min(bs) < 1:
        raise UsageError(f"--batches must be comma-separated positive integers, got {text!r}")
    return bs


def main(model: str = "llama-3.1-70b", draft: str | None = None, hardware: str = "h100-sxm", tp: int = 4,
         k: int = 5, acceptance: float = 0.7, batches: str = "1,2,4,8,16,32,64,128", prompt_tokens: int = 512,
         output_tokens: int = 256, out: str = "reports/runs/spec-decode", profile: str | None = None,
         draft_rate: float = 1.0) -> None:
    """Run :func:`spec_sweep` (or, with ``profile``, :func:`spec_sweep_profile`), write ``spec_sweep.csv`` and
    ``spec_sweep.png`` into ``out``, print the table. ``draft`` defaults to ``qwen2.5-0.5b`` (GPU what-if) or
    ``ngram`` (``profile``).

    Raises:
        UsageError: bad ``batches``, or in profile mode a bad model, profile, draft or rate
            (``CatalogError``, unknown names or a deployment that does not fit, is printed by the CLI as it is).
    """
    bs = parse_batches(batches)
    if profile is not None:
        draft = draft or "ngram"
        rows = spec_sweep_profile(model, profile, draft, k, acceptance, bs, prompt_tokens, output_tokens,
                                  draft_rate=draft_rate)
        title = (f"{model} on this machine's profile ({profile}), draft {draft}, k={k}, acceptance {acceptance}, "
                 f"draft rate {draft_rate}, prompt {prompt_tokens}, output {output_tokens}")
    else:
        if draft_rate != 1.0:
            raise UsageError("--draft-rate is for --profile (the analytic model drafts every decode row)")
        draft = draft or "qwen2.5-0.5b"
        rows = spec_sweep(model, draft, hardware, tp, k, acceptance, bs, prompt_tokens, output_tokens)
        title = (f"{model} on {tp} x {hardware}, draft {draft}, k={k}, acceptance {acceptance}, "
                 f"prompt {prompt_tokens}, output {output_tokens}")
    csv, png = write_sweep(rows, Path(out), title)
    print(title)
    print("batch  e2el_s  e2el_spec_s  speedup")
    for r in rows:
        print(f"{r['batch']:5d}  {r['e2el_s']:6.2f}  {r['e2el_spec_s']:11.2f}  {r['speedup']:6.2f}x")
    print(f"{csv}\n{png}")
