"""The OpenAI-compatible server (workbench serve) with the official openai client, on a tiny random model."""

import asyncio
import json
import random
import threading
import time

import httpx
import openai
import pytest

from engines import LLM, SamplingParams
from server_helpers import running_server, with_chat_template
from workbench.serve.app import build_app
from workbench.serve.prom import parse_metrics

KNOBS = dict(kv_cache_tokens=32768, max_model_len=256)
WORDS = "the quick brown fox jumps over lazy dog paged attention blocks continuous batching forward pass".split()


def prompts(n: int) -> list[str]:
    """``n`` different prompts of 2 to 13 words."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(2 + i % 12)) for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("tiny-chat") / "m")


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


def successes(url: str) -> dict[str, float]:
    """``vllm:request_success_total`` by ``finished_reason``."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            reason = line.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.split()[-1])
    return out


def last_step(engine):
    """A mark for :func:`steps_since`: the engine's latest step record (None before the first)."""
    return engine.steps[-1] if engine.steps else None


def steps_since(engine, mark) -> list:
    """The engine's step records after ``mark`` (all of them if the server has dropped it: it keeps the
    recent ones only)."""
    steps = list(engine.steps)
    for i in range(len(steps) - 1, -1, -1):
        if steps[i] is mark:
            return steps[i + 1:]
    return steps


def fresh_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids no other test sends (so the prefix cache has nothing of them yet)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll ``/metrics`` until no request runs or waits; returns the last sample."""
    deadline = time.time() + timeout
    while (m := metrics(url))["vllm:num_requests_running"] != 0 or m["vllm:num_requests_waiting"] != 0:
        assert time.time() < deadline, f"requests still running: {m}"
        time.sleep(0.05)
    return m


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
    mark = last_step(state.llm.engine)

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as cl:
            return await asyncio.gather(*[_stream_one(cl, url, p, 16, None) for p in ps])

    got = asyncio.run(main())
    assert [f for _, f in got] == [w.finish_reason for w in want]
    assert [ids for ids, _ in got] == [w.token_ids for w in want]
    steps = steps_since(state.llm.engine, mark)
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


# ------------------------------------------------------------------------------- prefix-cache counters


def _post(url: str, path: str = "/v1/completions", **body) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=60)


def _prefix_delta(url: str, bodies: list[dict], path: str = "/v1/completions") -> tuple[float, float]:
    """(queried, hit) prefix-cache tokens of sending ``bodies`` one after the other."""
    before = metrics(url)
    for b in bodies:
        r = _post(url, path, **b)
        assert r.status_code == 200, r.text
    after = metrics(url)
    return tuple(after[f"vllm:prefix_cache_{k}_total"] - before[f"vllm:prefix_cache_{k}_total"]
                 for k in ("queries", "hits"))


def test_prefix_cache_counters_count_queried_and_hit_tokens(server):
    url, state = server
    bs = state.llm.engine.scheduler.kv.block_size
    ids = fresh_prompt(1, 5 * bs + 3)  # 5 full blocks and a partial one
    queried, hit = _prefix_delta(url, [dict(prompt=ids, max_tokens=2, temperature=0)] * 2)
    assert queried == 2 * len(ids)  # every admission queries its whole prompt
    assert hit == 5 * bs  # the second finds the first's 5 full blocks (the last token is always computed)


def test_cache_salt_isolates_the_prefix_cache(server):
    url, state = server
    bs = state.llm.engine.scheduler.kv.block_size
    ids = fresh_prompt(2, 6 * bs + 1)
    body = dict(prompt=ids, max_tokens=2, temperature=0)
    assert _prefix_delta(url, [{**body, "cache_salt": "tenant-a"}, {**body, "cache_salt": "tenant-b"}])[1] == 0
    assert _prefix_delta(url, [body])[1] == 0  # unsalted: no hit on salted blocks either
    assert _prefix_delta(url, [{**body, "cache_salt": "tenant-a"}])[1] == 6 * bs  # same salt: hits
    # chat takes it too
    msgs = [{"role": "user", "content": " ".join(WORDS * 4)}]
    chat = dict(messages=msgs, max_tokens=2, temperature=0)
    assert _prefix_delta(url, [{**chat, "cache_salt": "x"}, {**chat, "cache_salt": "y"}], "/v1/chat/completions")[1] == 0
    assert _prefix_delta(url, [{**chat, "cache_salt": "y"}], "/v1/chat/completions")[1] > 0
    for bad in ("", 5):
        r = _post(url, prompt="x", max_tokens=2, cache_salt=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


# ------------------------------------------------------------------------------------------ request ids


def test_client_request_ids_are_labels_and_never_shared(server, offline):
    url, state = server
    ps = ["paged attention blocks", "the lazy dog jumps over"]
    want = offline.generate(ps, greedy(120, ignore_eos=True))
    mark = last_step(state.llm.engine)

    async def one(cl: httpx.AsyncClient, prompt: str):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 120, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        ids, finish, chunk_ids = [], None, set()
        async with cl.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": "same-label"}) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == "same-label"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                chunk_ids.add(obj["id"])
                ids += obj["choices"][0]["token_ids"]
                finish = obj["choices"][0]["finish_reason"] or finish
        return ids, finish, chunk_ids

    async def main():
        async with httpx.AsyncClient(timeout=60) as cl:
            return await asyncio.gather(*[one(cl, p) for p in ps])

    got = asyncio.run(main())
    assert [ids for ids, _, _ in got] == [w.token_ids for w in want]  # neither saw the other's state
    assert [f for _, f, _ in got] == ["length", "length"]
    assert all(c == {"cmpl-same-label"} for _, _, c in got)  # the label names both responses...
    assert max(s.num_seqs for s in steps_since(state.llm.engine, mark)) == 2  # ...which ran together
    # the body's request_id is a label too; the header wins over it; no label: a fresh id
    r = _post(url, prompt="fox", max_tokens=2, request_id="body-label")
    assert r.json()["id"] == "cmpl-body-label" and r.headers["x-request-id"] == "body-label"
    r = httpx.post(url + "/v1/chat/completions", headers={"X-Request-Id": "hdr"}, json={
        "model": "tiny", "messages": [{"role": "user", "content": "fox"}], "max_tokens": 2, "request_id": "body"})
    assert r.json()["id"] == "chatcmpl-hdr" and r.headers["x-request-id"] == "hdr"
    a, b = (_post(url, prompt="fox", max_tokens=2).json()["id"] for _ in range(2))
    assert a != b and a.startswith("cmpl-")
    for bad in ("has space", "x" * 257, ""):
        r = _post(url, prompt="fox", max_tokens=2, request_id=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_a_request_the_engine_refuses_fails_alone(server, monkeypatch):
    url, state = server

    def refuse(request):
        raise ValueError(f"request {request.request_id}: a request with this id is already in flight")

    monkeypatch.setattr(state.llm.engine, "add_request", refuse)
    r = _post(url, prompt="fox", max_tokens=4)
    assert r.status_code == 500 and "already in flight" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert _post(url, prompt="fox", max_tokens=4).status_code == 200  # the engine loop lives on
    wait_idle(url)


# ------------------------------------------------------------------------------------------ gauges


def test_gauges_show_admitted_and_queued_requests_during_a_long_step(model_dir):
    llm = LLM(model_dir, max_num_seqs=1, step_delay_s=0.4, **KNOBS)
    steps = llm.engine.steps
    with running_server(build_app(llm, "tiny")) as url:
        before = len(steps)
        body = {"model": "tiny", "prompt": [fresh_prompt(10 + i, 150) for i in range(4)], "max_tokens": 1}
        call = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=body, timeout=60))
        call.start()
        seen = []
        deadline = time.time() + 10
        while not seen and time.time() < deadline:
            k = len(steps)
            m = metrics(url)
            if k == len(steps) == before:  # no step has ended yet: the first one is running
                if (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (1, 3):
                    seen.append(m)
            time.sleep(0.01)
        call.join(30)
        assert seen, "while the first step ran, /metrics never showed 1 running and 3 waiting"
        assert seen[0]["vllm:kv_cache_usage_perc"] > 0
        m = wait_idle(url)
        assert m["vllm:kv_cache_usage_perc"] == 0.0
        assert successes(url) == {"length": 4}


def test_aborted_n2_requests_count_once_and_gauges_stay_sane(server):
    url, state = server
    before = successes(url)
    samples: list[dict] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(metrics(url))

    async def leave_n2(cl: httpx.AsyncClient, prompt: str):
        body = {"model": "tiny", "prompt": prompt, "n": 2, "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with cl.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    return  # drop the connection: both choices are aborted

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as cl:
            await asyncio.gather(*[leave_n2(cl, p) for p in prompts(16)])

    sampler = threading.Thread(target=sample)
    sampler.start()
    asyncio.run(main())
    m = wait_idle(url)
    stop.set()
    sampler.join()
    after = successes(url)
    assert after.get("abort", 0) - before.get("abort", 0) == 16  # requests, not choices
    assert sum(after.values()) - sum(before.values()) == 16
    assert all(s["vllm:num_requests_running"] >= 0 and s["vllm:num_requests_waiting"] >= 0 for s in samples)
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    kv = state.llm.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not state.llm.engine.scheduler.requests


# ------------------------------------------------------------------------------------------ 400s


def test_context_length_error_names_prompt_tokens_max_tokens_and_the_rule(server):
    url, _ = server
    rule = "prompt tokens + max_tokens must be <= max_model_len (256)"
    r = _post(url, prompt=[5] * 256, max_tokens=1)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt"
    assert rule in err["message"] and "256 prompt tokens + max_tokens 1 = 257" in err["message"]
    r = _post(url, prompt=[5] * 250)  # the default max_tokens (16) does not fit
    assert r.status_code == 400 and "250 prompt tokens + max_tokens 16 (the default) = 266" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_tokens"
    r = _post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "dog " * 300}])
    assert r.status_code == 400 and rule in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"


def test_bad_values_are_refused_with_400_not_a_server_error(server, small_server):
    url, _ = server
    cases = [
        (dict(prompt="x", max_tokens=2, n=2, best_of=1), "best_of"),
        (dict(prompt="x", max_tokens=2, best_of=3, stream=True), "best_of"),
        (dict(prompt="x", max_tokens=2, logit_bias={"five": 10}), "logit_bias"),
        (dict(prompt="x", max_tokens=2, logit_bias={"5": 101}), "logit_bias"),
        (dict(prompt="x", max_tokens=2, logit_bias={"999999": 1}), "logit_bias"),
        (dict(prompt="x", max_tokens=2, stop_token_ids=[10**6]), "stop_token_ids"),
        (dict(prompt="x", max_tokens=2, min_tokens=3), "min_tokens"),
        (dict(prompt="x", max_tokens=2, logprobs=21), "logprobs"),
        (dict(prompt="x", max_tokens=2, prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt="x", max_tokens=2, presence_penalty=2.5), "presence_penalty"),
        (dict(prompt="x", max_tokens=2, repetition_penalty=0), "repetition_penalty"),
        (dict(prompt="x", max_tokens=2, frobnicate=1), "frobnicate"),
        (dict(prompt="x", max_tokens=2, tools=[{"type": "function"}]), "tools"),
        (dict(prompt="x", max_tokens=0), "max_tokens"),
        (dict(prompt="x", max_tokens=2, guided_json={"type": "object"}), "guided_json"),
        (dict(prompt="x", max_tokens=2, seed=2**70), "seed"),
        (dict(prompt="x", max_tokens=2, n=65), "n"),
    ]
    for body, param in cases:
        r = _post(url, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert _post(url, prompt="x", max_tokens=2, best_of=1).status_code == 200  # neutral values are fine
    assert _post(url, prompt="x", max_tokens=2, tools=[], user="u1", metadata={"a": "b"}, store=False,
                 service_tier="auto").status_code == 200  # documented no-ops
    chat = "/v1/chat/completions"
    for body, param in [(dict(echo=True), "echo"), (dict(top_logprobs=2), "top_logprobs"),
                        (dict(logprobs=True, top_logprobs=30), "top_logprobs")]:
        r = _post(url, chat, messages=[{"role": "user", "content": "x"}], max_tokens=2, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    for raw in ('{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": NaN}',
                '{"model": "tiny", "prompt": "x", "max_tokens": 2, "top_p": Infinity}'):
        r = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
    r = _post(url, prompt="x", max_tokens=3, temperature=1e-300)  # raised to 0.01 (logits would overflow)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = _post(url, prompt="x", max_tokens=3, top_p=5e-324)  # float32 rounds it to 0: the top token alone
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = httpx.post(url + "/v1/completions", content=b"\xff\xfe{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400  # not UTF-8: OpenAI-shaped all the same
    chat = "/v1/chat/completions"
    r = _post(url, chat, messages=[{"role": "user", "content": "x"}], max_completion_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = _post(url, chat, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}], max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0"
    # more sequences than the waiting queue could ever hold is the client's error, not a 503
    r = httpx.post(small_server + "/v1/completions", headers={"Authorization": "Bearer sekret"},
                   json={"model": "tiny", "prompt": "dog", "max_tokens": 2, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_continuous_usage_stats_give_the_usage_in_every_chunk(server):
    r = httpx.post(server[0] + "/v1/completions", json={
        "model": "tiny", "prompt": "fox", "max_tokens": 5, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5, 5]
    assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1


def test_an_event_stays_on_one_line_for_any_line_splitter():
    from workbench.serve.app import _sse

    obj = {"text": "a\u2028b\u2029c\x85d\x1ce\u00e9"}  # what random tokens of a byte-level BPE can decode to
    event = _sse(obj)
    assert len(event.rstrip("\n").splitlines()) == 1 and json.loads(event[6:]) == obj
