"""Weight-only quantized layers (engines.real.quant): the round trips' error bounds, the kernels against the
dequantized weight (tight: the kernels' own bfloat16 rounding) and against the dense float32 layer (loose:
the quantization error), bytes as stored, batch independence, and a tiny Llama end to end in int8 and int4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.real import quant
from engines.real.linear import make_linear

# the kernels compute in bfloat16 (input, weight and output rounded; sums in float32): against the
# dequantized weight in float32, the relative (Frobenius) error stays within one bfloat16 ulp, 2^-8
TIGHT = 2.0**-8
# the quantization error of the layer's output against the dense float32 layer, for Gaussian weights and
# inputs: int8 per-channel ~0.8% (measured 0.79-0.89% on SmolLM2-135M's weights), int4 in groups of 64 ~9%
LOOSE = {"int8": 0.02, "int4": 0.15}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius), in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def weight():
    torch.manual_seed(0)
    return torch.randn(192, 128) * 0.05  # [out, in]; in = 2 groups of 64


# --------------------------------------------------------------------------------------- round trips


def test_int8_round_trip_is_within_half_a_step_per_channel(weight):
    q, scale = quant.quantize_int8(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scale.shape == (192,)
    assert q.abs().max() <= 127 and (q.abs().amax(dim=1) == 127).all()  # each row's max maps to +-127
    err = (quant.dequantize_int8(q, scale) - weight).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(quant.quantize_int8(torch.zeros(3, 8))[0], torch.zeros(3, 8, dtype=torch.int8))


def test_int4_round_trip_is_within_half_a_step_per_group_and_keeps_zero(weight):
    w = weight.clone()
    w[0, :64] = 0.0  # an all-zero group
    w[1, 64:] = w[1, 64:].abs() + 0.01  # an all-positive group: its range is stretched to include 0
    q, scale, zero = quant.quantize_int4(w, 64)
    assert q.dtype == zero.dtype == torch.uint8 and int(q.max()) <= 15 and int(zero.max()) <= 15
    assert scale.shape == zero.shape == (192, 2)
    deq = quant.dequantize_int4(q, scale, zero, 64)
    step = scale.repeat_interleave(64, dim=1)
    assert ((deq - w).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (deq[0, :64] == 0).all()  # zero is exactly representable
    # the relative error of 4-bit groups is ~ 1/sqrt(12) of a step, a step ~ range / 15
    assert 0.03 < rel(deq, w) < 0.15


def test_int4_needs_a_group_size_that_divides_the_input_width():
    with pytest.raises(ValueError, match="int4 group_size 64 must divide the layer's input width 100"):
        quant.quantize_int4(torch.randn(8, 100), 64)
    with pytest.raises(ValueError, match="input width 100"):
        quant.quantized_linear(torch.randn(8, 100), None, "int4")


# --------------------------------------------------------------------------------------- the layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_layer_matches_its_dequantized_weight_tightly_and_the_dense_layer_loosely(weight, kind, dtype):
    torch.manual_seed(1)
    bias = torch.randn(192).to(dtype) * 0.1
    layer = quant.quantized_linear(weight.to(dtype), bias, kind)
    assert (layer.out_features, layer.in_features, layer.dtype) == (192, 128, dtype)
    x = torch.randn(2, 5, 128).to(dtype)  # any leading dims
    y = layer(x)
    assert y.shape == (2, 5, 192) and y.dtype == dtype
    w_deq = layer.dequantized()  # [out, in] float32: what the kernel multiplies by
    assert w_deq.shape == weight.shape and w_deq.dtype == torch.float32
    # tight: the same weight in float32, the input rounded to bfloat16 as the kernel takes it
    exact = F.linear(x.to(torch.bfloat16).float(), w_deq, bias.float())
    assert rel(y, exact) < TIGHT
    # loose: the dense float32 layer
    dense = F.linear(x.float(), weight.to(dtype).float(), bias.float())
    assert rel(y, dense) < LOOSE[kind]


def test_int4_layer_computes_with_the_groups_scales_and_zero_points(weight):
    """The kernel's table (scale, (8 - zero) * scale in bfloat16) reproduces (q - zero) * scale: within the
    bfloat16 rounding of the two entries (relative 2^-8 each; |q - 8| <= 8, |8 - zero| <= 8), at most
    16 x scale x 2^-8 = scale / 16 per weight."""
    q, scale, zero = quant.quantize_int4(weight, 64)
    ref = quant.dequantize_int4(q, scale, zero, 64)
    got = quant.Int4Linear(weight).dequantized()
    assert ((got - ref).abs() <= scale.repeat_interleave(64, dim=1) / 16).all()


def test_int8_layer_computes_with_the_per_channel_scales(weight):
    q, scale = quant.quantize_int8(weight)
    layer = quant.Int8Linear(weight)
    assert torch.equal(layer.q, q)
    # the stored scale is bfloat16: relative 2^-8 at most
    assert torch.allclose(layer.dequantized(), quant.dequantize_int8(q, scale), rtol=2.0**-8, atol=0)


def test_the_bfloat16_inside_the_kernel_adds_little_to_the_quantization_error(weight):
    """A float32 model's int8 layer computes in bfloat16 (module docstring): its error against the dense
    float32 layer is within 10% of the weight quantization's alone (the dequantized weight, float32 input)."""
    torch.manual_seed(2)
    x = torch.randn(64, 128)
    layer = quant.Int8Linear(weight)
    dense = F.linear(x, weight)
    weight_only = rel(F.linear(x, layer.dequantized()), dense)
    assert rel(layer(x), dense) < 1.1 * weight_only


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_rows_output_does_not_depend_on_its_batch(weight, kind):
    """No activation quantization: a token's output is the same alone or batched with large-valued rows
    (what per-tensor dynamic W8A8 cannot promise)."""
    torch.manual_seed(3)
    layer = quant.quantized_linear(weight, None, kind)
    x = torch.randn(9, 128)
    batched = layer(torch.cat([x, 100 * torch.randn(4, 128)]))[:9]
    alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    assert torch.equal(batched, alone)


def test_nbytes_counts_the_weights_scales_and_zeros_as_stored():
    w, b = torch.randn(192, 128), torch.randn(192)
    assert quant.Int8Linear(w).nbytes == 192 * 128 + 192 * 2  # int8 + bf16 scale per row
    assert quant.Int8Linear(w, b).nbytes == 192 * 128 + 192 * 2 + 192 * 4
    # two 4-bit weights per byte + (scale, zero) in bf16 per group of 64 per row
    assert quant.Int4Linear(w).nbytes == 192 * 128 // 2 + 192 * 2 * 2 * 2
    assert quant.Int4Linear(w).nbytes < quant.Int8Linear(w).nbytes < w.numel() * 2 < w.numel() * 4


def test_make_linear_builds_quantized_layers_and_refuses_unknown_ones(weight):
    assert isinstance(make_linear(weight, None, "int8", "torch"), quant.Int8Linear)
    assert isinstance(make_linear(weight.bfloat16(), None, "int4", "torch"), quant.Int4Linear)
    with pytest.raises(ValueError, match="weight_dtype must be one of int8, int4 here, got 'int2'"):
        quant.quantized_linear(weight, None, "int2")


# --------------------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("weight_dtype", ["int8", "int4"])
def test_a_tiny_llama_generates_with_quantized_weights(tiny_llama_dir, weight_dtype):
    from engines import LLM, SamplingParams
    from workbench.runner import engine_runtime

    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    dense = LLM(tiny_llama_dir, kv_cache_tokens=512)
    llm = LLM(tiny_llama_dir, kv_cache_tokens=512, weight_dtype=weight_dtype)
    model = llm.engine.executor.model
    assert model.weight_dtype == weight_dtype
    assert all(isinstance(layer["gate_up"], quant.Int8Linear if weight_dtype == "int8" else quant.Int4Linear)
               for layer in model.layers)
    outs = llm.generate(prompts, sp)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    # the weights as stored shrink; the embedding (tied LM head) and norms stay dense
    assert model.weight_bytes() < dense.engine.executor.model.weight_bytes()
    runtime = engine_runtime(llm.engine)
    assert runtime["weight_dtype"] == weight_dtype and runtime["weight_bytes"] == model.weight_bytes()
    assert runtime["kv_cache_bytes"] == llm.engine.executor.kv.nbytes > 0
    # greedy decoding over the same prompts is deterministic
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in outs]


def test_a_tiny_llama_in_bfloat16_runs_int8_and_refuses_fp32_weights(tiny_llama_dir):
    from engines import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, kv_cache_tokens=512, dtype="bfloat16", weight_dtype="int8")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    with pytest.raises(ValueError, match="weight_dtype fp32 means dense weights in dtype float32, but dtype is "
                                         "bfloat16"):
        LLM(tiny_llama_dir, kv_cache_tokens=512, dtype="bfloat16", weight_dtype="fp32")


def test_generate_cli_takes_the_weight_dtype(tiny_llama_dir):
    """``workbench generate --weight-dtype int8`` runs quantized weights; a format the real engine does not
    run is a one-line usage error."""
    import json

    from typer.testing import CliRunner

    from workbench.cli import app

    args = ["generate", "--prompt", "hello there", "--model", str(tiny_llama_dir), "--max-tokens", "4", "--ignore-eos",
            "--json"]
    r = CliRunner().invoke(app, args + ["--weight-dtype", "int8"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.output)["outputs"][0]["token_ids"]) == 4
    r = CliRunner().invoke(app, args + ["--weight-dtype", "fp8"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "weight_dtype" in r.output and "fp8" in r.output
