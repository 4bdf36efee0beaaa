"""Soak: a real ``workbench serve`` process (tiny random-weight model, loopback only) under 64 concurrent
streaming clients for a bounded time.

A third of the clients disconnect at random points (before the first token, mid-stream, or a
non-streaming call given up), every client now and then sends a bad request, and the rest read their
responses to the end. Afterwards: nothing runs or waits, the KV cache is back to its baseline, the
server's resident memory grew by at most 5% between the first and the last part of the run, and every
response was either complete or a clean OpenAI-shaped error.

The CI form runs ``WORKBENCH_SOAK_SECONDS`` (default 30) of load; set it to e.g. 300 for a longer soak.
The figures (duration, requests, aborts, bad inputs, RSS, blocks in use at the end) are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from server_helpers import free_port
from workbench.serve.prom import parse_metrics

SECONDS = float(os.environ.get("WORKBENCH_SOAK_SECONDS", "30"))
CLIENTS = 64
KV_TOKENS, BLOCK_SIZE, MAX_MODEL_LEN = 2048, 16, 256  # a pool small enough for preemptions
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "the quick brown fox jumps over lazy dog paged attention blocks continuous batching forward pass".split()
SHARED_PREFIX = " ".join(WORDS * 2)  # several full blocks many requests share (prefix-cache hits)

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (``VmRSS`` in ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    """``workbench serve`` in a subprocess on a free loopback port: ``(url, process, log path)``."""
    tmp = tmp_path_factory.mktemp("soak")
    model = tmp / "m"
    shutil.copytree(tiny_llama_dir, model)
    (model / "chat_template.jinja").write_text(CHATML)
    port, log = free_port(), tmp / "server.log"
    cmd = [sys.executable, "-m", "workbench.cli", "serve", "--model", str(model), "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--kv-cache-tokens", str(KV_TOKENS),
           "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN), "--max-waiting", "1024"]
    env = {**os.environ, "WORKBENCH_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"workbench serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"workbench serve did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    try:
        yield url, proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Tally:
    """What the clients saw."""

    complete: int = 0
    left: int = 0
    bad_inputs: int = 0
    queue_full: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return self.complete + self.left + self.bad_inputs + self.queue_full


def _error_ok(status: int, body: bytes) -> bool:
    """A clean error: 4xx (or a 503 queue-full) with an OpenAI-shaped JSON body."""
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (400 <= status < 500 or status == 503) and set(err) == {"message", "type", "param", "code"}


BAD_BODIES = [
    {"model": "tiny", "prompt": "x", "max_tokens": 0},
    {"model": "nope", "prompt": "x", "max_tokens": 4},
    {"model": "tiny", "prompt": [1] * 300, "max_tokens": 1},
    {"model": "tiny", "prompt": [5, 10**9], "max_tokens": 4},
    {"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": -1},
    {"model": "tiny", "prompt": "x", "max_tokens": 4, "n": 1000},
    {"model": "tiny", "prompt": "x", "max_tokens": 4, "n": 3, "best_of": 2},
    {"model": "tiny", "prompt": "x", "max_tokens": 4, "guided_regex": "a+"},
    {"model": "tiny", "prompt": "x", "max_tokens": 4, "cache_salt": ""},
    {"model": "tiny", "prompt": [], "max_tokens": 4},
    {"model": "tiny", "messages": [], "max_tokens": 4},
    {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
]


def _request(rng: random.Random) -> tuple[str, dict, dict]:
    """A valid request: (path, body, headers)."""
    max_tokens = rng.choice([1, 4, 16, 32, 64])
    body: dict = {"model": "tiny", "max_tokens": max_tokens, "return_token_ids": True,
                  "ignore_eos": rng.random() < 0.5, "stream": rng.random() < 0.85,
                  "n": rng.choice([1, 1, 1, 2])}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, seed=rng.randrange(1000))
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(["o", "e ", "th"])]
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        body["cache_salt"] = rng.choice(["a", "b"])
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 25)))  # all fit 256 tokens with 64 more
    text = (SHARED_PREFIX + " " + words) if rng.random() < 0.4 else words
    headers = {"X-Request-Id": rng.choice(["soak", "dup", f"c{rng.randrange(10**6)}"])} if rng.random() < 0.3 else {}
    if rng.random() < 0.25:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}, headers
    prompt = text if rng.random() < 0.7 else [rng.randrange(3, 300) for _ in range(rng.randrange(1, 120))]
    return "/v1/completions", {**body, "prompt": prompt}, headers


def _check_stream(lines: list[str], body: dict) -> str | None:
    """Why a complete SSE response is wrong, or None."""
    if not lines or lines[-1] != "data: [DONE]":
        return "no [DONE] at the end"
    n, max_tokens = body["n"], body["max_tokens"]
    counts, finish = [0] * n, [None] * n
    usage = None
    for line in lines[:-1]:
        obj = json.loads(line[6:])
        if "error" in obj:
            return f"error event: {obj['error']}"
        if obj.get("usage"):
            usage = obj["usage"]
        for c in obj["choices"]:
            i = c["index"]
            if finish[i] is not None:
                return f"choice {i}: a chunk after its finish_reason"
            counts[i] += len(c.get("token_ids") or ())  # a chat stream's role chunk has none
            finish[i] = c["finish_reason"]
    if any(f not in ("stop", "length") for f in finish):
        return f"finish reasons {finish}"
    if any(k > max_tokens or (f == "length" and k != max_tokens) for k, f in zip(counts, finish)):
        return f"token counts {counts} with max_tokens {max_tokens} and finish {finish}"
    if body.get("stream_options") and (usage is None or usage["completion_tokens"] != sum(counts)):
        return f"usage {usage} for counts {counts}"
    return None


def _check_json(obj: dict, body: dict) -> str | None:
    if len(obj.get("choices", ())) != body["n"]:
        return f"{len(obj.get('choices', ()))} choices for n={body['n']}"
    if any(c["finish_reason"] not in ("stop", "length") for c in obj["choices"]):
        return f"finish reasons {[c['finish_reason'] for c in obj['choices']]}"
    if obj["usage"]["completion_tokens"] > body["n"] * body["max_tokens"]:
        return f"usage {obj['usage']}"
    return None


async def _one(cl: httpx.AsyncClient, url: str, rng: random.Random, leaver: bool, tally: Tally) -> None:
    """One request of one client; adds its outcome to ``tally``."""
    if rng.random() < 0.1:  # a bad request: must be a clean 4xx
        bad = rng.choice(BAD_BODIES)
        path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
        if rng.random() < 0.1:
            r = await cl.post(url + path, content=b"{not json", headers={"Content-Type": "application/json"})
        else:
            r = await cl.post(url + path, json=bad)
        tally.bad_inputs += 1
        if not (400 <= r.status_code < 500 and _error_ok(r.status_code, r.content)):
            tally.failures.append(f"bad input {bad}: HTTP {r.status_code} {r.text[:200]}")
        return
    path, body, headers = _request(rng)
    leave = leaver and rng.random() < 0.7
    if not body["stream"]:
        try:
            if leave:  # give up on a non-streaming call
                r = await asyncio.wait_for(cl.post(url + path, json=body, headers=headers), rng.uniform(0.0, 0.3))
            else:
                r = await cl.post(url + path, json=body, headers=headers)
        except asyncio.TimeoutError:
            tally.left += 1
            return
        if r.status_code != 200:
            tally.queue_full += r.status_code == 503
            if not _error_ok(r.status_code, r.content) or r.status_code != 503:
                tally.failures.append(f"{path} {body}: HTTP {r.status_code} {r.text[:200]}")
            return
        why = _check_json(r.json(), body)
        if why:
            tally.failures.append(f"{path} {body}: {why}")
        tally.complete += 1
        tally.tokens += r.json()["usage"]["completion_tokens"]
        return
    leave_after = rng.randrange(0, body["max_tokens"] * body["n"] + 1) if leave else None
    lines: list[str] = []
    async with cl.stream("POST", url + path, json=body, headers=headers) as r:
        if r.status_code != 200:
            content = await r.aread()
            tally.queue_full += r.status_code == 503
            if r.status_code != 503 or not _error_ok(r.status_code, content):
                tally.failures.append(f"{path} {body}: HTTP {r.status_code} {content[:200]!r}")
            return
        if leave_after == 0:
            tally.left += 1
            return  # gone before the first token
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if leave_after is not None and len(lines) >= leave_after:
                tally.left += 1
                return  # closing the response drops the connection mid-stream
    why = _check_stream(lines, body)
    if why:
        tally.failures.append(f"{path} {body}: {why}")
    tally.complete += 1
    tally.tokens += len(lines)


async def _client(i: int, url: str, deadline: float, tally: Tally) -> None:
    rng = random.Random(i)
    leaver = i % 3 == 0  # a third of the clients disconnect at random points
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as cl:
        while time.monotonic() < deadline:
            try:
                await _one(cl, url, rng, leaver, tally)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                tally.failures.append(f"client {i}: {type(e).__name__}: {e}")


async def _sample(url: str, pid: int, stop: asyncio.Event, rss: list, gauges: list) -> None:
    async with httpx.AsyncClient(timeout=10) as cl:
        while not stop.is_set():
            rss.append((time.monotonic(), rss_bytes(pid)))
            m = parse_metrics((await cl.get(url + "/metrics")).text)
            gauges.append((m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass


def test_soak_many_streaming_clients_leave_nothing_behind(served, capsys):
    url, proc, log = served
    scrape = lambda: parse_metrics(httpx.get(url + "/metrics").text)  # noqa: E731
    base = scrape()
    assert base["vllm:num_requests_running"] == base["vllm:num_requests_waiting"] == 0
    tally, rss, gauges = Tally(), [], []

    async def main():
        stop = asyncio.Event()
        start = time.monotonic()
        sampler = asyncio.create_task(_sample(url, proc.pid, stop, rss, gauges))
        await asyncio.gather(*[_client(i, url, start + SECONDS, tally) for i in range(CLIENTS)])
        stop.set()
        await sampler
        return time.monotonic() - start

    duration = asyncio.run(main())
    deadline = time.time() + 30
    while (m := scrape())["vllm:num_requests_running"] or m["vllm:num_requests_waiting"]:
        assert time.time() < deadline, f"requests left running after the soak: {m}"
        time.sleep(0.1)
    aborts = sum(float(x.split()[-1]) for x in httpx.get(url + "/metrics").text.splitlines()
                 if x.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in x)
    blocks_end = round(m["vllm:kv_cache_usage_perc"] * KV_TOKENS / BLOCK_SIZE)
    # RSS: the load's first part (after a warm-up of 15% of the run) against its last part
    t0 = rss[0][0]
    span = rss[-1][0] - t0
    first = [b for t, b in rss if 0.15 * span <= t - t0 <= 0.35 * span]
    last = [b for t, b in rss if t - t0 >= 0.8 * span]
    final_rss = rss_bytes(proc.pid)
    mib = 1 / 2**20
    figures = (f"soak: {duration:.0f} s, {CLIENTS} clients, {tally.requests} requests ({tally.complete} complete, "
               f"{tally.left} left early, {tally.bad_inputs} bad inputs, {tally.queue_full} queue-full), "
               f"{tally.tokens} chunks/tokens, server aborts {aborts:.0f}, RSS first part peak "
               f"{max(first) * mib:.1f} MiB, last part peak {max(last) * mib:.1f} MiB, overall peak "
               f"{max(b for _, b in rss) * mib:.1f} MiB, final {final_rss * mib:.1f} MiB, KV blocks in use at the "
               f"end {blocks_end} (baseline {round(base['vllm:kv_cache_usage_perc'] * KV_TOKENS / BLOCK_SIZE)}), "
               f"preemptions {m['vllm:num_preemptions_total']:.0f}, prefix-cache hits "
               f"{m['vllm:prefix_cache_hits_total']:.0f}/{m['vllm:prefix_cache_queries_total']:.0f} tokens")
    with capsys.disabled():
        print("\n" + figures)
    assert not tally.failures, f"{len(tally.failures)} bad responses, e.g.:\n" + "\n".join(tally.failures[:10])
    assert tally.complete > CLIENTS and tally.left > 0 and tally.bad_inputs > 0, figures
    assert all(r >= 0 and w >= 0 for r, w in gauges)
    assert m["vllm:kv_cache_usage_perc"] == base["vllm:kv_cache_usage_perc"], figures
    assert max(last) <= 1.05 * max(first), figures
    assert proc.poll() is None, "the server died"
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
