"""Trace replay against any OpenAI-compatible endpoint (``kind: openai``), measured from the client side.

Each trace request is sent at its arrival time to ``POST {base_url}/completions`` with the trace's
exact prompt token ids (``prompt`` as a list of ints, as vLLM accepts), ``max_tokens`` = the trace's
output length, ``ignore_eos`` (a vLLM extension) and greedy sampling, streamed with
``stream_options.include_usage``. Every streamed chunk with choices is stamped on arrival; the tokens it
carries (its ``token_ids`` when the server returns them on ``return_token_ids``, otherwise one token per
chunk, as ``vllm bench serve`` counts) get that time, so TTFT, TPOT, ITL and E2EL follow the same
``RequestOutput`` records and formulas as the in-process engines. ``usage.completion_tokens``, when sent,
is the final token count.

Requests end ``stop``/``length`` (finished), ``rejected`` (HTTP 400/413/422/503: the server refused it,
reason kept) or ``failed`` (any other HTTP status, a broken stream, a connection error). When the
endpoint serves ``/metrics`` (at the root above ``/v1``), it is scraped before and after the replay and
the ``vllm:*`` counter deltas are kept.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from engines.core.llm_engine import RequestOutput
from workbench.traces import TraceRequest

REJECT_STATUSES = (400, 413, 422, 503)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


class EndpointError(ValueError):
    """The endpoint cannot be used (unreachable, wrong key, model not served); one-line message."""


class OpenAIOutputs(list):
    """The replay's ``RequestOutput`` list, plus ``server_metrics`` (None when there is no /metrics)."""

    server_metrics: dict | None = None


def metrics_url(base_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p/metrics`` (vLLM and ``workbench serve`` serve it at the root)."""
    root = base_url.rstrip("/")
    return (root[: -len("/v1")] if root.endswith("/v1") else root) + "/metrics"


def replay_openai(base_url: str, model: str, trace: list[TraceRequest], api_key: str | None = None,
                  on_output: Callable[[RequestOutput], None] | None = None,
                  engine_name: str = "openai", max_concurrency: int | None = None) -> OpenAIOutputs:
    """Replay ``trace`` against the endpoint in real time; one output per trace request.

    ``max_concurrency`` (requests): closed-loop users, as ``vllm bench serve --max-concurrency``: at most
    that many requests in flight; a request is sent at max(its arrival time, when a user's previous request
    ended), and its ``arrival_time`` (TTFT and E2EL are measured from it) is when it was sent.

    Raises:
        EndpointError: the endpoint is unreachable, refuses the key, or does not serve ``model``.
        ValueError: ``max_concurrency`` < 1.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (or None), got {max_concurrency}")
    return asyncio.run(_replay(base_url.rstrip("/"), model, trace, api_key, on_output, engine_name,
                               max_concurrency))


async def _replay(base_url, model, trace, api_key, on_output, engine_name, max_concurrency) -> OpenAIOutputs:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits, headers=headers) as client:
        await _check_endpoint(client, base_url, model, engine_name)
        before = await _scrape(client, metrics_url(base_url))
        t0 = time.perf_counter()
        users = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        order = sorted(trace, key=lambda t: t.arrival_s)  # users are taken in arrival order (the semaphore is FIFO)
        tasks = [asyncio.create_task(_one(client, f"{base_url}/completions", model, t, t0, users)) for t in order]
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


async def _one(client, url: str, model: str, t: TraceRequest, t0: float,
               users: asyncio.Semaphore | None = None) -> RequestOutput:
    """Send one request at its arrival time (``t0``: the replay's start, ``time.perf_counter`` seconds), once
    a user is free when ``users`` limits them; the user is held until the request ends."""
    await asyncio.sleep(max(0.0, t.arrival_s - (time.perf_counter() - t0)))
    if users is None:
        return await _send(client, url, model, t, t0)
    async with users:
        return await _send(client, url, model, t, t0)


async def _send(client, url: str, model: str, t: TraceRequest, t0: float) -> RequestOutput:
    import httpx

    arrival = time.perf_counter() - t0
    prompt = list(t.prompt_token_ids or [])
    payload = {"model": model, "prompt": prompt, "max_tokens": t.output_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
               "return_token_ids": True}
    ids: list[int] = []
    times: list[float] = []
    texts: list[str] = []
    finish, error, usage_tokens = None, None, None

    def output(reason: str, err: str | None = None) -> RequestOutput:
        n = len(ids) if usage_tokens is None else usage_tokens
        token_ids = (ids + [-1] * n)[:n]  # -1: a token the server did not name
        return RequestOutput(
            request_id=t.request_id, prompt=None, prompt_token_ids=prompt, token_ids=token_ids, text="".join(texts),
            finish_reason=reason, error=err, arrival_time=arrival, first_token_time=times[0] if times else None,
            finished_time=time.perf_counter() - t0, token_times=times[:n])

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
                obj = json.loads(data)
                now = time.perf_counter() - t0
                if obj.get("error"):
                    error = _error_message(data.encode())
                    continue
                choices = obj.get("choices") or []
                if choices:
                    c = choices[0]
                    new = c.get("token_ids")
                    new = list(new) if new is not None else [-1]
                    ids.extend(new)
                    times.extend([now] * len(new))
                    texts.append(c.get("text") or "")
                    finish = c.get("finish_reason") or finish
                if isinstance(obj.get("usage"), dict) and obj["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(obj["usage"]["completion_tokens"])
    except (httpx.HTTPError, ValueError) as e:
        return output("failed", f"{type(e).__name__}: {e}")
    if error:
        return output("failed", error)
    if finish not in ("stop", "length"):
        return output("failed", f"stream ended without a finish reason (got {finish!r})")
    return output(finish)
