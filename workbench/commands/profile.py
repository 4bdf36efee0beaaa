"""``workbench profile``: time real steps over a grid of batch shapes on this machine and fit the simulator's
cost model (``engines.sim.profiler``); writes the profile a sim engine's ``cost_model: auto`` reads here (or a
file a scenario can name)."""

from __future__ import annotations

from workbench.commands import set_torch_threads
from workbench.errors import UsageError


def main(model: str, out: str | None, dtype: str = "float32", quick: bool = False, repeats: int = 3,
         weight_dtype: str | None = None) -> None:
    """Profile, fit, save to ``out`` (default: this machine's cache entry); print the fit's errors.
    ``weight_dtype``: the real engine's linear weights (``fp32``, ``bf16``, ``int8``, ``int4``; None: the
    dense weights of ``dtype``); the model profiled is built with it, and the fingerprint records it.

    Raises:
        ModelNotFoundError: ``model`` is neither a known name nor a model folder.
        UsageError: ``dtype`` is not float32 or bfloat16, or ``weight_dtype`` is one the real engine cannot
            run in it.
    """
    from pathlib import Path

    from rich.progress import Progress

    from engines.core.config import real_weight_dtype_problem
    from engines.real.model_store import resolve_model
    from workbench.calibration import fingerprint, measure_profile, profile_path

    if dtype not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    problem = real_weight_dtype_problem(weight_dtype, dtype, "workbench profile (the real engine)")
    if problem:
        raise UsageError(f"--{problem.replace('_', '-', 1)}")
    set_torch_threads()
    model_dir = resolve_model(model)
    fp = fingerprint(model, model_dir, dtype, weight_dtype=weight_dtype)
    path = Path(out) if out else profile_path(fp)
    with Progress(transient=True) as prog:
        task = prog.add_task("profiling steps", total=None)
        cm = measure_profile(model_dir, fp, quick=quick, repeats=repeats,
                             progress=lambda i, n: prog.update(task, completed=i, total=n))
    path.parent.mkdir(parents=True, exist_ok=True)
    cm.save(path)
    fe = cm.fit_error
    print(cm.source)
    print(f"fit on {fe['n_points']} steps: mean {fe['fit_mean_abs_rel']:.1%}, max {fe['fit_max_abs_rel']:.1%}; "
          f"held out {fe['n_holdout']}: mean {fe['holdout_mean_abs_rel']:.1%}, max {fe['holdout_max_abs_rel']:.1%}; "
          f"step-to-step spread {cm.noise_cv:.1%}")
    if cm.noise_table:
        print("step-to-step spread by step size: " + ", ".join(f"{c:.1%} at {t:.0f} tokens" for t, c in cm.noise_table))
    print(f"engine overhead per step: {cm.overhead['const'] * 1e3:.3f} ms + {cm.overhead['per_seq'] * 1e6:.2f} us "
          "per sequence")
    print(path)
