"""The server's logprobs, echo, prompt_logprobs and vLLM's sampling extensions, checked by value against
transformers' float32 log-softmax on the same weights (a tiny random Llama; SmolLM2 in the real-model test)."""

import json
import math

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines import LLM
from server_helpers import CHATML, running_server, with_chat_template
from workbench.serve.app import build_app

KNOBS = dict(kv_cache_tokens=8192, max_model_len=256)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("tiny-lp") / "m")


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def server(model_dir, request):
    llm = LLM(model_dir, enable_prefix_caching=request.param, max_num_batched_tokens=24, **KNOBS)
    with running_server(build_app(llm, "tiny")) as url:
        yield url, llm


@pytest.fixture(scope="module")
def ref(model_dir):
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def logsoftmax(ids):
        with torch.no_grad():
            return torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logsoftmax


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def post(url, path="/v1/completions", **body):
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=60)


PROMPT = [11, 52, 7, 99, 140, 3, 250, 61, 18, 77, 201, 33, 5, 90, 120, 44, 8, 13, 160, 70, 21, 66, 240, 101,
          17, 29, 135, 87, 4, 222]  # 30 tokens: two chunks of the 24-token step budget


def test_echo_with_logprobs_as_lm_eval_asks(server, ref, tok):
    """lm-eval's loglikelihood request: ``max_tokens 1, logprobs 1, echo true`` with token-id prompts."""
    url, _ = server
    for _ in range(2):  # the second identical request must give the same logprobs (no prefix-cache skip)
        r = post(url, prompt=[PROMPT, PROMPT[:9]], max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234)
        assert r.status_code == 200, r.text
        for choice, prompt in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), [PROMPT, PROMPT[:9]]):
            lp = choice["logprobs"]
            assert "token_ids" not in choice  # not asked for
            assert len(lp["tokens"]) == len(prompt) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            full = ref(prompt)
            for q in range(1, len(prompt)):
                want = full[q - 1, prompt[q]].item()
                assert abs(lp["token_logprobs"][q] - want) < 1e-4
                top = lp["top_logprobs"][q]
                best = int(full[q - 1].argmax())
                own_s, best_s = tok.decode([prompt[q]]), tok.decode([best])
                if best != prompt[q] and own_s == best_s:
                    continue  # two ids with one text (parts of a UTF-8 character): one key in the dict
                # the position's own token, then the most likely one
                assert top[own_s] == lp["token_logprobs"][q]
                assert abs(top[best_s] - full[q - 1, best].item()) < 1e-4
                assert len(top) == (1 if best == prompt[q] else 2)
            # the generated token: greedy, its logprob the last position's max
            assert abs(lp["token_logprobs"][-1] - full[-1].max().item()) < 1e-4
            assert lp["tokens"][-1] == tok.decode([int(full[-1].argmax())])
            assert choice["text"] == tok.decode(prompt) + tok.decode([int(full[-1].argmax())])
            # text offsets are the running length of the token strings
            assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]


def test_generated_logprobs_and_top_n(server, ref, tok):
    url, _ = server
    r = post(url, prompt=PROMPT[:12], max_tokens=5, logprobs=3, temperature=0, ignore_eos=True, return_token_ids=True)
    c = r.json()["choices"][0]
    full = ref(PROMPT[:12] + c["token_ids"])
    for k, tid in enumerate(c["token_ids"]):
        row = full[11 + k]
        assert abs(c["logprobs"]["token_logprobs"][k] - row[tid].item()) < 1e-4
        top3 = torch.topk(row, 3)
        got = c["logprobs"]["top_logprobs"][k]
        assert set(got) == {tok.decode([t]) for t in top3.indices.tolist()}  # the sampled one is the top one
        for t, v in zip(top3.indices.tolist(), top3.values.tolist()):
            assert abs(got[tok.decode([t])] - v) < 1e-4
    assert "prompt_logprobs" not in c


def test_prompt_logprobs_vllm_format(server, ref):
    url, _ = server
    for stream in (False, True):
        r = post(url, prompt=PROMPT, max_tokens=2, prompt_logprobs=2, temperature=0, stream=stream)
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            pl = chunks[0]["choices"][0]["prompt_logprobs"]
            assert all("prompt_logprobs" not in ch["choices"][0] for ch in chunks[1:])
        else:
            pl = r.json()["choices"][0]["prompt_logprobs"]
        full = ref(PROMPT)
        assert pl[0] is None and len(pl) == len(PROMPT)
        for q in range(1, len(PROMPT)):
            own = pl[q][str(PROMPT[q])]
            assert abs(own["logprob"] - full[q - 1, PROMPT[q]].item()) < 1e-4
            assert own["rank"] == int((full[q - 1] > full[q - 1, PROMPT[q]]).sum()) + 1
            top2 = torch.topk(full[q - 1], 2).indices.tolist()
            assert set(pl[q]) == {str(PROMPT[q])} | {str(t) for t in top2}


def test_chat_logprobs_and_top_logprobs(server, ref, tok):
    url, llm = server
    r = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "fox"}], max_tokens=4,
             logprobs=True, top_logprobs=2, temperature=0, ignore_eos=True, return_token_ids=True)
    c = r.json()["choices"][0]
    prompt = llm.encode("fox", chat=True)
    full = ref(prompt + c["token_ids"])
    content = c["logprobs"]["content"]
    assert len(content) == 4
    for k, (tid, e) in enumerate(zip(c["token_ids"], content)):
        row = full[len(prompt) - 1 + k]
        assert e["token"] == tok.decode([tid])
        if "\ufffd" not in e["token"]:
            assert e["bytes"] == list(e["token"].encode())
        assert abs(e["logprob"] - row[tid].item()) < 1e-4
        assert [t["token"] for t in e["top_logprobs"]] == [tok.decode([t]) for t in torch.topk(row, 2).indices.tolist()]
    # streamed: the same entries, one per chunk
    r = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "fox"}], max_tokens=4,
             logprobs=True, top_logprobs=2, temperature=0, ignore_eos=True, stream=True)
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    streamed = [e for ch in chunks if ch["choices"] and ch["choices"][0].get("logprobs")
                for e in ch["choices"][0]["logprobs"]["content"]]
    assert [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in streamed] == \
        [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in content]
    # the second request may read the first's cached prompt KV: the same figures within float32 rounding
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed, content)) < 1e-4
    # without logprobs, none
    r = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "fox"}], max_tokens=2)
    assert r.json()["choices"][0]["logprobs"] is None


def test_streamed_completion_logprobs_match_the_non_streamed(server):
    url, _ = server
    body = dict(prompt=PROMPT[:10], max_tokens=5, logprobs=2, echo=True, temperature=0, ignore_eos=True)
    whole = post(url, **body).json()["choices"][0]
    r = post(url, stream=True, **body)
    chunks = [json.loads(x[6:])["choices"][0] for x in r.text.splitlines() if x.startswith("data: {")]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        for k in merged:
            merged[k] += ch["logprobs"][k] if ch["logprobs"] else []
    assert "".join(ch["text"] for ch in chunks) == whole["text"]
    assert merged == whole["logprobs"]


def test_sampling_extensions_by_value(server, tok):
    url, _ = server
    base = dict(prompt=PROMPT[:8], temperature=0, ignore_eos=True, return_token_ids=True)
    free = post(url, max_tokens=10, **base).json()["choices"][0]["token_ids"]
    # logit_bias forces a token; stop_token_ids ends at it, kept in token_ids, reason = the id
    r = post(url, max_tokens=6, logit_bias={"77": 100}, **base).json()["choices"][0]
    assert r["token_ids"] == [77] * 6
    stop_tok = free[3]
    first = free.index(stop_tok)
    r = post(url, max_tokens=10, stop_token_ids=[stop_tok], **base).json()["choices"][0]
    assert r["token_ids"] == free[: first + 1] and r["finish_reason"] == "stop" and r["stop_reason"] == stop_tok
    # min_tokens holds the stop token off
    r = post(url, max_tokens=10, stop_token_ids=[stop_tok], min_tokens=first + 2, **base).json()["choices"][0]
    assert len(r["token_ids"]) >= first + 2 and stop_tok not in r["token_ids"][: first + 1]
    # penalties change a repeated token (the bias makes 77 win; the penalties hold it off after it occurs)
    pen = post(url, max_tokens=8, logit_bias={"77": 14}, repetition_penalty=1.7, frequency_penalty=2.0,
               presence_penalty=2.0, **base).json()["choices"][0]["token_ids"]
    assert pen[0] == 77 and pen != [77] * 8  # tests/test_logprobs_sampling.py checks the formula token by token
    # include_stop_str_in_output keeps the stop string; without it the text ends before it
    text = tok.decode(free)
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text)) if "\ufffd" not in text[i:i + 2])
    cut = post(url, max_tokens=10, stop=[stop], **base).json()["choices"][0]
    kept = post(url, max_tokens=10, stop=[stop], include_stop_str_in_output=True, **base).json()["choices"][0]
    assert cut["stop_reason"] == stop and cut["text"] == text[: text.index(stop)]
    assert kept["text"] == cut["text"] + stop and kept["stop_reason"] == stop


def test_best_of_returns_the_n_most_likely_and_counts_all(server):
    url, _ = server
    r = post(url, prompt=PROMPT[:6], max_tokens=4, n=2, best_of=4, temperature=1.0, seed=5, ignore_eos=True,
             logprobs=0)
    body = r.json()
    assert r.status_code == 200 and len(body["choices"]) == 2
    assert body["usage"]["completion_tokens"] == 16  # 4 sequences x 4 tokens
    # the same seeds, one sequence per call: the 4 candidates and their cumulative logprobs
    cands = []
    for i in range(4):
        c = post(url, prompt=PROMPT[:6], max_tokens=4, temperature=1.0, seed=5 + i, ignore_eos=True,
                 logprobs=0).json()["choices"][0]
        cands.append((sum(c["logprobs"]["token_logprobs"]), c["text"]))
    best = sorted(cands, key=lambda x: -x[0])[:2]
    assert [c["text"] for c in body["choices"]] == [t for _, t in best]
    got = [sum(c["logprobs"]["token_logprobs"]) for c in body["choices"]]
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, (b, _) in zip(got, best))


def test_token_bytes_rebuild_split_characters(tok):
    """Characters split over tokens: each token's ``bytes`` are its raw bytes, which join to the UTF-8."""
    from types import SimpleNamespace

    from workbench.serve.app import _View

    state = SimpleNamespace(tokenizer=tok, token_strs={})
    view = _View.__new__(_View)
    view.state = state
    for text in ("日本語のテキスト", "naïve café 😀", "plain words"):
        ids = tok.encode(text)
        assert b"".join(bytes(view.token_bytes(t)) for t in ids) == text.encode()
    assert any("\ufffd" in tok.decode([t]) for t in tok.encode("日本語"))  # some pieces are partial characters


def test_tokenizer_info_as_lm_eval_reads_it(server):
    url, _ = server
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == CHATML
    assert info["model_max_length"] == 256
    r = httpx.post(url + "/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert isinstance(r["tokens"], list) and r["tokens"]


def test_special_tokens_kept_when_asked(server):
    url, _ = server
    r = post(url, prompt=PROMPT[:5], max_tokens=3, logit_bias={"2": 100}, ignore_eos=True, temperature=0,
             skip_special_tokens=False).json()["choices"][0]  # token 2 is <|im_end|>
    assert r["text"] == "<|im_end|>" * 3
    r = post(url, prompt=PROMPT[:5], max_tokens=3, logit_bias={"2": 100}, ignore_eos=True, temperature=0).json()
    assert r["choices"][0]["text"] == ""


def test_openai_client_reads_logprobs(server):
    url, _ = server
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = c.completions.create(model="tiny", prompt=PROMPT[:7], max_tokens=3, logprobs=2, echo=True, temperature=0)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == 10 and len(lp.top_logprobs) == 10
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "dog"}], max_tokens=3,
                                     logprobs=True, top_logprobs=1, temperature=0)
    assert len(chat.choices[0].logprobs.content) >= 1


@pytest.mark.real_model
def test_real_model_logprobs_match_transformers(smollm2_dir):
    """SmolLM2-135M: echo + logprobs and prompt logprobs within 1e-4 of transformers' float32 log-softmax,
    with prefix caching on, twice (the second request would hit the cache)."""
    tokzr = AutoTokenizer.from_pretrained(smollm2_dir)
    m = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
    ids = tokzr(text)["input_ids"]
    with torch.no_grad():
        full = torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), dim=-1)
    llm = LLM(smollm2_dir, kv_cache_tokens=4096, max_model_len=512)
    with running_server(build_app(llm, "smollm2-135m")) as url:
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json={
                "model": "smollm2-135m", "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True,
                "temperature": 0, "prompt_logprobs": 0}, timeout=120).json()
            lp = r["choices"][0]["logprobs"]["token_logprobs"]
            err = max(abs(lp[q] - full[q - 1, ids[q]].item()) for q in range(1, len(ids)))
            print(f"SmolLM2 echo logprobs vs transformers float32: largest error {err:.2e} over {len(ids)} tokens")
            assert err < 1e-4, err
            pl = r["choices"][0]["prompt_logprobs"]
            assert max(abs(pl[q][str(ids[q])]["logprob"] - full[q - 1, ids[q]].item()) for q in range(1, len(ids))) < 1e-4
            assert abs(lp[-1] - full[-1].max().item()) < 1e-4
