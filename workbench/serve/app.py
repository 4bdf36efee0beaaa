"""The OpenAI-compatible HTTP API (FastAPI) over one ``AsyncEngine``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or, with
``stream: true``, server-sent events ending in ``data: [DONE]``), ``GET /health``, ``GET /metrics``
(Prometheus text, vLLM's names), and vLLM's ``POST /tokenize`` / ``POST /detokenize`` / ``GET /tokenizer_info``
(which lm-evaluation-harness's remote tokenizer reads). Extensions as in vLLM: ``ignore_eos``, ``top_k``, ``return_token_ids``
(each choice / chunk carries its ``token_ids``), ``cache_salt`` (mixed into the request's prefix-cache
block hashes: requests share cached KV only with requests of the same salt), and a completions
``prompt`` may be token ids.

Request ids: the engine's ids are the server's own (a fresh uuid per API call, ``-<choice>`` per
sequence), so clients can never make two requests share engine state. A client's ``X-Request-Id``
header (or, failing that, the body's ``request_id``) is a label only, as in vLLM: the response's ``id``
is ``cmpl-<label>`` / ``chatcmpl-<label>``, the response echoes it in ``X-Request-Id``, and the logs
name it next to the engine's ids. Without a label the id is ``cmpl-<uuid>``.

Request fields: what OpenAI and vLLM define and this server implements (sampling: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``seed``, ``n``, ``best_of``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias``; stopping: ``stop``, ``stop_token_ids``, ``min_tokens``,
``ignore_eos``, ``include_stop_str_in_output``; output: ``logprobs`` (completions: top-N per token; chat:
``logprobs: true`` with ``top_logprobs``), ``echo`` (completions: the prompt first, with its logprobs when
``logprobs`` is set), ``prompt_logprobs`` (vLLM), ``skip_special_tokens``, ``return_token_ids``,
``stream_options.include_usage`` / ``continuous_usage_stats``). Fields of the OpenAI API that mean nothing
to a local server (``NOOP_FIELDS``: ``user``, ``metadata``, ``store``, ``service_tier``...) are accepted and
ignored. Every other field is refused with a 400 that names it (a generation control this server does not
implement, such as guided decoding or tools, is never silently ignored), except that the
``UNSUPPORTED_FIELDS`` pass when set to their neutral value (``tools: []``). 0 is never "unset": a
``max_tokens`` or ``max_completion_tokens`` of 0 is refused. Floats must be finite; a temperature in (0,
0.01) is raised to 0.01, as vLLM does (smaller ones overflow the logits).

Log-probabilities are the float32 log-softmax of the model's raw logits (before penalties, biases and
temperature; vLLM's default), from the same forward pass that samples; ``-inf`` is sent as -9999.0 (JSON
has no infinity). A request with prompt logprobs (or echo with logprobs) does not read the prefix cache:
every prompt position is computed, so identical requests get identical prompt logprobs.

Streaming sends one chunk per generated token (its text may be empty while a multi-byte character or a
possible stop string is held back), so client-side inter-token latencies are per token, as
``vllm bench serve`` measures them. A client that disconnects has its requests aborted (KV freed).

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with 400 (bad parameter,
body that is not JSON, prompt over ``max_model_len``, more sequences than the waiting queue holds), 401
(missing or wrong API key), 404 (unknown model or path), 503 (waiting queue full), 500 (engine failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.core.request import Request
from engines.core.sampling_params import SamplingParams
from workbench.serve.async_engine import AsyncEngine, QueueFullError, RequestGroup
from workbench.serve.prom import ServerMetrics

log = logging.getLogger("workbench.serve")

# ------------------------------------------------------------------------------------------ protocol


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the usage; with ``continuous_usage_stats`` too, every chunk
    carries the usage so far (vLLM's extension)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


# OpenAI / vLLM request fields that change what is generated and that this server does not implement:
# refused (400) when set to anything but one of their neutral values, never silently ignored
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "suffix": (None, ""), "allowed_token_ids": (None,), "bad_words": (None, []),
    "use_beam_search": (None, False), "length_penalty": (None, 1), "logits_processors": (None,),
    "truncate_prompt_tokens": (None,), "prompt_embeds": (None,), "response_format": (None, {"type": "text"}),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "web_search_options": (None,), "spaces_between_special_tokens": (None, True), "priority": (None, 0),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None,), "add_special_tokens": (None,),
}
# OpenAI fields with no meaning for a local server: accepted and ignored (documented no-ops)
NOOP_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort",
                         "verbosity", "safety_identifier", "prompt_cache_key"})
MAX_LOGPROBS = 20  # most top log-probabilities per position (vLLM's default max_logprobs)
LOGPROB_FLOOR = -9999.0  # what -inf is sent as (as vLLM)
LABEL_RE = re.compile(r"[!-~]{1,256}")  # a client's request label: printable ASCII, no spaces
MIN_TEMPERATURE = 0.01  # vLLM's floor for a non-zero temperature (_MAX_TEMP in vllm/sampling_params.py)
INT64 = 2**63


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat requests.

    Other fields: ``NOOP_FIELDS`` are ignored, ``UNSUPPORTED_FIELDS`` refused unless neutral, anything else
    refused (see the module docstring). Floats must be finite (NaN or Infinity, which Python's JSON parser
    accepts, are refused).
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=64)
    best_of: int | None = Field(None, ge=1, le=64)
    seed: int | None = Field(None, ge=-INT64, le=INT64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    request_id: str | None = None  # a label for logs and the response id; X-Request-Id wins over it
    cache_salt: str | None = Field(None, min_length=1, max_length=4096)

    def top_logprobs_count(self) -> int | None:
        """How many top log-probabilities per generated token were asked for (None: no logprobs)."""
        raise NotImplementedError


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize`` (``vllm bench serve`` uses it to align prompt lengths)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class APIError(Exception):
    """An OpenAI-style error response."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# ------------------------------------------------------------------------------------------ the app


class APIKeyMiddleware:
    """Plain ASGI middleware: ``/v1/*`` needs ``Authorization: Bearer <api_key>``, else 401 (``/health``,
    ``/metrics`` and ``/tokenize`` stay open, as in vLLM). Pure ASGI, so streamed bodies pass untouched."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if auth != self.expected:
                resp = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)").response()
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServerState:
    """What the handlers share: the engine loop, tokenizer, limits and metrics."""

    def __init__(self, llm, model_name: str, api_key: str | None, max_waiting: int | None):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.max_model_len = llm.engine.scheduler.config.max_model_len
        kv = llm.engine.scheduler.kv
        self.pool_tokens = kv.num_blocks * kv.block_size
        self.vocab_size = llm.model_config.vocab_size
        self.metrics = ServerMetrics(model_name)
        self.engine = AsyncEngine(llm.engine, max_waiting=max_waiting, metrics=self.metrics)
        self.created = int(time.time())
        self.token_strs: dict[int, str] = {}  # token id -> its text (logprobs), filled as used


def build_app(llm, model_name: str, api_key: str | None = None, max_waiting: int | None = 1024) -> FastAPI:
    """The FastAPI app serving ``llm`` (an ``engines.LLM``) as ``model_name``.

    The engine thread starts with the app (lifespan) and stops with it.

    Args:
        llm: the loaded model and engine.
        model_name: the id clients pass as ``model`` (others get 404).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        max_waiting: most queued (not yet running) requests before new ones get 503; None = no limit.
    """
    state = ServerState(llm, model_name, api_key, max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.engine.start()
        yield
        state.engine.shutdown()

    app = FastAPI(title="workbench OpenAI-compatible server", lifespan=lifespan)
    app.state.workbench = state

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'invalid')})"
                            ).response()
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        return APIError(400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid request')}",
                        ".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):  # e.g. a body that is not UTF-8, an unknown path
        detail = exc.detail if isinstance(exc.detail, str) else "invalid request"
        return JSONResponse(APIError(exc.status_code, detail).body(), status_code=exc.status_code, headers=exc.headers)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "workbench",
            "root": str(state.llm.model_dir), "max_model_len": state.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(state, body.model or state.model_name)
        if body.messages is not None:
            ids = _chat_prompt(state, body.messages)
        elif body.prompt is not None:
            ids = state.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        else:
            raise APIError(400, "give prompt or messages", "prompt")
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": list(ids)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(state, body.model or state.model_name)
        if any(not 0 <= t < state.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {state.vocab_size})", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's tokenizer description (lm-evaluation-harness's remote tokenizer reads ``eos_token`` and
        ``chat_template`` here, then tokenizes through ``/tokenize``)."""
        tok = state.tokenizer
        return {"tokenizer_class": type(tok).__name__, "model_max_length": state.max_model_len,
                "vocab_size": state.vocab_size, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                "eos_token_ids": sorted(state.llm.eos_token_ids),
                "chat_template": getattr(tok, "chat_template", None)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        _check_model(state, body.model)
        prompts = _completion_prompts(state, body.prompt)
        sp = _sampling_params(state, body, body.max_tokens, [len(p) for p in prompts], default_max_tokens=16)
        texts = _prompt_texts(state, body.prompt, prompts) if body.echo else None
        return await _respond(state, request, body, prompts, sp, chat=False, prompt_texts=texts)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest):
        _check_model(state, body.model)
        prompt = _chat_prompt(state, body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sp = _sampling_params(state, body, max_tokens, [len(prompt)], None)
        return await _respond(state, request, body, [prompt], sp, chat=True)

    return app


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    """Token ids of each prompt: a string, a list of strings, token ids or a list of token-id lists."""
    if isinstance(prompt, str):
        raw: list = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        raw = [prompt]
    else:
        raw = list(prompt)
    if not raw:
        raise APIError(400, "prompt must not be empty", "prompt")
    out = []
    for p in raw:
        ids = state.tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt must not be empty", "prompt")
        bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {state.vocab_size})", "prompt")
        out.append(ids)
    return out


def _prompt_texts(state: ServerState, prompt, ids: list[list[int]]) -> list[str]:
    """What ``echo`` returns for each prompt: the prompt string as sent, or its token ids decoded."""
    strings = [prompt] if isinstance(prompt, str) else list(prompt) if prompt and isinstance(prompt[0], str) else None
    if strings is not None:
        return strings
    return [state.tokenizer.decode(p, skip_special_tokens=False) for p in ids]


def _chat_prompt(state: ServerState, messages: list[dict]) -> list[int]:
    """The conversation through the tokenizer's chat template, with the assistant turn opened."""
    if not getattr(state.tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
    msgs = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if not all(isinstance(t, str) for t in parts):
                raise APIError(400, f"messages.{i}: a text content part needs a string text", f"messages.{i}")
            content = "".join(parts)
        if not isinstance(m.get("role"), str) or not isinstance(content, (str, type(None))):
            raise APIError(400, f"messages.{i}: needs a string role and text content", f"messages.{i}")
        msgs.append({"role": m["role"], "content": content or ""})
    try:
        ids = state.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # template errors (e.g. role order) are the client's
        raise APIError(400, f"chat template failed: {e}", "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _sampling_params(state: ServerState, body: _SamplingRequest, max_tokens: int | None,
                     prompt_lens: list[int], default_max_tokens: int | None) -> SamplingParams:
    """SamplingParams of a request; 400 for bad values or a prompt + max_tokens over max_model_len.

    ``max_tokens`` defaults to ``default_max_tokens`` (16 for completions, as OpenAI and vLLM) or, when
    that is None (chat), to what is left of ``max_model_len`` (and of the KV pool) after the longest prompt.
    """
    _check_extra_fields(body)
    limit, longest = state.max_model_len, max(prompt_lens)
    prompt_param = "prompt" if isinstance(body, CompletionRequest) else "messages"
    rule = f"prompt tokens + max_tokens must be <= max_model_len ({limit})"
    default = ""
    if max_tokens is None and default_max_tokens is None:  # whatever room is left after the prompt
        if longest >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens: {rule}, but the prompt has "
                                f"{longest} tokens, which leaves no room for a completion token.", prompt_param)
        max_tokens, default = max(1, min(limit, state.pool_tokens) - longest), " (the default: what is left)"
    elif max_tokens is None:
        max_tokens, default = default_max_tokens, " (the default)"
    temperature = 1.0 if body.temperature is None else body.temperature
    if 0 < temperature < MIN_TEMPERATURE:
        log.warning("temperature %g is below %g, which overflows the logits; raised to %g (as vLLM does)",
                    temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
        temperature = MIN_TEMPERATURE
    top_p, top_k = 1.0 if body.top_p is None else body.top_p, body.top_k or 0
    if top_p < 1.0 / state.vocab_size:  # the nucleus is the most likely token alone (its probability is
        top_k = 1                       # >= 1/vocab): sample it as such, not through a top_p that float32 rounds to 0
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stop_ids = list(body.stop_token_ids or [])
    bad_id = next((t for t in stop_ids if not 0 <= t < state.vocab_size), None)
    if bad_id is not None:
        raise APIError(400, f"stop_token_ids: {bad_id} is outside the vocabulary [0, {state.vocab_size})", "stop_token_ids")
    logprobs = body.top_logprobs_count()
    prompt_logprobs = body.prompt_logprobs
    if getattr(body, "echo", False) and logprobs is not None:  # the echoed prompt carries its logprobs
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    best_of = body.best_of
    if best_of is not None and best_of < body.n:
        raise APIError(400, f"best_of must be >= n ({body.n}), got {best_of}", "best_of")
    if best_of is not None and best_of > body.n and body.stream:
        raise APIError(400, "best_of > n cannot be streamed (the best sequences are known only at the end)", "best_of")
    if best_of is not None and best_of > body.n and logprobs is None:
        logprobs = 0  # each sequence's cumulative logprob ranks it (not returned unless asked)
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=body.seed,
                        stop=[s for s in stop if s], ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                        stop_token_ids=stop_ids, include_stop_str_in_output=body.include_stop_str_in_output,
                        skip_special_tokens=body.skip_special_tokens,
                        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                        logit_bias=_logit_bias(state, body.logit_bias), min_p=body.min_p or 0.0,
                        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    bad = sp.validate()
    if bad:
        raise APIError(400, bad, bad.split(" ", 1)[0])
    if longest + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens: {rule}, but this request has "
                            f"{longest} prompt tokens + max_tokens {max_tokens}{default} = {longest + max_tokens}. "
                            f"Please reduce the prompt or max_tokens.",
                       prompt_param if longest >= limit else "max_tokens")
    return sp


def _check_extra_fields(body: _SamplingRequest) -> None:
    """400 for a field this server does not implement (``NOOP_FIELDS`` pass; ``UNSUPPORTED_FIELDS`` pass when
    neutral); the message names the field."""
    for name, value in (body.model_extra or {}).items():
        if name in NOOP_FIELDS:
            continue
        neutral = UNSUPPORTED_FIELDS.get(name)
        if neutral is not None and any(value == v for v in neutral):
            continue
        what = "is not supported by this server" if neutral is not None else "is not a field this server knows"
        raise APIError(400, f"{name} {what}", name)


def _logit_bias(state: ServerState, bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id strings -> bias in [-100, 100]) as ``{token id: bias}``; 400 for a key
    that is no token id of the vocabulary or a value out of range."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= tok < state.vocab_size:
            raise APIError(400, f"logit_bias: token id {tok} is outside the vocabulary [0, {state.vocab_size})",
                           "logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias: the bias of token {tok} must be in [-100, 100], got {value}", "logit_bias")
        out[tok] = float(value)
    return out


# --------------------------------------------------------------------------------- n (parallel sampling)
def fan_out_requests(state: ServerState, prompts: list[list[int]], sp: SamplingParams, n: int,
                     id_prefix: str, cache_salt: str | None = None) -> list[Request]:
    """The engine requests of one API call, ids ``{id_prefix}-{index}``; choice ``index = prompt_index * n + i``.

    ``id_prefix`` must be the server's own (unique per call), never a client's label. ``cache_salt`` is
    set on every request (the KV manager mixes it into the prompt's block hashes).

    ``n`` is done in the server: one engine request per choice, the ``i``-th with seed ``seed + i``
    when a seed is given (so the choices differ but the call is reproducible; the engine's own
    ``SamplingParams.n`` forks children with the same seeds, so the tokens are the same). With prefix
    caching on (the default) the choices share the prompt's full KV blocks through the cache; the
    engine-level ``n`` would also share the partly filled last block (copy-on-write). Switching here
    means routing forked children's outputs (``parent_id``) to their choice streams.
    """
    import dataclasses

    now = time.perf_counter()
    reqs = []
    eos = state.llm.eos_token_ids  # every stop id of the model
    for p, ids in enumerate(prompts):
        for i in range(n):
            params = sp if n == 1 or sp.seed is None else dataclasses.replace(sp, seed=sp.seed + i, stop=list(sp.stop))
            reqs.append(Request(f"{id_prefix}-{p * n + i}", list(ids), params, arrival_time=now, eos_token_id=eos))
    for r in reqs:
        r.cache_salt = cache_salt
    return reqs
# ---------------------------------------------------------------------------------------------------


def _submit(state: ServerState, reqs: list[Request], n: int) -> RequestGroup:
    limit = state.engine.max_waiting
    if limit is not None and len(reqs) > limit:  # could never be queued: the client's to fix, not a 503
        raise APIError(400, f"this request needs {len(reqs)} sequences (prompts x n) but the server queues at most "
                            f"{limit}; send fewer prompts or a smaller n", "n")
    for r in reqs:  # same checks as the scheduler's admission (e.g. the KV pool size)
        reason = state.llm.engine.scheduler.validate(r)
        if reason:
            raise APIError(400, reason)
    try:
        return state.engine.submit(reqs, choices_per_prompt=n)
    except QueueFullError as e:
        raise APIError(503, str(e)) from None
    except RuntimeError as e:
        raise APIError(503, str(e)) from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _request_label(http: HTTPRequest, body: _SamplingRequest) -> str | None:
    """The client's label for this call: the ``X-Request-Id`` header, else the body's ``request_id``."""
    header = http.headers.get("x-request-id")
    label, param = (header, "X-Request-Id") if header is not None else (body.request_id, "request_id")
    if label is not None and not LABEL_RE.fullmatch(label):
        raise APIError(400, f"{param} must be 1 to 256 printable ASCII characters without spaces", param)
    return label


async def _respond(state: ServerState, http: HTTPRequest, body: _SamplingRequest, prompts: list[list[int]],
                   sp: SamplingParams, chat: bool, prompt_texts: list[str] | None = None):
    kind = "chatcmpl" if chat else "cmpl"
    label = _request_label(http, body)
    engine_prefix = f"{kind}-{uuid.uuid4().hex}"  # the engine's ids: the server's own, unique per call
    rid = f"{kind}-{label}" if label is not None else engine_prefix  # the response's id
    per_prompt = body.best_of or body.n  # sequences generated per prompt (best_of: the n best are returned)
    reqs = fan_out_requests(state, prompts, sp, per_prompt, engine_prefix, body.cache_salt)
    group = _submit(state, reqs, per_prompt)
    log.info("%s: %d sequence(s) as %s-0..%d", rid, len(reqs), engine_prefix, len(reqs) - 1)
    headers = {"X-Request-Id": label if label is not None else rid}
    view = _View(state, body, chat, rid, prompt_texts or [""] * len(prompts), per_prompt)
    view.prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs[::per_prompt])
    if body.stream:
        return StreamingResponse(_stream(state, view, group), media_type="text/event-stream", headers=headers)
    out = await _until_done_or_disconnect(state, http, group, _collect(state, view, group))
    return out if isinstance(out, Response) else JSONResponse(out, headers=headers)


async def _until_done_or_disconnect(state: ServerState, http: HTTPRequest, group: RequestGroup, work):
    """Await ``work``; if the client disconnects first, abort the group's requests."""

    async def disconnected():
        while (await http.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            for s in group.unfinished():
                state.engine.abort(s.request_id)
    if not task.done() or task.cancelled():
        return Response(status_code=499)
    return task.result()


def _raise_for(delta) -> None:
    if delta.finish_reason == "rejected":
        raise APIError(400, delta.error or "request rejected")
    if delta.finish_reason == "error":
        raise APIError(500, delta.error or "engine failure")


class _View:
    """How one API call's output is written: completions or chat, echo, which logprobs, token strings."""

    def __init__(self, state: ServerState, body: _SamplingRequest, chat: bool, rid: str, prompt_texts: list[str],
                 per_prompt: int):
        self.state, self.body, self.chat, self.rid = state, body, chat, rid
        self.prompt_texts, self.per_prompt = prompt_texts, per_prompt
        self.num_top = body.top_logprobs_count()  # None: no logprobs in the answer
        self.echo = bool(getattr(body, "echo", False))
        self.prompt_tokens = 0

    def token_str(self, tok: int) -> str:
        """A token's own text, special tokens included (vLLM's ``decoded_token``)."""
        cache = self.state.token_strs
        t = cache.get(tok)
        if t is None:
            t = cache[tok] = self.state.tokenizer.decode([tok], skip_special_tokens=False)
        return t

    def token_bytes(self, tok: int) -> list[int]:
        """A token's raw bytes (OpenAI's ``bytes``: a token can hold part of a UTF-8 character, which its text
        shows as U+FFFD): byte-level BPE pieces mapped back through GPT-2's byte alphabet, other tokens as
        the UTF-8 of their text."""
        piece = self.state.tokenizer.convert_ids_to_tokens(tok)
        inverse = _byte_decoder()
        if isinstance(piece, str) and piece and all(ch in inverse for ch in piece):
            return [inverse[ch] for ch in piece]
        return list(self.token_str(tok).encode("utf-8"))

    def completion_logprobs(self, entries: list, offset: int) -> dict:
        """OpenAI's legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the
        position's own token, then the ``logprobs`` most likely) and ``text_offset`` (characters, from
        ``offset``), for ``entries`` = ``[(token id, TokenLogprob or None)]``."""
        tokens, lps, tops, offsets = [], [], [], []
        for tok, lp in entries:
            t = self.token_str(tok)
            tokens.append(t)
            offsets.append(offset)
            offset += len(t)
            if lp is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_lp(lp.logprob))
            top = {t: _lp(lp.logprob)}
            for tid, v in lp.top[: self.num_top]:
                top.setdefault(self.token_str(tid), _lp(v))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, entries: list) -> dict:
        """The chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
        def one(tok, v):
            return {"token": self.token_str(tok), "logprob": _lp(v), "bytes": self.token_bytes(tok)}

        return {"content": [{**one(tok, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top[: self.num_top]]}
                            for tok, lp in entries if lp is not None]}

    def prompt_logprobs(self, req: Request) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {logprob, rank, decoded_token}}`` (its own
        token, then the most likely), the first None; None when not asked."""
        if self.body.prompt_logprobs is None:
            return None
        out: list = []
        for tok, lp in zip(req.prompt_token_ids, req.prompt_logprobs or [None] * req.num_prompt_tokens):
            if lp is None:
                out.append(None)
                continue
            d = {str(tok): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": self.token_str(tok)}}
            for rank, (tid, v) in enumerate(lp.top[: self.body.prompt_logprobs], 1):
                d.setdefault(str(tid), {"logprob": _lp(v), "rank": rank, "decoded_token": self.token_str(tid)})
            out.append(d)
        return out

    def echo_entries(self, req: Request) -> list:
        return list(zip(req.prompt_token_ids, req.prompt_logprobs or [None] * req.num_prompt_tokens))

    def logprobs_of(self, entries: list, offset: int = 0) -> dict | None:
        if self.num_top is None:
            return None
        return self.chat_logprobs(entries) if self.chat else self.completion_logprobs(entries, offset)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the inverse of ``bytes_to_unicode`` in GPT-2's
    ``encoder.py``: printable bytes stand for themselves, the others are shifted to 256 + i)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _lp(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf has no JSON form


def _stop_reason(req: Request):
    """vLLM's ``stop_reason``: the stop string or ``stop_token_ids`` id that ended the sequence, None for EOS,
    a length limit or an abort."""
    r = req.stop_reason
    if isinstance(r, int) and r not in req.sampling_params.stop_token_ids:
        return None
    return r


def _best(streams: list, per_prompt: int, n: int) -> list:
    """Per prompt, its ``n`` sequences of highest cumulative log-probability among ``per_prompt`` (best_of),
    in generation order otherwise; the list is in choice order."""
    if per_prompt == n:
        return streams
    out = []
    for p in range(0, len(streams), per_prompt):
        cands = streams[p : p + per_prompt]
        ranked = sorted(cands, key=lambda s: -sum(lp.logprob for lp in s.request.output_logprobs))
        out.extend(ranked[:n])
    return out


async def _collect(state: ServerState, view: _View, group: RequestGroup):
    body, chat = view.body, view.chat
    k = len(group.streams)
    texts, ids, reasons = [""] * k, [[] for _ in range(k)], [None] * k
    async for d in group:
        _raise_for(d)
        texts[d.index] += d.text
        ids[d.index].extend(d.token_ids)
        if d.finish_reason:
            reasons[d.index] = d.finish_reason
    choices = []
    top_prompt_logprobs = None
    for i, stream in enumerate(_best(group.streams, view.per_prompt, body.n)):
        j, req = stream.index, stream.request
        out_entries = list(zip(ids[j], req.output_logprobs)) if view.num_top is not None else []
        c: dict[str, Any] = {"index": i}
        if chat:
            c["message"] = {"role": "assistant", "content": texts[j]}
            c["logprobs"] = view.logprobs_of(out_entries)
        else:
            prompt_text = view.prompt_texts[j // view.per_prompt] if view.echo else ""
            c["text"] = prompt_text + texts[j]
            entries = (view.echo_entries(req) if view.echo else []) + out_entries
            c["logprobs"] = view.logprobs_of(entries)
        c.update({"finish_reason": reasons[j], "stop_reason": _stop_reason(req)})
        if body.return_token_ids:
            c["token_ids"] = ids[j]
        pl = view.prompt_logprobs(req)
        if chat:
            top_prompt_logprobs = top_prompt_logprobs or pl
        elif pl is not None:
            c["prompt_logprobs"] = pl
        choices.append(c)
    out = {"id": view.rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
           "model": state.model_name, "choices": choices,
           "usage": _usage(view.prompt_tokens, sum(len(x) for x in ids))}
    if chat and body.prompt_logprobs is not None:
        out["prompt_logprobs"] = top_prompt_logprobs
    return out


# characters str.splitlines() breaks lines at that json.dumps(ensure_ascii=False) leaves raw; SSE lines end at
# CR / LF only, but clients that split with splitlines (httpx's aiter_lines) would cut an event in two
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(obj) -> str:
    """One server-sent event: ``data: <json>``, on one line for any line splitter (see ``_LINE_BREAKS``)."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


async def _stream(state: ServerState, view: _View, group: RequestGroup):
    """SSE chunks: one per generated token per choice, then usage (if asked), then ``[DONE]``.

    With ``echo`` a choice's first chunk is its prompt (with its logprobs when asked); a choice's first
    token chunk carries ``prompt_logprobs`` when asked (in the choice for completions, at the top for chat).
    Whatever ends the generator early (client disconnect, cancellation) aborts the unfinished requests.
    """
    body, chat, rid = view.body, view.chat, view.rid
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous_usage = include_usage and body.stream_options.continuous_usage_stats
    completion_tokens = 0
    offsets = [0] * len(group.streams)  # text_offset of each choice's next token (completions logprobs)
    started = [False] * len(group.streams)

    def chunk(index: int, text: str, finish: str | None, token_ids: list[int] | None, first: bool = False,
              entries: list | None = None, extra: dict | None = None, top: dict | None = None) -> str:
        c: dict[str, Any] = {"index": index}
        if chat:
            c["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish else {})
            c["logprobs"] = view.logprobs_of(entries) if entries else None
        else:
            c["text"] = text
            c["logprobs"] = view.logprobs_of(entries, offsets[index]) if entries else None
            if entries:
                offsets[index] += sum(len(view.token_str(t)) for t, _ in entries)
        c["finish_reason"] = finish
        if extra:
            c.update(extra)
        if body.return_token_ids and token_ids is not None:
            c["token_ids"] = token_ids
        out = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [c]}
        if top:
            out.update(top)
        if include_usage:
            out["usage"] = _usage(view.prompt_tokens, completion_tokens) if continuous_usage else None
        return _sse(out)

    try:
        if chat:
            for s in group.streams:
                yield chunk(s.index, "", None, None, first=True)
        async for d in group:
            if d.finish_reason in ("rejected", "error"):  # an error event in the stream, as vLLM does
                yield _sse(APIError(400 if d.finish_reason == "rejected" else 500, d.error or "failed").body())
                continue
            req = group.streams[d.index].request
            completion_tokens += len(d.token_ids)
            if not d.token_ids and not d.text and d.finish_reason is None:
                continue
            text, top = d.text, None
            entries = [(t, d.logprob) for t in d.token_ids] if view.num_top is not None and d.logprob else []
            extra = {"stop_reason": _stop_reason(req)} if d.finish_reason else {}
            if not started[d.index]:  # the choice's first chunk: the echoed prompt, prompt logprobs
                started[d.index] = True
                if view.echo:
                    text = view.prompt_texts[d.index // view.per_prompt] + text
                    entries = (view.echo_entries(req) if view.num_top is not None else []) + entries
                pl = view.prompt_logprobs(req)
                if pl is not None and chat:
                    top = {"prompt_logprobs": pl}
                elif pl is not None:
                    extra["prompt_logprobs"] = pl
            yield chunk(d.index, text, d.finish_reason, d.token_ids, entries=entries or None, extra=extra, top=top)
        if include_usage:
            yield _sse({"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [],
                        "usage": _usage(view.prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"
    finally:
        for s in group.unfinished():
            state.engine.abort(s.request_id)


def serve(model: str = "smollm2-135m", host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, max_waiting: int | None = 1024, log_level: str = "warning",
          **llm_kwargs) -> None:
    """Load the model and serve it until interrupted (``workbench serve``).

    ``llm_kwargs`` are ``engines.LLM`` knobs (engine, dtype, block_size, kv_cache_tokens, max_num_seqs,
    max_num_batched_tokens, max_model_len, seed).
    """
    import uvicorn

    from engines.llm import LLM

    llm = LLM(model, **llm_kwargs)
    # a long-running server builds oneDNN's per-row-count GEMM primitives now rather than as new batch sizes
    # arrive, so its resident memory stays flat (engines.real.linear.warm_onednn)
    cfg = llm.engine.scheduler.config
    llm.engine.executor.model.warm_gemms(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    app = build_app(llm, served_model_name or model, api_key=api_key, max_waiting=max_waiting)
    print(f"serving {served_model_name or model} on http://{host}:{port}/v1 (metrics: http://{host}:{port}/metrics)",
          flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

