"""``workbench kv-calc``: KV-cache arithmetic for a catalogue model (and, with ``--hardware``, what fits)."""

from __future__ import annotations

import json

from engines.sim.catalog import GIB, MIB, get_hardware, get_model, kv_dtype_bytes, kv_heads_per_gpu, memory_plan
from workbench.errors import UsageError


def kv_calc(model: str, dtype: str = "bf16", tokens: int = 2048, hardware: str | None = None, tp: int = 1,
            gpu_memory_utilization: float = 0.9, weight_dtype: str = "bf16", block_size: int = 16) -> dict:
    """KV bytes per token and per request of ``tokens`` tokens; with ``hardware``, the memory plan of
    one GPU (weights/tp, activation reserve, KV pool), blocks and concurrent requests of that length.

    KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x dtype bytes (all GPUs together;
    each of ``tp`` GPUs holds KV heads / tp of them, at least one).

    Raises:
        CatalogError: unknown model, hardware or dtype; bad tp or utilization.
    """
    m = get_model(model)
    per_token = m.kv_bytes_per_token(dtype, 1)
    out = {
        "model": m.key, "model_source": m.source, "kv_dtype": dtype, "tokens": tokens, "tp": tp,
        "formula": f"2 x {m.num_hidden_layers} layers x {m.num_key_value_heads} KV heads x {m.head_dim} x "
                   f"{kv_dtype_bytes(dtype)} B",
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_token_per_gpu": m.kv_bytes_per_token(dtype, tp),
        "kv_heads_per_gpu": kv_heads_per_gpu(m.num_key_value_heads, tp),
        "kv_bytes_per_request": per_token * tokens,
        "weight_bytes": m.weight_bytes(weight_dtype), "weight_dtype": weight_dtype, "num_params": m.num_params,
    }
    if hardware is not None:
        hw = get_hardware(hardware)
        plan = memory_plan(m, hw, tp, weight_dtype, dtype, gpu_memory_utilization, block_size)
        blocks_per_req = -(-tokens // block_size)
        out.update({
            "hardware": hw.key, "hardware_source": hw.source, "gpu_memory_utilization": gpu_memory_utilization,
            "gpu_memory_bytes": hw.memory_bytes, "usable_bytes_per_gpu": plan.usable,
            "weight_bytes_per_gpu": plan.weights, "activation_reserve_bytes_per_gpu": plan.activation_reserve,
            "kv_pool_bytes_per_gpu": plan.kv_pool_bytes, "weights_fit": plan.weights_fit,
            "block_size": block_size, "num_blocks": plan.num_blocks, "kv_tokens": plan.kv_tokens,
            "concurrent_requests": plan.num_blocks // blocks_per_req,
        })
    return out


def format_kv_calc(r: dict) -> list[str]:
    """Human-readable lines of a ``kv_calc`` result."""
    lines = [
        f"{r['model']}: {r['num_params'] / 1e9:.2f} B params, KV dtype {r['kv_dtype']} ({r['model_source']})",
        f"KV per token:   {r['kv_bytes_per_token']:,} bytes ({r['kv_bytes_per_token'] / 1024:,.1f} KiB) = {r['formula']}",
        f"KV per request: {r['kv_bytes_per_request']:,} bytes ({r['kv_bytes_per_request'] / MIB:,.1f} MiB) "
        f"for {r['tokens']:,} tokens",
    ]
    if r["tp"] > 1:
        lines.append(f"per GPU (tp {r['tp']}, {r['kv_heads_per_gpu']} KV heads each): "
                     f"{r['kv_bytes_per_token_per_gpu']:,} bytes per token")
    if "hardware" in r:
        g = lambda b: f"{b / GIB:,.1f} GiB"  # noqa: E731
        lines += [
            f"{r['tp']} x {r['hardware']}: usable {g(r['usable_bytes_per_gpu'])} per GPU "
            f"({r['gpu_memory_utilization']:.2f} x {g(r['gpu_memory_bytes'])})",
            f"  weights ({r['weight_dtype']}) {g(r['weight_bytes_per_gpu'])} + activation reserve "
            f"{g(r['activation_reserve_bytes_per_gpu'])} per GPU -> KV pool {g(r['kv_pool_bytes_per_gpu'])}",
            f"  weights fit: {'yes' if r['weights_fit'] else 'NO'}",
            f"  KV blocks: {r['num_blocks']:,} of {r['block_size']} tokens = {r['kv_tokens']:,} tokens; "
            f"concurrent requests of {r['tokens']:,} tokens: {r['concurrent_requests']:,}",
        ]
    return lines


def main(model: str, dtype: str = "bf16", tokens: int = 2048, hardware: str | None = None, tp: int = 1,
         gpu_memory_utilization: float = 0.9, weight_dtype: str = "bf16", block_size: int = 16,
         as_json: bool = False) -> None:
    """Print :func:`kv_calc`'s result as text lines or JSON.

    Raises:
        UsageError: ``tokens`` or ``block_size`` < 1 (``CatalogError``, an unknown name or a setting that
            does not fit, is printed by the CLI as it is).
    """
    if tokens < 1 or block_size < 1:
        raise UsageError("--tokens and --block-size must be >= 1")
    r = kv_calc(model, dtype, tokens, hardware, tp, gpu_memory_utilization, weight_dtype, block_size)
    print(json.dumps(r, indent=2) if as_json else "\n".join(format_kv_calc(r)))
