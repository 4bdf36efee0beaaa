"""Where the real engine runs: the ``device`` knob and the attention kernels picked for it.

This machine has no GPU, so the CUDA branch is checked through what it picks (Triton kernels for a CUDA
device, never the compiled CPU kernel) and through the Triton kernels themselves in the interpreter
(``tests/test_triton_attention.py`` runs the whole engine on them); a GPU run is
``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

from engines.real.model import pick_attention, resolve_device
from wb_kernels import paged_attention as ref

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only behaviour")
def test_auto_device_is_cpu_without_a_gpu_and_cuda_is_a_one_line_error():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=rf"device '{name}': torch sees no CUDA device") as e:
            resolve_device(name)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        resolve_device("gpu")


def test_a_cuda_device_gets_the_triton_kernels():
    pytest.importorskip("triton")
    from wb_kernels import triton_attention

    for dtype in (torch.float32, torch.bfloat16):
        ops = pick_attention("auto", dtype, torch.device("cuda"))
        assert ops.name == "triton" and not ops.fused_cpu
        assert ops.decode is triton_attention.paged_attention_decode
        assert ops.prefill is triton_attention.paged_attention_prefill
        assert ops.prefill_varlen is triton_attention.paged_attention_prefill_varlen
    assert pick_attention("torch", torch.float32, torch.device("cuda")).decode is ref.paged_attention_decode
    with pytest.raises(ValueError, match="'cpp' is a CPU kernel; the model is on cuda"):
        pick_attention("cpp", torch.float32, torch.device("cuda"))


def test_cpu_keeps_the_compiled_kernel_and_never_auto_picks_triton():
    from wb_kernels import cpu_ops

    cpu = torch.device("cpu")
    f32 = pick_attention("auto", torch.float32, cpu)
    if cpu_ops.available():
        assert (f32.name, f32.fused_cpu, f32.decode) == ("cpp", True, cpu_ops.paged_attention_decode)
    else:
        assert f32.name == "torch"
    assert f32.prefill is ref.paged_attention_prefill
    bf16 = pick_attention("auto", torch.bfloat16, cpu)
    if cpu_ops.available():  # the compiled kernels take bfloat16 too; other dtypes get the reference
        assert f32.prefill_varlen is bf16.prefill_varlen is cpu_ops.paged_attention_prefill_varlen
        assert (bf16.name, bf16.fused_cpu) == ("cpp", True)
        with pytest.raises(ValueError, match="'cpp' needs float32 or bfloat16"):
            pick_attention("cpp", torch.float16, cpu)
    else:
        assert bf16.name == "torch"
    assert pick_attention("auto", torch.float16, cpu).name == "torch"
    assert pick_attention("torch", torch.float32, cpu).prefill_varlen is ref.paged_attention_prefill_varlen
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        pick_attention("flash", torch.float32, cpu)


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only behaviour")
def test_llm_with_cuda_fails_before_loading_weights(tiny_llama_dir, monkeypatch):
    from engines.llm import LLM
    from engines.real import model as model_mod

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the device was checked")

    monkeypatch.setattr(model_mod, "load_safetensors", no_load)
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        LLM(tiny_llama_dir, device="cuda")


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only behaviour")
def test_generate_cli_device_error_is_one_line(tiny_llama_dir):
    from workbench.cli import app

    r = CliRunner().invoke(app, ["generate", "--prompt", "hello", "--model", str(tiny_llama_dir), "--device", "cuda"])
    assert r.exit_code == 2
    assert "device 'cuda': torch sees no CUDA device" in r.output
    assert "Traceback" not in r.output


def test_scenario_device_knobs(tmp_path):
    from workbench.scenario import ScenarioError, load_scenario, scenario_hash
    from workbench.traces import BUILTIN_TRACE_DIR

    shutil.copy(BUILTIN_TRACE_DIR / "azure_conv_slice.csv", tmp_path / "conv.csv")

    def scen(engine: str):
        p = tmp_path / "s.yaml"
        p.write_text("name: d\ntrace: {format: azure, path: conv.csv, limit: 4}\n"
                     f"engines:\n  - {engine}\n")
        return p

    plain = load_scenario(scen("{name: p, kind: paged}"))
    assert (plain.engines[0].device, plain.engines[0].attention_backend) == ("auto", "auto")
    gpu = load_scenario(scen("{name: p, kind: paged, device: 'cuda:0', attention_backend: triton}"), check_files=False)
    assert gpu.engines[0].device == "cuda:0"
    assert scenario_hash(gpu) != scenario_hash(plain)
    explicit_auto = load_scenario(scen("{name: p, kind: paged, device: auto}"))
    assert scenario_hash(explicit_auto) == scenario_hash(plain)  # defaults stay out of the hash
    for engine, msg in [("{name: s, kind: sim, device: cuda}", "device is only for real engines"),
                        ("{name: p, kind: paged, device: tpu}", "device"),
                        ("{name: p, kind: static, attention_backend: flash}", "attention_backend")]:
        with pytest.raises(ScenarioError, match=msg) as e:
            load_scenario(scen(engine))
        assert "\n" not in str(e.value)


def test_triton_imported_without_the_interpreter_is_a_clear_error(monkeypatch):
    """Triton reads TRITON_INTERPRET at its first import: if something imported it earlier on a machine
    without a GPU, asking for the Triton kernels says so in one line instead of failing inside Triton."""
    triton_attention = pytest.importorskip("wb_kernels.triton_attention")
    monkeypatch.setattr(triton_attention, "_NO_INTERPRETER", True)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 in the environment"):
        pick_attention("triton", torch.float32, torch.device("cpu"))
    assert pick_attention("auto", torch.float32, torch.device("cuda")).name == "torch"  # falls back
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_attention.paged_attention_decode(torch.zeros(1, 2, 16), torch.zeros(2, 16, 1, 16),
                                                torch.zeros(2, 16, 1, 16), torch.zeros(1, 1, dtype=torch.long),
                                                torch.ones(1, dtype=torch.long))


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only behaviour")
def test_scenario_asking_for_a_missing_gpu_fails_at_load_naming_file_field_and_engine(tmp_path):
    from workbench.scenario import ScenarioError, load_scenario
    from workbench.traces import BUILTIN_TRACE_DIR

    shutil.copy(BUILTIN_TRACE_DIR / "azure_conv_slice.csv", tmp_path / "conv.csv")
    p = tmp_path / "gpu.yaml"
    p.write_text("name: d\ntrace: {format: azure, path: conv.csv, limit: 4}\nengines:\n"
                 "  - {name: sim, kind: sim}\n  - name: gpu-paged\n    kind: paged\n    device: cuda\n")
    with pytest.raises(ScenarioError) as e:
        load_scenario(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: engines.1.device: device 'cuda': torch sees no CUDA device")
    assert msg.endswith("(engine gpu-paged, line 7)")
    assert load_scenario(p, check_files=False).engines[1].device == "cuda"  # written here, run on a GPU machine
