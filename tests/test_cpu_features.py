"""CPU capability detection, ``dtype: auto`` and the dense GEMM backends."""

from __future__ import annotations

import pytest
import torch

from engines.factory import EngineConfig
from engines.real import cpu_features
from engines.core.row_buckets import onednn_rows_bucket
from engines.real.linear import Linear, resolve_linear_backend


@pytest.fixture
def flags(monkeypatch):
    """Pretend the CPU has the given /proc/cpuinfo flags."""
    def set_flags(*names):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: tuple(names))
    return set_flags


def test_auto_dtype_is_bf16_only_where_the_cpu_has_it(flags):
    flags("avx2", "fma")
    assert cpu_features.resolve_dtype("auto") == "float32"
    flags("avx2", "avx512f", "avx512_bf16")
    assert cpu_features.resolve_dtype("auto") == "bfloat16"
    flags("avx2", "avx512f", "amx_tile", "amx_bf16")
    assert cpu_features.resolve_dtype("auto") == "bfloat16"
    flags("avx2")
    assert cpu_features.resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert cpu_features.resolve_dtype("float32") == "float32" and cpu_features.resolve_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or auto, got 'fp16'"):
        cpu_features.resolve_dtype("fp16")


def test_engine_config_and_scenario_resolve_auto(flags):
    from workbench.scenario.engine_spec import PagedEngineSpec

    flags("avx2")
    assert EngineConfig(kind="paged", model="m", dtype="auto").dtype == "float32"
    assert PagedEngineSpec(name="p", kind="paged", dtype="auto").dtype == "float32"
    flags("avx512f", "avx512_bf16")
    assert EngineConfig(kind="paged", model="m", dtype="auto").dtype == "bfloat16"
    assert PagedEngineSpec(name="p", kind="paged", dtype="auto").dtype == "bfloat16"


def test_flags_are_read_from_proc_cpuinfo():
    have = cpu_features.cpu_flags()
    assert set(have) <= set(cpu_features.ISA_FLAGS)
    text = open("/proc/cpuinfo").read()
    assert ("avx2" in have) == (" avx2" in text)
    assert cpu_features.native_bf16() == (" avx512_bf16" in text or " amx_bf16" in text)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_linear_matches_f_linear(dtype):
    """The reordered oneDNN weight gives F.linear's result (another summation order, same precision) at
    the row counts of decode and prefill steps, with and without bias, on a strided input."""
    from engines.real.linear import onednn_supports

    cpu = torch.device("cpu")
    if not onednn_supports(dtype):  # bfloat16 on an AVX2-only CPU: auto falls back to F.linear, onednn is refused
        assert dtype == torch.bfloat16 and "avx512bw" not in cpu_features.cpu_flags()
        assert resolve_linear_backend("auto", cpu, dtype) == "torch"
        with pytest.raises(ValueError, match="cannot run"):
            resolve_linear_backend("onednn", cpu, dtype)
        return
    assert resolve_linear_backend("auto", cpu, dtype) == "onednn"
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    onednn, ref = Linear(w, b, "onednn"), Linear(w, b, "torch")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (0, 1, 7, 17, 64, 300):
        x = torch.randn(rows, 80, generator=g).to(dtype)[:, ::2]  # not contiguous
        got, want = onednn(x), ref(x)
        assert got.shape == (rows, 96) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)
    assert onednn.nbytes == ref.nbytes == (96 * 40 + 96) * w.element_size()


def test_onednn_row_buckets_are_few_and_tight():
    """oneDNN keeps a compiled primitive per row count, so row counts are padded to a bounded set: exact up
    to 16 rows, then 8 per doubling, never more than 1/8 extra rows."""
    buckets = {r: onednn_rows_bucket(r) for r in range(0, 4097)}
    assert all(buckets[r] == r for r in range(17))
    assert [buckets[r] for r in (17, 33, 63, 65, 1000, 1025, 1054)] == [18, 36, 64, 72, 1024, 1152, 1152]
    assert all(r <= b <= r * 9 / 8 for r, b in buckets.items())
    assert len(set(buckets.values())) == 17 + 8 * 8  # 0-16, then 8 per doubling from 17-32 to 2,049-4,096
    assert all(onednn_rows_bucket(b) == b for b in buckets.values())


def test_linear_backend_choice():
    cpu = torch.device("cpu")
    assert resolve_linear_backend("auto", cpu) == "onednn"
    assert resolve_linear_backend("auto", torch.device("cuda", 0)) == "torch"
    assert resolve_linear_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="linear_backend must be one of auto, torch, onednn, got 'mkl'"):
        resolve_linear_backend("mkl", cpu)
    with pytest.raises(ValueError, match="needs the CPU"):
        resolve_linear_backend("onednn", torch.device("cuda", 0))


def test_engines_agree_across_linear_backends(tiny_llama_dir):
    """Greedy tokens of the tiny model are the same with oneDNN and F.linear GEMMs, and the runtime says
    which ran."""
    from engines import LLM, SamplingParams
    from workbench.runner import engine_runtime

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["The quick brown fox", "Paged attention stores"]
    outs = {}
    for backend in ("onednn", "torch"):
        llm = LLM(tiny_llama_dir, linear_backend=backend, kv_cache_tokens=1024)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, sp)]
        rt = engine_runtime(llm.engine)
        assert rt["linear"] == backend and rt["dtype"] == "float32"
        assert rt["isa"] == list(cpu_features.cpu_flags())
    assert outs["onednn"] == outs["torch"]


def test_warm_onednn_builds_each_shape_once_per_bucket():
    """Warming runs one layer per distinct (in, out, dtype) at every bucket up to the step's rows, skips
    F.linear layers, and leaves the layers' results unchanged."""
    from engines.real.linear import warm_onednn

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(24, 40, generator=g), torch.randn(8, 40, generator=g)
    layers = [Linear(a, None, "onednn"), Linear(a.clone(), None, "onednn"), Linear(b, None, "onednn"),
              Linear(b, None, "torch")]
    x = torch.randn(37, 40, generator=g)
    before = layers[0](x)
    assert warm_onednn(layers, 100) == 2 * len({onednn_rows_bucket(r) for r in range(1, 101)})
    torch.testing.assert_close(layers[0](x), before)
    assert warm_onednn(layers[3:], 100) == 0


def test_replay_warm_up_builds_the_gemm_buckets_of_the_step_budget(tiny_llama_dir, monkeypatch):
    """A real engine's warm-up before a replay warms its GEMMs up to the step token budget (paged) or the
    warm cap (static), and the LM head up to the most sequences of a step; the model's row buckets tell
    the simulator to look its tables up at the padded rows."""
    from engines import LLM
    from engines.real.linear import ONEDNN_WARM_MAX_ROWS
    from engines.real.model import LlamaModel
    from workbench.runner import warm_up

    calls = []
    monkeypatch.setattr(LlamaModel, "warm_gemms", lambda self, t, s: calls.append((t, s)) or 0)
    paged = LLM(tiny_llama_dir, kv_cache_tokens=1024, max_num_seqs=8, max_num_batched_tokens=256)
    warm_up(paged.engine)
    static = LLM(tiny_llama_dir, engine="static", kv_cache_tokens=1024, max_batch_size=6)
    warm_up(static.engine)
    assert calls == [(256, 8), (ONEDNN_WARM_MAX_ROWS, 6)]
    assert not paged.engine.steps  # the warm-up request's steps are forgotten
    assert paged.engine.executor.model.row_buckets() == {"body": "onednn", "lm_head": "onednn"}
    plain = LLM(tiny_llama_dir, kv_cache_tokens=1024, linear_backend="torch")
    assert plain.engine.executor.model.row_buckets() == {"body": "", "lm_head": ""}
