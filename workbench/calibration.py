"""Per-machine calibration of the simulator: ``cost_model: auto`` finds or measures this machine's profile.

A profile is valid for one *fingerprint*: CPU model and ISA flags, torch's CPU kernel level, torch threads,
torch version, the model (name and a hash of its config), dtype, weight dtype (``fp32``, ``bf16``, ``int8``,
``int4``: the model, dtype and weight dtype must match, so a profile measured with fp32 weights is refused
for an int8 engine), attention and GEMM kernels, the engine's kernel version (``kernels``: the compiled kernel
source's hash and ``engines.real.ENGINE_SPEED_REVISION``) and the profile format (``engines.sim.cost_model.PROFILE_FORMAT``). Profiles
live in ``$WORKBENCH_CACHE/profiles/<model>-<key>.json`` (``key``: the first 16 hex digits of the
fingerprint's sha256); ``workbench profile`` writes the same files. Block size is a feature of the cost model
(each step's KV read), not of the fingerprint, so a block-size sweep calibrates once. A file lock makes
concurrent processes (sweep workers) measure a fingerprint once.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Callable

from engines.core.config import DENSE_WEIGHT_DTYPE, real_weight_dtype, real_weight_dtype_problem
from engines.real.cpu_features import cpu_flags, cpu_name
from engines.sim.cost_model import PROFILE_FORMAT, CostModel

# fingerprint fields that decide what computation was measured (a mismatch refuses the profile) ...
COMPUTATION_FIELDS = ("model", "model_config_sha256", "dtype", "weight_dtype")
# ... and the machine's (a mismatch warns: a profile of another machine predicts another speed)
MACHINE_FIELDS = ("cpu", "isa", "cpu_capability", "threads", "torch", "attention", "linear", "kernels",
                  "profile_format")


class ProfileMismatchError(ValueError):
    """A profile measured another computation (model, dtype or weight dtype) than the engine simulates."""


def target_threads() -> int:
    """The torch thread count the real engines run with: ``$WORKBENCH_PROFILE_THREADS`` (set by a sweep for its
    single-threaded simulator workers), else torch's current setting."""
    import torch

    return int(os.environ.get("WORKBENCH_PROFILE_THREADS") or torch.get_num_threads())


def fingerprint(model_name: str, model_dir: Path, dtype: str = "float32", attention: str | None = None,
                threads: int | None = None, weight_dtype: str | None = None) -> dict:
    """This machine's fingerprint for simulating ``model_dir`` in ``dtype`` with linear weights stored as
    ``weight_dtype`` (``fp32``, ``bf16``, ``int8``, ``int4``; None: the dense weights of ``dtype``), see the
    module docstring. ``attention``: the real engine's attention kernels (default: what ``auto`` picks here).

    Raises:
        ValueError: a weight dtype the real engine cannot run in ``dtype`` (one line).
    """
    import torch

    problem = real_weight_dtype_problem(weight_dtype, dtype, "a measured profile (of the real engine)")
    if problem:
        raise ValueError(problem)
    from engines.real import ENGINE_SPEED_REVISION
    from engines.real.linear import resolve_linear_backend
    from engines.real.model import pick_attention
    from wb_kernels.cpu_ops import source_sha256

    if attention is None:
        attention = pick_attention("auto", getattr(torch, dtype), torch.device("cpu")).name
    return {"cpu": cpu_name(), "isa": list(cpu_flags()), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": threads or target_threads(), "torch": torch.__version__, "model": model_name,
            "model_config_sha256": model_config_digest(model_dir), "dtype": dtype,
            "weight_dtype": real_weight_dtype(weight_dtype, dtype),
            "attention": attention, "linear": resolve_linear_backend("auto", torch.device("cpu"), getattr(torch, dtype)),
            "kernels": f"r{ENGINE_SPEED_REVISION}-{source_sha256()}", "profile_format": PROFILE_FORMAT}


def model_config_digest(model_dir: Path) -> str:
    """First 16 hex digits of the sha256 of the model's ``config.json`` as canonical JSON (keys sorted), without
    the fields that do not change the computation: ``transformers_version`` (the version that wrote the file;
    ``workbench model pull`` writes it with the installed transformers) and names starting with ``_``.

    Raises:
        FileNotFoundError: ``model_dir`` has no ``config.json``.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    kept = {k: v for k, v in cfg.items() if k != "transformers_version" and not k.startswith("_")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def profile_key(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def profiles_dir() -> Path:
    from engines.real.model_store import cache_dir

    return cache_dir() / "profiles"


def profile_path(fp: dict) -> Path:
    """Where the profile of fingerprint ``fp`` is cached."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(fp["model"]).name) or "model"  # a model folder: its name
    return profiles_dir() / f"{name}-{profile_key(fp)}.json"


def check_profile(cm: CostModel, fp: dict, where: str) -> list[str]:
    """Compare a named profile's fingerprint with this run's. Returns the machine fields that differ (the
    caller warns); a profile without a fingerprint (hand-written) differs in all of them.

    Raises:
        ProfileMismatchError: it measured another model, dtype or weight dtype.
    """
    have = cm.fingerprint
    if not have:
        return list(MACHINE_FIELDS)
    have = {**have, "weight_dtype": _weight_dtype_name(have.get("weight_dtype"))}
    bad = [k for k in COMPUTATION_FIELDS if k in have and have[k] != fp[k]]
    if bad:
        raise ProfileMismatchError(f"{where}: the profile measured another computation ("
                                   + ", ".join(f"{k} {have[k]} != {fp[k]}" for k in bad)
                                   + "); measure one with `workbench profile` or use cost_model: auto")
    return [k for k in MACHINE_FIELDS if have.get(k) != fp.get(k)]


def _weight_dtype_name(value: str | None) -> str | None:
    """A fingerprint's weight dtype in today's vocabulary: profiles written before ``weight_dtype`` took
    ``fp32``/``bf16``/``int8``/``int4`` recorded the dense weights by the dtype's name (``float32``)."""
    return DENSE_WEIGHT_DTYPE.get(value, value) if value is not None else None


def warn_machine(where: str, diff: list[str], cm: CostModel) -> None:
    if diff:
        warnings.warn(f"{where}: profile from another machine or setup (differs in {', '.join(diff)}; "
                      f"{cm.source or 'no source'}); its speeds may not hold here", stacklevel=2)


def profile_executor(model_dir: Path, fp: dict, kv_cache_tokens: int = 65536):
    """The real executor a profile of fingerprint ``fp`` times (``ModelExecutor``: ``model_dir`` in ``fp``'s dtype,
    attention kernels and weight dtype, a KV pool of ``kv_cache_tokens`` in blocks of 16); the caller sets the
    torch threads (``fp['threads']``)."""
    import torch

    from engines.real.model import LlamaModel
    from engines.real.model_runner import ModelExecutor

    model = LlamaModel.from_dir(model_dir, getattr(torch, fp["dtype"]), fp["attention"],
                                weight_dtype=_weight_dtype_name(fp.get("weight_dtype")))
    return ModelExecutor(model, kv_cache_tokens // 16, 16)


def measure_profile(model_dir: Path, fp: dict, quick: bool = False, repeats: int = 3,
                    progress: Callable[[int, int], None] | None = None, kv_cache_tokens: int = 65536) -> CostModel:
    """Measure a profile of ``model_dir`` on this machine with ``fp['threads']`` torch threads (the full grid
    takes about 2 minutes on a 2-core CPU, 2:04-2:16 measured on an AMD EPYC with AVX-512, and 3:18 at one
    thread, one run on the same CPU; the quick one about 70 s)."""
    import torch

    from engines.sim.profiler import FULL_GRID, QUICK_GRID, profile

    before = torch.get_num_threads()
    torch.set_num_threads(fp["threads"])
    try:
        ex = profile_executor(model_dir, fp, kv_cache_tokens)
        cm = profile(ex, QUICK_GRID if quick else FULL_GRID, repeats, progress=progress)
    finally:
        torch.set_num_threads(before)
    cm.fingerprint = fp
    cm.created = dt.datetime.now().isoformat(timespec="seconds")
    cm.source = (f"workbench profile{' --quick' if quick else ''}: {fp['model']} {fp['dtype']} "
                 f"(weights {_weight_dtype_name(fp.get('weight_dtype')) or fp['dtype']}) on {fp['cpu']} "
                 f"({fp['cpu_capability']}), {fp['threads']} threads, torch {fp['torch']}")
    return cm


def ensure_profile(model_name: str, model_dir: Path, dtype: str = "float32", quick: bool = False,
                   progress: Callable[[int, int], None] | None = None,
                   echo: Callable[[str], None] | None = None,
                   weight_dtype: str | None = None) -> tuple[CostModel, Path]:
    """This machine's profile for the fingerprint of ``(model, dtype, weight_dtype)``: the cached file, else
    measured now (under a file lock, so that concurrent processes measure it once) and cached. Returns
    ``(model, path)``."""
    import fcntl

    fp = fingerprint(model_name, model_dir, dtype, weight_dtype=weight_dtype)
    path = profile_path(fp)
    if path.exists():
        return CostModel.load(path), path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process measured it while this one waited
            return CostModel.load(path), path
        if echo:
            echo(f"calibrating the simulator for this machine ({fp['cpu']}, {fp['threads']} threads, "
                 f"{model_name} {dtype}, weights {fp['weight_dtype']}); cached in {path}")
        if progress is None and sys.stderr.isatty():
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("calibrating the simulator", total=None)
                cm = measure_profile(model_dir, fp, quick=quick,
                                     progress=lambda i, n: bar.update(task, completed=i, total=n))
        else:
            cm = measure_profile(model_dir, fp, quick=quick, progress=progress)
        tmp = path.with_suffix(".tmp")
        cm.save(tmp)
        tmp.replace(path)
    return cm, path
