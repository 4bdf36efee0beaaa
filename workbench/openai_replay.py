"""Trace replay against any OpenAI-compatible endpoint (``kind: openai``), measured from the client side,
with ``vllm bench serve``'s definitions also when a server sends several tokens in one SSE chunk
(speculative decoding, stream intervals).

Each trace request is sent at its arrival time, streamed with ``stream_options.include_usage``, greedy,
``ignore_eos`` and ``return_token_ids`` (vLLM extensions), to one of:

* ``endpoint: completions`` (default): ``POST {base_url}/completions`` with the trace's exact prompt token
  ids (``prompt`` as a list of ints, as vLLM accepts) and ``max_tokens`` = the trace's output length;
* ``endpoint: chat``: ``POST {base_url}/chat/completions`` with one user message, the trace's prompt text
  when it has one (ShareGPT) or else its token ids decoded with the scenario model's tokenizer, and
  ``max_completion_tokens`` = the trace's output length. The server applies its chat template and
  re-tokenizes the text, so chat prompts are longer than the trace's (and may tokenize differently); the
  input tokens counted are then ``usage.prompt_tokens`` when the server sends it.

What is measured (every time ``time.perf_counter`` on arrival of the SSE line, seconds from the replay's
start):

* an *output chunk* is a streamed chunk whose first choice carries output: non-empty ``text`` (completions)
  or ``delta.content``, a ``delta.reasoning_content`` / ``delta.reasoning``, non-empty ``delta.tool_calls``
  (chat), or non-empty ``token_ids``. Role-only, empty and finish-only chunks are not output chunks.
* TTFT: the first output chunk's arrival - the request's send time; E2EL: the last output chunk's arrival
  - the send time.
* output tokens n: ``usage.completion_tokens`` when sent; else the streamed token ids when every output
  chunk carries ``token_ids``; else an estimate, one per output chunk (``len(token_ids)`` for a chunk that
  has them), and the request is ``output_tokens_estimated``.
* TPOT = (E2EL - TTFT) / (n - 1), undefined (None) when n == 1.
* ITL (``itl_mode``, see :func:`workbench.metrics.chunk_itls`): ``chunk`` (default, as ``vllm bench
  serve``): one gap per output chunk after the first; ``token``: a chunk of k tokens contributes its gap
  divided evenly over k tokens (k from its ``token_ids``, else 1).
* a request whose stream disagrees with its usage is ``suspect`` (see :func:`suspect_reason`): kept and
  counted, but never part of goodput.

Where ``vllm bench serve`` differs: it takes TTFT at the first chunk with ``choices`` even when it carries
nothing (a chat stream's role-only first chunk, an empty chunk), and its E2EL ends at the last chunk with
``choices``; here both follow the output chunks only.

Requests end ``stop``/``length`` (finished), ``rejected`` (HTTP 400/413/422/503: the server refused it,
reason kept) or ``failed`` (any other HTTP status, a broken stream, a connection error). When the
endpoint serves ``/metrics`` (at the root above ``/v1``), it is scraped before and after the replay and
the ``vllm:*`` counter deltas are kept.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engines.core.llm_engine import RequestOutput
from workbench.traces import TraceRequest

REJECT_STATUSES = (400, 413, 422, 503)
ENDPOINTS = ("completions", "chat")
ITL_MODES = ("chunk", "token")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


class EndpointError(ValueError):
    """The endpoint cannot be used (unreachable, wrong key, model not served); one-line message."""


@dataclass
class StreamedOutput(RequestOutput):
    """A ``RequestOutput`` measured from a stream (see the module docstring).

    ``token_ids`` has the n output tokens (-1 for a token the server did not name); ``token_times`` one
    time per named token (its chunk's arrival), or per output chunk where the tokens are not named.

    Attributes:
        chunk_times: arrival of each output chunk (s from the replay's start), in stream order.
        chunk_tokens: tokens each output chunk named (``len(token_ids)``; None where it had no token_ids).
        itl_mode: ``chunk`` or ``token``: how :func:`workbench.metrics.request_metrics` turns chunks into ITLs.
        usage_tokens: ``usage.completion_tokens`` as sent (None when not sent).
        output_tokens_estimated: n is the one-per-output-chunk estimate (no usage, no token ids).
        suspect: why the stream disagrees with its usage (:func:`suspect_reason`); None when it agrees.
    """

    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int | None] = field(default_factory=list)
    itl_mode: str = "chunk"
    usage_tokens: int | None = None
    output_tokens_estimated: bool = False
    suspect: str | None = None


def is_output(choice: dict, chat: bool) -> bool:
    """Whether a streamed choice carries output: non-empty ``text`` (completions) or ``delta.content``, a
    ``delta.reasoning_content`` / ``delta.reasoning`` or non-empty ``delta.tool_calls`` (chat), or a
    non-empty ``token_ids``."""
    if choice.get("token_ids"):
        return True
    if not chat:
        return bool(choice.get("text"))
    d = choice.get("delta") or {}
    return bool(d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls"))


def suspect_reason(chunk_tokens: list[int | None], usage_tokens: int | None, max_tokens: int) -> str | None:
    """Why a finished stream disagrees with its usage, in one line; None when it agrees or has no usage.

    With U = ``usage_tokens`` (``usage.completion_tokens``) and k_i = ``chunk_tokens[i]`` (the token ids
    output chunk i carried; None where it carried no ``token_ids``), the stream is suspect when, in this
    order:

    1. every output chunk carried token ids and U != sum(k_i) (e.g. 10 streamed ids, usage 1024);
    2. U < sum(k_i, or 1 where k_i is None): a chunk without token ids carries at least one token, so more
       such chunks than U tokens cannot be;
    3. U > 0 but there was no output chunk;
    4. U > ``max_tokens`` (the request's limit).
    """
    if usage_tokens is None:
        return None
    u = usage_tokens
    if chunk_tokens and all(k is not None for k in chunk_tokens) and sum(chunk_tokens) != u:
        return f"streamed {sum(chunk_tokens)} token ids in {len(chunk_tokens)} chunks but usage.completion_tokens is {u}"
    least = sum(1 if k is None else k for k in chunk_tokens)
    if least > u:
        return f"{len(chunk_tokens)} output chunks carry at least {least} tokens but usage.completion_tokens is {u}"
    if u > 0 and not chunk_tokens:
        return f"usage.completion_tokens is {u} but no chunk carried output"
    if u > max_tokens:
        return f"usage.completion_tokens {u} > max_tokens {max_tokens}"
    return None


class OpenAIOutputs(list):
    """The replay's ``RequestOutput`` list, plus ``server_metrics`` (None when there is no /metrics)."""

    server_metrics: dict | None = None


def metrics_url(base_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p/metrics`` (vLLM and ``workbench serve`` serve it at the root)."""
    root = base_url.rstrip("/")
    return (root[: -len("/v1")] if root.endswith("/v1") else root) + "/metrics"


def replay_openai(base_url: str, model: str, trace: list[TraceRequest], api_key: str | None = None,
                  on_output: Callable[[RequestOutput], None] | None = None,
                  engine_name: str = "openai", max_concurrency: int | None = None, endpoint: str = "completions",
                  itl_mode: str = "chunk", tokenizer: Any = None) -> OpenAIOutputs:
    """Replay ``trace`` against the endpoint in real time; one :class:`StreamedOutput` per trace request.

    ``max_concurrency`` (requests): closed-loop users, as ``vllm bench serve --max-concurrency``: at most
    that many requests in flight; a request is sent at max(its arrival time, when a user's previous request
    ended), and its ``arrival_time`` (TTFT and E2EL are measured from it) is when it was sent.
    ``endpoint``: ``completions`` or ``chat`` (see the module docstring); ``tokenizer`` (anything with
    ``decode(ids)``) makes a chat prompt's text from its token ids when the trace has no text.
    ``itl_mode``: ``chunk`` or ``token`` (:func:`workbench.metrics.chunk_itls`).

    Raises:
        EndpointError: the endpoint is unreachable, refuses the key, or does not serve ``model``.
        ValueError: ``max_concurrency`` < 1, an unknown ``endpoint`` or ``itl_mode``, or a chat replay of a
            request with neither prompt text nor a tokenizer.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (or None), got {max_concurrency}")
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if itl_mode not in ITL_MODES:
        raise ValueError(f"itl_mode must be one of {', '.join(ITL_MODES)}, got {itl_mode!r}")
    texts = {t.request_id: chat_prompt_text(t, tokenizer, engine_name) for t in trace} if endpoint == "chat" else None
    return asyncio.run(_replay(base_url.rstrip("/"), model, trace, api_key, on_output, engine_name,
                               max_concurrency, texts, itl_mode))


def chat_prompt_text(t: TraceRequest, tokenizer: Any, engine_name: str = "openai") -> str:
    """The user message of a chat replay: the trace's prompt text, else its token ids decoded with
    ``tokenizer`` (special tokens kept as text).

    Raises:
        ValueError: the request has no text and there is no tokenizer (or no token ids).
    """
    if t.prompt_text is not None:
        return t.prompt_text
    if tokenizer is None or t.prompt_token_ids is None:
        raise ValueError(f"engine {engine_name}: endpoint chat needs the prompt text of request {t.request_id}: "
                         f"a trace with text, or the model's tokenizer to decode its token ids")
    return tokenizer.decode(list(t.prompt_token_ids))


async def _replay(base_url, model, trace, api_key, on_output, engine_name, max_concurrency, texts=None,
                  itl_mode="chunk") -> OpenAIOutputs:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits, headers=headers) as client:
        await _check_endpoint(client, base_url, model, engine_name)
        before = await _scrape(client, metrics_url(base_url))
        t0 = time.perf_counter()
        users = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        order = sorted(trace, key=lambda t: t.arrival_s)  # users are taken in arrival order (the semaphore is FIFO)
        url = f"{base_url}/chat/completions" if texts is not None else f"{base_url}/completions"
        tasks = [asyncio.create_task(_one(client, url, model, t, t0, users, texts, itl_mode)) for t in order]
        outs = OpenAIOutputs()
        for fut in asyncio.as_completed(tasks):
            o = await fut
            outs.append(o)
            if on_output:
                on_output(o)
        after = await _scrape(client, metrics_url(base_url)) if before is not None else None
    if before is not None and after is not None:
        outs.server_metrics = {
            "url": metrics_url(base_url),
            "delta": {k: after[k] - before.get(k, 0.0) for k in sorted(after) if k not in GAUGES},
            "after": {k: after[k] for k in GAUGES if k in after},
        }
    return outs


async def _check_endpoint(client, base_url: str, model: str, engine_name: str) -> None:
    import httpx

    try:
        r = await client.get(f"{base_url}/models", timeout=30.0)
    except httpx.HTTPError as e:
        raise EndpointError(f"engine {engine_name}: cannot reach {base_url}: {type(e).__name__}: {e}".strip()) from None
    if r.status_code == 401:
        raise EndpointError(f"engine {engine_name}: {base_url} refused the API key (HTTP 401); set api_key")
    if r.status_code != 200:
        return  # some endpoints have no /models; let the requests speak
    try:
        served = [m.get("id") for m in r.json().get("data", [])]
    except (ValueError, AttributeError):
        return
    if served and model not in served:
        raise EndpointError(f"engine {engine_name}: {base_url} does not serve model {model!r}; it serves "
                            f"{', '.join(map(str, served))}")


async def _scrape(client, url: str) -> dict[str, float] | None:
    """``vllm:*`` samples of the endpoint's Prometheus metrics; None when it has none."""
    import httpx

    from workbench.serve.prom import parse_metrics

    try:
        r = await client.get(url, timeout=10.0)
        if r.status_code != 200:
            return None
        return parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        return None


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        return " ".join(str(msg).split())[:300]
    except (ValueError, AttributeError):
        return " ".join(body.decode(errors="replace").split())[:300]


async def _one(client, url: str, model: str, t: TraceRequest, t0: float, users: asyncio.Semaphore | None = None,
               texts: dict[str, str] | None = None, itl_mode: str = "chunk") -> StreamedOutput:
    """Send one request at its arrival time (``t0``: the replay's start, ``time.perf_counter`` seconds), once
    a user is free when ``users`` limits them; the user is held until the request ends. ``texts``: the
    chat prompts by request id (None: a completions replay)."""
    await asyncio.sleep(max(0.0, t.arrival_s - (time.perf_counter() - t0)))
    text = texts[t.request_id] if texts is not None else None
    if users is None:
        return await _send(client, url, model, t, t0, text, itl_mode)
    async with users:
        return await _send(client, url, model, t, t0, text, itl_mode)


async def _send(client, url: str, model: str, t: TraceRequest, t0: float, chat_text: str | None = None,
                itl_mode: str = "chunk") -> StreamedOutput:
    """Stream one request (chat when ``chat_text`` is given) and measure it (see the module docstring)."""
    import httpx

    chat = chat_text is not None
    arrival = time.perf_counter() - t0
    prompt = list(t.prompt_token_ids or [])
    payload: dict[str, Any] = {"model": model, "temperature": 0.0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}, "return_token_ids": True}
    if chat:
        payload.update(messages=[{"role": "user", "content": chat_text}], max_completion_tokens=t.output_tokens)
    else:
        payload.update(prompt=prompt, max_tokens=t.output_tokens)
    ids: list[int] = []  # every output chunk's tokens, -1 for each chunk that named none
    times: list[float] = []  # one per entry of ids
    chunk_times: list[float] = []
    chunk_tokens: list[int | None] = []
    texts: list[str] = []
    finish, error, usage_tokens, usage_prompt = None, None, None, None

    def output(reason: str, err: str | None = None) -> StreamedOutput:
        named = bool(chunk_tokens) and all(k is not None for k in chunk_tokens)
        estimated = usage_tokens is None and bool(chunk_tokens) and not named
        n = usage_tokens if usage_tokens is not None else len(ids)
        token_ids = (ids + [-1] * n)[:n]  # -1: a token the server did not name
        prompt_ids = [-1] * usage_prompt if chat and usage_prompt is not None else prompt
        finished = reason in ("stop", "length")
        return StreamedOutput(
            request_id=t.request_id, prompt=chat_text, prompt_token_ids=prompt_ids, token_ids=token_ids,
            text="".join(texts), finish_reason=reason, error=err, arrival_time=arrival,
            first_token_time=chunk_times[0] if chunk_times else None, finished_time=time.perf_counter() - t0,
            token_times=times[:n], chunk_times=chunk_times, chunk_tokens=chunk_tokens, itl_mode=itl_mode,
            usage_tokens=usage_tokens, output_tokens_estimated=estimated and finished,
            suspect=suspect_reason(chunk_tokens, usage_tokens, t.output_tokens) if finished else None)

    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                msg = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                return output("rejected" if resp.status_code in REJECT_STATUSES else "failed", msg)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                obj = json.loads(data)
                if obj.get("error"):
                    error = _error_message(data.encode())
                    continue
                choices = obj.get("choices") or []
                if choices:
                    c = choices[0]
                    if is_output(c, chat):
                        new = c.get("token_ids")
                        named = [int(x) for x in new] if isinstance(new, list) else None
                        chunk_times.append(now)
                        chunk_tokens.append(len(named) if named is not None else None)
                        got = named if named is not None else [-1]  # -1: one token, not named
                        ids.extend(got)
                        times.extend([now] * len(got))
                        texts.append(((c.get("delta") or {}).get("content") if chat else c.get("text")) or "")
                    finish = c.get("finish_reason") or finish
                usage = obj.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        usage_prompt = int(usage["prompt_tokens"])
    except (httpx.HTTPError, ValueError) as e:
        return output("failed", f"{type(e).__name__}: {e}")
    if error:
        return output("failed", error)
    if finish not in ("stop", "length"):
        return output("failed", f"stream ended without a finish reason (got {finish!r})")
    return output(finish)
