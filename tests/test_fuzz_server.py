"""Schema fuzzing of the OpenAI-compatible server with schemathesis, over the app's own OpenAPI description.

Every operation of ``/openapi.json`` gets a bounded number of generated requests, both ones that fit
the schema (positive) and ones that break it (negative), sent to a loopback server over a tiny
random-weight model. No answer may be a server error (5xx) and none may hang (each call has a
timeout); afterwards nothing runs or waits and the KV cache is free. 4xx answers must be OpenAI-shaped,
and a stream must carry no server-error event.

Three passes: the app's schema (``model`` pinned to the served name) positive and negative, and a
positive pass over a schema narrowed to what this server accepts (token ids in the vocabulary, short
prompts and outputs), so most of its examples reach generation. ``WORKBENCH_FUZZ_EXAMPLES`` (default
40) is the number of examples per operation and pass; ``WORKBENCH_FUZZ_VERBOSE=1`` prints every 4xx.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import shutil

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from engines import LLM
from server_helpers import running_server
from workbench.serve.app import build_app
from workbench.serve.prom import parse_metrics

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = int(os.environ.get("WORKBENCH_FUZZ_EXAMPLES", "40"))
TIMEOUT_S = 30.0
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir, tmp_path_factory):
    """A server with a short context (64 tokens) and a small waiting queue, so any example runs fast."""
    d = tmp_path_factory.mktemp("fuzz") / "m"
    shutil.copytree(tiny_llama_dir, d)
    (d / "chat_template.jinja").write_text(CHATML)
    llm = LLM(d, kv_cache_tokens=4096, max_model_len=64)
    app = build_app(llm, "tiny", max_waiting=32)
    with running_server(app) as url:
        yield url, app, llm


def _served_model_only(openapi: dict) -> dict:
    """The app's OpenAPI description with every request's ``model`` pinned to the served one (``tiny``),
    so positive examples get past the model check instead of a 404; negative ones still try others."""
    openapi = copy.deepcopy(openapi)
    for spec in openapi.get("components", {}).get("schemas", {}).values():
        prop = spec.get("properties", {}).get("model")
        if prop is not None:
            spec["properties"]["model"] = {"type": "string", "enum": ["tiny"], "title": prop.get("title", "Model")}
    return openapi


def _in_range(openapi: dict, vocab_size: int) -> dict:
    """Narrowed further to what this server accepts (token ids in the vocabulary, prompts and outputs
    that fit 64 tokens, chat messages with a role and text), so most examples reach generation."""
    openapi = _served_model_only(openapi)
    schemas = openapi["components"]["schemas"]
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
           "minItems": 1, "maxItems": 40}
    text = {"type": "string", "minLength": 1, "maxLength": 60}
    few_tokens = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 16}, {"type": "null"}]}
    schemas["CompletionRequest"]["properties"].update(
        prompt={"anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1, "maxItems": 3},
                          {"type": "array", "items": ids, "minItems": 1, "maxItems": 3}]},
        max_tokens=few_tokens, n={"type": "integer", "minimum": 1, "maximum": 3})
    schemas["ChatCompletionRequest"]["properties"].update(
        messages={"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": text}}},
        max_tokens=few_tokens, max_completion_tokens=few_tokens, n={"type": "integer", "minimum": 1, "maximum": 3})
    for name in ("DetokenizeRequest",):
        if name in schemas:
            schemas[name]["properties"]["tokens"] = {**ids, "minItems": 0}
    return openapi


def _openai_error(response) -> bool:
    try:
        err = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}


def test_schema_fuzzing_finds_no_server_error_or_hang(fuzz_server, capsys):
    url, app, llm = fuzz_server
    passes = [("schema", schemathesis.openapi.from_dict(_served_model_only(app.openapi())), GenerationMode.POSITIVE),
              ("schema", schemathesis.openapi.from_dict(_served_model_only(app.openapi())), GenerationMode.NEGATIVE),
              ("in range", schemathesis.openapi.from_dict(_in_range(app.openapi(), llm.model_config.vocab_size)),
               GenerationMode.POSITIVE)]
    tally: dict[str, collections.Counter] = {}
    failures: list[str] = []
    for kind, schema, mode in passes:
        for result in schema.get_all_operations():
            op = result.ok()
            if kind == "in range" and op.method.upper() != "POST":
                continue
            key = f"{op.label} [{kind}, {mode.value}]"
            seen = tally.setdefault(key, collections.Counter())

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                try:
                    response = case.call(base_url=url, timeout=TIMEOUT_S)
                except Exception as e:  # a timeout (hang) or a dropped connection
                    failures.append(f"{op.label}: {type(e).__name__}: {e} for {case.body!r:.300}")
                    seen["no answer"] += 1
                    return
                seen[response.status_code] += 1
                if os.environ.get("WORKBENCH_FUZZ_VERBOSE") and response.status_code >= 400:
                    print(op.label, response.text[:150], repr(case.body)[:200])
                if response.status_code >= 500:
                    failures.append(f"{op.label}: HTTP {response.status_code} {response.text[:300]} for "
                                    f"{case.body!r:.300}")
                elif response.status_code == 200 and "text/event-stream" in response.headers.get("content-type", ""):
                    for line in response.text.splitlines():  # an error in a stream is an event, under HTTP 200
                        if line.startswith("data: {") and '"error"' in line[:12]:
                            code = json.loads(line[6:])["error"]["code"]
                            seen[f"stream {code}"] += 1
                            if code >= 500:
                                failures.append(f"{op.label}: error event {line[:300]} for {case.body!r:.300}")
                elif response.status_code >= 400 and not _openai_error(response):
                    failures.append(f"{op.label}: HTTP {response.status_code} without an OpenAI-shaped error: "
                                    f"{response.text[:200]} for {case.body!r:.300}")

            try:
                run()
            except Unsatisfiable:  # nothing to break: an operation without parameters or body (GET /health)
                if mode is GenerationMode.POSITIVE:
                    raise
                del tally[key]
    m = parse_metrics(httpx.get(url + "/metrics").text)
    examples = sum(sum(c.values()) for c in tally.values())
    lines = [f"schema fuzzing: {examples} examples over {len(tally)} operation/pass pairs, {len(failures)} failures"]
    lines += [f"  {k}: {dict(sorted(v.items(), key=str))}" for k, v in tally.items()]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not failures, "\n".join(failures[:10])
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
    kv = llm.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
