"""`kind: openai` engines: scenario schema, trace replay against the in-process server, unreachable endpoints,
and the `workbench serve` command."""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from engines import LLM
from server_helpers import free_port, running_server
from workbench.cli import app
from workbench.openai_replay import EndpointError, metrics_url
from workbench.runner import run_scenario
from workbench.scenario import ScenarioError, load_scenario, validate_scenario

TRACE = {"format": "synthetic", "synthetic": {"num_requests": 12, "request_rate": 30.0, "lengths": "uniform",
                                              "input_range": [8, 60], "output_range": [2, 14]}}


def scenario(model, engines, tmp_path):
    p = tmp_path / "sc.yaml"
    p.write_text(yaml.safe_dump({"name": "oa", "model": str(model), "seed": 3, "trace": TRACE, "engines": engines}))
    return p


def test_schema_kind_openai(tmp_path):
    base = {"name": "x", "trace": TRACE}
    sc = validate_scenario({**base, "engines": [{"name": "srv", "kind": "openai", "base_url": "http://h:1/v1",
                                                 "api_key": "top-secret"}]})
    assert sc.engines[0].api_key.get_secret_value() == "top-secret"
    assert "top-secret" not in json.dumps(sc.model_dump(mode="json"))  # results.json never holds the key
    bad = [({"name": "srv", "kind": "openai"}, "needs base_url"),
           ({"name": "srv", "kind": "openai", "base_url": "h:1"}, "needs base_url"),
           ({"name": "srv", "kind": "openai", "base_url": "http://h:1/v1", "max_num_seqs": 4}, "set on the server"),
           ({"name": "p", "kind": "paged", "base_url": "http://h:1/v1"}, "only for kind openai"),
           ({"name": "p", "kind": "paged", "endpoint": "chat"}, "only for kind openai"),
           ({"name": "srv", "kind": "openai", "base_url": "http://h:1/v1", "endpoint": "responses"}, "endpoint"),
           ({"name": "srv", "kind": "openai", "base_url": "http://h:1/v1", "itl_mode": "step"}, "itl_mode")]
    for eng, msg in bad:
        with pytest.raises(ScenarioError, match=msg):
            validate_scenario({**base, "engines": [eng]})
    assert metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    eng = validate_scenario({**base, "engines": [{"name": "srv", "kind": "openai", "base_url": "http://h:1/v1"}]}).engines[0]
    assert (eng.endpoint, eng.itl_mode) == ("completions", "chunk")


def test_replay_against_our_server_counts_add_up(tiny_llama_dir, tmp_path):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096, max_model_len=128)
    from workbench.serve.app import build_app

    with running_server(build_app(llm, "tiny", api_key="k")) as url:
        engines = [{"name": "paged", "kind": "paged", "kv_cache_tokens": 4096, "max_model_len": 128},
                   {"name": "srv", "kind": "openai", "base_url": url + "/v1", "model": "tiny", "api_key": "env:OA_KEY"}]
        os.environ["OA_KEY"] = "k"
        try:
            res = run_scenario(load_scenario(scenario(tiny_llama_dir, engines, tmp_path)), tmp_path / "out")
        finally:
            del os.environ["OA_KEY"]
    p, s = res["engines"]["paged"]["summary"], res["engines"]["srv"]["summary"]
    assert s["num_finished"] == 12 and s["num_rejected"] == s["num_failed"] == 0
    assert s["total_output_tokens"] == p["total_output_tokens"] and s["total_input_tokens"] == p["total_input_tokens"]
    assert s["output_throughput"] > 0 and s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["p50"] > 0
    d = s["server_metrics"]["delta"]
    assert d["vllm:generation_tokens_total"] == s["total_output_tokens"]
    assert d["vllm:prompt_tokens_total"] == s["total_input_tokens"]
    assert d["vllm:e2e_request_latency_seconds_count"] == 12
    assert s["server_metrics"]["after"]["vllm:num_requests_running"] == 0
    assert res["engines"]["srv"]["config"]["api_key"] == "**********"
    rows = (tmp_path / "out" / "srv" / "requests.csv").read_text().splitlines()
    assert len(rows) == 13
    # greedy, same prompts: the server produced exactly the trace's output lengths, with a time per token
    import pandas as pd

    rf = pd.read_csv(tmp_path / "out" / "srv" / "requests.csv")
    assert (rf["token_times_s"].str.split().str.len() == rf["output_tokens"]).all()


def test_chat_replay_against_our_server(tiny_llama_dir, tmp_path):
    """endpoint chat: the trace's token ids decoded, sent as one user message; the server's chat template
    makes the prompts longer than the trace's, and usage.prompt_tokens counts them; one output token per
    content chunk, the role-only first chunk not a token."""
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096, max_model_len=512)
    llm.tokenizer.chat_template = "{% for m in messages %}<user> {{ m['content'] }}\n{% endfor %}<assistant> "
    from workbench.serve.app import build_app

    with running_server(build_app(llm, "tiny")) as url:
        engines = [{"name": "chat", "kind": "openai", "base_url": url + "/v1", "model": "tiny", "endpoint": "chat",
                    "itl_mode": "token"}]
        res = run_scenario(load_scenario(scenario(tiny_llama_dir, engines, tmp_path)), tmp_path / "out")
    s = res["engines"]["chat"]["summary"]
    assert s["num_finished"] == 12 and s["num_rejected"] == s["num_failed"] == 0
    assert s["num_suspect"] == 0 and s["num_output_tokens_estimated"] == 0
    assert s["ttft_ms"]["count"] == 12 and s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["count"] > 0
    import pandas as pd

    rf = pd.read_csv(tmp_path / "out" / "chat" / "requests.csv")
    assert (~rf["output_tokens_estimated"]).all() and rf["suspect"].isna().all()
    from workbench.scenario import load_scenario_trace  # prompt tokens: the server's (template, re-tokenized text)
    from transformers import AutoTokenizer

    sc = load_scenario(tmp_path / "sc.yaml")
    trace = {t.request_id: t.prompt_tokens for t in load_scenario_trace(sc, AutoTokenizer.from_pretrained(tiny_llama_dir))}
    assert rf["prompt_tokens"].sum() == s["total_input_tokens"]
    assert (rf["prompt_tokens"] != rf["request_id"].map(trace)).all()  # not the trace's lengths
    assert (rf["token_times_s"].str.split().str.len() == rf["output_tokens"]).all()


def test_unreachable_endpoint_fails_in_one_line(tiny_llama_dir, tmp_path):
    engines = [{"name": "srv", "kind": "openai", "base_url": f"http://127.0.0.1:{free_port()}/v1"}]
    path = scenario(tiny_llama_dir, engines, tmp_path)
    with pytest.raises(EndpointError, match="engine srv: cannot reach"):
        run_scenario(load_scenario(path), tmp_path / "out")
    r = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "o2")])
    assert r.exit_code == 2
    errs = [x for x in r.output.splitlines() if x.startswith("error: ")]
    assert len(errs) == 1 and errs[0].startswith("error: engine srv: cannot reach http://127.0.0.1:")
    assert "Traceback" not in r.output


def test_workbench_serve_command(tiny_llama_dir):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "WORKBENCH_NO_CPP": "1"}  # no kernel build here
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", "--model", str(tiny_llama_dir),
                             "--port", str(port), "--served-model-name", "tiny", "--kv-cache-tokens", "2048",
                             "--max-model-len", "128", "--max-waiting", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.time() + 300  # a cold start may build the CPU kernels first
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "tiny", "prompt": "fox", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["max_model_len"] == 128
    finally:
        proc.terminate()
        proc.wait(20)
    bad = CliRunner().invoke(app, ["serve", "--engine", "nope"])
    assert bad.exit_code == 2 and "--engine must be paged or static" in bad.output
