"""Engine-side safety: collision-proof prefix-cache keys, request ids unique while in flight, forks
within ``max_num_seqs``, every EOS id of a model stopping generation, and the Triton wrappers handing
every tensor to their kernels on the query's device."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engines.core.kv_cache_manager as kv_mod
from engines.core.block_pool import hash_block_tokens
from engines.core.config import ModelConfig, SchedulerConfig
from engines.core.kv_cache_manager import PagedKVCacheManager
from engines.core.paged_scheduler import PagedScheduler
from engines.core.request import Request, RequestStatus
from engines.core.sampling_params import SamplingParams
from engines.core.scheduler import StepResult
from test_prefix_cache import FakeKVExecutor, check_step

PROPS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _req(rid, ids, max_tokens=3, **kw):
    return Request(rid, list(ids), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw))


def _drain(sched, fake, check=True):
    while sched.has_unfinished():
        out = sched.schedule()
        if check:
            check_step(sched, out)
        sched.update(out, fake(out))


# ------------------------------------------------------------------------------------------ prefix keys


def test_block_hash_is_sha256_of_a_canonical_encoding():
    h = hash_block_tokens(None, [1, 2, 3])
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(None, (1, 2, 3))
    # the encoding cannot be shifted: the token count and the salt's length are part of it
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(None, [1], "ab") != hash_block_tokens(None, [1], "a")
    assert hash_block_tokens(None, [1], "") != hash_block_tokens(None, [1])
    assert hash_block_tokens(h, [4, 5]) != hash_block_tokens(None, [4, 5])
    with pytest.raises(TypeError):
        hash_block_tokens(None, ["1"])


def test_a_colliding_key_never_serves_another_prompts_kv(monkeypatch):
    """Every block hashes to the same key: a lookup must compare what the cached block holds and miss;
    the fake KV memory checks that every attended slot holds the request's own token."""
    monkeypatch.setattr(kv_mod, "hash_token_blocks", lambda parent, toks, bs, extra=None: [b"\x00" * 32] * (len(toks) // bs))
    kv = PagedKVCacheManager(num_blocks=32, block_size=4, enable_caching=True)
    sched = PagedScheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    fake = FakeKVExecutor(kv, sched)
    sched.add_request(_req("a", range(10, 22)))
    _drain(sched, fake)
    sched.add_request(_req("b", range(40, 52)))  # shares nothing with a, same (forced) key
    hit, n = kv.get_computed_blocks(sched.requests["b"])
    assert (hit, n) == ([], 0) and kv.pool.num_hash_collisions == 1
    _drain(sched, fake)
    # a true repeat of a still hits: its first block's content matches
    sched.add_request(_req("a2", range(10, 22)))
    hit, n = kv.get_computed_blocks(sched.requests["a2"])
    assert n == 4
    _drain(sched, fake)


def test_cache_salt_isolates_tenants():
    kv = PagedKVCacheManager(num_blocks=32, block_size=4, enable_caching=True)
    sched = PagedScheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    fake = FakeKVExecutor(kv, sched)
    a = _req("a", range(10, 22))
    a.cache_salt = "tenant-1"
    sched.add_request(a)
    _drain(sched, fake)
    for rid, salt, hits in [("b", "tenant-2", 0), ("c", None, 0), ("d", "tenant-1", 8)]:
        r = _req(rid, range(10, 22))
        r.cache_salt = salt
        sched.add_request(r)
        assert kv.get_computed_blocks(r)[1] == hits, rid
        _drain(sched, fake)


def test_llm_generate_takes_a_cache_salt(tiny_llama_dir):
    from engines.llm import LLM

    llm = LLM(tiny_llama_dir, kv_cache_tokens=1024, block_size=4)
    prompt = list(range(20, 44))
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    kv = llm.engine.scheduler.kv
    first = llm.generate([prompt], sp, cache_salt="x")[0]
    before = kv.prefix_hits
    assert llm.generate([prompt], sp, cache_salt="y")[0].token_ids == first.token_ids
    assert kv.prefix_hits == before  # another salt: nothing shared
    assert llm.generate([prompt], sp, cache_salt="x")[0].token_ids == first.token_ids
    assert kv.prefix_hits > before


# ------------------------------------------------------------------------------------------ request ids


def test_an_id_in_flight_is_refused_and_free_again_once_finished():
    kv = PagedKVCacheManager(num_blocks=32, block_size=4)
    sched = PagedScheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    fake = FakeKVExecutor(kv, sched)
    first = _req("x", range(3, 9))
    sched.add_request(first)
    with pytest.raises(ValueError, match="request x: .*already in flight"):
        sched.add_request(_req("x", range(50, 56)))
    assert sched.requests["x"] is first and list(sched.waiting) == [first]
    _drain(sched, fake)
    assert first.status == RequestStatus.FINISHED_LENGTH
    sched.add_request(_req("x", range(50, 56)))  # finished: the id may be used again
    _drain(sched, fake)


def test_a_parent_id_stays_in_flight_while_its_forks_run():
    kv = PagedKVCacheManager(num_blocks=64, block_size=4)
    sched = PagedScheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    fake = FakeKVExecutor(kv, sched)
    sched.add_request(Request("p", list(range(3, 9)), SamplingParams(n=3, max_tokens=4, ignore_eos=True)))
    out = sched.schedule()
    sched.update(out, fake(out))
    sched.abort("p")  # the parent ends, its children p#1 and p#2 still run
    assert "p" not in sched.requests and "p#1" in sched.requests
    with pytest.raises(ValueError, match="already in flight"):
        sched.add_request(Request("p", [5, 6], SamplingParams(n=3, max_tokens=2)))
    _drain(sched, fake, check=False)
    sched.add_request(Request("p", [5, 6], SamplingParams(n=3, max_tokens=2)))


def test_engine_add_request_refuses_a_duplicate_id(tiny_llama_dir):
    from engines.llm import LLM

    engine = LLM(tiny_llama_dir, kv_cache_tokens=1024).engine
    engine.add_request(_req("dup", range(3, 9)))
    with pytest.raises(ValueError, match="dup"):
        engine.add_request(_req("dup", range(30, 39)))
    outs = engine.run_to_completion()
    assert [o.request_id for o in outs] == ["dup"] and not engine.scheduler.requests


# ------------------------------------------------------------------------------------------ forks


@PROPS
@given(st.data())
def test_forks_never_push_running_past_max_num_seqs(data):
    max_seqs = data.draw(st.integers(1, 6), label="max_num_seqs")
    kv = PagedKVCacheManager(num_blocks=data.draw(st.integers(24, 80)), block_size=4, enable_caching=True,
                             num_cpu_blocks=32)
    mode = data.draw(st.sampled_from(["recompute", "swap"]))
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=32, max_model_len=64,
                                           preemption_mode=mode), kv)
    fake = FakeKVExecutor(kv, sched, seed=data.draw(st.integers(0, 99)))
    ids = data.draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=12), label="ids")
    added = refused = rejected = 0
    for step, rid in enumerate(ids):
        n = data.draw(st.integers(1, 4))
        r = Request(rid, [3 + (step * 5 + j) % 50 for j in range(data.draw(st.integers(1, 14)))],
                    SamplingParams(n=n, max_tokens=data.draw(st.integers(1, 6)), ignore_eos=True))
        in_flight = sched.in_flight(rid)
        try:
            ok = sched.add_request(r)
        except ValueError:
            assert in_flight
            refused += 1
        else:
            assert not in_flight
            added += ok
            rejected += not ok
            assert ok == (n <= max_seqs)
        for _ in range(data.draw(st.integers(0, 3))):
            out = sched.schedule()
            check_step(sched, out)
            sched.update(out, fake(out))
            assert len(sched.running) <= max_seqs
    while sched.has_unfinished():
        out = sched.schedule()
        check_step(sched, out)
        sched.update(out, fake(out))
        assert len(sched.running) <= max_seqs
    assert added + refused + rejected == len(ids)
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_a_request_with_more_sequences_than_max_num_seqs_is_rejected():
    kv = PagedKVCacheManager(num_blocks=32, block_size=4)
    sched = PagedScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), kv)
    r = Request("w", [3, 4, 5], SamplingParams(n=3, max_tokens=2))
    assert not sched.add_request(r)
    assert r.status == RequestStatus.REJECTED and "3 sequences" in r.reject_reason and "max_num_seqs (2)" in r.reject_reason


# ------------------------------------------------------------------------------------------ EOS ids


def test_every_eos_id_stops_generation():
    kv = PagedKVCacheManager(num_blocks=32, block_size=4)
    sched = PagedScheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    reqs = [Request(f"r{e}", [3, 4, 5], SamplingParams(max_tokens=8), eos_token_id=(7, 8, 9)) for e in (7, 8, 9)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, StepResult({f"r{e}": e for e in (7, 8, 9)}, 0.0))
    assert all(r.status == RequestStatus.FINISHED_STOPPED for r in reqs)
    assert [r.stop_reason for r in reqs] == [7, 8, 9]


def test_model_config_takes_the_eos_ids_of_generation_config(tmp_path, tiny_llama_dir):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["eos_token_id"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 9]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (5, 2, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (7, 2)


def test_llm_stops_on_any_of_the_models_eos_ids(tiny_llama_dir):
    from engines.llm import LLM

    llm = LLM(tiny_llama_dir, kv_cache_tokens=1024)
    prompt = list(range(20, 40))
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    later, sooner = free.token_ids[7], free.token_ids[3]
    llm.eos_token_ids = (later, sooner)  # the first id is not the one that comes first
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(sooner) + 1]


# ------------------------------------------------------------------------------------------ Triton devices


class _RecordedLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` records the tensors it gets."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tensors += [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        return launch


def test_triton_wrappers_put_every_tensor_on_the_querys_device(monkeypatch):
    """Tensors on the ``meta`` device stand for a CUDA device: an index tensor the wrapper builds on the
    host (or a block table passed from the host) shows up as a ``cpu`` tensor in the launch."""
    tri = pytest.importorskip("wb_kernels.triton_attention")
    monkeypatch.setattr(tri, "_check_runnable", lambda: None)
    meta = torch.device("meta")
    kc = torch.empty(8, 4, 2, 16, device=meta)
    for name in ("_decode_kernel", "_prefill_kernel"):
        monkeypatch.setattr(tri, name, _RecordedLaunch())
    q1 = torch.empty(3, 4, 16, device=meta)
    tri.paged_attention_decode(q1, kc, kc, torch.zeros(3, 2, dtype=torch.int64), torch.tensor([3, 5, 8]))
    q2 = torch.empty(5, 4, 16, device=meta)
    tri.paged_attention_prefill(q2, kc, kc, torch.tensor([1, 2]), start_pos=3)
    tri.paged_attention_prefill_varlen(q2, kc, kc, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0, 2, 5]),
                                       torch.tensor([0, 4]), max_seqlen_q=3)
    for name in ("_decode_kernel", "_prefill_kernel"):
        got = getattr(tri, name).tensors
        assert got and {t.device for t in got} == {meta}, (name, [t.device for t in got])
    with pytest.raises(ValueError, match="one device"):
        tri.paged_attention_decode(q1, torch.empty(8, 4, 2, 16), kc, torch.zeros(3, 2), torch.tensor([3, 5, 8]))
