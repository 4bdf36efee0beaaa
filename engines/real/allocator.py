"""Keep the memory a forward pass frees inside the process, so the next step does not page it in again.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a request above its mmap threshold
(at most 32 MiB on 64-bit Linux) with a fresh ``mmap`` and returns it with ``munmap`` when the tensor is freed,
and it trims the top of its heap back to the kernel once more than the trim threshold (128 KiB, raised
dynamically) lies free there. A prefill step's activations (for SmolLM2-135M, the ``[tokens, 3072]`` gate/up
output is 126 MB at 10,240 tokens) are therefore mapped, zeroed page by page on first touch and unmapped again,
layer after layer, step after step. Measured on a 2-core Intel Xeon (AVX-512) with the real executor by
``python benchmarks/allocator_ab.py`` (the same step alternately with glibc's defaults and this module's setting,
in one process; medians of 8 runs):

====================================  ==================  =====================  =====
step                                  glibc default       memory kept            ratio
====================================  ==================  =====================  =====
16 prompts of 640 tokens              12,934 ms, 2.56 M   10,549 ms, 0 faults    0.816
4 prompts of 512 tokens               2,346 ms, 354 k     2,054 ms, 0 faults     0.876
decode of 16 rows at context 512      69.6 ms, 0          71.4 ms, 0             1.025
decode of 4 rows at context 128       33.9 ms, 0          34.2 ms, 0             1.010
====================================  ==================  =====================  =====

(faults: minor page faults per step). The cost of a fault is not even the machine's own: in a virtual
machine whose balloon reports free pages to its host, memory handed back while the engine waits is taken
away by the host and must be backed again on the next touch, so what a fault costs depends on the host.
(The slowdown of the first steps after an idle gap is not this: it stays with the memory kept, and a plain
torch GEMV chain shows it too; ``benchmarks/idle_machine.py``.) With every allocation served from the heap and the heap never trimmed, the memory
of the largest step stays mapped after its first runs (the process keeps its peak), and later steps of any
shape touch no new page.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt(3) parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

KEEP_ENV = "WORKBENCH_KEEP_FREED_MEMORY"  # "0": leave the C library's defaults (for A/B benchmarks)
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Make glibc serve every allocation from its heap (``M_MMAP_MAX`` 0) and never trim the heap
    (``M_TRIM_THRESHOLD`` 2 GiB, the most ``mallopt`` takes), once per process; later calls return the first call's answer.

    Returns:
        True when the setting is in force; False on a C library other than glibc (macOS, musl), where
        nothing is changed, or when ``$WORKBENCH_KEEP_FREED_MEMORY`` is ``0``.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(KEEP_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it; musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied


def allocator_setting() -> str:
    """What :func:`keep_freed_memory` did in this process, for results and profiles: ``glibc, freed memory
    kept``, ``C library defaults`` (not applied) or ``not set`` (not called yet)."""
    if _applied is None:
        return "not set"
    return "glibc, freed memory kept" if _applied else "C library defaults"
