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

from engines.core.block_pool import BlockPool, hash_token_blocks
from engines.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def count_breaks(table: list[int]) -> int:
    """Neighbouring entries of a block table that are not consecutive block ids."""
    return sum(1 for a, b in zip(table, table[1:]) if b != a + 1)


@dataclass
class KVStats:
    """Slot counts (tokens) of the whole pool at one instant."""

    total_slots: int
    allocated: int
    token_states: int
    reserved: int
    internal_frag: int
    external_frag: int

    # Written out rather than generated, with the fields and defaults declared above: mypyc compiles this one,
    # while the ``__init__`` that ``dataclasses`` generates runs interpreted even in the compiled build (one per step).
    def __init__(self, total_slots: int, allocated: int, token_states: int, reserved: int, internal_frag: int,
                 external_frag: int) -> None:
        self.total_slots = total_slots
        self.allocated = allocated
        self.token_states = token_states
        self.reserved = reserved
        self.internal_frag = internal_frag
        self.external_frag = external_frag

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

    With ``enable_caching`` (automatic prefix caching, vLLM V1 style) every full block of a request is
    registered in the pool's prefix cache under its chained block hash as soon as its tokens are
    scheduled; :meth:`get_computed_blocks` finds a new request's longest cached prefix of full blocks.
    With ``num_cpu_blocks`` > 0 a CPU swap pool backs swap preemption (:meth:`swap_out`, :meth:`swap_in`).

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_caching: automatic prefix caching (off by default at this level; the engine's
            ``SchedulerConfig.enable_prefix_caching`` turns it on by default).
        num_cpu_blocks: blocks in the CPU swap pool (0 = no swapping).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.enable_caching = enable_caching
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks of its table already hashed
        # request id -> neighbouring entries of its block table that are not consecutive block ids, kept as
        # the table changes so that a step's scatter (StepShape.scattered_ctx) costs O(1) per row, not O(blocks)
        self._breaks: dict[str, int] = {}
        # prefix-cache counters in tokens (vLLM's PrefixCacheStats): first admissions, and re-admissions
        # after a recompute preemption, kept apart so the hit rate describes the workload
        self.prefix_queries = self.prefix_hits = 0
        self.preempted_queries = self.preempted_hits = 0
        # CPU swap pool: block ids 0 .. num_cpu_blocks-1
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.cpu_tables: dict[str, list[int]] = {}
        # copy-on-write block copies (src, dst) made by allocate_slots, drained by the scheduler each step
        self.pending_copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def fits_ever(self, request: Request) -> bool:
        """Whether the request's whole prompt + max output could fit an empty pool."""
        return cdiv(request.max_total_tokens, self.block_size) <= self.pool.num_blocks

    # -- prefix caching ----------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list:
        """Chained hashes of the request's full blocks (prompt and output), extended as tokens arrive."""
        hs, bs, toks = request.block_hashes, self.block_size, request.all_token_ids
        have, full = len(hs), len(toks) // bs
        if full > have:
            hs.extend(hash_token_blocks(hs[-1] if hs else None, toks[have * bs : full * bs], bs, request.cache_salt))
        return hs

    def _block_key(self, request: Request, i: int) -> tuple:
        """What full block ``i`` of the request holds: ``(parent hash, token ids, cache salt)``."""
        bs, hs = self.block_size, request.block_hashes
        return (hs[i - 1] if i else None, tuple(request.all_token_ids[i * bs : (i + 1) * bs]), request.cache_salt)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's full blocks: ``(block ids, tokens)``.

        At most ``num_tokens_total - 1`` tokens are returned so the last token is always computed (its
        logits are sampled). Nothing is taken yet: pass the blocks to :meth:`allocate_slots`. A request
        that asks for prompt log-probabilities gets no hit: every prompt position's logits are computed.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        bs = self.block_size
        hashes = self.block_hashes(request)
        hit: list[int] = []
        cached = self.pool.cached
        for i, h in enumerate(hashes[: (request.num_tokens_total - 1) // bs]):
            # the block's key (its token ids, compared against a collision) is built only for a hash found
            b = self.pool.get_cached_block(h, self._block_key(request, i)) if h in cached else None
            if b is None:
                break
            hit.append(b)
        return hit, len(hit) * bs

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup: ``num_tokens_total`` queried, ``num_hit_tokens`` found."""
        if not self.enable_caching:
            return
        if request.num_preemptions:
            self.preempted_queries += request.num_tokens_total
            self.preempted_hits += num_hit_tokens
        else:
            self.prefix_queries += request.num_tokens_total
            self.prefix_hits += num_hit_tokens

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        n_full = min(num_tokens, request.num_tokens_total) // self.block_size
        start = self._num_cached.get(rid, 0)
        if n_full <= start:
            return
        table, hashes = self.block_tables[rid], self.block_hashes(request)
        for i in range(start, n_full):
            self.pool.cache_block(table[i], hashes[i], self._block_key(request, i))
        self._num_cached[rid] = n_full

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``num_computed_tokens``, after first taking
        ``new_computed_blocks`` (a prefix-cache hit from :meth:`get_computed_blocks`, whose tokens the
        caller then adds to ``num_computed_tokens``).

        Returns False (taking and allocating nothing) when the pool has too few free blocks.
        """
        bs = self.block_size
        table = self.block_tables.get(request.request_id)
        if table is not None and not new_computed_blocks:
            # the common decode step first: its tokens fit the blocks it holds and no shared partly filled
            # block needs a copy (the same outcome as the general path below, without its bookkeeping)
            computed = request.num_computed_tokens
            total = computed + num_new_tokens
            if total <= len(table) * bs and (num_new_tokens <= 0 or not computed % bs
                                             or not self.pool.num_shared_blocks):
                if self.enable_caching and min(total, len(request.all_token_ids)) // bs > \
                        self._num_cached.get(request.request_id, 0):
                    self._cache_full_blocks(request, total)
                return True
        table = self.block_tables.setdefault(request.request_id, [])
        hit = new_computed_blocks or []
        total = request.num_computed_tokens + len(hit) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(table) - len(hit)
        # copy-on-write: the first new token lands in a partly filled block another sequence shares
        cow = -1
        if num_new_tokens > 0 and request.num_computed_tokens % self.block_size:
            i = request.num_computed_tokens // self.block_size
            if i < len(table) and self.pool.blocks[table[i]].ref_cnt > 1:
                cow = i
        if cow >= 0:
            if max(need, 0) + 1 > self.pool.num_free_blocks:
                return False
            got = self.pool.allocate(1)
            assert got is not None  # one free block was checked for just above
            dst = got[0]
            src = table[cow]
            self.pending_copies.append((src, dst))
            self.pool.free([src])
            table[cow] = dst
            self._breaks[request.request_id] = count_breaks(table)
            self.num_cow_copies += 1
        if hit:
            # hit blocks that sit in the free queue stop being available for fresh allocation
            free_hits = sum(1 for b in hit if self.pool.blocks[b].ref_cnt == 0)
            if max(need, 0) > self.pool.num_free_blocks - free_hits:
                return False
            self.pool.touch(hit)
            self._extend(request.request_id, table, hit)
        if need > 0:
            blocks = self.pool.allocate(need)
            if blocks is None:
                return False
            self._extend(request.request_id, table, blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, total)
        return True

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the blocks of the request's table past the first ``cdiv(num_tokens, block_size)`` (slots of
        rejected draft tokens: never hashed, since only tokens in ``all_token_ids`` are). Returns the blocks
        freed."""
        table = self.block_tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        self._breaks[request.request_id] = count_breaks(table)
        self.pool.free(list(reversed(tail)))
        return len(tail)

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks (shared by ref count; a shared partly filled block is copied
        when one of them writes into it, see :meth:`allocate_slots`)."""
        table = list(self.block_tables.get(parent.request_id, []))
        self.pool.incref(table)
        self.block_tables[child.request_id] = table
        self._breaks[child.request_id] = self._breaks.get(parent.request_id, 0)
        self._num_cached[child.request_id] = self._num_cached.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def free(self, request: Request) -> None:
        """Release all blocks of the request, GPU and swapped-out CPU ones (no-op if it holds none).
        Freed blocks keep their prefix-cache hashes until they are reused."""
        table = self.block_tables.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self._breaks.pop(request.request_id, None)
        if table:
            # free in reverse so the tail blocks (least likely shared later) are evicted first
            self.pool.free(list(reversed(table)))
        cpu = self.cpu_tables.pop(request.request_id, None)
        if cpu:
            self._cpu_free.extend(cpu)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def scatter(self, request_id: str) -> float:
        """Share of the request's block-table neighbours that are not consecutive block ids (0: one contiguous
        run, or fewer than two blocks): ``engines.core.step_shape`` scatter, kept up to date as the table changes."""
        return self.table_and_scatter(request_id)[1]

    def table_and_scatter(self, request_id: str) -> tuple[list[int], float]:
        """:meth:`block_table` and :meth:`scatter` in one call (the scheduler asks for both for every row of
        every step)."""
        table = self.block_tables.get(request_id)
        if table is None:
            return [], 0.0
        n = len(table)
        return table, (self._breaks.get(request_id, 0) / (n - 1) if n >= 2 else 0.0)

    def _extend(self, request_id: str, table: list[int], blocks: list[int]) -> None:
        """Append ``blocks`` to ``table`` (the request's block table), counting the new non-consecutive neighbours."""
        if not blocks:
            return
        prev = table[-1] if table else blocks[0] - 1
        breaks = 0
        for b in blocks:
            if b != prev + 1:
                breaks += 1
            prev = b
        self._breaks[request_id] = self._breaks.get(request_id, 0) + breaks
        table.extend(blocks)

    # -- swapping ----------------------------------------------------------------------------
    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def can_swap_out(self, request: Request) -> bool:
        """Whether the CPU swap pool has room for all of the request's blocks."""
        return 0 < len(self.block_tables.get(request.request_id, ())) <= len(self._cpu_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the CPU pool: returns ``[(gpu block, cpu block)]`` to copy (the
        GPU blocks are freed; the copy must run before this step writes any KV).

        Raises:
            ValueError: not enough CPU blocks (check :meth:`can_swap_out`).
        """
        rid = request.request_id
        table = self.block_tables.get(rid, [])
        if not self.can_swap_out(request):
            raise ValueError(f"request {rid}: swap pool has {len(self._cpu_free)} free blocks, needs {len(table)}")
        cpu = [self._cpu_free.pop() for _ in table]
        mapping = list(zip(table, cpu))
        self.free(request)
        self.cpu_tables[rid] = cpu
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back with room for ``num_new_tokens`` more tokens: returns
        ``[(cpu block, gpu block)]`` to copy, or None (changing nothing) when the GPU pool is too full."""
        rid = request.request_id
        cpu = self.cpu_tables.get(rid, [])
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        blocks = self.pool.allocate(max(need, len(cpu)))
        if blocks is None:
            return None
        del self.cpu_tables[rid]
        self._cpu_free.extend(cpu)
        self.block_tables[rid] = blocks
        self._breaks[rid] = count_breaks(blocks)
        if self.enable_caching:
            self._num_cached[rid] = 0
            self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return list(zip(cpu, blocks))

    # -- accounting --------------------------------------------------------------------------
    def _unshared_states(self, requests: list[Request], scheduled: dict[str, int]) -> tuple[int, int]:
        """``(token_states, reserved)`` slots of ``requests`` when no block is shared (see :meth:`stats`): per
        request, states = computed + scheduled tokens (at most its slots) and reserved = its slots up to
        ``max_total_tokens`` (at least the states) minus the states. One pass, run every step."""
        bs, tables, sched = self.block_size, self.block_tables, scheduled.get
        states = reserved = 0
        for r in requests:
            table = tables.get(r.request_id)
            if not table:
                continue
            held = len(table) * bs
            s = r.num_computed_tokens + sched(r.request_id, 0)
            if s > held:
                s = held
            want = len(r.prompt_token_ids) + r.sampling_params.max_tokens  # Request.max_total_tokens
            if want < s:
                want = s
            states += s
            reserved += (held if held < want else want) - s
        return states, reserved

    def _shared_full_states(self, requests: list[Request], scheduled: dict[str, int]) -> tuple[int, int] | None:
        """``(token_states, reserved)`` of ``requests`` when blocks are shared, in one pass over the requests
        (not their blocks), or None when this shortcut does not apply and :meth:`stats` must go block by block.

        It applies when every shared block is a full block registered in the prefix cache that each holder has
        computed or scheduled (a holder's hashed blocks are the first ``_num_cached`` of its table, so
        states >= ``_num_cached`` x block_size says so) and ``requests`` hold every reference (their tables'
        lengths add up to the pool's used blocks plus its extra references). Each shared block then holds
        block_size token states and no reserved slot for every holder, and is counted once: the per-request
        sums less block_size per extra reference (``BlockPool.num_extra_refs``). Same result as the block loop.
        """
        pool = self.pool
        if pool.num_shared_unhashed:
            return None
        bs, tables, sched, cached = self.block_size, self.block_tables, scheduled.get, self._num_cached
        states = reserved = refs = 0
        for r in requests:
            rid = r.request_id
            table = tables.get(rid)
            if not table:
                continue
            held = len(table) * bs
            s = r.num_computed_tokens + sched(rid, 0)
            if s > held:
                s = held
            if s < cached.get(rid, 0) * bs:
                return None  # a hashed block this request has not computed or scheduled yet
            want = r.max_total_tokens
            if want < s:
                want = s
            states += s
            reserved += (held if held < want else want) - s
            refs += len(table)
        if refs != pool.num_used_blocks + pool.num_extra_refs:
            return None  # a block is held by a request not in ``requests``
        return states - pool.num_extra_refs * bs, reserved

    def stats(self, requests: list[Request], scheduled: dict[str, int] | None = None) -> KVStats:
        """Slot accounting for the requests that hold blocks (see module docstring).

        ``scheduled`` (request id -> tokens computed in the step being accounted) counts those tokens'
        slots as holding token states: the step writes them. A block shared by several requests (prefix
        cache, parallel sampling) is counted once: its token states and reserved slots are the largest
        any holder has in it.
        """
        scheduled = scheduled or {}
        bs = self.block_size
        allocated = self.pool.num_used_blocks * bs
        if not self.pool.num_shared_blocks:
            states, reserved = self._unshared_states(requests, scheduled)
        else:
            states, reserved = self._shared_full_states(requests, scheduled) or self._states_by_block(requests, scheduled)
        return KVStats(self.pool.num_blocks * bs, allocated, states, reserved, allocated - states - reserved, 0)

    def _states_by_block(self, requests: list[Request], scheduled: dict[str, int]) -> tuple[int, int]:
        """``(token_states, reserved)`` of ``requests`` block by block (see :meth:`stats`): a shared block counts
        once, with the most states and usable slots any holder has in it. O(blocks held); the general case
        that :meth:`_shared_full_states` shortcuts."""
        bs, blocks = self.block_size, self.pool.blocks
        states = reserved = 0
        shared: dict[int, tuple[int, int]] = {}  # shared block -> (states, states + reserved)
        for r in requests:
            table = self.block_tables.get(r.request_id, ())
            held = len(table) * bs
            if not held:
                continue
            s = min(r.num_computed_tokens + scheduled.get(r.request_id, 0), held)
            usable = min(held, max(s, r.max_total_tokens))
            for i, b in enumerate(table):
                bs_i = min(bs, max(0, s - i * bs))
                bu_i = min(bs, max(0, usable - i * bs))
                if blocks[b].ref_cnt > 1:
                    old = shared.get(b, (0, 0))
                    shared[b] = (max(old[0], bs_i), max(old[1], bu_i))
                else:
                    states += bs_i
                    reserved += bu_i - bs_i
        for s_b, u_b in shared.values():
            states += s_b
            reserved += u_b - s_b
        return states, reserved

    def num_cached_prefix_blocks(self, block_hashes: list) -> int:
        """How many leading entries of ``block_hashes`` (chained full-block hashes, as
        :meth:`block_hashes` makes them) are registered in the prefix cache, held or free; read-only (a
        router's query: no hit is recorded, no block taken, stored token ids not compared)."""
        cached, n = self.pool.cached, 0
        for h in block_hashes:
            if h not in cached:
                break
            n += 1
        return n


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
