"""Where one decode step's time goes: the whole executor step, the model body, its GEMMs alone, the
LM head and the paged decode attention kernel, for a batch of decode rows at one context length; then the
same batch through the engine's own loop (``LLMEngine.step``), split into scheduling, building the step's
tensors, the forward pass, the LM head, sampling, and the rest (scheduler update, detokenization,
bookkeeping).

    python benchmarks/decode_step.py [--batch 64] [--context 300] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
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
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=16, help="engine-loop steps timed")
    a = ap.parse_args()
    torch.set_num_threads(2)
    b, ctx, bs = a.batch, a.context, 16
    nb = -(-ctx // bs)
    llm = LLM("smollm2-135m", kv_cache_tokens=(b * nb + 1) * bs, max_model_len=max(2048, ctx + 1), dtype=a.dtype)
    ex, m = llm.engine.executor, llm.engine.executor.model
    sp = SamplingParams(max_tokens=1, temperature=0)
    seqs = [ScheduledSeq(str(i), [100], ctx - 1, list(range(i * nb, (i + 1) * nb)), True, sp) for i in range(b)]
    out = SchedulerOutput(seqs)
    ids, pos, meta, _ = ex._prepare(seqs)
    x = torch.randn(b, m.cfg.hidden_size, dtype=m.dtype)
    inter = m.cfg.intermediate_size

    def gemms():
        for layer in m.layers:
            layer["qkv"](x), layer["o"](x)
            layer["down"](layer["gate_up"](x)[:, :inter].contiguous())

    kc, vc = ex.kv.layers[0]
    q = torch.randn(b, m.cfg.num_attention_heads, m.cfg.head_dim, dtype=m.dtype)
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
    engine_loop(b, ctx, a.dtype, a.steps)


def engine_loop(b: int, ctx: int, dtype: str, steps: int) -> None:
    """Time ``steps`` decode steps of ``b`` requests at about ``ctx`` tokens of context through
    ``LLMEngine.step``, with each phase wrapped in a timer."""
    from engines.core.request import Request

    llm = LLM("smollm2-135m", kv_cache_tokens=b * (ctx + steps + 32) + 256, max_model_len=max(2048, ctx + steps + 8),
              max_num_seqs=b, max_num_batched_tokens=max(2048, ctx), dtype=dtype, enable_prefix_caching=False)
    eng = llm.engine
    for i in range(b):
        eng.add_request(Request(str(i), [100 + (i * 7 + j) % 30000 for j in range(ctx - 1)],
                                SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True), arrival_time=0.0))
    while any(len(r.output_token_ids) == 0 for r in eng.scheduler.requests.values()):
        eng.step()  # prefill every request; the timed steps are pure decode
    spent: dict[str, float] = defaultdict(float)

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed_call(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[label] += time.perf_counter() - t0
        setattr(obj, name, timed_call)

    ex = eng.executor
    for obj, name, label in ((eng.scheduler, "schedule", "schedule"), (ex, "_prepare", "build step tensors"),
                             (ex.model, "forward", "forward (model body)"), (ex.model, "compute_logits", "LM head"),
                             (ex.sampler, "sample", "sampling")):
        wrap(obj, name, label)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    total = time.perf_counter() - t0
    print(f"engine loop, {b} decode rows, context ~{ctx}, {steps} steps: {total / steps * 1000:.1f} ms/step = "
          f"{b * steps / total:.1f} tok/s")
    for label, sec in spent.items():
        print(f"  {label:24s} {sec / steps * 1000:7.2f} ms/step ({sec / total:.1%})")
    rest = total - sum(spent.values())
    print(f"  {'the rest (update, detokenize, bookkeeping)':24s} {rest / steps * 1000:7.2f} ms/step ({rest / total:.1%})")


if __name__ == "__main__":
    main()
