"""Both engines against transformers' generate on tiny random-weight Llama-family models."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.core.sampling_params import SamplingParams
from engines.llm import LLM


def reference(model_dir, prompts, max_new_tokens):
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    m.generation_config.eos_token_id = None  # ignore EOS, as the engines are asked to
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                       pad_token_id=0)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def prompts_of(lengths, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


LENGTHS = [5, 17, 1, 64, 33, 120, 16, 250]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3"])
def test_paged_matches_transformers(tiny_model_dirs, arch):
    d = tiny_model_dirs[arch]
    prompts = prompts_of(LENGTHS)
    ref = reference(d, prompts, 12)
    outs = LLM(d, kv_cache_tokens=4096).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref


@pytest.mark.parametrize("reservation", ["max", "pow2", "oracle"])
def test_static_matches_transformers(tiny_llama_dir, reservation):
    prompts = prompts_of(LENGTHS)
    ref = reference(tiny_llama_dir, prompts, 12)
    llm = LLM(tiny_llama_dir, engine="static", reservation=reservation, max_batch_size=3, max_model_len=512,
              kv_cache_tokens=4096)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    steps = llm.engine.steps
    assert max(s.num_seqs for s in steps) == 3
    if reservation == "max":
        assert max(s.kv_allocated for s in steps) == 3 * 512


def test_preemption_and_chunked_prefill_keep_outputs_exact(tiny_llama_dir):
    prompts = prompts_of(LENGTHS, seed=3)
    ref = reference(tiny_llama_dir, prompts, 12)
    llm = LLM(tiny_llama_dir, kv_cache_tokens=288, block_size=16, max_num_batched_tokens=128)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.engine.scheduler.kv.pool.num_blocks


def test_bad_requests_are_rejected_while_the_rest_completes(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=64, kv_cache_tokens=1024)
    prompts = prompts_of([10, 80, 10, 10])
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=0), GREEDY]
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "rejected", "rejected", "length"]
    assert "exceeds max_model_len (64)" in outs[1].error and "request 1" in outs[1].error
    assert "max_tokens must be >= 1" in outs[2].error
    assert len(outs[0].token_ids) == len(outs[3].token_ids) == 12


def test_eos_and_stop_strings(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=1024)
    prompt = prompts_of([20])[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    # make the 5th generated token the EOS token: it must stop there
    llm.eos_token_id = free.token_ids[4]
    eos = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    assert eos.finish_reason == "stop" and eos.token_ids == free.token_ids[:5]
    # a stop string taken from the free-running text ends generation before it
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        out = LLM(tiny_llama_dir, kv_cache_tokens=1024).generate(
            [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0]
        assert out.finish_reason == "stop" and stop not in out.text and text.startswith(out.text)


def test_seeded_sampling_is_reproducible(tiny_llama_dir):
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    prompts = prompts_of([9, 30])
    a = LLM(tiny_llama_dir, kv_cache_tokens=1024).generate(prompts, sp)
    b = LLM(tiny_llama_dir, kv_cache_tokens=1024).generate(prompts[:1], sp)
    assert a[0].token_ids == b[0].token_ids
