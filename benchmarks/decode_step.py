"""Where one decode step's time goes: the whole executor step, the model body, its GEMMs alone, the
LM head and the paged decode attention kernel, for a batch of decode rows at one context length.

    python benchmarks/decode_step.py [--batch 64] [--context 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines import LLM, SamplingParams  # noqa: E402
from engines.core.scheduler import ScheduledSeq, SchedulerOutput  # noqa: E402
from engines.sim.profiler import median_time  # noqa: E402


def timed(fn) -> float:
    """Median milliseconds of 7 runs."""
    return median_time(fn, 7) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(2)
    b, ctx, bs = a.batch, a.context, 16
    nb = -(-ctx // bs)
    llm = LLM("smollm2-135m", kv_cache_tokens=(b * nb + 1) * bs, max_model_len=max(2048, ctx + 1))
    ex, m = llm.engine.executor, llm.engine.executor.model
    sp = SamplingParams(max_tokens=1, temperature=0)
    seqs = [ScheduledSeq(str(i), [100], ctx - 1, list(range(i * nb, (i + 1) * nb)), True, sp) for i in range(b)]
    out = SchedulerOutput(seqs)
    ids, pos, meta, _ = ex._prepare(seqs)
    x = torch.randn(b, m.cfg.hidden_size)
    inter = m.cfg.intermediate_size

    def gemms():
        for layer in m.layers:
            layer["qkv"](x), layer["o"](x)
            layer["down"](layer["gate_up"](x)[:, :inter].contiguous())

    kc, vc = ex.kv.layers[0]
    q = torch.randn(b, m.cfg.num_attention_heads, m.cfg.head_dim)
    step = timed(lambda: ex.execute(out))
    fwd = timed(lambda: m.forward(ids, pos, meta, ex.kv.layers))
    g = timed(gemms)
    lm = timed(lambda: m.compute_logits(x))
    att = timed(lambda: m.decode_attention(q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, m.scale))
    L = m.cfg.num_hidden_layers
    print(f"decode step, batch {b}, context {ctx}: {step:.1f} ms = {b / step * 1000:.1f} tok/s")
    print(f"  model body (forward)     {fwd:7.1f} ms")
    print(f"    GEMMs alone            {g:7.1f} ms")
    print(f"    decode attention       {att * L:7.1f} ms ({att:.2f} ms/layer x {L})")
    print(f"    the rest (norms, RoPE, SiLU, residual, Python) {fwd - g - att * L:7.1f} ms")
    print(f"  LM head                  {lm:7.1f} ms")
    print(f"  GEMM-only ceiling: {b / (g + lm) * 1000:.1f} tok/s")


if __name__ == "__main__":
    main()
