"""Peer benchmark: vLLM (CPU build), offline ``LLM.generate``, float32, greedy, ignore_eos.

Runs in its own venv (~/vllm-peer, see /work/shared/peers/README.md), not the project's:

    ~/vllm-peer/bin/python benchmarks/peers/vllm_peer.py --model DIR --num-prompts 64 \
        --max-tokens 128 --out result.json

Same prompts as hf_peer.py (ShareGPT first human turns, truncated, no chat template), passed as
token ids so both engines see identical inputs. ``--batch-size`` maps to ``max_num_seqs`` (omit
it for the engine default). Start-up takes minutes (compilation); only ``generate`` is timed,
after an untimed warm-up call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")  # else vLLM runs the model on one core of two

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.prompts import load_sharegpt_prompts, truncate_prompts  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--mode", default="vllm", choices=["vllm"])
    ap.add_argument("--batch-size", type=int, default=None, help="max_num_seqs (default: engine's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)  # share of CPU memory here
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import vllm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = truncate_prompts(load_sharegpt_prompts(a.num_prompts), tok, a.max_prompt_tokens)
    inputs = [{"prompt_token_ids": tok(p, add_special_tokens=False)["input_ids"]} for p in prompts]

    kw = {"max_num_seqs": a.batch_size} if a.batch_size else {}
    llm = LLM(model=a.model, dtype="float32", gpu_memory_utilization=a.gpu_memory_utilization, **kw)
    try:
        max_num_seqs = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    except AttributeError:
        max_num_seqs = a.batch_size

    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(inputs[:4], warm, use_tqdm=False)  # warm-up, untimed

    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)

    result = {
        "engine": f"vllm-cpu-{vllm.__version__}",
        "mode": a.mode,
        "batch_size": max_num_seqs,
        "num_requests": len(outs),
        "output_tokens": n_out,
        "requested_output_tokens": len(prompts) * a.max_tokens,
        "elapsed_s": round(dt, 3),
        "output_tok_per_s": round(n_out / dt, 2),
        "loadavg_1m_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],  # noisy host?
        "torch_threads": int(os.environ["OMP_NUM_THREADS"]),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
