"""The OpenAI-compatible server (workbench serve) with the official openai client, on a tiny random model."""

import asyncio
import json
import shutil
import threading
import time

import httpx
import openai
import pytest

from engines import LLM, SamplingParams
from server_helpers import running_server
from workbench.serve.app import build_app
from workbench.serve.prom import parse_metrics

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KNOBS = dict(kv_cache_tokens=32768, max_model_len=256)
WORDS = "the quick brown fox jumps over lazy dog paged attention blocks continuous batching forward pass".split()


def prompts(n: int) -> list[str]:
    """``n`` different prompts of 2 to 13 words."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(2 + i % 12)) for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-chat") / "m"
    shutil.copytree(tiny_llama_dir, d)
    (d / "chat_template.jinja").write_text(CHATML)
    return d


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, **KNOBS)


@pytest.fixture(scope="module")
def server(model_dir):
    app = build_app(LLM(model_dir, **KNOBS), "tiny")
    with running_server(app) as url:
        yield url, app.state.workbench


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics").text)


def test_models_and_greedy_completion_equal_offline(server, client, offline):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    want = offline.generate(["The quick brown fox"], greedy())[0]
    assert r.choices[0].token_ids == want.token_ids
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    # a token-id prompt (as vLLM accepts) gives the same
    r2 = client.completions.create(model="tiny", prompt=want.prompt_token_ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == want.text


def test_tokenize_and_detokenize_as_vllm(server, offline):
    r = httpx.post(server[0] + "/tokenize", json={"model": "tiny", "prompt": "lazy dog", "add_special_tokens": False})
    assert r.json()["tokens"] == offline.tokenizer("lazy dog", add_special_tokens=False)["input_ids"]
    assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] == 256
    back = httpx.post(server[0] + "/detokenize", json={"model": "tiny", "tokens": r.json()["tokens"]}).json()
    assert back == {"prompt": "lazy dog"}


def test_chat_uses_the_chat_template(client, offline):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "paged attention"}],
                                       max_tokens=10, temperature=0)
    want = offline.generate(["paged attention"], greedy(10), chat=True)[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) == len(offline.encode("paged attention", chat=True))
    # streamed: a role chunk first, then the same text
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "paged attention"}],
                                                 max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_streaming_sends_one_chunk_per_token_usage_last_and_done(server, client):
    kw = dict(model="tiny", prompt="Continuous batching", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **{**kw, "extra_body": {"ignore_eos": True, "return_token_ids": True}}))
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) == 20  # one chunk per generated token, even when its text is held back
    assert all(len(c.choices[0].token_ids) == 1 for c in with_choices)
    assert "".join(c.choices[0].text for c in with_choices) == full.choices[0].text
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    raw = httpx.post(server[0] + "/v1/completions", json={**{k: v for k, v in kw.items() if k != "extra_body"},
                                                          "stream": True}).text
    assert raw.rstrip().endswith("data: [DONE]") and raw.count("data: ") == 21


def test_n2_gives_seeded_choices(client):
    kw = dict(model="tiny", prompt="The lazy dog", max_tokens=8, temperature=1.0)
    r = client.completions.create(n=2, seed=7, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    one = [client.completions.create(seed=s, **kw).choices[0].text for s in (7, 8)]
    assert [c.text for c in r.choices] == one
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == client.completions.create(
        seed=7, **kw).usage.prompt_tokens
    streamed = list(client.completions.create(n=2, seed=7, stream=True, **kw))
    texts = ["", ""]
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == one


def test_stop_strings_cut_text_streamed_or_not(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    k = next(i for i in range(2, len(text) - 2) if text[i:i + 2].isalnum())
    stop = text[k:k + 2]
    want = text[: text.find(stop)]
    r = client.completions.create(stop=[stop, "never-there"], **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_errors_are_openai_shaped(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert "gpt-4" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=1000)  # max_model_len is 256
    assert "maximum context length is 256" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[1] * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[5, 99999], max_tokens=4)
    r = httpx.post(server[0] + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400 and "max_tokens" in err["message"]
    r = httpx.post(server[0] + "/v1/chat/completions", json={"model": "tiny"})  # no messages
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.fixture(scope="module")
def small_server(model_dir):
    """One request at a time, one waiting slot, an API key, slow steps: for 401 and 503."""
    app = build_app(LLM(model_dir, max_num_seqs=1, step_delay_s=0.01, **KNOBS), "tiny", api_key="sekret",
                    max_waiting=1)
    with running_server(app) as url:
        yield url


def test_wrong_api_key_is_401(small_server):
    bad = openai.OpenAI(base_url=small_server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(small_server + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(small_server + "/health").status_code == 200  # health and metrics stay open
    good = openai.OpenAI(base_url=small_server + "/v1", api_key="sekret", max_retries=0)
    assert good.completions.create(model="tiny", prompt="dog", max_tokens=2).usage.completion_tokens >= 1


def test_full_waiting_queue_is_503(small_server):
    c = openai.OpenAI(base_url=small_server + "/v1", api_key="sekret", max_retries=0)
    kw = dict(model="tiny", prompt="dog", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    running = c.completions.create(stream=True, **kw)
    next(iter(running))  # A runs (max_num_seqs 1)
    waiting = threading.Thread(target=lambda: c.completions.create(**kw))
    waiting.start()  # B waits
    deadline = time.time() + 10
    while metrics(small_server).get("vllm:num_requests_waiting") != 1.0:
        assert time.time() < deadline, "the second request never queued"
        time.sleep(0.01)
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(**kw)
    assert e.value.status_code == 503 and "waiting queue is full" in e.value.message
    assert sum(1 for ch in running if ch.choices) == 59
    waiting.join(30)


async def _stream_one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, leave_after: int | None):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": leave_after is not None}
    ids, finish = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            ids += c["token_ids"]
            finish = c["finish_reason"] or finish
            if leave_after is not None and len(ids) >= leave_after:
                return ids, "left"  # closing the response drops the connection mid-stream
    return ids, finish


def test_64_concurrent_streaming_clients_match_offline_engine(server, offline):
    url, state = server
    ps = prompts(64)
    want = offline.generate(ps, greedy(16))
    steps_before = len(state.llm.engine.steps)

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as cl:
            return await asyncio.gather(*[_stream_one(cl, url, p, 16, None) for p in ps])

    got = asyncio.run(main())
    assert [f for _, f in got] == [w.finish_reason for w in want]
    assert [ids for ids, _ in got] == [w.token_ids for w in want]
    steps = state.llm.engine.steps[steps_before:]
    assert max(s.num_seqs for s in steps) > 8  # clients shared batches (continuous batching across clients)


def test_half_the_clients_disconnect_and_everything_is_freed(server):
    url, state = server
    ps = prompts(64)
    before = metrics(url)

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as cl:
            return await asyncio.gather(*[_stream_one(cl, url, p, 120, 3 if i % 2 else None)
                                          for i, p in enumerate(ps)])

    got = asyncio.run(main())
    assert all(f == "left" for _, f in got[1::2])
    assert all(f in ("stop", "length") for _, f in got[0::2])
    deadline = time.time() + 20
    while (m := metrics(url))["vllm:num_requests_running"] != 0 or m["vllm:num_requests_waiting"] != 0:
        assert time.time() < deadline, f"requests still running: {m}"
        time.sleep(0.05)
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    kv = state.llm.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not state.llm.engine.scheduler.requests
    aborted = m["vllm:request_success_total"] - before["vllm:request_success_total"]
    assert aborted == 64  # every request is counted once, aborted ones under finished_reason="abort"
    text = httpx.get(url + "/metrics").text
    line = next(x for x in text.splitlines() if 'finished_reason="abort"' in x and not x.startswith("#"))
    assert float(line.split()[-1]) >= 30  # nearly all leavers were cut mid-stream (120 tokens each)


def test_metrics_use_vllm_names(server, client):
    client.completions.create(model="tiny", prompt="fox", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text = httpx.get(server[0] + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum"):
        assert f'{name}{{' in text and 'model_name="tiny"' in text, name
    m = parse_metrics(text)
    assert m["vllm:generation_tokens_total"] >= 5 and m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:inter_token_latency_seconds_count"] == m["vllm:generation_tokens_total"] - m[
        "vllm:time_to_first_token_seconds_count"]


@pytest.mark.real_model
def test_real_model_chat_and_stream_equal_offline(smollm2_dir):
    llm = LLM(smollm2_dir, kv_cache_tokens=4096, max_model_len=512)
    q = "What is the capital of France?"
    with running_server(build_app(llm, "smollm2-135m")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chat = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": q}],
                                         max_tokens=12, temperature=0)
        streamed = list(c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=8,
                                             temperature=0, stream=True))
    # the engine thread has stopped with the server: the same LLM now answers offline
    want_chat = llm.generate([q], greedy(12), chat=True)[0]
    want = llm.generate(["The capital of France is"], greedy(8))[0]
    assert chat.choices[0].message.content == want_chat.text and "Paris" in want_chat.text
    assert "".join(ch.choices[0].text for ch in streamed) == want.text
    assert len(streamed) == len(want.token_ids)


def test_non_streaming_client_that_gives_up_is_aborted(small_server):
    before = httpx.get(small_server + "/metrics").text
    aborted = lambda text: sum(float(x.split()[-1]) for x in text.splitlines()  # noqa: E731
                               if 'finished_reason="abort"' in x and not x.startswith("#"))
    with pytest.raises(httpx.ReadTimeout):  # 250 tokens at >= 10 ms a step: the client leaves long before
        httpx.post(small_server + "/v1/completions", headers={"Authorization": "Bearer sekret"}, timeout=0.5,
                   json={"model": "tiny", "prompt": "dog", "max_tokens": 250, "ignore_eos": True})
    deadline = time.time() + 1.5
    while aborted(text := httpx.get(small_server + "/metrics").text) == aborted(before):
        assert time.time() < deadline, "the abandoned request was not aborted"
        time.sleep(0.02)
    assert parse_metrics(text)["vllm:num_requests_running"] == 0
