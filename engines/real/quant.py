"""Weight-only quantized linear layers of the real model: ``int8`` and ``int4`` weights, activations in the
model dtype.

Both are round-to-nearest (RTN) from the dense weights, with no calibration data: no AWQ activation-aware
scaling, no GPTQ error compensation. Their precision loss is therefore an upper bound of what those methods
lose at the same storage format (``workbench quality`` measures it).

* ``int8``: per-output-channel symmetric. ``scale[o] = max_i |W[o, i]| / 127``,
  ``q[o, i] = clamp(round(W[o, i] / scale[o]), -127, 127)``, ``W ~ q * scale``. Stored: ``q`` int8
  ``[out, in]`` and ``scale`` ``[out]`` in bfloat16 (the kernel's dtype, below).
* ``int4``: group-wise asymmetric with integer zero points, the layout AWQ and GPTQ checkpoints store:
  for each output row and each group of ``group_size`` input channels, ``scale = (max - min) / 15``,
  ``zero = clamp(round(-min / scale), 0, 15)``, ``q = clamp(round(W / scale) + zero, 0, 15)``,
  ``W ~ (q - zero) * scale``. ``group_size`` is 64 by default: SmolLM2-135M's input widths are 576 and
  1,536, and 64 divides both (128, the AWQ/GPTQ default, does not divide 576). Stored: ``q`` packed two per
  byte (``[out, in / 2]`` uint8) and per group one scale and one zero in bfloat16 (the kernel's
  ``[in / group_size, out, 2]`` table); the zero is kept in the kernel's float form ``(8 - zero) * scale``.

Kernels (CPU; measured at SmolLM2-135M's shapes by ``benchmarks/quant_kernels.py``, see
``reports/quantization.md``). Both take bfloat16 activations, whatever the model dtype: ATen's
weight-only kernels have a vectorised path for bfloat16 activations and none worth the name for float32
(on a 2-core AVX-512 EPYC, at 64 rows: int8 224 GFLOP/s in bfloat16 against 4 in float32; int4 246
against 2). A float32 model's quantized layer therefore rounds its input to bfloat16, runs the kernel
(products and sums in float32, output rounded to bfloat16) and returns float32: the activations are
float32 at the layer's input and output, bfloat16 inside the GEMM. That rounding (relative 2^-8 at most
per element, bfloat16's unit roundoff) is small beside the weights' own (int8: up to ``scale / 2`` =
``max |W[o]| / 254`` per weight): on SmolLM2-135M's layers it raised the int8 layer's output error against
float32 from 0.79-0.89% (the dequantized weight, float32 input) to 0.82-0.92%; ``tests/test_quant.py``
bounds it.

* ``int8``: ``torch._weight_int8pack_mm(x_bf16, q, scale_bf16)``: the scales are stored in bfloat16 (the
  kernel's dtype). Dequantize-then-GEMM was slower at every row count measured (1-1,024 rows) for a float32
  model, and faster only from about 512 rows for a bfloat16 one (not used: a token's numerics would then
  depend on its step's row count).
* ``int4``: ``torch._weight_int4pack_mm_for_cpu`` over ``torch._convert_weight_to_int4pack_for_cpu``
  (the tinygemm CPU kernel): ``y = x @ ((q - 8) * s + z)^T`` with ``z`` the float-domain zero
  ``(8 - zero) * scale``; scales and zeros stored in bfloat16, ``[in / group_size, out, 2]``.

Neither quantizes activations: ``int8`` is weight-only. Measured and not used: fbgemm's dynamic W8A8
linear (``torch.ops.quantized.linear_dynamic``, 3-5x faster from 16 rows on, with VNNI) quantizes the
activations with one scale for the whole flattened batch, so one request's tokens would change with what
else is batched with it; per-token W8A8 through ``torch._int_mm`` is batch-independent and also fast, but
is activation quantization, not this ``int8`` (``reports/quantization.md``).
"""

from __future__ import annotations

import torch

QUANTIZED_WEIGHT_DTYPES = ("int8", "int4")
INT4_GROUP_SIZE = 64
INT8_QMAX = 127
INT4_QMAX = 15
# the activation dtype of both kernels (see the module docstring)
KERNEL_DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------------------------- int8
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of ``weight [out, in]``.

    Returns:
        ``(q [out, in] int8 in [-127, 127], scale [out] float32)`` with ``weight ~ q * scale[:, None]``;
        the round-trip error is at most ``scale / 2`` per element. An all-zero row gets scale 1.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_QMAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [out, in] int8``, ``scale [out]`` -> ``[out, in]`` in ``dtype`` (computed in float32)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def _bias_bytes(bias: torch.Tensor | None) -> int:
    return 0 if bias is None else bias.numel() * bias.element_size()


class Int8Linear:
    """``y = x @ (q * scale)^T + b``: int8 weights, per-output-channel scales (see the module docstring).

    Args:
        weight: ``[out, in]`` dense, in the model dtype (float32 or bfloat16), on the CPU.
        bias: ``[out]`` (model dtype) or None.
    Attributes:
        q: ``[out, in]`` int8; scale: ``[out]`` bfloat16; nbytes: both (and the bias) in bytes.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.dtype, self.bias = weight.dtype, bias
        self.q, scale = quantize_int8(weight)
        self.scale = scale.to(KERNEL_DTYPE)
        self.nbytes = self.q.numel() + self.scale.numel() * self.scale.element_size() + _bias_bytes(bias)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[out, in]`` float32: ``q * scale`` with the stored scale."""
        return dequantize_int8(self.q, self.scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [*, in]`` -> ``[*, out]`` in ``x``'s dtype (the GEMM in bfloat16, see the module docstring)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        y = torch._weight_int8pack_mm(x2, self.q, self.scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


# ----------------------------------------------------------------------------------------------- int4
def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4 of ``weight [out, in]`` with integer zero points (AWQ/GPTQ's format).

    Returns:
        ``(q [out, in] uint8 in [0, 15], scale [out, in / group_size] float32, zero [out, in / group_size]
        uint8 in [0, 15])`` with ``weight ~ (q - zero) * scale`` group by group. Per element the round-trip
        error is at most ``scale / 2`` where the group's range contains 0 (always, unless a group is all
        of one sign; then ``zero`` clamps and the error grows by at most the clamp).

    Raises:
        ValueError: ``in`` is not a multiple of ``group_size``.
    """
    out, inp = weight.shape
    if group_size <= 0 or inp % group_size:
        raise ValueError(f"int4 group_size {group_size} must divide the layer's input width {inp}")
    w = weight.float().reshape(out, inp // group_size, group_size)
    lo = w.amin(dim=2).clamp(max=0)  # the range always contains 0, so that zero is exactly representable
    hi = w.amax(dim=2).clamp(min=0)
    scale = (hi - lo) / INT4_QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp_(0, INT4_QMAX)
    q = (torch.round(w / scale[..., None]) + zero[..., None]).clamp_(0, INT4_QMAX)
    return q.reshape(out, inp).to(torch.uint8), scale, zero.to(torch.uint8)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int = INT4_GROUP_SIZE,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [out, in]``, ``scale``/``zero [out, in / group_size]`` -> ``[out, in]`` in ``dtype`` (float32 math)."""
    out, inp = q.shape
    w = (q.float().reshape(out, -1, group_size) - zero.float()[..., None]) * scale.float()[..., None]
    return w.reshape(out, inp).to(dtype)


class Int4Linear:
    """``y = x @ ((q - zero) * scale)^T + b``: int4 weights in groups of ``group_size`` input channels (see
    the module docstring), through the tinygemm CPU kernel.

    Args:
        weight: ``[out, in]`` dense, in the model dtype (float32 or bfloat16), on the CPU.
        bias: ``[out]`` (model dtype) or None.
        group_size: input channels per scale and zero; must divide ``in``.
    Attributes:
        packed: ``[out, in / 2]`` uint8 (the kernel's blocked layout); scales_and_zeros:
        ``[in / group_size, out, 2]`` bfloat16; nbytes: both (and the bias) in bytes.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = INT4_GROUP_SIZE):
        self.out_features, self.in_features = weight.shape
        self.dtype, self.group_size, self.bias = weight.dtype, group_size, bias
        q, scale, zero = quantize_int4(weight, group_size)
        # the kernel computes (q - 8) * s + z: z = (8 - zero) * scale makes that (q - zero) * scale
        zf = (8.0 - zero.float()) * scale
        self.scales_and_zeros = torch.stack([scale, zf], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.nbytes = (self.packed.numel() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()
                       + _bias_bytes(bias))

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[out, in]`` float32: the kernel run in float32 on the
        identity, which gives ``(q - 8) * s + z`` with the stored bfloat16 ``s`` and ``z`` exactly (its float32
        path is slow, about 2 GFLOP/s: for tests and checks, not the forward pass)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        table = self.scales_and_zeros.float()
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, table).T.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [*, in]`` -> ``[*, out]`` in ``x``'s dtype (the GEMM in bfloat16, see the module docstring)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: str):
    """The weight-only quantized layer of ``weight [out, in]`` (model dtype) as ``weight_dtype``.

    Returns:
        an :class:`Int8Linear` or :class:`Int4Linear`: ``__call__(x [*, in]) -> [*, out]`` in ``x``'s dtype,
        ``out_features``, ``in_features``, ``nbytes`` (bytes as stored, scales and zeros included), ``dtype``.
    Raises:
        ValueError: an unknown ``weight_dtype``, a weight off the CPU, or (int4) an input width that
            :data:`INT4_GROUP_SIZE` does not divide.
    """
    if weight.device.type != "cpu":
        raise ValueError(f"weight_dtype {weight_dtype}: the quantized kernels run on the CPU (weight on "
                         f"{weight.device})")
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight_dtype {weight_dtype}: model dtype must be float32 or bfloat16, got {weight.dtype}")
    if weight_dtype == "int8":
        return Int8Linear(weight, bias)
    if weight_dtype == "int4":
        return Int4Linear(weight, bias)
    raise ValueError(f"weight_dtype must be one of {', '.join(QUANTIZED_WEIGHT_DTYPES)} here, got {weight_dtype!r}")
