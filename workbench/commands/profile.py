"""``workbench profile``: time real steps over a grid of batches on this machine and fit the simulator's
cost model (``engines.sim.profiler``); writes the profile JSON a sim engine's ``cost_model`` can name."""

from __future__ import annotations

import os

from workbench.commands import set_torch_threads


def main(model: str, out: str, quick: bool = False, repeats: int = 3, kv_cache_tokens: int = 65536) -> None:
    """Profile, fit, save to ``out``; print the coefficients and the held-out error.

    Raises:
        ModelNotFoundError: ``model`` is neither a known name nor a model folder.
    """
    from pathlib import Path

    import torch
    from rich.progress import Progress

    from engines.real.model import LlamaModel
    from engines.real.model_runner import ModelExecutor
    from engines.real.model_store import resolve_model
    from engines.sim.profiler import QUICK_GRID, fit_with_holdout, profile_steps, profile_tables

    set_torch_threads()
    model_dir = resolve_model(model)
    ex = ModelExecutor(LlamaModel.from_dir(model_dir), kv_cache_tokens // 16, 16)
    source = f"workbench profile, {model}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    with Progress(transient=True) as prog:
        task = prog.add_task("profiling steps", total=None)
        cb = lambda i, n: prog.update(task, completed=i, total=n)  # noqa: E731
        if quick:
            cm = fit_with_holdout(profile_steps(ex, QUICK_GRID, repeats, cb), source=source)
        else:
            cm = profile_tables(ex, repeats, cb)
            cm.source = source
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    cm.save(Path(out))
    print("coefficients (seconds per unit): " + ", ".join(f"{k}={v:.3g}" for k, v in cm.coef.items()))
    fe = cm.fit_error
    print(f"held-out error on {fe['n_holdout']} of {fe['n_points']} points: mean {fe['holdout_mean_abs_rel']:.1%}, "
          f"max {fe['holdout_max_abs_rel']:.1%}")
    if cm.body_table:
        print(f"tables: model body at {len(cm.body_table)} token counts, LM head at {len(cm.lm_table)} row counts")
    print(out)
