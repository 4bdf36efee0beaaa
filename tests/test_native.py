"""The mypyc-compiled engines (``workbench/native.py``) give exactly what the plain source gives.

The hot modules are built once for the test session (about half a minute), then the same workloads run in two
processes, one on the plain source and one on the compiled copy, and print a digest of every output (tokens,
finish reason, preemptions, every token time) and every step record. Workloads: the paged policy with prefix
caching, shared prompts and a small pool (hits, preemption), parallel sampling and beam search, speculative
decoding, the static policy, and a 3-replica GPU what-if cluster behind the prefix-aware router.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import native

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = r'''
import dataclasses, hashlib, json, sys
if sys.argv[1] == "native":
    from workbench import native
    native.activate()
    assert native.is_active()
from engines.core.config import SchedulerConfig
from engines.core.request import Request
from engines.core.router import make_router
from engines.core.sampling_params import SamplingParams
from engines.core.spec_decode import SpecDecodeConfig
from engines.factory import EngineConfig, build_engine, build_scheduler
from engines.sim.cluster import simulate_cluster
from engines.sim.cost_model import CostModel
from engines.sim.simulator import make_sim_engine, simulate

CM = CostModel({"const": 0.01, "tokens": 0.001, "decode_ctx": 1e-6, "prefill_attn": 1e-9, "sampled": 1e-4})


def prompt(i, n, shared=7):
    return [3 + ((i % shared) * 131 + k * 17) % 900 for k in range(n)]


def reqs(count, **sp):
    return [Request(f"r{i}", prompt(i, 20 + (i * 37) % 300), SamplingParams(max_tokens=5 + (i * 13) % 60, **sp),
                    arrival_time=i * 0.02) for i in range(count)]


def digest(outs, engines):
    h = hashlib.sha256()
    for o in sorted(outs, key=lambda o: o.request_id):
        h.update(repr((o.request_id, o.finish_reason, o.token_ids, o.num_preemptions, o.first_token_time,
                       o.finished_time, o.token_times, len(o.outputs))).encode())
    for e in engines:
        for s in e.steps:
            h.update(repr(dataclasses.astuple(s)).encode())
    return h.hexdigest()[:16]


def sim(policy, requests, num_blocks, caching=True, spec=None, **cfg):
    c = SchedulerConfig(max_model_len=1024, enable_prefix_caching=caching, **cfg)
    eng = make_sim_engine(build_scheduler(policy, c, num_blocks, 16, num_cpu_blocks=32, spec=spec), CM)
    outs = simulate(eng, requests)
    hits = sum(s.prefix_cache_hits for s in eng.steps)
    return [digest(outs, [eng]), sum(o.num_preemptions for o in outs), hits]


res = {
    "paged_prefix_preempt": sim("paged", reqs(120), 160, max_num_seqs=32, max_num_batched_tokens=256),
    "paged_swap": sim("paged", reqs(80), 120, preemption_mode="swap", max_num_batched_tokens=128),
    "parallel_and_beams": sim("paged", reqs(20, n=3, temperature=1.0) + [
        Request(f"b{i}", prompt(i, 30), SamplingParams(max_tokens=12, beam_width=3), arrival_time=0.1 * i)
        for i in range(6)], 400),
    "spec_decode": sim("paged", reqs(40, ignore_eos=True), 400, spec=SpecDecodeConfig.parse("ngram", 3)),
    "static": sim("static", reqs(40), 400, caching=False, max_batch_size=8),
}
replicas = [build_engine(EngineConfig(kind="sim", policy="paged", model="llama-3.1-8b", hardware="h100-sxm", tp=1,
                                      max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=2048))
            for _ in range(3)]
run = simulate_cluster(replicas, make_router("prefix_aware"), reqs(150))
res["cluster_prefix_aware"] = digest(run.outputs, replicas)
res["cluster_split"] = [sum(1 for v in run.replica_of.values() if v == i) for i in range(3)]
print(json.dumps(res))
'''


@pytest.fixture(scope="module")
def native_cache(tmp_path_factory) -> Path:
    """A cache folder holding a fresh build of the compiled engines (built here: a failed build fails the test)."""
    cache = tmp_path_factory.mktemp("wb-cache")
    out = native.build(cache=cache / "native")
    assert (out / ".complete").exists()
    compiled = sorted(p.relative_to(out).as_posix() for p in out.glob("engines/**/*.so"))
    assert [c.split(".")[0] + ".py" for c in compiled] == sorted(native.COMPILED)
    return cache


def _run(mode: str, cache: Path) -> dict:
    env = {**os.environ, "WORKBENCH_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", WORKLOADS, mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_compiled_engines_give_the_same_outputs_and_steps(native_cache):
    plain, compiled = _run("plain", native_cache), _run("native", native_cache)
    print(json.dumps({"plain": plain, "native": compiled}, indent=1))
    assert compiled == plain
    assert all(n > 0 for n in plain["cluster_split"])  # every replica served requests
    assert min(plain["paged_prefix_preempt"][1:]) > 0 and plain["paged_swap"][1] > 0  # preempted; prefix hits


def test_activate_refuses_once_engines_is_imported(native_cache, monkeypatch):
    import engines  # noqa: F401  (the plain source, as every test imports it)

    monkeypatch.setenv("WORKBENCH_CACHE", str(native_cache))
    with pytest.raises(RuntimeError, match="before anything imports engines"):
        native.activate()
    assert not native.is_active()


def test_the_build_is_keyed_by_the_source(tmp_path):
    """A copy of the source with one byte changed gets another digest (a stale build is never reused)."""
    import shutil

    shutil.copytree(ROOT / "engines", tmp_path / "engines", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    before = native.source_digest(tmp_path)
    assert before == native.source_digest(ROOT)
    p = tmp_path / "engines" / "core" / "request.py"
    p.write_text(p.read_text() + "\n")
    assert native.source_digest(tmp_path) != before
