"""GEMM kernels for int8 / int4 weights at SmolLM2-135M's linear shapes, beside the dense ones: GFLOP/s
(2 x rows x in x out per call) of each option, rows 1 to 1,024, the way ``engines.real.quant`` chose its
kernels (``reports/quantization.md``).

    python benchmarks/quant_kernels.py [--rows 1,16,64,256,1024] [--dtype float32] [--json out.json]

Each figure is the best of 7 timed batches of calls (a batch lasts at least ~30 ms) after one warm-up
call, with torch's thread count as set (``torch.get_num_threads()``): the best, not the median, because on a
shared 2-core machine other processes only ever slow a batch down. Options measured:

* dense: ``F.linear`` (MKL / the BLAS torch was built with) and oneDNN with the weight reordered once
  (``engines.real.linear.Linear``, backend ``onednn``), and ``F.linear`` on bfloat16 weights (what the bf16
  model's GEMMs cost, the casts of the activation timed);
* int8, weight-only, per-output-channel: ``torch._weight_int8pack_mm`` with float32 activations and with
  bfloat16 activations (the cast to and from bfloat16 is timed); dequantize-then-``F.linear`` (the
  dequantization timed on every call); the layer ``engines.real.quant.Int8Linear`` as shipped;
* int8, W8A8 (not weight-only): ``torch.ops.quantized.linear_dynamic`` (fbgemm; quantizes the activations
  per call with one scale for the whole batch) and per-token dynamic quantization + ``torch._int_mm``;
* int4, weight-only, groups of 64: ``torch._weight_int4pack_mm_for_cpu`` in float32 and in bfloat16;
  dequantize-then-``F.linear``; the layer ``engines.real.quant.Int4Linear`` as shipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.real import quant  # noqa: E402
from engines.real.linear import Linear  # noqa: E402

# (name, in_features, out_features) of SmolLM2-135M's fused layers
SHAPES = (("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576))


def seconds_per_call(fn, batch_s: float = 0.03, samples: int = 7) -> float:
    """Seconds of one call of ``fn``: the best of ``samples`` batches of calls lasting ``batch_s`` each."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    k = max(1, int(batch_s / max(first, 1e-7)))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        times.append((time.perf_counter() - t0) / k)
    return min(times)


def options(w: torch.Tensor, dtype: torch.dtype) -> dict:
    """Name -> ``f(x)`` for every kernel option of weight ``w [out, in]`` with activations in ``dtype``."""
    wd, wbf = w.to(dtype), w.to(torch.bfloat16)
    dense_onednn = Linear(wd, None, "onednn")
    q8, s8 = quant.quantize_int8(w)
    s8d, s8b = s8.to(dtype), s8.to(torch.bfloat16)
    q4, s4, z4 = quant.quantize_int4(w)
    l4 = quant.Int4Linear(w)
    table = {dt: l4.scales_and_zeros.to(dt) for dt in (torch.float32, torch.bfloat16)}

    def int4(x, dt):
        return torch._weight_int4pack_mm_for_cpu(x.to(dt), l4.packed, l4.group_size, table[dt]).to(dtype)

    ops = {
        "dense F.linear": lambda x: F.linear(x, wd),
        "dense bf16 F.linear": lambda x: F.linear(x.to(torch.bfloat16), wbf).to(dtype),
        "dense oneDNN": dense_onednn,
        "int8pack_mm fp32 act": (lambda x: torch._weight_int8pack_mm(x.float(), q8, s8).to(dtype)),
        "int8pack_mm bf16 act": lambda x: torch._weight_int8pack_mm(x.to(torch.bfloat16), q8, s8b).to(dtype),
        "int8 dequant+F.linear": lambda x: F.linear(x, quant.dequantize_int8(q8, s8d, dtype)),
        "Int8Linear (shipped)": quant.Int8Linear(wd),
        "W8A8 per-token _int_mm": _w8a8_per_token(q8, s8, dtype),
        "int4pack_mm fp32 act": lambda x: int4(x, torch.float32),
        "int4pack_mm bf16 act": lambda x: int4(x, torch.bfloat16),
        "Int4Linear (shipped)": quant.Int4Linear(wd),
        "int4 dequant+F.linear": lambda x: F.linear(x, quant.dequantize_int4(q4, s4, z4, quant.INT4_GROUP_SIZE, dtype)),
    }
    if "fbgemm" in torch.backends.quantized.supported_engines:
        ops["fbgemm W8A8 dynamic"] = _fbgemm_dynamic(w, dtype)
    return ops


def _w8a8_per_token(q8: torch.Tensor, s8: torch.Tensor, dtype: torch.dtype):
    """int8 x int8 -> int32 GEMM (``torch._int_mm``) with each activation row quantized on its own
    (symmetric, ``max |x[r]| / 127``): batch-independent, but activation quantization."""
    qt = q8.T

    def run(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sx = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(xf / sx).to(torch.int8)
        return (torch._int_mm(xq, qt).float() * sx * s8).to(dtype)

    return run


def _fbgemm_dynamic(w: torch.Tensor, dtype: torch.dtype):
    """fbgemm's dynamic int8 linear: per-channel int8 weights, activations quantized per call (uint8, per
    tensor), int32 accumulation, float32 output."""
    torch.backends.quantized.engine = "fbgemm"
    q8, s8 = quant.quantize_int8(w)
    qw = torch._make_per_channel_quantized_tensor(q8, s8.double(), torch.zeros_like(s8, dtype=torch.int64), 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x.float(), packed, True).to(dtype)


def measure(rows: list[int], dtype: torch.dtype) -> list[dict]:
    """One row per (shape, rows, option): ``{"layer", "in", "out", "rows", "option", "gflops"}``."""
    torch.manual_seed(0)
    out = []
    for name, k, n in SHAPES:
        w = torch.randn(n, k) * 0.02
        ops = options(w, dtype)
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            for opt, fn in ops.items():
                with torch.inference_mode():
                    t = seconds_per_call(lambda: fn(x))
                out.append({"layer": name, "in": k, "out": n, "rows": m, "option": opt,
                            "gflops": 2.0 * m * k * n / t / 1e9})
    return out


def table(results: list[dict], rows: list[int]) -> str:
    """Per option and row count: GFLOP/s summed over the four layers' times (so a model-like mix)."""
    opts = list(dict.fromkeys(r["option"] for r in results))
    lines = ["| option | " + " | ".join(f"{m} rows" for m in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for o in opts:
        cells = []
        for m in rows:
            rs = [r for r in results if r["option"] == o and r["rows"] == m]
            flops = sum(2.0 * m * r["in"] * r["out"] for r in rs)
            secs = sum(2.0 * m * r["in"] * r["out"] / (r["gflops"] * 1e9) for r in rs)
            cells.append(f"{flops / secs / 1e9:.0f}")
        lines.append(f"| {o} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64,256,1024")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", default=None, help="also write every measurement here")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    res = measure(rows, getattr(torch, a.dtype))
    print(f"{a.dtype} activations, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}; GFLOP/s over qkv+o+gate_up+down")
    print(table(res, rows))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
