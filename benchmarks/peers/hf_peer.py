"""Peer benchmark: Hugging Face transformers, in-process, greedy, float32 unless ``--dtype bfloat16``.

Modes:
  generate        ``model.generate`` on left-padded static batches of ``--batch-size``;
                  EOS is suppressed with ``min_new_tokens``, so every request yields exactly
                  ``--max-tokens`` new tokens (checked).
  generate_batch  ``model.generate_batch`` (transformers >= 5 paged continuous batching) with the
                  model's default EOS (``eos_token_id=-1`` makes it crawl), so requests may stop
                  early; the tokens actually produced are counted.

Prompts: the first human turn of each ShareGPT conversation, truncated to ``--max-prompt-tokens``,
as plain text (no chat template). Only generation is timed, after an untimed warm-up.

    python benchmarks/peers/hf_peer.py --model DIR --num-prompts 64 --max-tokens 128 \
        --mode generate --batch-size 16 --out result.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.prompts import add_workload_args, load_sharegpt_prompts, truncate_prompts, write_result  # noqa: E402,E501


def run_generate(model, tok, prompts, max_tokens, batch_size):
    """Left-padded static batches; returns the number of new tokens (all checked to be max_tokens)."""
    total = 0
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, pad_token_id=tok.pad_token_id)
        new = out[:, enc["input_ids"].shape[1] :]
        assert new.shape[1] == max_tokens, f"got {new.shape[1]} new tokens, wanted {max_tokens}"
        assert not (new == model.generation_config.eos_token_id).any(), "EOS was generated"
        total += new.numel()
    return total


def run_generate_batch(model, tok, prompts, max_tokens):
    """Paged continuous batching with the default EOS; returns the tokens actually generated."""
    cfg = copy.deepcopy(model.generation_config)  # keeps the model's eos_token_id
    cfg.max_new_tokens, cfg.do_sample = max_tokens, False
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    with torch.inference_mode():
        res = model.generate_batch(ids, generation_config=cfg)
    assert len(res) == len(prompts), f"{len(res)} results for {len(prompts)} prompts"
    assert all(r.error is None for r in res.values()), "a request failed"
    return sum(len(r.generated_tokens) for r in res.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--mode", choices=["generate", "generate_batch"], default="generate")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).eval()
    prompts = truncate_prompts(load_sharegpt_prompts(a.num_prompts), tok, a.max_prompt_tokens)

    if a.mode == "generate":
        run = lambda ps, n: run_generate(model, tok, ps, n, a.batch_size)  # noqa: E731
    else:
        run = lambda ps, n: run_generate_batch(model, tok, ps, n)  # noqa: E731
    run(prompts[: min(4, len(prompts))], 8)  # warm-up, untimed

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    n_out = run(prompts, a.max_tokens)
    dt = time.perf_counter() - t0

    write_result(a.out, f"transformers-{__import__('transformers').__version__}", a.mode,
                 a.batch_size if a.mode == "generate" else None, len(prompts), n_out, a.max_tokens, dt, load0,
                 torch.get_num_threads(), extra={"dtype": a.dtype})


if __name__ == "__main__":
    main()
