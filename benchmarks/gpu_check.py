"""The real engine on a GPU: same greedy tokens as on the CPU, with the Triton kernels; then decode speed.

For a session that is lent a CUDA device (``benchmarks/gpu_check.sh`` runs this and the kernel bandwidth
benchmark as one short job). No model file travels to that machine, so it builds a random-weight
Llama folder (``tests/tiny_model.py``, made larger: 4 layers, 8 query / 2 KV heads of 64) and compares:

1. ``LLM(device=DEVICE)`` (``attention_backend`` auto: Triton on CUDA) against ``LLM(device="cpu",
   attention_backend="torch")`` on the same prompts: greedy token ids must be identical, in float32,
   with chunked prefill over cached context (small ``max_num_batched_tokens``) and prefix caching hits
   (prompts share a prefix).
2. Output tokens/s of one batch of ``--batch`` requests (``--speed-tokens`` each) on the device.

    python benchmarks/gpu_check.py [--device cuda] [--batch 64] [--csv out.csv]

Exit status 1 when the tokens differ. ``--device cpu --backend triton`` runs the same check in Triton's
interpreter here (slow; for trying the script without a GPU).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":  # before anything imports Triton
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def prompts(n: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of 20..90 tokens sharing a 40-token prefix (so prefix caching hits)."""
    import random

    rng = random.Random(0)
    prefix = [rng.randrange(10, vocab) for _ in range(40)]
    return [prefix[: rng.randint(0, 40)] + [rng.randrange(10, vocab) for _ in range(rng.randint(20, 50))]
            for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto", help="attention_backend on the device (auto: Triton on CUDA)")
    ap.add_argument("--batch", type=int, default=64, help="requests in the speed run")
    ap.add_argument("--n-check", type=int, default=12, help="prompts in the token check")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per prompt in the token check")
    ap.add_argument("--speed-tokens", type=int, default=128, help="output tokens per request in the speed run")
    ap.add_argument("--csv", help="write the figures here")
    args = ap.parse_args()

    import torch

    from engines.core.sampling_params import SamplingParams
    from engines.llm import LLM
    from tiny_model import make_tiny_llama

    folder = make_tiny_llama(Path(tempfile.mkdtemp()) / "m", "llama", num_hidden_layers=4, hidden_size=512,
                             intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    knobs = dict(kv_cache_tokens=16384, max_num_batched_tokens=48, block_size=16)
    ref_llm = LLM(folder, device="cpu", attention_backend="torch", **knobs)
    ps = prompts(args.n_check, ref_llm.model_config.vocab_size)
    ref = [o.token_ids for o in ref_llm.generate(ps, sp)]
    llm = LLM(folder, device=args.device, attention_backend=args.backend, **knobs)
    model = llm.engine.executor.model
    got = [o.token_ids for o in llm.generate(ps, sp)]
    same = sum(a == b for a, b in zip(ref, got))
    hits = sum(st.prefix_cache_hits for st in llm.engine.steps)
    print(f"device {model.device} ({torch.cuda.get_device_name() if model.device.type == 'cuda' else 'cpu'}), "
          f"attention {model.attention.name}: {same}/{len(ref)} prompts give the CPU reference's greedy tokens")
    print(f"prefix-cache hits: {hits} tokens; steps: {len(llm.engine.steps)} (chunked prefill, budget 48 tokens)")

    big = LLM(folder, device=args.device, attention_backend=args.backend, kv_cache_tokens=65536,
              max_num_batched_tokens=8192)
    bp = prompts(args.batch, big.model_config.vocab_size)
    big.generate(bp[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (kernel compiles)
    t0 = time.perf_counter()
    outs = big.generate(bp, SamplingParams(max_tokens=args.speed_tokens, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    print(f"batch {args.batch} x {args.speed_tokens} output tokens: {toks / wall:,.0f} output tok/s ({wall:.2f} s)")
    if args.csv:
        Path(args.csv).write_text("device,attention,prompts_equal,prompts,output_tok_s\n"
                                  f"{model.device},{model.attention.name},{same},{len(ref)},{toks / wall:.1f}\n")
    return 0 if same == len(ref) else 1


if __name__ == "__main__":
    sys.exit(main())
