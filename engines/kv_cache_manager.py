"""KV cache bookkeeping for both policies: paged blocks and contiguous per-request reservations.

Both managers describe a request's KV as a *block table* over one tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, so the model runner and the
attention kernel are the same for both engines. The paged manager hands out any free blocks as the
request grows; the contiguous manager reserves, at admission, one run of consecutive blocks large
enough for the request's whole reservation (the Orca-style baseline of the PagedAttention paper).

Token-slot accounting (PagedAttention paper, SOSP 2023, Fig. 2), per request:
  allocated   = slots the request holds (blocks x block_size, or its reservation)
  token_states= slots holding K/V of tokens already computed (``num_computed_tokens``)
  reserved    = slots held for tokens the request may still produce (scheduled or future output,
                capped by ``max_tokens``)
  internal    = allocated - token_states - reserved (slots it can never use)
and for the pool: external = slots lost between allocations (alignment gaps of contiguous runs).
KV waste = 1 - token_states / allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.block_pool import BlockPool
from engines.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


@dataclass
class KVStats:
    """Slot counts (tokens) of the whole pool at one instant."""

    total_slots: int
    allocated: int
    token_states: int
    reserved: int
    internal_frag: int
    external_frag: int

    @property
    def waste_frac(self) -> float:
        """1 - token_states / allocated (0 when nothing is allocated)."""
        return 1.0 - self.token_states / self.allocated if self.allocated else 0.0

    @property
    def usage_frac(self) -> float:
        """Allocated slots over pool slots (vLLM's ``kv_cache_usage_perc`` as a fraction)."""
        return self.allocated / self.total_slots if self.total_slots else 0.0


class PagedKVCacheManager:
    """Paged KV: blocks are allocated on demand as a request's tokens are scheduled.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def fits_ever(self, request: Request) -> bool:
        """Whether the request's whole prompt + max output could fit an empty pool."""
        return cdiv(request.max_total_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``num_computed_tokens``.

        Returns False (allocating nothing) when the pool has too few free blocks.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        table.extend(blocks)
        return True

    def free(self, request: Request) -> None:
        """Release all blocks of the request (no-op if it holds none)."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            # free in reverse so the tail blocks (least likely shared later) are reused first
            self.pool.free(list(reversed(table)))

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def stats(self, requests: list[Request], scheduled: dict[str, int] | None = None) -> KVStats:
        """Slot accounting for the requests that hold blocks (see module docstring).

        ``scheduled`` (request id -> tokens computed in the step being accounted) counts those tokens'
        slots as holding token states: the step writes them.
        """
        scheduled = scheduled or {}
        allocated = self.pool.num_used_blocks * self.block_size
        states = reserved = 0
        for r in requests:
            held = len(self.block_tables.get(r.request_id, ())) * self.block_size
            if not held:
                continue
            s = min(r.num_computed_tokens + scheduled.get(r.request_id, 0), held)
            states += s
            reserved += min(held - s, r.max_total_tokens - s)
        return KVStats(
            total_slots=self.pool.num_blocks * self.block_size,
            allocated=allocated,
            token_states=states,
            reserved=reserved,
            internal_frag=allocated - states - reserved,
            external_frag=0,
        )


RESERVATION_POLICIES = ("max", "pow2", "oracle")


def reservation_tokens(policy: str, request: Request, max_model_len: int, oracle_len: int | None = None) -> int:
    """Slots the static baseline reserves for a request (PagedAttention paper, Fig. 2 / Sec. 6.1).

    ``max``: max_model_len; ``pow2``: next power of two >= prompt + max_tokens (capped at
    max_model_len); ``oracle``: the exact final length (``oracle_len`` if given, else prompt +
    max_tokens).

    Raises:
        ValueError: unknown policy.
    """
    need = request.max_total_tokens
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(max_model_len, 1 << max(0, (need - 1).bit_length()))
    if policy == "oracle":
        return oracle_len if oracle_len is not None else need
    raise ValueError(f"reservation must be one of {', '.join(RESERVATION_POLICIES)}, got {policy!r}")


class ContiguousKVCacheManager:
    """Static-batching KV: one contiguous run of blocks per request, reserved at admission.

    A run starts on a block boundary; the slots between the end of a reservation and the next block
    boundary are counted as external fragmentation (alignment gap). First-fit over the free runs.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.runs: dict[str, tuple[int, int, int]] = {}  # request_id -> (first block, n blocks, reserved slots)

    def _free_extents(self) -> list[tuple[int, int]]:
        taken = sorted((s, n) for s, n, _ in self.runs.values())
        extents, cur = [], 0
        for s, n in taken:
            if s > cur:
                extents.append((cur, s - cur))
            cur = max(cur, s + n)
        if cur < self.num_blocks:
            extents.append((cur, self.num_blocks - cur))
        return extents

    def reserve(self, request: Request, slots: int) -> bool:
        """Reserve ``slots`` contiguous slots for the request; False if no free run is long enough."""
        n = cdiv(slots, self.block_size)
        for start, length in self._free_extents():
            if length >= n:
                self.runs[request.request_id] = (start, n, slots)
                return True
        return False

    def fits_ever(self, slots: int) -> bool:
        return cdiv(slots, self.block_size) <= self.num_blocks

    def free(self, request: Request) -> None:
        self.runs.pop(request.request_id, None)

    def block_table(self, request_id: str) -> list[int]:
        start, n, _ = self.runs[request_id]
        return list(range(start, start + n))

    def stats(self, requests: list[Request], scheduled: dict[str, int] | None = None) -> KVStats:
        """Slot accounting: a reservation is allocated from admission to release (``scheduled`` as
        in ``PagedKVCacheManager.stats``)."""
        scheduled = scheduled or {}
        allocated = states = reserved = internal = external = 0
        for r in requests:
            run = self.runs.get(r.request_id)
            if run is None:
                continue
            _, n, slots = run
            allocated += n * self.block_size
            external += n * self.block_size - slots
            s = min(r.num_computed_tokens + scheduled.get(r.request_id, 0), slots)
            states += s
            res = min(slots - s, max(0, r.max_total_tokens - s))
            reserved += res
            internal += slots - s - res
        return KVStats(
            total_slots=self.num_blocks * self.block_size,
            allocated=allocated,
            token_states=states,
            reserved=reserved,
            internal_frag=internal,
            external_frag=external,
        )
