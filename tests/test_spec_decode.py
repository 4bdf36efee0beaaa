"""Speculative decoding on the real paged engine: the n-gram proposer, the acceptance rule, and greedy output
token-identical to the same engine without speculation (tiny random model and the real model), under
preemption and prefix caching, with no block left behind."""

import pytest
import torch

from engines.core.sampling_params import SamplingParams
from engines.core.spec_decode import NgramProposer, SpecDecodeConfig, SpecDecodeStats
from engines.llm import LLM
from engines.real.sampler import Sampler


def repetitive_prompts(lengths, vocab=300, seed=0):
    """Prompts that repeat themselves (a passage, half of it, the passage again), so prompt lookup finds
    matches; random tiny models also tend to loop, which gives ngram drafts in the output."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        base = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(base + base[: n // 2] + base)
    return out


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SPECS = [dict(speculative_model="ngram", num_speculative_tokens=4),
         dict(speculative_model="ngram", num_speculative_tokens=1, prompt_lookup_min=2, prompt_lookup_max=3),
         dict(speculative_model="layers:1", num_speculative_tokens=3)]


def assert_no_blocks_held(llm):
    kv = llm.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not any(kv.block_tables.values())


# -- proposer, config, counters ----------------------------------------------------------------
def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    p = NgramProposer(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # suffix [5, 6, 7] occurs at 0 (followed by 8, 1, 6); [6, 7] is more recent (at 5) but shorter
    assert p.propose(toks, 3) == [8, 1, 6]
    assert p.propose(toks, 1) == [8]
    assert NgramProposer(1, 2).propose(toks, 2) == [9, 5]  # longest n = 2: the most recent [6, 7] is at 5
    assert p.propose([1, 2, 3], 4) == []  # no earlier occurrence of any suffix
    assert p.propose([4, 4], 3) == [4]  # a match at the very end proposes what there is
    assert NgramProposer(2, 2).propose([1, 2, 9, 2], 3) == []  # [9, 2] never occurred before


def test_spec_config_parses_the_scenario_vocabulary_and_refuses_the_rest():
    assert SpecDecodeConfig.parse("ngram", 4) == SpecDecodeConfig("ngram", 4, 1, 4)
    assert SpecDecodeConfig.parse("layers:12", 2).draft_layers == 12
    for bad, k in [("ngram", 0), ("ngram", None), ("layers:x", 2), ("layers:0", 2), ("qwen2.5-0.5b", 3)]:
        with pytest.raises(ValueError, match="speculative_model|num_speculative_tokens"):
            SpecDecodeConfig.parse(bad, k)
    with pytest.raises(ValueError, match="prompt_lookup"):
        SpecDecodeConfig.parse("ngram", 2, prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="prompt_lookup"):
        SpecDecodeConfig.parse("layers:2", 2, prompt_lookup_max=2)


def test_stats_follow_vllm_counters():
    st = SpecDecodeStats()
    st.record(4, 2)
    st.record(2, 0)
    st.record(0, 0)  # no drafts: not a draft
    d = st.as_dict()
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (2, 6, 2)
    assert d["acceptance_rate"] == pytest.approx(2 / 6)
    assert d["mean_acceptance_length"] == pytest.approx(1 + 2 / 2)
    assert d["accepted_per_pos"] == [1, 1, 0, 0]
    assert d["acceptance_rate_per_pos"] == [0.5, 0.5, 0.0, 0.0]


# -- the acceptance rule -------------------------------------------------------------------------
def test_greedy_verify_keeps_the_longest_matching_prefix_then_the_targets_token():
    s = Sampler(0)
    logits = torch.full((4, 6), -5.0)
    for row, tok in enumerate([2, 3, 1, 5]):  # the target's argmax after the last token and each draft
        logits[row, tok] = 5.0
    p = SamplingParams(temperature=0)
    assert s.verify(logits, [2, 3, 4], "r", p) == ([2, 3], 1)  # third draft wrong: the target's 1 follows
    assert s.verify(logits, [2, 3, 1], "r", p) == ([2, 3, 1], 5)  # all kept: the bonus token
    assert s.verify(logits, [0, 3, 1], "r", p) == ([], 2)


def test_sampled_verify_leaves_the_target_distribution_unchanged():
    """Speculative sampling with a point-mass draft: the first emitted token is distributed as p, whatever
    the draft (here the most likely and an unlikely token), within 4 standard errors over 20,000 draws."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0], [0.0] * 5])
    p = torch.softmax(logits[0], -1)
    params = SamplingParams(temperature=1.0, seed=7)
    n = 20000
    for draft in (3, 2):
        s = Sampler(0)
        counts = torch.zeros(5)
        kept = 0
        for _ in range(n):
            acc, nxt = s.verify(logits, [draft], "r", params)
            counts[acc[0] if acc else nxt] += 1
            kept += len(acc)
        freq = counts / n
        se = (p * (1 - p) / n).sqrt()
        assert ((freq - p).abs() <= 4 * se + 1e-3).all(), (draft, freq, p)
        assert kept / n == pytest.approx(float(p[draft]), abs=4 * float(se[draft]) + 1e-3)  # P(keep d) = p(d)


def test_sampled_verify_is_reproducible_per_seed():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    runs = [[Sampler(0).verify(logits, [1, 2, 3, 4], "r", params) for _ in range(1)] for _ in range(2)]
    assert runs[0] == runs[1]


# -- the engine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s['speculative_model']}-k{s['num_speculative_tokens']}")
def test_greedy_output_is_token_identical_with_speculation(tiny_llama_dir, spec):
    prompts = repetitive_prompts([5, 17, 33, 64, 120])
    ref = [o.token_ids for o in LLM(tiny_llama_dir, kv_cache_tokens=4096).generate(prompts, GREEDY)]
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096, **spec)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    st = llm.engine.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0, st
    assert st.num_accepted_tokens <= st.num_draft_tokens
    # fewer steps than tokens: some steps emitted several tokens per request
    assert sum(s.spec_accepted_tokens for s in llm.engine.steps) == st.num_accepted_tokens
    assert all(len(o.token_times) == len(o.token_ids) for o in outs)
    assert_no_blocks_held(llm)


def test_speculation_under_preemption_and_prefix_caching_keeps_outputs_exact(tiny_llama_dir):
    """A KV pool too small for the batch (recompute and swap preemptions) and prompts that share a long
    prefix (prefix-cache hits): outputs equal those of the same engine without speculation."""
    shared = repetitive_prompts([40])[0]
    prompts = [shared + p for p in repetitive_prompts([3, 9, 20, 31, 12, 7], seed=1)]
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for mode in ("recompute", "swap"):
        knobs = dict(kv_cache_tokens=448, block_size=8, max_num_seqs=6, preemption_mode=mode,
                     swap_space_bytes=10**7)
        ref = [o.token_ids for o in LLM(tiny_llama_dir, **knobs).generate(prompts, sp)]
        llm = LLM(tiny_llama_dir, speculative_model="ngram", num_speculative_tokens=4, **knobs)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == ref, mode
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0, mode
        assert sched.kv.prefix_hits > 0
        assert sched.spec_stats.num_accepted_tokens > 0
        assert_no_blocks_held(llm)


def test_stop_tokens_and_max_tokens_inside_a_speculative_step(tiny_llama_dir):
    """A stop token or max_tokens reached among a step's kept drafts ends the request there: the same
    tokens, finish reason and text as without speculation."""
    prompts = repetitive_prompts([33, 64, 120])
    plain = LLM(tiny_llama_dir, kv_cache_tokens=4096)
    spec = LLM(tiny_llama_dir, kv_cache_tokens=4096, speculative_model="ngram", num_speculative_tokens=6)
    ref = plain.generate(prompts, GREEDY)
    for i, r in enumerate(ref):
        stop_tok = r.token_ids[len(r.token_ids) // 2]
        text = plain.tokenizer.decode(r.token_ids[: len(r.token_ids) // 2 + 3])
        cases = [SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_tok]),
                 SamplingParams(max_tokens=len(r.token_ids) // 2 + 1, temperature=0, ignore_eos=True),
                 SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[text[-3:]])]
        for sp in cases:
            want, got = plain.generate([prompts[i]], sp)[0], spec.generate([prompts[i]], sp)[0]
            assert (got.token_ids, got.finish_reason, got.text) == (want.token_ids, want.finish_reason, want.text)
            assert len(got.token_times) == len(got.token_ids)
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_no_blocks_held(spec)


def test_requests_that_need_per_token_state_decode_without_drafts(tiny_llama_dir):
    """Penalties, log-probabilities and beam search get no drafts: their outputs are the plain engine's."""
    prompts = repetitive_prompts([20, 40])
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096, speculative_model="ngram", num_speculative_tokens=3)
    plain = LLM(tiny_llama_dir, kv_cache_tokens=4096)
    for sp in [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3),
               SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)]:
        before = llm.engine.scheduler.spec_stats.num_drafts
        assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]
        assert llm.engine.scheduler.spec_stats.num_drafts == before


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama_dir):
    prompts = repetitive_prompts([20, 50])
    sp = SamplingParams(max_tokens=30, temperature=0.7, top_p=0.95, seed=11, ignore_eos=True)
    runs = [[o.token_ids for o in LLM(tiny_llama_dir, kv_cache_tokens=4096, speculative_model="ngram",
                                      num_speculative_tokens=3).generate(prompts, sp)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(t) == 30 for t in runs[0])


def test_speculation_knobs_are_refused_where_they_do_not_apply(tiny_llama_dir):
    with pytest.raises(ValueError, match="paged engine"):
        LLM(tiny_llama_dir, engine="static", speculative_model="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="need speculative_model"):
        LLM(tiny_llama_dir, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="has only 2 layers"):
        LLM(tiny_llama_dir, speculative_model="layers:99", num_speculative_tokens=2)


def test_scenario_engine_takes_speculation_and_results_report_acceptance(tiny_llama_dir, tmp_path):
    import yaml

    from workbench.runner import run_scenario
    from workbench.scenario import load_scenario

    from engines.sim.cost_model import CostModel

    CostModel({"const": 0.002, "tokens": 1e-4, "decode_ctx": 0, "prefill_attn": 0, "sampled": 0}).save(tmp_path / "cm.json")
    engine = {"kind": "paged", "kv_cache_tokens": 4096, "max_model_len": 256}
    sim = {"kind": "sim", "cost_model": "cm.json", "kv_cache_tokens": 4096, "max_model_len": 256, "step_noise": False}
    d = {"name": "spec", "seed": 1, "model": str(tiny_llama_dir),
         "trace": {"format": "synthetic", "synthetic": {"num_requests": 6, "request_rate": 40.0, "lengths": "uniform",
                                                        "input_range": [8, 60], "output_range": [30, 40]}},
         "engines": [dict(engine, name="plain"),
                     dict(engine, name="spec", speculative_model="ngram", num_speculative_tokens=3),
                     dict(sim, name="sim-plain"),
                     dict(sim, name="sim-spec", speculative_model="ngram", num_speculative_tokens=3,
                          spec_acceptance_rate=0.6)]}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    res = run_scenario(load_scenario(p), tmp_path / "out", plots=False)
    plain, spec = res["engines"]["plain"]["summary"], res["engines"]["spec"]["summary"]
    assert "spec_decode" not in plain and "spec_decode" in res["formulas"]
    sd = spec["spec_decode"]
    assert sd["num_drafts"] > 0 and 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"]
    assert sd["mean_acceptance_length"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])
    assert spec["total_output_tokens"] == plain["total_output_tokens"]
    # the simulator runs the same speculative path: the same outputs in fewer steps, at the given rate
    sim_plain, sim_spec = res["engines"]["sim-plain"]["summary"], res["engines"]["sim-spec"]["summary"]
    assert sim_spec["total_output_tokens"] == sim_plain["total_output_tokens"]
    assert sim_spec["num_steps"] < sim_plain["num_steps"]
    assert 0.3 < sim_spec["spec_decode"]["acceptance_rate"] < 0.9
    bad = dict(d, engines=[dict(engine, name="x", num_speculative_tokens=3)])
    p.write_text(yaml.safe_dump(bad))
    with pytest.raises(Exception, match="needs speculative_model"):
        load_scenario(p)


# -- the real model -----------------------------------------------------------------------------
PASSAGE = ("PagedAttention stores the key and value cache of each request in fixed-size blocks that need not be "
           "contiguous in memory, and a block table maps each request's logical blocks to physical ones. ")


@pytest.mark.real_model
def test_real_model_greedy_output_is_identical_with_ngram_and_a_layer_draft(smollm2_dir, one_thread):
    plain = LLM(smollm2_dir, kv_cache_tokens=8192)
    tok = plain.tokenizer

    def chat(t):
        return tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)

    prompts = [chat("Repeat the following passage exactly, word for word:\n\n" + PASSAGE * 2),
               chat("Fix the typo in this sentence and repeat it: " + PASSAGE.replace("memory", "memroy")),
               chat("Copy this text: " + PASSAGE),
               chat("What is the capital of France?")]
    sp = SamplingParams(max_tokens=48, temperature=0)
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    for spec in (dict(speculative_model="ngram", num_speculative_tokens=4),
                 dict(speculative_model="layers:20", num_speculative_tokens=2)):
        llm = LLM(smollm2_dir, kv_cache_tokens=8192, **spec)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == ref, spec
        st = llm.engine.scheduler.spec_stats
        assert st.num_drafts > 0
        if spec["speculative_model"] == "ngram":  # the copy prompts repeat their input: most drafts are kept
            assert st.acceptance_rate > 0.4, st.as_dict()
        assert_no_blocks_held(llm)


def test_server_streams_a_speculative_steps_tokens_and_exports_vllm_counters(tiny_llama_dir):
    """``workbench serve`` with speculation: the streamed token ids (a chunk may carry several) equal the
    plain engine's greedy output, and ``/metrics`` has vLLM's spec-decode counters."""
    import httpx
    import openai
    from server_helpers import running_server

    from workbench.serve.app import build_app
    from workbench.serve.prom import parse_metrics

    prompt = repetitive_prompts([5])[0]  # token ids (this one gets drafts accepted)
    want = LLM(tiny_llama_dir, kv_cache_tokens=4096).generate([prompt], GREEDY)[0].token_ids
    app = build_app(LLM(tiny_llama_dir, kv_cache_tokens=4096, speculative_model="ngram", num_speculative_tokens=4),
                    "tiny")
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True, "return_token_ids": True}))
        got = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
        assert got == want
        m = parse_metrics(httpx.get(url + "/metrics").text)
    assert m["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]
    assert m["vllm:generation_tokens_total"] == 40
