"""Block pool: fixed-size KV blocks with reference counts, a free-block queue and a prefix cache (no torch).

Shaped after vLLM V1's ``BlockPool``: blocks are handed out from the head of a free queue and returned
to its tail when their reference count drops to zero, so the least recently freed block is reused
first. Reference counts let several sequences share a block (prefix caching, parallel sampling).

Automatic prefix caching (vLLM V1): a full block can be registered under its *block hash* (see
:func:`hash_block_tokens`). A freed block keeps its hash and stays findable while it waits in the free
queue; it is evicted (its hash forgotten) only when :meth:`BlockPool.allocate` hands it out as a fresh
block, so eviction is least-recently-freed first. A cache hit on a free block takes it out of the free
queue (:meth:`BlockPool.touch`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from engines.core.errors import BlockPoolError  # noqa: F401  (raised here; importable from here)


BlockHash = bytes
"""A block's prefix-cache key: 32 bytes of sha256 (see :func:`hash_block_tokens`)."""

BlockKey = tuple
"""What a cached block holds, compared on every hit: ``(parent hash, token ids, extra keys)``."""

_NO_PARENT = bytes(32)
_sha256 = hashlib.sha256


def _pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive 8-byte little-endian signed integers, the encoding :func:`hash_block_tokens`
    hashes (one ``struct.pack`` call: about a third of the time ``array("q", ids)`` takes per id).

    Raises:
        TypeError: an id is not an integer in int64 range.
    """
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as e:
        raise TypeError(f"token ids must be integers in int64 range ({e})") from None


def _extra_tail(extra_keys: Hashable | None) -> bytes:
    """The encoding's last part: a flag, then the length-prefixed ``repr`` of ``extra_keys``."""
    if extra_keys is None:
        return b"\x00"
    e = repr(extra_keys).encode()
    return b"\x01" + len(e).to_bytes(8, "little") + e


def _digest(parent_hash: BlockHash | None, count: bytes, packed_ids: bytes, tail: bytes) -> BlockHash:
    """sha256 of one block's message, ``parent hash | n | token ids | extra keys``, joined and hashed in one call
    (fewer calls than one update per part; the same digest)."""
    return _sha256(b"".join((parent_hash if parent_hash is not None else _NO_PARENT, count, packed_ids,
                             tail))).digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: Hashable | None = None) -> BlockHash:
    """sha256 of one full block, chained: ``sha256(parent hash | n | token ids | extra keys)``.

    Chaining the parent's hash makes a block's hash identify the whole prefix up to and including it
    (vLLM V1's ``hash_block_tokens``). The encoding is canonical: the parent's 32 bytes (zeros for the
    first block), the number of tokens and each id as 8-byte little-endian integers, then a flag and
    the length-prefixed ``repr`` of ``extra_keys`` (a tenant's ``cache_salt``). sha256 rather than
    Python's tuple ``hash``, which is not collision-resistant (crafted prompts can collide and serve one
    client another's KV; vLLM moved to sha256 for the same reason, GHSA-rm76-4mrf-v9r8). A hit also
    compares the stored token ids (:meth:`BlockPool.get_cached_block`), so even a colliding key never
    reuses the wrong block.

    Args:
        parent_hash: the previous block's hash, None for the first block.
        token_ids: the block's token ids (ints in int64 range).
        extra_keys: anything with a stable ``repr`` that must also match (None: nothing).
    Returns:
        32 bytes.
    Raises:
        TypeError: a token id is not an integer in int64 range.
    """
    return _digest(parent_hash, len(token_ids).to_bytes(8, "little"), _pack_token_ids(token_ids),
                   _extra_tail(extra_keys))


def hash_token_blocks(parent_hash: BlockHash | None, token_ids: Sequence[int], block_size: int,
                      extra_keys: Hashable | None = None) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block is not hashed): the
    digests :func:`hash_block_tokens` gives block by block, with every id packed in one call.

    Args:
        parent_hash: the hash of the block before ``token_ids[0]``'s block, None if it is the first.
        token_ids: consecutive blocks' token ids, starting at a block boundary.
        block_size: tokens per block.
        extra_keys: as :func:`hash_block_tokens`.
    Returns:
        ``len(token_ids) // block_size`` hashes of 32 bytes, in block order.
    Raises:
        TypeError: a token id is not an integer in int64 range.
    """
    n = len(token_ids) // block_size
    if n <= 0:
        return []
    data = _pack_token_ids(token_ids if len(token_ids) == n * block_size else token_ids[: n * block_size])
    count, tail, step = block_size.to_bytes(8, "little"), _extra_tail(extra_keys), 8 * block_size
    out: list[BlockHash] = []
    parent = parent_hash
    for i in range(n):
        parent = _digest(parent, count, data[i * step : (i + 1) * step], tail)
        out.append(parent)
    return out


@dataclass
class KVBlock:
    """One block of ``block_size`` token slots. ``ref_cnt`` = sequences that hold it;
    ``block_hash`` = its prefix-cache key while it is registered in the cache (None otherwise);
    ``key`` = what it holds, ``(parent hash, token ids, extra keys)``, compared on every hit;
    ``next_free`` / ``prev_free`` = the next block and the previous block's id in the free queue while it is
    free (``next_free`` None otherwise)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    key: BlockKey | None = None
    next_free: KVBlock | None = field(default=None, repr=False, compare=False)
    prev_free: int = field(default=-1, repr=False, compare=False)


class FreeBlockQueue:
    """The free blocks in LRU order (head = next to reuse), a doubly linked list through the blocks (vLLM
    V1's ``FreeKVCacheBlockQueue``): taking from the head, adding at the tail and taking a block out of the
    middle (a prefix-cache hit on a free block) are O(1) updates, with no dict and no per-operation
    allocation. A block links to the next one and names the previous one by id, so the blocks hold no
    reference cycle (the simulator runs with the cycle collector paused).

    Args:
        blocks: the pool's blocks, ``blocks[i].block_id == i``, all free, queued in that order.
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._blocks = blocks
        self._head = KVBlock(-1)  # sentinels: every queued block has both neighbours; id -1 names the head
        self._tail = KVBlock(-2)
        prev = self._head
        for blk in blocks:
            prev.next_free = blk
            blk.prev_free = prev.block_id
            prev = blk
        prev.next_free = self._tail
        self._tail.prev_free = prev.block_id
        self.num_free = len(blocks)

    def __len__(self) -> int:
        return self.num_free

    def _block(self, block_id: int) -> KVBlock:
        return self._head if block_id < 0 else self._blocks[block_id]

    def popleft(self, n: int) -> list[KVBlock]:
        """Take the ``n`` blocks at the head (``n`` <= ``num_free``, checked by the caller), head first."""
        out: list[KVBlock] = []
        blk = self._head.next_free
        for _ in range(n):
            assert blk is not None and blk is not self._tail
            out.append(blk)
            nxt = blk.next_free
            blk.next_free = None
            blk = nxt
        assert blk is not None
        self._head.next_free = blk
        blk.prev_free = -1
        self.num_free -= n
        return out

    def append(self, blk: KVBlock) -> None:
        """Add a block at the tail (the last to be reused)."""
        tail = self._tail
        self._block(tail.prev_free).next_free = blk
        blk.prev_free = tail.prev_free
        blk.next_free = tail
        tail.prev_free = blk.block_id
        self.num_free += 1

    def remove(self, blk: KVBlock) -> None:
        """Take a block out of the queue wherever it is.

        Raises:
            BlockPoolError: the block is not in the queue.
        """
        nxt = blk.next_free
        if nxt is None:
            raise BlockPoolError(f"block {blk.block_id} is not in the free queue")
        self._block(blk.prev_free).next_free = nxt
        nxt.prev_free = blk.prev_free
        blk.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        """The free blocks' ids, head first (O(free blocks): for tests and inspection)."""
        out: list[int] = []
        blk = self._head.next_free
        while blk is not None and blk is not self._tail:
            out.append(blk.block_id)
            blk = blk.next_free
        return out


class BlockPool:
    """``num_blocks`` blocks, ids ``0 .. num_blocks-1``.

    A failed allocation is a normal answer (``None``), not an exception: the scheduler preempts.
    ``num_free_blocks`` counts every block with ref count 0, cached ones included (they are evictable).

    Attributes:
        cached: block hash -> block id of every block registered in the prefix cache.
        num_evictions: cached blocks whose hash was dropped to reuse them as fresh blocks.
        num_hash_collisions: lookups whose hash matched a block holding other tokens (answered as misses).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # free queue in LRU order (head = next to reuse)
        self._free = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        self.num_hash_collisions = 0
        self.num_shared_blocks = 0  # blocks with ref_cnt > 1 (KV accounting takes a slower path then)
        # kept as ref counts and hashes change, so KV accounting over shared blocks costs O(requests), not
        # O(blocks): references beyond the first (sum of ref_cnt - 1 over shared blocks), and shared blocks
        # that are not registered in the prefix cache (no hash: e.g. a forked sequence's partly filled block)
        self.num_extra_refs = 0
        self.num_shared_unhashed = 0

    @property
    def num_free_blocks(self) -> int:
        return self._free.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._free.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self.cached)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each), evicting the cached ones among them;
        ``None`` if fewer than ``n`` are free."""
        if n > self._free.num_free:
            return None
        ids: list[int] = []
        for blk in self._free.popleft(n):
            i = blk.block_id
            h = blk.block_hash
            if h is not None:  # evict: its contents are about to be overwritten
                if self.cached.get(h) == i:
                    del self.cached[h]
                blk.block_hash = blk.key = None
                self.num_evictions += 1
            blk.ref_cnt = 1
            ids.append(i)
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Share already-held blocks with one more sequence."""
        for i in block_ids:
            blk = self.blocks[i]
            if blk.ref_cnt <= 0:
                raise BlockPoolError(f"block {i} is free and cannot be shared")
            blk.ref_cnt += 1
            if blk.ref_cnt >= 2:
                self._shared_ref_added(blk)

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference to cached blocks found by a prefix-cache hit; a free one leaves the
        free queue (it is no longer evictable)."""
        for i in block_ids:
            blk = self.blocks[i]
            if blk.ref_cnt == 0:
                self._free.remove(blk)
            blk.ref_cnt += 1
            if blk.ref_cnt >= 2:
                self._shared_ref_added(blk)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches zero joins the tail of the free
        queue (keeping its hash, so it can still be hit until it is evicted).

        Raises:
            BlockPoolError: a block is already free.
        """
        for i in block_ids:
            blk = self.blocks[i]
            if blk.ref_cnt <= 0:
                raise BlockPoolError(f"block {i} freed twice (ref count would go negative)")
            blk.ref_cnt -= 1
            if blk.ref_cnt >= 1:
                self.num_extra_refs -= 1
                if blk.ref_cnt == 1:
                    self.num_shared_blocks -= 1
                    if blk.block_hash is None:
                        self.num_shared_unhashed -= 1
            else:
                self._free.append(blk)

    def _shared_ref_added(self, blk: KVBlock) -> None:
        """Count one more reference to ``blk`` beyond its first (its ``ref_cnt`` is now >= 2)."""
        self.num_extra_refs += 1
        if blk.ref_cnt == 2:
            self.num_shared_blocks += 1
            if blk.block_hash is None:
                self.num_shared_unhashed += 1

    # -- prefix cache ------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash, key: BlockKey | None = None) -> int | None:
        """The block registered under ``block_hash``, or None. With ``key``, a block registered with a
        different key is a collision: counted in ``num_hash_collisions`` and answered None (a miss)."""
        b = self.cached.get(block_hash)
        if b is None or key is None:
            return b
        stored = self.blocks[b].key
        if stored is not None and stored != key:
            self.num_hash_collisions += 1
            return None
        return b

    def cache_block(self, block_id: int, block_hash: BlockHash, key: BlockKey | None = None) -> bool:
        """Register a held, full block under ``block_hash`` (holding ``key``). Returns False (changing
        nothing) when another block already holds that hash (two requests computed the same block) or
        this one has a hash."""
        blk = self.blocks[block_id]
        if blk.block_hash is not None or block_hash in self.cached:
            return False
        blk.block_hash, blk.key = block_hash, key
        self.cached[block_hash] = block_id
        if blk.ref_cnt > 1:
            self.num_shared_unhashed -= 1
        return True

    def uncache_block(self, block_id: int) -> None:
        """Forget a block's hash (its contents are about to change in place, e.g. copy-on-write)."""
        blk = self.blocks[block_id]
        if blk.block_hash is not None:
            if self.cached.get(blk.block_hash) == block_id:
                del self.cached[blk.block_hash]
            blk.block_hash = blk.key = None
            if blk.ref_cnt > 1:
                self.num_shared_unhashed += 1

    def reset_prefix_cache(self) -> None:
        """Forget every hash (blocks stay where they are)."""
        for blk in self.blocks:
            blk.block_hash = blk.key = None
        self.cached.clear()
        self.num_shared_unhashed = self.num_shared_blocks
