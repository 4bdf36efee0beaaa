"""Log-probabilities, prompt log-probabilities and vLLM's sampling extensions on the real engine, against
transformers' float32 forward pass on the same tiny random-weight Llama."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.core.sampling_params import SamplingParams
from engines.llm import LLM


def prompts_of(lengths, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def ref_logsoftmax(model_dir, ids):
    """transformers' float32 log-softmax at every position of ``ids``: ``[len(ids), vocab]``."""
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("caching", [True, False])
def test_output_and_prompt_logprobs_match_transformers(tiny_llama_dir, caching):
    prompts = prompts_of([40, 7, 90])
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    # a small chunk budget splits the 90-token prompt over steps; the second call of the same prompts would
    # hit the prefix cache if prompt log-probabilities did not bypass it
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096, enable_prefix_caching=caching, max_num_batched_tokens=32)
    for _ in range(2):
        outs = llm.generate(prompts, sp)
        for p, o in zip(prompts, outs):
            full = p + o.token_ids
            ref = ref_logsoftmax(tiny_llama_dir, full)
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
            for q in range(1, len(p)):
                lp = o.prompt_logprobs[q]
                assert lp.token_id == p[q]
                assert abs(lp.logprob - ref[q - 1, p[q]].item()) < 1e-4
                assert lp.rank == int((ref[q - 1] > ref[q - 1, p[q]]).sum()) + 1
                top = torch.topk(ref[q - 1], 2)
                assert [t for t, _ in lp.top] == top.indices.tolist()
                assert max(abs(a - b) for (_, a), b in zip(lp.top, top.values.tolist())) < 1e-4
            assert len(o.logprobs) == 6
            for k, lp in enumerate(o.logprobs):
                row = ref[len(p) - 1 + k]
                assert lp.token_id == o.token_ids[k] == int(row.argmax())  # greedy
                assert lp.rank == 1 and abs(lp.logprob - row.max().item()) < 1e-4
                assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()
    if caching:
        assert llm.engine.scheduler.kv.prefix_hits == 0  # nothing was read from the cache


def test_logprobs_zero_gives_the_sampled_token_only_and_none_when_unset(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096)
    [p] = prompts_of([12])
    a, b = llm.generate([p, p], [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0),
                                 SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)])
    assert [lp.top for lp in a.logprobs] == [[], [], []] and all(lp.logprob <= 0 for lp in a.logprobs)
    assert b.logprobs is None and b.prompt_logprobs is None
    assert a.token_ids == b.token_ids


def test_sampled_logprobs_are_of_the_raw_logits(tiny_llama_dir):
    """A sampled (temperature 2) token's logprob is the raw model's, not the tempered distribution's."""
    [p] = prompts_of([10])
    out = LLM(tiny_llama_dir, kv_cache_tokens=4096).generate(
        [p], SamplingParams(max_tokens=4, temperature=2.0, seed=3, ignore_eos=True, logprobs=1))[0]
    ref = ref_logsoftmax(tiny_llama_dir, p + out.token_ids)
    for k, lp in enumerate(out.logprobs):
        assert abs(lp.logprob - ref[len(p) - 1 + k, out.token_ids[k]].item()) < 1e-4


def greedy_next(model_dir, ids, process=None):
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0, -1].float()
    return logits if process is None else process(logits)


def test_logit_bias_forces_a_token(tiny_llama_dir):
    [p] = prompts_of([8])
    out = LLM(tiny_llama_dir, kv_cache_tokens=4096).generate(
        [p], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias={77: 100.0}))[0]
    assert out.token_ids == [77] * 5


def test_penalties_follow_their_definitions(tiny_llama_dir):
    """Each greedy token equals the argmax of transformers' logits after the documented bias and penalty
    formulas. A bias makes token 77 win every step; the penalties then hold it off after it occurs."""
    [p] = prompts_of([9])
    bias = {77: 14.0}
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.7,
                        frequency_penalty=2.0, presence_penalty=2.0, logit_bias=bias)
    out = LLM(tiny_llama_dir, kv_cache_tokens=4096).generate([p], sp)[0]
    plain = LLM(tiny_llama_dir, kv_cache_tokens=4096).generate(
        [p], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias=bias))[0]
    assert plain.token_ids == [77] * 8
    assert out.token_ids[0] == 77 and out.token_ids != plain.token_ids  # the penalties change something here
    ctx = list(p)
    for tok in out.token_ids:
        outs = ctx[len(p):]

        def penalize(x):
            x[77] += 14.0
            seen = torch.tensor(sorted(set(ctx)))
            v = x[seen]
            x[seen] = torch.where(v > 0, v / 1.7, v * 1.7)
            for t in set(outs):
                x[t] -= 2.0 * outs.count(t) + 2.0
            return x

        assert tok == int(greedy_next(tiny_llama_dir, ctx, penalize).argmax())
        ctx.append(tok)


def test_min_tokens_and_stop_token_ids(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096)
    [p] = prompts_of([6])
    free = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    stop_tok = free[2]
    first = free.index(stop_tok)
    # the first occurrence of stop_tok ends generation; the token is kept in token_ids, the reason is its id
    o = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert o.token_ids == free[: first + 1] and o.finish_reason == "stop"
    # min_tokens masks the stop token until that many outputs exist
    o = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok],
                                         min_tokens=first + 2))[0]
    assert len(o.token_ids) >= first + 2 and stop_tok not in o.token_ids[: first + 1]
    # EOS is masked too: with the EOS id biased up it would come first, min_tokens holds it off
    llm.eos_token_id = 5
    o = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, logit_bias={5: 100.0}, min_tokens=3))[0]
    assert len(o.token_ids) == 4 and o.token_ids[-1] == 5 and 5 not in o.token_ids[:3]


def test_min_p_keeps_only_likely_tokens(tiny_llama_dir):
    [p] = prompts_of([6])
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096)
    # min_p = 1 keeps only the most likely token: sampling at any temperature is greedy
    a = llm.generate([p], SamplingParams(max_tokens=6, temperature=1.5, seed=1, ignore_eos=True, min_p=1.0))[0]
    g = llm.generate([p], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert a.token_ids == g.token_ids


def test_bad_extension_values_are_rejected(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096)
    [p] = prompts_of([4])
    bad = [SamplingParams(min_tokens=20, max_tokens=4), SamplingParams(presence_penalty=3),
           SamplingParams(repetition_penalty=0), SamplingParams(logit_bias={1: 200.0}), SamplingParams(logprobs=21),
           SamplingParams(prompt_logprobs=-1), SamplingParams(min_p=1.5)]
    outs = llm.generate([p] * len(bad), bad)
    assert [o.finish_reason for o in outs] == ["rejected"] * len(bad)
    assert "min_tokens" in outs[0].error and "presence_penalty" in outs[1].error and "logprobs" in outs[4].error
