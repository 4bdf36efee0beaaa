"""Prefill attention's share of a step: ``LlamaModel.forward`` of one step against its GEMMs alone and its
attention calls alone, for four step shapes (SmolLM2-135M):

  (a) one fresh 1,024-token prompt, (b) four fresh 256-token prompts, (c) a 512-token chunk after 512 cached
  tokens, (d) 8 decode rows (context 300) + 3 prefill chunks (128 fresh, 200 after 100 cached, 64 fresh).

    python benchmarks/prefill_attention.py [--dtype float32|bfloat16] [--backend auto|torch|cpp]
        [--linear-backend auto|torch|onednn] [--threads 2] [--repeats 5]

Times are the best of ``--repeats`` runs in milliseconds (the least disturbed by other processes on a shared
machine). ``attention`` is the step's 30 per-layer ``_attention`` calls (decode and prefill, on random q and
the step's K/V already in the cache); ``att share`` its part of the forward; ``GEMMs`` the step's linear layers
alone (the ceiling a step could reach if everything else were free); ``GEMM/fwd`` how close the step is to it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.core.sampling_params import SamplingParams  # noqa: E402
from engines.core.scheduler import ScheduledSeq  # noqa: E402
from engines.real.model import LlamaModel  # noqa: E402
from engines.real.model_runner import ModelExecutor  # noqa: E402
from engines.real.model_store import resolve_model  # noqa: E402

BLOCK_SIZE = 16
# name -> [(new tokens, cached tokens before them)]; one new token after a cached context is a decode row
STEPS = {
    "(a) 1 x 1024 fresh": [(1024, 0)],
    "(b) 4 x 256 fresh": [(256, 0)] * 4,
    "(c) 512 after 512 cached": [(512, 512)],
    "(d) 8 decode + 3 chunks": [(1, 299)] * 8 + [(128, 0), (200, 100), (64, 0)],
}


def best_ms(fn, repeats: int) -> float:
    """Milliseconds of the fastest of ``repeats`` calls of ``fn`` after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def step_seqs(shape: list[tuple[int, int]], num_blocks: int, seed: int = 0) -> list[ScheduledSeq]:
    """Scheduled sequences of one step, decode rows first, each on its own blocks taken in a shuffled
    order of the pool (as a running engine's free queue hands them out)."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    sp = SamplingParams(max_tokens=1, temperature=0)
    seqs = []
    for i, (n, cached) in enumerate(sorted(shape, key=lambda s: s[0] != 1)):
        nb = -(-(n + cached) // BLOCK_SIZE)
        table, free = free[:nb], free[nb:]
        seqs.append(ScheduledSeq(str(i), [100 + i % 50] * n, cached, table, True, sp))
    return seqs


def _linear(layer: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    """The layer's linear ``name`` on ``x``: a callable layer, or a plain weight matrix (with ``qkv_bias``)."""
    w = layer[name]
    if callable(w):
        return w(x)
    return F.linear(x, w, layer.get(f"{name}_bias"))


def measure(m: LlamaModel, ex: ModelExecutor, shape: list[tuple[int, int]], repeats: int) -> dict[str, float]:
    """Milliseconds of the step's forward, its GEMMs alone and its attention calls alone."""
    ids, pos, meta, _ = ex._prepare(step_seqs(shape, ex.kv.num_blocks))
    cfg, t = m.cfg, ids.shape[0]
    h, kvh, d, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    x = torch.randn(t, cfg.hidden_size, dtype=m.dtype)
    xi = torch.randn(t, inter, dtype=m.dtype)
    q = torch.randn(t, h, d, dtype=m.dtype)
    k, v = torch.randn(t, kvh, d, dtype=m.dtype), torch.randn(t, kvh, d, dtype=m.dtype)

    def gemms():
        for layer in m.layers:
            _linear(layer, "qkv", x), _linear(layer, "o", x), _linear(layer, "gate_up", x), _linear(layer, "down", xi)

    def attention():
        for kc, vc in ex.kv.layers:
            m._attention(q, kc, vc, meta)

    with torch.inference_mode():
        fwd = best_ms(lambda: m.forward(ids, pos, meta, ex.kv.layers), repeats)
        gemm = best_ms(gemms, repeats)
        att = best_ms(attention, repeats)
    return dict(tokens=t, forward=fwd, gemm=gemm, attention=att)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "cpp"))
    ap.add_argument("--linear-backend", default="auto", choices=("auto", "torch", "onednn"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kwargs = {"linear_backend": a.linear_backend} if a.linear_backend != "auto" else {}
    m = LlamaModel.from_dir(resolve_model("smollm2-135m"), getattr(torch, a.dtype), a.backend, **kwargs)
    need = sum(-(-(n + c) // BLOCK_SIZE) for shape in STEPS.values() for n, c in shape)
    ex = ModelExecutor(m, need + 1, BLOCK_SIZE)
    linear = getattr(m, "linear_backend", "torch")
    print(f"SmolLM2-135M {a.dtype}, attention {m.attention.name}, linear {linear}, {a.threads} threads, "
          f"block size {BLOCK_SIZE}")
    print(f"{'step':26} {'tokens':>6} {'forward':>9} {'GEMMs':>9} {'attention':>10} {'att share':>9} {'GEMM/fwd':>9}")
    for name, shape in STEPS.items():
        r = measure(m, ex, shape, a.repeats)
        print(f"{name:26} {r['tokens']:6d} {r['forward']:8.1f}ms {r['gemm']:8.1f}ms {r['attention']:9.1f}ms "
              f"{r['attention'] / r['forward']:9.1%} {r['gemm'] / r['forward']:9.1%}")


if __name__ == "__main__":
    main()
