"""Block pool: fixed-size KV blocks with reference counts and a free-block queue (no torch).

Shaped after vLLM V1's ``BlockPool``: blocks are handed out from the head of a free queue and returned
to its tail when their reference count drops to zero, so the least recently freed block is reused
first. Reference counts let several sequences share a block (prefix caching, parallel sampling).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class BlockPoolError(RuntimeError):
    """Raised on a bookkeeping bug: freeing a free block (ref count would go negative)."""


@dataclass
class KVBlock:
    """One block of ``block_size`` token slots. ``ref_cnt`` = sequences that hold it."""

    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """``num_blocks`` blocks, ids ``0 .. num_blocks-1``.

    A failed allocation is a normal answer (``None``), not an exception: the scheduler preempts.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each); ``None`` if fewer than ``n`` are free."""
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self.blocks[i].ref_cnt = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Share already-held blocks with one more sequence."""
        for i in block_ids:
            if self.blocks[i].ref_cnt <= 0:
                raise BlockPoolError(f"block {i} is free and cannot be shared")
            self.blocks[i].ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches zero joins the free queue.

        Raises:
            BlockPoolError: a block is already free.
        """
        for i in block_ids:
            blk = self.blocks[i]
            if blk.ref_cnt <= 0:
                raise BlockPoolError(f"block {i} freed twice (ref count would go negative)")
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free.append(i)
