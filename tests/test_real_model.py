"""SmolLM2-135M-Instruct: both engines token-identical to transformers' generate (float32, greedy)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from engines.core.sampling_params import SamplingParams
from engines.llm import LLM

pytestmark = pytest.mark.real_model

TEXT = (
    "Serving a language model to many users at once is mostly a memory problem. Every request keeps the "
    "keys and values of all its previous tokens, and that cache grows by one entry per layer for every token "
    "it generates. A server that reserves space for the longest possible answer wastes most of it, because "
    "few answers are that long. Paging the cache into small blocks, the way an operating system pages "
    "virtual memory, lets the server hand out memory only when a request actually needs it. The scheduler "
    "then decides, after each forward pass, which requests run next: finished requests leave the batch at "
    "once and waiting ones take their place. When memory runs out, the newest request is evicted and its "
    "cache recomputed later. Prefix caching reuses the blocks of a shared system prompt, and chunked "
    "prefill splits a long prompt across steps so that it does not stall the decodes of everyone else. "
    "Measuring all of this honestly needs a baseline: a static batch that waits for its longest member, "
    "with contiguous memory reserved up front. Here is a short story to vary the text. The lighthouse "
    "keeper counted ships every night, writing their names in a ledger that nobody read. One winter a ship "
    "came without a name, its sails grey as the fog, and the keeper wrote down only a question mark. In the "
    "spring, letters began arriving addressed to the question mark, and the keeper, unsure what else to do, "
    "answered each of them. Recipes follow: to bake bread, mix flour, water, salt and yeast; knead for ten "
    "minutes; let it rise for an hour; shape it; bake it at two hundred and twenty degrees until the crust "
    "sounds hollow when tapped. Some arithmetic: seventeen times three is fifty-one, and the square root of "
    "one hundred and forty-four is twelve. "
)
LENGTHS = [5, 9, 14, 23, 37, 50, 64, 80, 101, 128, 160, 200, 250, 300, 350, 400]
MAX_NEW = 32


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok(TEXT * 3)["input_ids"]
    return [ids[(i * 37) % 200 : (i * 37) % 200 + n] for i, n in enumerate(LENGTHS)]


def hf_greedy(model_dir, prompts, dtype: torch.dtype) -> list[list[int]]:
    """transformers' greedy ``generate`` of MAX_NEW tokens per prompt (EOS ignored), in ``dtype``."""
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    m.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=2)
        out.append(g[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts):
    return hf_greedy(smollm2_dir, prompts, torch.float32)


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def test_paged_engine_is_token_exact(smollm2_dir, prompts, reference):
    outs = LLM(smollm2_dir, kv_cache_tokens=16384, max_model_len=2048).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_paged_engine_is_token_exact_under_preemption(smollm2_dir, prompts, reference):
    llm = LLM(smollm2_dir, kv_cache_tokens=1024, max_model_len=1024, max_num_batched_tokens=512)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference


def test_static_engine_is_token_exact(smollm2_dir, prompts, reference):
    llm = LLM(smollm2_dir, engine="static", reservation="pow2", max_batch_size=16, max_model_len=1024,
              kv_cache_tokens=16384)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_cli_chat_answers_paris():
    from workbench.cli import app

    res = CliRunner().invoke(app, ["generate", "--chat", "--prompt", "What is the capital of France?",
                                   "--temperature", "0", "--max-tokens", "24", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])["outputs"][0]
    assert "Paris" in out["text"] and out["token_ids"]


def greedy_agreement(reference: list[list[int]], tokens: list[list[int]]) -> tuple[float, float, float]:
    """``(positions, prompts identical, first tokens)``: the fraction of reference positions matched up to
    each prompt's first divergence, the fraction of prompts identical, the fraction of prompts whose first
    generated token matches."""
    from workbench.quality import agreement

    pos, same = agreement(reference, tokens)
    return pos, same, sum(r[:1] == t[:1] for r, t in zip(reference, tokens)) / len(reference)


def test_paged_engine_in_bfloat16_agrees_with_transformers_in_bfloat16(smollm2_dir, prompts):
    """bfloat16 is not token-exact: two implementations that round differently (attention summation order,
    fused vs unfused ops) drift apart after a few tokens. Measured on the 16 prompts x 32 tokens (2-core AVX-512
    EPYC, torch 2.13): our engine vs transformers, both bfloat16: 0.70-0.71 of positions up to each prompt's
    first divergence, 8-10 of 16 prompts identical, the first token equal on 15-16 of 16 (0.88 and 11 of 16 with
    attention_backend torch), as the CPU attention kernel changed; transformers' own bfloat16 against its
    float32 agrees on 0.74 of positions. The bounds leave room for that noise, and would catch a wrong
    bfloat16 path (which diverges at once)."""
    reference = hf_greedy(smollm2_dir, prompts, torch.bfloat16)
    outs = LLM(smollm2_dir, kv_cache_tokens=16384, max_model_len=2048, dtype="bfloat16").generate(prompts, GREEDY)
    pos, same, first = greedy_agreement(reference, [o.token_ids for o in outs])
    print(f"bf16 vs transformers bf16: positions {pos:.3f}, prompts identical {same:.3f}, first tokens {first:.3f}")
    assert pos >= 0.55 and same >= 0.25 and first >= 0.85
