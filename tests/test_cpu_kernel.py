"""The compiled CPU paged decode attention against the PyTorch reference; in CI a kernel that does not build
fails these tests with the build's error instead of skipping them."""

import pytest
import torch

from kernels import cpu_ops
from kernels.paged_attention import paged_attention_decode

KERNEL_MISSING = "the compiled CPU kernel (kernels/csrc/paged_attention_cpu.cpp) is unavailable"


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


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """``kernels.cpu_ops`` as before its first load (restored afterwards), outside CI settings."""
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
