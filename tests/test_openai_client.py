"""The ``kind: openai`` client's measurements against a scripted streaming server: chunks that carry several
tokens, empty and role-only chunks, one-token requests, missing usage, streams that disagree with their usage,
and chat replay. Every scripted time is in seconds after the server received the request; expected numbers
follow from the chunk times the client recorded, and those are checked against the script only where a
loaded 2-core machine cannot break it (a chunk arrives 100 ms late now and then, but never before it was
sent)."""

from __future__ import annotations

import asyncio
import json

import pytest

from server_helpers import running_server
from workbench.metrics import chunk_itls, summarize
from workbench.openai_replay import replay_openai, suspect_reason
from workbench.traces import TraceRequest



def cmpl(text="", ids=None, finish=None):
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        c["token_ids"] = ids
    return {"object": "text_completion", "choices": [c]}


def delta(finish=None, ids=None, **d):
    c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        c["token_ids"] = ids
    return {"object": "chat.completion.chunk", "choices": [c]}


def usage(n, prompt=7):
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}}


# (seconds after the request arrived, chunk); "[DONE]" is sent after the last one
SCRIPTS = {
    # an empty chunk at 10 ms, then 1, 3, 1 and 5 tokens' text at 200, 400, 500 and 900 ms; usage 10
    "coalesced": [(0.010, cmpl("")), (0.200, cmpl("a")), (0.400, cmpl("bcd")), (0.500, cmpl("e")),
                  (0.900, cmpl("fghij", finish="length")), (0.905, usage(10))],
    # the same with the chunks' token ids
    "coalesced_ids": [(0.010, cmpl("", ids=[])), (0.200, cmpl("a", ids=[1])), (0.400, cmpl("bcd", ids=[2, 3, 4])),
                      (0.500, cmpl("e", ids=[5])), (0.900, cmpl("fghij", ids=[6, 7, 8, 9, 10], finish="length")),
                      (0.905, usage(10))],
    "single": [(0.150, cmpl("a", ids=[1], finish="length")), (0.155, usage(1))],
    # no usage and no token ids: 4 chunks of 2 tokens' text each
    "no_usage": [(0.100, cmpl("ab")), (0.200, cmpl("cd")), (0.300, cmpl("ef")), (0.400, cmpl("gh", finish="length"))],
    # 10 streamed token ids, then finish length and usage 1024
    "short_ids": [(0.050 * (i + 1), cmpl("x", ids=[i], finish="length" if i == 9 else None)) for i in range(10)]
                 + [(0.560, usage(1024))],
    # 5 text chunks without token ids, usage 3: more chunks than tokens
    "chunks_over_usage": [(0.050 * (i + 1), cmpl("y", finish="length" if i == 4 else None)) for i in range(5)]
                         + [(0.300, usage(3))],
    # chat: a role-only first chunk at 10 ms, content at 200 and 300 ms, a finish-only chunk
    "chat": [(0.010, delta(role="assistant", content="")), (0.200, delta(content="Hi")),
             (0.300, delta(content=" there")), (0.310, delta(finish="stop")), (0.315, usage(2, prompt=23))],
    # chat: a reasoning delta first (150 ms), then content
    "chat_reasoning": [(0.010, delta(role="assistant")), (0.150, delta(reasoning_content="hmm")),
                       (0.250, delta(content="ok", finish="stop")), (0.255, usage(2))],
}
NAMES = list(SCRIPTS)
BODIES: list[dict] = []


def script_of(body: dict) -> str:
    """The script a request names: its first prompt token id (completions) or ``script:NAME`` (chat)."""
    if "messages" in body:
        return body["messages"][0]["content"].split("script:", 1)[1]
    return NAMES[body["prompt"][0]]


def mock_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"data": [{"id": "mock"}]})

    async def generate(request):
        body = await request.json()
        BODIES.append(body)
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def events():
            for at, obj in SCRIPTS[script_of(body)]:
                await asyncio.sleep(max(0.0, start + at - loop.time()))  # absolute times: no drift
                yield f"data: {json.dumps(obj)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


@pytest.fixture(scope="module")
def url():
    with running_server(mock_app()) as u:
        yield u + "/v1"


def req(name: str, i: int = 0, arrival: float = 0.0, max_tokens: int = 1024, text: str | None = None) -> TraceRequest:
    return TraceRequest(f"{name}-{i}", arrival, 4, max_tokens, prompt_token_ids=[NAMES.index(name), 5, 6, 7],
                        prompt_text=text)


def ms(xs):
    return [x * 1000.0 for x in xs]


def one(url, name, **kw):
    (o,) = replay_openai(url, "mock", [req(name)], **kw)
    assert o.finish_reason in ("stop", "length"), o.error
    return o, summarize([o], [], 1)


def scripted_chunk_times(name: str) -> list[float]:
    """Seconds after the request arrived at which the script sends its output-carrying chunks."""
    return [at for at, obj in SCRIPTS[name] if obj["choices"] and obj["choices"][0].get("text")]


def test_coalesced_chunks_ttft_at_first_output_tpot_over_tokens_itl_per_chunk(url):
    """The formulas are checked on the chunk times the client recorded (a loaded 2-core machine delivers a chunk
    100 ms late now and then: the server's schedule is not the client's truth); the recorded times are checked
    against the schedule only where lateness cannot break it: a chunk never arrives before it was sent."""
    o, s = one(url, "coalesced")
    assert len(o.token_ids) == 10 and not o.output_tokens_estimated and o.suspect is None
    sent = scripted_chunk_times("coalesced")  # 200, 400, 500, 900 ms; the empty chunk at 10 ms carries nothing
    assert len(o.chunk_times) == 4 and all(t >= at for t, at in zip(o.chunk_times, sent))
    ttft, e2el = o.chunk_times[0] - o.arrival_time, o.chunk_times[-1] - o.arrival_time
    assert s["ttft_ms"]["mean"] == pytest.approx(1000 * ttft)  # the first output chunk, never the empty one
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * (e2el - ttft) / 9) and s["tpot_ms"]["count"] == 1
    gaps = ms(chunk_itls(o.chunk_times))
    assert gaps == pytest.approx(ms([b - a for a, b in zip(o.chunk_times, o.chunk_times[1:])]))  # one per chunk
    assert s["itl_ms"]["count"] == 3 and s["itl_ms"]["mean"] == pytest.approx(sum(gaps) / 3)
    assert s["e2el_ms"]["mean"] == pytest.approx(1000 * e2el)
    assert o.text == "abcdefghij"


def test_coalesced_chunks_with_token_ids_have_no_zero_gaps(url):
    o, s = one(url, "coalesced_ids")
    assert o.token_ids == list(range(1, 11)) and o.chunk_tokens == [1, 3, 1, 5]
    assert len(o.token_times) == 10  # one time per named token (its chunk's)
    assert all(t >= at for t, at in zip(o.chunk_times, scripted_chunk_times("coalesced_ids")))
    gaps = ms(chunk_itls(o.chunk_times))
    # one gap per chunk, none of 0 ms between the tokens a chunk carries
    assert s["itl_ms"]["count"] == len(gaps) == 3 and min(gaps) > 0
    assert s["itl_ms"]["p50"] == pytest.approx(sorted(gaps)[1])
    ttft, e2el = o.chunk_times[0] - o.arrival_time, o.chunk_times[-1] - o.arrival_time
    assert s["ttft_ms"]["mean"] == pytest.approx(1000 * ttft) and ttft >= 0.200
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * (e2el - ttft) / 9)
    # itl_mode token: each chunk's gap spread evenly over its tokens; 9 values whose mean is the TPOT
    o2, s2 = one(url, "coalesced_ids", itl_mode="token")
    assert o2.itl_mode == "token" and s2["itl_ms"]["count"] == 9
    t = o2.chunk_times
    assert ms(chunk_itls(t, o2.chunk_tokens, "token")) == pytest.approx(
        ms([(t[1] - t[0]) / 3] * 3 + [t[2] - t[1]] + [(t[3] - t[2]) / 5] * 5))
    assert s2["itl_ms"]["mean"] == pytest.approx(s2["tpot_ms"]["mean"], abs=0.5)


def test_chunk_itls_formula():
    t = [0.2, 0.4, 0.5, 0.9]
    assert chunk_itls(t) == pytest.approx([0.2, 0.1, 0.4])
    assert chunk_itls(t, [1, 3, 1, 5], "token") == pytest.approx([0.2 / 3] * 3 + [0.1] + [0.08] * 5)
    assert chunk_itls(t, None, "token") == pytest.approx([0.2, 0.1, 0.4])  # tokens unknown: 1 per chunk
    assert chunk_itls([0.3]) == []
    with pytest.raises(ValueError, match="chunk or token"):
        chunk_itls(t, None, "tokens")


def test_one_token_requests_leave_tpot_and_itl_undefined(url):
    outs = replay_openai(url, "mock", [req("single", i, 0.01 * i) for i in range(3)])
    s = summarize(outs, [], 3)
    assert s["num_finished"] == 3 and s["total_output_tokens"] == 3
    assert s["tpot_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}
    assert s["itl_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}
    ttfts = sorted(1000 * (o.first_token_time - o.arrival_time) for o in outs)
    assert s["ttft_ms"]["count"] == 3 and s["ttft_ms"]["p50"] == pytest.approx(ttfts[1]) and ttfts[0] >= 150
    # the consumers read null: flattening leaves it out, an SLO on TPOT is met, capacity probes pass it
    from workbench.capacity import evaluate
    from workbench.results import flatten, metric_value

    assert "tpot_ms.p99" not in flatten(s) and flatten(s)["tpot_ms.count"] == 0
    assert metric_value(s, "tpot_ms.p99") is None
    assert summarize(outs, [], 3, slo={"tpot_ms": 1.0})["goodput"] == pytest.approx(s["request_throughput"])
    assert evaluate(s, {"tpot_ms": 1.0}, 1.0).ok


def test_no_usage_no_token_ids_estimates_one_token_per_chunk(url):
    o, s = one(url, "no_usage")
    assert len(o.token_ids) == 4 and o.token_ids == [-1] * 4 and o.output_tokens_estimated
    assert o.usage_tokens is None and o.suspect is None
    assert s["num_output_tokens_estimated"] == 1 and s["total_output_tokens"] == 4
    assert len(o.chunk_times) == 4 and all(t >= at for t, at in zip(o.chunk_times, scripted_chunk_times("no_usage")))
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * (o.chunk_times[-1] - o.chunk_times[0]) / 3)
    # with usage (or token ids) nothing is estimated
    assert summarize(replay_openai(url, "mock", [req("coalesced")]), [], 1)["num_output_tokens_estimated"] == 0


def test_stream_disagreeing_with_usage_is_suspect_and_not_goodput(url):
    trace = [req("short_ids", 0), req("coalesced_ids", 1), req("chunks_over_usage", 2)]
    outs = {o.request_id: o for o in replay_openai(url, "mock", trace)}
    short, good, over = outs["short_ids-0"], outs["coalesced_ids-1"], outs["chunks_over_usage-2"]
    assert short.finish_reason == "length" and len(short.token_ids) == 1024  # usage is the count, flagged
    assert short.suspect == "streamed 10 token ids in 10 chunks but usage.completion_tokens is 1024"
    assert over.suspect == "5 output chunks carry at least 5 tokens but usage.completion_tokens is 3"
    assert good.suspect is None
    s = summarize(list(outs.values()), [], 3)
    assert s["num_finished"] == 3 and s["num_suspect"] == 2 and len(s["suspect_reasons"]) == 2
    assert s["goodput"] == pytest.approx(s["request_throughput"] / 3)  # only the consistent request
    assert s["ttft_ms"]["count"] == 3  # kept in the latency figures


def test_suspect_rule():
    assert suspect_reason([1, 3, 1, 5], 10, 1024) is None
    assert suspect_reason([1, 3, 1, 5], 11, 1024).startswith("streamed 10 token ids")
    assert suspect_reason([None] * 4, 10, 1024) is None  # text chunks may carry several tokens each
    assert suspect_reason([None, 2, None], 3, 1024).startswith("3 output chunks carry at least 4")
    assert suspect_reason([], 5, 1024) == "usage.completion_tokens is 5 but no chunk carried output"
    assert suspect_reason([None], 9, 8) == "usage.completion_tokens 9 > max_tokens 8"
    assert suspect_reason([None] * 4, None, 1024) is None  # no usage: nothing to disagree with


class Tok:
    """A stand-in tokenizer: decodes a prompt to the script it names."""

    def decode(self, ids):
        return "script:" + NAMES[ids[0]]


def test_chat_replay_measures_ttft_at_first_content_delta(url):
    BODIES.clear()
    outs = replay_openai(url, "mock", [req("chat")], endpoint="chat", tokenizer=Tok())
    (o,) = outs
    assert o.finish_reason == "stop" and o.text == "Hi there" and len(o.token_ids) == 2 and o.suspect is None
    s = summarize(outs, [], 1)
    # two content chunks (sent at 200 and 300 ms): not the role-only chunk at 10 ms, and the finish-only chunk
    # at 310 ms is no token
    assert len(o.chunk_times) == 2 and o.chunk_times[0] - o.arrival_time >= 0.200
    ttft, e2el = o.chunk_times[0] - o.arrival_time, o.chunk_times[1] - o.arrival_time
    assert s["ttft_ms"]["mean"] == pytest.approx(1000 * ttft) and s["e2el_ms"]["mean"] == pytest.approx(1000 * e2el)
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * (e2el - ttft))
    assert s["total_input_tokens"] == 23  # usage.prompt_tokens: the chat template's prompt, not the trace's 4
    (body,) = BODIES
    assert body["messages"] == [{"role": "user", "content": "script:chat"}]
    assert body["max_completion_tokens"] == 1024 and "prompt" not in body and body["stream"]
    # a reasoning delta is the first token too; the trace's own text wins over the tokenizer
    (r,) = replay_openai(url, "mock", [req("chat_reasoning", text="script:chat_reasoning")], endpoint="chat")
    assert r.finish_reason == "stop"
    # the reasoning delta (sent at 150 ms) and the content: two output chunks, the first one the first token
    assert len(r.chunk_times) == 2 and r.first_token_time == r.chunk_times[0]
    assert r.first_token_time - r.arrival_time >= 0.150
    with pytest.raises(ValueError, match="endpoint chat needs the prompt text"):
        replay_openai(url, "mock", [req("chat")], endpoint="chat")
    with pytest.raises(ValueError, match="endpoint must be one of"):
        replay_openai(url, "mock", [req("chat")], endpoint="responses")
