"""Linear layers of the real model: ``y = x @ W^T + b`` with the GEMM kernel picked for the device.

On CPU, ``linear_backend: onednn`` runs oneDNN with the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the path PyTorch's Inductor uses for
frozen CPU linears). ``F.linear`` in float32 goes to the BLAS torch was built with (MKL), which on AMD
CPUs runs a generic code path: on one 2-core AMD EPYC (AVX-512) MKL's float32 GEMM of SmolLM2's shapes ran at
about 180 GFLOP/s and oneDNN's reordered one at 400-470, with the same float32 results to about 1e-6
relative (another summation order, not lower precision). ``benchmarks/throughput.py`` measures both beside
each other as the GEMM ceilings. ``auto`` is ``onednn`` on CPU and ``torch`` elsewhere, and ``torch`` for bfloat16
on a CPU whose oneDNN refuses it (AVX2 only).

oneDNN keeps about 1 MiB per distinct row count it has seen (a compiled primitive; capping
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` did not release it), so a server fed every batch size from 1 to 1,100
rows grew by about 700 MiB. The oneDNN layer therefore pads its input up to one of a fixed set of row
counts (:func:`onednn_rows_bucket`: exact up to 16, then 8 per doubling): a bounded set of primitives
(72 up to 4,096 rows), at most 1/8 extra rows (the GEMM's time per row was flat from 32 rows up).

Weight dtypes (``weight_dtype``): ``fp32``/``bf16`` are the model dtype's dense weights; ``int8`` and ``int4``
are weight-only quantized layers (``engines.real.quant``), the activations staying in the model dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engines.core.config import DENSE_WEIGHT_DTYPE, REAL_WEIGHT_DTYPES
from engines.core.row_buckets import onednn_rows_bucket

LINEAR_BACKENDS = ("auto", "torch", "onednn")

# rows the oneDNN reorder is tuned for: a hint of 1 made 1,024-row prefills 2.6x slower, 64 was within
# 5% of the best hint from 8 to 1,024 rows on the machine above
ONEDNN_ROWS_HINT = 64

# engines warm the buckets up to this many rows at load (LlamaModel.warm_gemms)
ONEDNN_WARM_MAX_ROWS = 4096


@functools.lru_cache(maxsize=None)
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN reorder runs ``dtype`` on this CPU: float32 wherever torch has oneDNN; bfloat16
    only where the CPU has ``avx512bw``/``avx512vl``/``avx512dq`` or ``avx_ne_convert`` (an AVX2-only CPU
    refuses it: ``bf16 path needs the cpu support ...``). Probed once per dtype with a 16 x 16 weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), ONEDNN_ROWS_HINT)
    except RuntimeError:
        return False
    return True


def resolve_linear_backend(backend: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """``torch`` or ``onednn`` for a ``linear_backend`` knob on ``device`` for weights of ``dtype``: ``auto`` is
    ``onednn`` on a CPU whose oneDNN runs ``dtype`` (:func:`onednn_supports`), else ``torch``.

    Raises:
        ValueError: an unknown name, or ``onednn`` asked for off the CPU, where torch has no oneDNN, or for a
            dtype this CPU's oneDNN cannot run (bfloat16 on an AVX2-only CPU).
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {backend!r}")
    usable = device.type == "cpu" and torch.backends.mkldnn.is_available()
    if backend == "onednn" and not usable:
        raise ValueError(f"linear_backend 'onednn' needs the CPU and torch built with oneDNN (device {device})")
    if usable and not onednn_supports(dtype):
        if backend == "onednn":
            raise ValueError(f"linear_backend 'onednn': this CPU's oneDNN cannot run {dtype} GEMMs (bfloat16 needs "
                             "avx512bw/vl/dq or avx_ne_convert); use linear_backend torch or auto")
        usable = False
    if backend == "auto":
        return "onednn" if usable else "torch"
    return backend


class Linear:
    """A dense linear layer ``[*, in] -> [*, out]`` in the weight's dtype.

    Args:
        weight: ``[out_features, in_features]``, already in the model's dtype and on its device.
        bias: ``[out_features]`` or None.
        backend: ``torch`` (``F.linear``) or ``onednn`` (weight reordered once; CPU only), as resolved by
            :func:`resolve_linear_backend`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str = "torch"):
        self.out_features, self.in_features = weight.shape
        self.bias, self.backend = bias, backend
        self.dtype = weight.dtype
        self.nbytes = weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
        if backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_ROWS_HINT)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [*, in_features]`` -> ``[*, out_features]`` in ``x``'s dtype."""
        if self.backend != "onednn":
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        rows = x.shape[0]
        padded = onednn_rows_bucket(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return y[:rows].reshape(*lead, self.out_features)


def warm_onednn(layers: list, max_rows: int) -> int:
    """Run each distinct oneDNN layer shape once at every row bucket up to ``max_rows`` rows, on zeros.

    oneDNN builds a primitive (about 1 MiB) the first time it sees a row count for a weight shape, and
    keeps it; warming at load builds them all up front, so a server's resident memory does not creep up
    while new batch sizes arrive (one layer per shape is enough: layers of the same shape share them).
    SmolLM2 at 2,048 body rows and 256 LM-head rows: 336 primitives, 6.7 s while another process loaded the
    2 cores (AMD EPYC; not timed on an idle machine).

    Args:
        layers: :class:`Linear` (others, such as quantized layers, are skipped).
        max_rows: the most rows a step gives these layers.
    Returns:
        the number of (shape, row count) primitives warmed.
    """
    shapes = {}
    for layer in layers:
        if isinstance(layer, Linear) and layer.backend == "onednn":
            shapes.setdefault((layer.in_features, layer.out_features, layer.dtype), layer)
    buckets = sorted({onednn_rows_bucket(r) for r in range(1, max_rows + 1)})
    with torch.no_grad():
        for (in_features, _, dtype), layer in shapes.items():
            for rows in buckets:
                layer(torch.zeros(rows, in_features, dtype=dtype))
    return len(shapes) * len(buckets)


def model_weight_dtype(dtype: torch.dtype) -> str:
    """The ``weight_dtype`` name of dense weights in ``dtype`` (``fp32`` or ``bf16``)."""
    return DENSE_WEIGHT_DTYPE[str(dtype).removeprefix("torch.")]


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: str, backend: str) -> Linear:
    """The layer for ``weight`` stored as ``weight_dtype``.

    Args:
        weight: ``[out, in]`` dense, in the model's dtype on its device.
        bias: ``[out]`` or None.
        weight_dtype: ``fp32``/``bf16`` (must be the model dtype's name: dense weights), ``int8`` or ``int4``.
        backend: resolved linear backend for dense layers.
    Raises:
        ValueError: a weight dtype this engine cannot run, in one line.
    """
    dense = model_weight_dtype(weight.dtype)
    if weight_dtype == dense:
        return Linear(weight, bias, backend)
    if weight_dtype in ("fp32", "bf16"):
        raise ValueError(f"weight_dtype {weight_dtype} with dtype {dense}: dense weights are stored in the model "
                         f"dtype (set dtype instead)")
    if weight_dtype in ("int8", "int4"):
        from engines.real import quant

        return quant.quantized_linear(weight, bias, weight_dtype)
    raise ValueError(f"weight_dtype {weight_dtype!r} is not one the real engine runs ({', '.join(REAL_WEIGHT_DTYPES)})")
