"""The compiled CPU paged decode attention against the PyTorch reference."""

import pytest
import torch

from kernels import cpu_ops
from kernels.paged_attention import paged_attention_decode

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler for the CPU kernel")


@pytest.mark.parametrize("seed", range(12))
def test_cpu_decode_kernel_matches_reference(seed):
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
