"""The real engine's KV memory: the paged K/V tensors on the model's device, and the CPU swap space that
swap preemption copies blocks to and from (block ids are the ``engines.core`` KV manager's)."""

from __future__ import annotations

import torch

from engines.core.config import ModelConfig


class KVCache:
    """Per-layer K and V tensors ``[num_blocks + 1, block_size, num_kv_heads, head_dim]``.

    The extra last block is scratch space for static-batching padding rows: a padding row's block table is
    this block repeated, so its K/V writes land there (rows may overwrite each other: nothing reads them
    but padding rows, whose output is discarded).
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu"):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.num_hidden_layers, 2, num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(cfg.num_hidden_layers)]
        self.scratch_block = num_blocks

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    # block copies for copy-on-write (a forked sequence's shared, partly filled block)
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` inside the pool (all layers, K and V)."""
        if pairs:
            src, dst = _block_index(pairs, self.data.device)
            self.data[:, :, dst] = self.data[:, :, src]


def _block_index(pairs: list[tuple[int, int]], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``[(src, dst)]`` block pairs as two index tensors ``[len(pairs)]`` (int64) on ``device``."""
    return (torch.tensor([p[0] for p in pairs], device=device), torch.tensor([p[1] for p in pairs], device=device))


class SwapSpace:
    """CPU swap pool ``[layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim]``: pinned memory
    when the KV cache is on a CUDA device (as vLLM's swap space), ordinary memory otherwise (on a CPU-only
    machine the "device" pool is CPU memory too, so a swap is a memcpy)."""

    def __init__(self, kv: KVCache, num_cpu_blocks: int) -> None:
        shape = list(kv.data.shape)
        shape[2] = num_cpu_blocks
        self.data = torch.zeros(shape, dtype=kv.data.dtype, device="cpu", pin_memory=kv.data.is_cuda)

    def swap_out(self, kv: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: ``pairs`` = ``[(device block, cpu block)]``."""
        if pairs:
            src, dst = _block_index(pairs)
            self.data[:, :, dst] = kv.data[:, :, src.to(kv.data.device)].to("cpu")

    def swap_in(self, kv: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks to device blocks: ``pairs`` = ``[(cpu block, device block)]``."""
        if pairs:
            src, dst = _block_index(pairs)
            kv.data[:, :, dst.to(kv.data.device)] = self.data[:, :, src].to(kv.data.device)
