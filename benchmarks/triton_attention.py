"""Achieved memory bandwidth of the Triton paged-attention decode kernel against the GPU's peak.

Needs a CUDA GPU (not run in CI; no GPU was at hand when it was written, so no figures yet). For each
(batch, context length) it times ``wb_kernels.triton_attention.paged_attention_decode`` on one layer's
cache (bf16, block_size 16, Llama-3.1-8B-like heads: 32 query / 8 KV heads, head_dim 128; random
block tables) with CUDA events (median of --iters), counts the bytes the kernel must read (K and V of
every context token, plus q and out) and prints achieved GB/s and the fraction of the catalogue peak
(``engines/sim/data/hardware.yaml``; the GPU is matched by name or given with --hardware).

    python benchmarks/triton_attention.py [--hardware h100-sxm] [--iters 50] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engines.sim.catalog import get_hardware  # noqa: E402

NAME_TO_KEY = [("H200", "h200"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-80gb"), ("A100 80GB", "a100-80gb"),
               ("A100", "a100-40gb"), ("L40S", "l40s")]


def guess_hardware(name: str) -> str | None:
    for needle, key in NAME_TO_KEY:
        if needle.lower() in name.lower():
            return key
    return None


def time_kernel(fn, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs (CUDA events, after 5 warm-ups)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", help="catalogue GPU (default: from the device name)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--csv", help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device: this benchmark measures GPU memory bandwidth")
    from wb_kernels.paged_attention import paged_attention_decode as reference
    from wb_kernels.triton_attention import paged_attention_decode

    dev_name = torch.cuda.get_device_name()
    key = args.hardware or guess_hardware(dev_name)
    peak = get_hardware(key).mem_bw if key else None
    print(f"device {dev_name}; catalogue {key or '(unknown: pass --hardware)'}; peak "
          f"{peak / 1e9:,.0f} GB/s" if peak else "")
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, 16
    rows = []
    for batch in (1, 8, 32, 128):
        for ctx in (512, 2048, 8192):
            nb = -(-ctx // bs)
            num_blocks = batch * nb + 1
            kc = torch.randn(num_blocks, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            tables = torch.randperm(num_blocks - 1, device="cuda")[: batch * nb].view(batch, nb)
            lens = torch.full((batch,), ctx, device="cuda")
            q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)
            out = paged_attention_decode(q, kc, vc, tables, lens)
            ref = reference(q.float(), kc.float(), vc.float(), tables, lens)
            err = (out.float() - ref).abs().max().item()
            t = time_kernel(lambda: paged_attention_decode(q, kc, vc, tables, lens), args.iters)
            nbytes = batch * ctx * kvh * d * 2 * 2 + 2 * q.numel() * 2 + tables.numel() * 4
            bw = nbytes / t
            rows.append({"batch": batch, "context": ctx, "us": t * 1e6, "GB/s": bw / 1e9,
                         "frac_peak": bw / peak if peak else float("nan"), "max_abs_err": err})
            print(f"batch {batch:4d} ctx {ctx:5d}: {t * 1e6:8.1f} us  {bw / 1e9:8.1f} GB/s  "
                  f"{(bw / peak if peak else float('nan')):6.1%} of peak  (max |err| vs reference {err:.2e})")
            del kc, vc
    if args.csv:
        import pandas as pd

        pd.DataFrame(rows).to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
