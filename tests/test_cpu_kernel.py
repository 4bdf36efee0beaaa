"""The compiled CPU ops (paged decode attention, fused residual + RMSNorm, RoPE, SiLU-and-mul) against the
PyTorch reference in float32 and bfloat16; in CI a kernel that does not build fails these tests with the
build's error instead of skipping them. The varlen prefill kernel is tested in ``test_prefill_varlen.py``."""

import pytest
import torch

import torch.nn.functional as F

from engines.real.model import LlamaModel
from wb_kernels import cpu_ops
from wb_kernels.paged_attention import paged_attention_decode

KERNEL_MISSING = "the compiled CPU kernel (wb_kernels/csrc/paged_attention_cpu.cpp) is unavailable"


def require_kernel(require) -> None:
    """Skip (developer machine) or fail (CI) when the kernel is unavailable, with its build error."""
    require(cpu_ops.available(), KERNEL_MISSING, cpu_ops.build_error())


@pytest.fixture
def kernel(require):
    require_kernel(require)


@pytest.mark.parametrize("seed", range(12))
def test_cpu_decode_kernel_matches_reference(seed, kernel):
    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 9, (1,), generator=g))
    kvh = int(torch.randint(1, 5, (1,), generator=g))
    groups = int(torch.randint(1, 4, (1,), generator=g))
    d = [16, 32, 64][seed % 3]
    bs = [1, 4, 16][(seed // 3) % 3]
    nb = 64
    k = torch.randn(nb, bs, kvh, d, generator=g)
    v = torch.randn(nb, bs, kvh, d, generator=g)
    lens = torch.randint(1, 8 * bs, (batch,), generator=g)
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in range(batch)])
    q = torch.randn(batch, kvh * groups, d, generator=g)
    out = cpu_ops.paged_attention_decode(q, k, v, tables, lens, d**-0.5)
    ref = paged_attention_decode(q, k, v, tables, lens, d**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_decode_kernel_balances_uneven_contexts_across_threads(threads, kernel):
    """The decode kernel deals whole sequences to the threads by context (longest first, to the least-loaded
    thread), not in consecutive ranges: every row's output lands in its own place whatever the thread count,
    with more threads than rows, rows of context 0 and the long contexts bunched at the front."""
    g = torch.Generator().manual_seed(threads)
    batch, kvh, groups, d, bs, nb = 11, 3, 3, 64, 16, 128
    k = torch.randn(nb, bs, kvh, d, generator=g)
    v = torch.randn(nb, bs, kvh, d, generator=g)
    lens = torch.tensor([400, 390, 350, 300, 17, 16, 9, 1, 0, 33, 2])
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in range(batch)])
    q = torch.randn(batch, kvh * groups, d, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_ops.paged_attention_decode(q, k, v, tables, lens, d**-0.5)
    finally:
        torch.set_num_threads(before)
    live = lens > 0  # a row of no context has no defined attention: only its place must be left to it
    ref = paged_attention_decode(q[live], k, v, tables[live], lens[live], d**-0.5)
    torch.testing.assert_close(out[live], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,bs", [([1000], 16), ([777], 5), ([1500, 3], 16), ([260, 2000, 31], 16)])
def test_decode_kernel_splits_long_contexts_over_threads(lens, bs, dtype, kernel):
    """A context longer than its fair share of the threads is split into parts of whole blocks (a partial
    last block too), each part's softmax statistics and weighted values combined after: the same attention
    as the reference, in float32 and bfloat16."""
    g = torch.Generator().manual_seed(len(lens) * 100 + bs)
    kvh, groups, d = 3, 3, 64
    nb = sum(-(-n // bs) for n in lens) + 4
    k = (3 * torch.randn(nb, bs, kvh, d, generator=g)).to(dtype)  # large scores: the parts' maxima differ
    v = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    width = max(-(-n // bs) for n in lens)
    perm = torch.randperm(nb, generator=g)
    tables = torch.stack([perm[i * width % nb:][:width] if i * width + width <= nb else perm[:width]
                          for i in range(len(lens))])
    q = torch.randn(len(lens), kvh * groups, d, generator=g).to(dtype)
    lens_t = torch.tensor(lens)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = cpu_ops.paged_attention_decode(q, k, v, tables, lens_t, d**-0.5)
    finally:
        torch.set_num_threads(before)
    ref = paged_attention_decode(q.float(), k.float(), v.float(), tables, lens_t, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.float(), ref, atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("d,groups", [(64, 1), (64, 2), (64, 3), (64, 4), (128, 1), (128, 2), (128, 4), (32, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vectorized_decode_shapes_match_the_reference(d, groups, dtype, kernel):
    """The register-blocked decode path (head dims 32/64/128 with up to 4 query heads per KV head) over
    shuffled blocks, partial last blocks (block size 5) and contexts longer than the prefetch distance."""
    g = torch.Generator().manual_seed(d * 10 + groups)
    batch, kvh, bs, nb = 4, 2, 5, 96
    k = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    v = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    lens = torch.tensor([1, 7, 64, 203])
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in range(batch)])
    q = torch.randn(batch, kvh * groups, d, generator=g).to(dtype)
    out = cpu_ops.paged_attention_decode(q, k, v, tables, lens, d**-0.5)
    ref = paged_attention_decode(q.float(), k.float(), v.float(), tables, lens, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.float(), ref, atol=tol * 10, rtol=tol)


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance between two bfloat16 tensors in units in the last place (same-sign values)."""
    a, b = got.view(torch.int16).int(), want.view(torch.int16).int()
    return int((a - b).abs().max()) if got.numel() else 0


@pytest.mark.parametrize("seed", range(6))
def test_bf16_decode_kernel_matches_the_float32_reference(seed, kernel):
    """bfloat16 K/V/q are exact in float32 and the kernel computes in float32: the result is the float32
    reference's rounded to bfloat16, within one bfloat16 ulp (relative 2**-8)."""
    g = torch.Generator().manual_seed(100 + seed)
    batch, kvh, groups, d, bs, nb = 5, [1, 3, 2][seed % 3], [3, 1, 4][seed % 3], [64, 32, 48][seed % 3], [16, 8][seed % 2], 48
    k = torch.randn(nb, bs, kvh, d, generator=g).bfloat16()
    v = torch.randn(nb, bs, kvh, d, generator=g).bfloat16()
    lens = torch.randint(1, 5 * bs, (batch,), generator=g)
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in range(batch)])
    q = torch.randn(batch, kvh * groups, d, generator=g).bfloat16()
    out = cpu_ops.paged_attention_decode(q, k, v, tables, lens, d**-0.5)
    assert out.dtype == torch.bfloat16
    ref = paged_attention_decode(q.float(), k.float(), v.float(), tables, lens, d**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-4, rtol=2**-8)


def reference_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: float32 math, the normalized x cast to the model dtype, then the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_the_reference(dtype, kernel):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(37, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    want_x = x + delta  # the residual add in the model dtype
    want = reference_rms(want_x, w, 1e-5)
    got = cpu_ops.fused_add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, want_x) and got.dtype == dtype  # x was updated in place
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # the sum of squares in another order may move a rounding by one ulp, never more
        assert bf16_ulps(got, want) <= 1
        assert (got != want).float().mean() < 0.01
    assert torch.equal(cpu_ops.fused_add_rms_norm(x, None, w, 1e-5), got)  # no delta: the norm of x as it is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_inplace_matches_the_reference(dtype, kernel):
    """bfloat16 rounds where ``x * cos + rotate_half(x) * sin`` in bfloat16 does: bit for bit."""
    g = torch.Generator().manual_seed(2)
    t, h, d = 23, 9, 64
    qkv = torch.randn(t, (h + 6) * d, generator=g).to(dtype)
    q = qkv[:, : h * d].view(t, h, d)  # strided rows, as the model passes the q slice of qkv
    pos = torch.randint(0, 500, (t,), generator=g)
    ang = torch.arange(512, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(0, d, 2) / d))[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want = LlamaModel._rope(q.clone(), cos[pos][:, None, :], sin[pos][:, None, :])
    cpu_ops.rope_inplace(q, pos, cos, sin)
    if dtype == torch.float32:
        torch.testing.assert_close(q, want, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(q, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_reference(dtype, kernel):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(19, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = cpu_ops.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (19, 1536)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # exp to 2e-7 relative: silu(gate) rounds like torch's except at near-ties, then the same multiply
        assert bf16_ulps(got.abs(), want.abs()) <= 1


def test_mismatched_dtypes_are_one_line_errors(kernel):
    x = torch.randn(4, 8)
    for call, match in [
        (lambda: cpu_ops.fused_add_rms_norm(x, None, torch.ones(8).bfloat16(), 1e-5), "x and w must have the same dtype"),
        (lambda: cpu_ops.silu_and_mul(x.half()), "float32 or bfloat16 tensors only"),
        (lambda: cpu_ops.rope_inplace(x.view(4, 2, 4), torch.zeros(4, dtype=torch.long), torch.ones(3, 4).bfloat16(),
                                      torch.ones(3, 4).bfloat16()), "x and cos must have the same dtype"),
        (lambda: cpu_ops.paged_attention_decode(torch.randn(1, 2, 4).bfloat16(), torch.randn(2, 4, 1, 4),
                                                torch.randn(2, 4, 1, 4), torch.zeros(1, 1, dtype=torch.long),
                                                torch.ones(1, dtype=torch.long), 1.0), "q and k_cache must have the same dtype"),
    ]:
        with pytest.raises(RuntimeError, match=match) as e:
            call()
        assert "\n" not in str(e.value).strip()


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """``wb_kernels.cpu_ops`` as before its first load (restored afterwards), outside CI settings."""
    monkeypatch.setattr(cpu_ops, "_mod", None)
    monkeypatch.setattr(cpu_ops, "_failed", False)
    monkeypatch.setattr(cpu_ops, "_error", None)
    for var in ("WORKBENCH_NO_CPP", "CI", "WORKBENCH_REQUIRE_ALL"):
        monkeypatch.delenv(var, raising=False)


def test_a_failed_kernel_build_keeps_its_error_and_fails_in_ci(monkeypatch, require, fresh_kernel_state):
    compiler_output = "Error building extension 'workbench_paged_attention_cpu': c++: fatal error: no such compiler"

    def broken_build():
        raise RuntimeError(compiler_output)

    monkeypatch.setattr(cpu_ops, "_build", broken_build)
    with pytest.warns(UserWarning, match="no such compiler"):
        assert not cpu_ops.available()
    assert cpu_ops.build_error() == f"RuntimeError: {compiler_output}"
    with pytest.raises(RuntimeError, match="no such compiler"):
        cpu_ops.paged_attention_decode(torch.zeros(1, 1, 4), None, None, None, None, 1.0)

    # a developer machine: skipped, the reason names the kernel and the error's first line
    with pytest.raises(pytest.skip.Exception, match="no such compiler") as skipped:
        require_kernel(require)
    assert KERNEL_MISSING in str(skipped.value)
    # CI: a failure that shows the whole build error
    for var, value in (("CI", "true"), ("CI", "1"), ("WORKBENCH_REQUIRE_ALL", "1")):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            with pytest.raises(pytest.fail.Exception) as failed:
                require_kernel(require)
        assert KERNEL_MISSING in str(failed.value) and compiler_output in str(failed.value), (var, value)


def test_the_kernel_switched_off_says_so(monkeypatch, require, fresh_kernel_state):
    monkeypatch.setattr(cpu_ops, "_build", lambda: pytest.fail("WORKBENCH_NO_CPP=1 must not build"))
    monkeypatch.setenv("WORKBENCH_NO_CPP", "1")
    assert not cpu_ops.available() and cpu_ops.build_error() == "disabled by WORKBENCH_NO_CPP=1"
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="WORKBENCH_NO_CPP=1"):
        require_kernel(require)


def test_a_built_kernel_runs_in_ci(monkeypatch, require, fresh_kernel_state):
    monkeypatch.setattr(cpu_ops, "_build", lambda: object())
    monkeypatch.setenv("CI", "true")
    require_kernel(require)  # neither skips nor fails
    assert cpu_ops.build_error() is None
