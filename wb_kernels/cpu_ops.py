"""Compiled CPU kernels (C++ via ``torch.utils.cpp_extension``), built on first use and cached.

``paged_attention_decode`` here reads K/V blocks in place through the block table instead of
gathering them into a padded copy as the PyTorch reference does; on a 2-core machine that copy took
about a third of a batch-64 decode step. The build takes about a minute once and is cached under
``$WORKBENCH_CACHE/torch_extensions`` (default ``~/.cache/workbench``), one folder per torch version,
source file and Python environment, so that two checkouts or venvs on one machine do not rebuild it in
turn. If the build fails (no compiler), ``available()`` is False, callers use the reference, and
``build_error()`` keeps the error (with the compiler's output) for the warning and for tests that need the
kernel: in CI those fail with it instead of skipping.
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
_error: str | None = None  # why the kernel is unavailable, once load() has failed


def source_sha256() -> str:
    """The first 12 hex digits of the kernel source's sha256: part of a profile's fingerprint, so that a
    simulator profile measured with other kernels is measured again."""
    return hashlib.sha256(_SRC.read_bytes()).hexdigest()[:12]


def _build_dir() -> Path:
    root = Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench")).expanduser()
    key = hashlib.sha1(f"{_SRC.resolve()}|{sys.prefix}".encode()).hexdigest()[:10]
    d = root / "torch_extensions" / f"torch{torch.__version__.replace('+', '_')}-{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _build():
    """Compile (or load the cached build of) the extension; raises whatever the build raises."""
    from torch.utils.cpp_extension import load as _load

    return _load(
        name="workbench_paged_attention_cpu",
        sources=[str(_SRC)],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(_build_dir()),
        verbose=False,
    )


def load():
    """The compiled module, building it if needed; None if it cannot be built (or WORKBENCH_NO_CPP=1),
    with the reason in :func:`build_error`."""
    global _mod, _failed, _error
    if _mod is not None or _failed:
        return _mod
    if os.environ.get("WORKBENCH_NO_CPP") == "1":
        _failed, _error = True, "disabled by WORKBENCH_NO_CPP=1"
        return None
    try:
        _mod = _build()
    except Exception as e:  # no compiler or headers: fall back to the reference
        _failed, _error = True, f"{type(e).__name__}: {e}".strip()
        warnings.warn(f"CPU paged-attention kernel unavailable, using the PyTorch reference: {_error}")
    return _mod


def available() -> bool:
    """True when the compiled module loads (building it on the first call)."""
    return load() is not None


def build_error() -> str | None:
    """Why the kernel is unavailable (the build's exception with the compiler's output, or the
    ``WORKBENCH_NO_CPP`` switch); None when it loaded or :func:`load` has not failed."""
    return _error


def _module():
    """The loaded module; RuntimeError (with the build error) when it is unavailable."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"CPU paged-attention kernel is unavailable: {_error}")
    return mod


def fused_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (if given), then return ``w * x / sqrt(mean(x^2) + eps)``.

    Args:
        x: ``[T, hidden]`` float32 or bfloat16, contiguous (updated in place when ``delta`` is given).
        delta: ``[T, hidden]`` in x's dtype, or None.
        w: ``[hidden]`` in x's dtype.
    Returns:
        ``[T, hidden]`` in x's dtype. In bfloat16 the norm is computed in float32 and the normalized x is
        rounded to bfloat16 before the weight multiply, as transformers' ``LlamaRMSNorm`` does.
    """
    return _module().fused_add_rms_norm(x, delta, w, float(eps))


def rope_inplace(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding (rotate-half) in place on ``x [T, heads, head_dim]`` (last dim contiguous) at
    ``positions [T]``; tables ``[max_pos, head_dim]`` in x's dtype (float32 or bfloat16)."""
    _module().rope_inplace(x, positions, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` (float32 or bfloat16, contiguous) -> ``[T, I]``."""
    return _module().silu_and_mul(x)


def prefill_bf16_dot() -> bool:
    """True when the build computes bfloat16 prefill scores with ``vdpbf16ps`` (compiled with
    ``-march=native`` on a CPU with ``avx512_bf16``): bfloat16 keys are read in place instead of converted to
    float32 per key tile. ``WORKBENCH_PREFILL_FP32_KEYS=1`` turns that path off per call (benchmarks compare
    the two). RuntimeError when the kernel is unavailable."""
    return bool(_module().prefill_bf16_dot())


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """Same contract as ``wb_kernels.paged_attention.paged_attention_decode`` (float32 or bfloat16 tensors of
    one dtype, CPU, contiguous caches).

    Raises:
        RuntimeError: the kernel is unavailable or the inputs do not fit it.
    """
    return _module().paged_attention_decode(q.contiguous(), k_cache, v_cache, block_tables, context_lens, float(scale))


def paged_attention_prefill_varlen(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos,
                                   scale: float | None = None, *, max_seqlen_q: int | None = None) -> torch.Tensor:
    """Same contract as ``wb_kernels.paged_attention.paged_attention_prefill_varlen``: every prefill chunk of a
    step in one call, read through block tables, causal with each chunk's offset, grouped-query heads.

    Args:
        q: ``[T, num_heads, head_dim]`` float32 or bfloat16 (a strided view is fine if the last dim is
            contiguous: the q slice of the fused qkv output).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype, contiguous.
        block_tables, cu_seqlens_q, start_pos: ``[P, max_blocks]``, ``[P + 1]``, ``[P]`` int64.
        max_seqlen_q: unused here (the Triton kernel's launch size); accepted for the common contract.
    Returns:
        ``[T, num_heads, head_dim]`` in q's dtype.

    Raises:
        RuntimeError: the kernel is unavailable or the inputs do not fit together (one line).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _module().paged_attention_prefill_varlen(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos,
                                                    float(scale))
