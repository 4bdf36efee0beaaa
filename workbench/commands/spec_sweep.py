"""``workbench spec-sweep``: speculative-decoding what-if, the predicted per-request latency with and
without a draft model over batch sizes.

Each point simulates ``batch`` requests arriving together (prompt ``prompt_tokens``, exactly
``output_tokens`` outputs) on the paged policy with ``max_num_seqs = batch``, once on the plain
target and once with speculative decoding; latency is the mean E2EL of the batch.
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


def main(model: str = "llama-3.1-70b", draft: str = "qwen2.5-0.5b", hardware: str = "h100-sxm", tp: int = 4,
         k: int = 5, acceptance: float = 0.7, batches: str = "1,2,4,8,16,32,64,128", prompt_tokens: int = 512,
         output_tokens: int = 256, out: str = "reports/runs/spec-decode") -> None:
    """Run :func:`spec_sweep`, write ``spec_sweep.csv`` and ``spec_sweep.png`` into ``out``, print the table.

    Raises:
        UsageError: bad ``batches`` (``CatalogError``, unknown names or a deployment that does not fit, is
            printed by the CLI as it is).
    """
    bs = parse_batches(batches)
    rows = spec_sweep(model, draft, hardware, tp, k, acceptance, bs, prompt_tokens, output_tokens)
    title = (f"{model} on {tp} x {hardware}, draft {draft}, k={k}, acceptance {acceptance}, "
             f"prompt {prompt_tokens}, output {output_tokens}")
    csv, png = write_sweep(rows, Path(out), title)
    print(title)
    print("batch  e2el_s  e2el_spec_s  speedup")
    for r in rows:
        print(f"{r['batch']:5d}  {r['e2el_s']:6.2f}  {r['e2el_spec_s']:11.2f}  {r['speedup']:6.2f}x")
    print(f"{csv}\n{png}")
