"""Compiled CPU kernels (C++ via ``torch.utils.cpp_extension``), built on first use and cached.

``paged_attention_decode`` here reads K/V blocks in place through the block table instead of
gathering them into a padded copy as the PyTorch reference does; on a 2-core machine that copy took
about a third of a batch-64 decode step. The build takes about a minute once and is cached under
``$WORKBENCH_CACHE/torch_extensions`` (default ``~/.cache/workbench``), one folder per torch version,
source file and Python environment, so that two checkouts or venvs on one machine do not rebuild it in
turn. If the build fails (no
compiler), ``available()`` is False and callers use the reference.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

_SRC = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
_mod = None
_failed = False


def _build_dir() -> Path:
    root = Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench")).expanduser()
    key = hashlib.sha1(f"{_SRC.resolve()}|{sys.prefix}".encode()).hexdigest()[:10]
    d = root / "torch_extensions" / f"torch{torch.__version__.replace('+', '_')}-{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def load():
    """The compiled module, building it if needed; None if it cannot be built (or WORKBENCH_NO_CPP=1)."""
    global _mod, _failed
    if _mod is not None or _failed:
        return _mod
    if os.environ.get("WORKBENCH_NO_CPP") == "1":
        _failed = True
        return None
    try:
        from torch.utils.cpp_extension import load as _load

        _mod = _load(
            name="workbench_paged_attention_cpu",
            sources=[str(_SRC)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_dir()),
            verbose=False,
        )
    except Exception as e:  # no compiler or headers: fall back to the reference
        warnings.warn(f"CPU paged-attention kernel unavailable, using the PyTorch reference: {e}")
        _failed = True
    return _mod


def available() -> bool:
    return load() is not None


def fused_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (if given), then return ``w * x / sqrt(mean(x^2) + eps)``; x ``[T, hidden]`` float32."""
    return load().fused_add_rms_norm(x, delta, w, float(eps))


def rope_inplace(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding (rotate-half) in place on ``x [T, heads, head_dim]``; tables ``[max_pos, head_dim]``."""
    load().rope_inplace(x, positions, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` float32."""
    return load().silu_and_mul(x)


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """Same contract as ``kernels.paged_attention.paged_attention_decode`` (float32, CPU, contiguous).

    Raises:
        RuntimeError: the kernel is unavailable or the inputs are not float32/contiguous.
    """
    mod = load()
    if mod is None:
        raise RuntimeError("CPU paged-attention kernel is unavailable")
    return mod.paged_attention_decode(q.contiguous(), k_cache, v_cache, block_tables, context_lens, float(scale))
