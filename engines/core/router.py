"""Request routers for a cluster of engine replicas: which replica serves a request (pure policy, no torch,
no clock).

A router sees each replica as an ``LLMEngine`` and reads only its scheduler (requests in flight) and KV
manager (block usage, prefix-cache hashes), so the same router drives the cluster simulator
(``engines.sim.cluster``) and a real cluster of engines. It is called once per request, when the request
arrives, and returns the index of the replica that gets it.

Routers (``ROUTERS``):

* ``round_robin``: replicas 0, 1, ..., N-1, 0, ... in arrival order.
* ``least_outstanding``: the fewest requests in flight (``Scheduler.num_unanswered``: waiting, running,
  preempted or swapped); ties to the lowest index.
* ``least_kv``: the lowest KV usage (held blocks / pool blocks); ties to the fewest in flight, then the
  lowest index.
* ``prefix_aware``: the replica whose prefix cache holds the most leading full blocks of the request's
  prompt (the cache-aware routing of llm-d's scheduler and SGLang's router), among the *eligible*
  replicas: those with at most ``max_imbalance`` more requests in flight than the least loaded one (a
  hot prefix would otherwise pile every request onto one replica; SGLang's router switches to
  shortest-queue on imbalance in the same spirit). Ties, and no hit anywhere, go to the least
  outstanding eligible replica. A cached block counts while it is registered in the pool's prefix cache,
  held or free (a free cached block is hit as the engine would hit it, until it is evicted).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from engines.core.block_pool import hash_token_blocks
from engines.core.kv_cache_manager import PagedKVCacheManager
from engines.core.request import Request

ROUTERS = ("round_robin", "least_outstanding", "least_kv", "prefix_aware")
DEFAULT_MAX_IMBALANCE = 8  # requests: prefix_aware's load bound (see the module docstring)


class Router(Protocol):
    """Chooses the replica (an index into ``replicas``) that serves ``request``."""

    name: str

    def choose(self, request: Request, replicas: Sequence) -> int: ...


def outstanding(replica) -> int:
    """Requests added to ``replica`` (an ``LLMEngine``) and not yet answered (a request with several
    sequences counted once)."""
    return replica.scheduler.num_unanswered()


def kv_usage(replica) -> float:
    """Fraction of ``replica``'s KV pool held by requests (0..1): held blocks / pool blocks for paged KV,
    reserved blocks / pool blocks for a contiguous (static, Orca) manager."""
    kv = replica.scheduler.kv
    if isinstance(kv, PagedKVCacheManager):
        return kv.pool.num_used_blocks / kv.pool.num_blocks
    return sum(n for _, n, _ in kv.runs.values()) / kv.num_blocks


def least_loaded(replicas: Sequence, among: Sequence[int] | None = None) -> int:
    """The index (of ``among``, default all) with the fewest requests in flight; ties to the lowest index."""
    idx = range(len(replicas)) if among is None else among
    return min(idx, key=lambda i: (outstanding(replicas[i]), i))


def prompt_block_hashes(request: Request, block_size: int) -> list:
    """Chained hashes (``engines.core.block_pool.hash_block_tokens``, with the request's ``cache_salt``) of
    the prompt's full blocks that a prefix-cache hit can cover: at most (prompt tokens - 1) // block_size,
    as ``PagedKVCacheManager.get_computed_blocks`` always computes the last token. Does not touch
    ``request.block_hashes``."""
    toks = request.prompt_token_ids
    return hash_token_blocks(None, toks[: (len(toks) - 1) // block_size * block_size], block_size,
                             request.cache_salt)


class RoundRobin:
    """Replicas in turn, in arrival order."""

    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, request: Request, replicas: Sequence) -> int:
        i = self.next % len(replicas)
        self.next = i + 1
        return i


class LeastOutstanding:
    """The replica with the fewest requests in flight."""

    name = "least_outstanding"

    def choose(self, request: Request, replicas: Sequence) -> int:
        return least_loaded(replicas)


class LeastKV:
    """The replica with the lowest KV usage (:func:`kv_usage`)."""

    name = "least_kv"

    def choose(self, request: Request, replicas: Sequence) -> int:
        return min(range(len(replicas)), key=lambda i: (kv_usage(replicas[i]), outstanding(replicas[i]), i))


class PrefixAware:
    """The eligible replica whose prefix cache holds the longest run of the prompt's leading full blocks
    (see the module docstring for eligibility and ties).

    Args:
        max_imbalance: requests; a replica is eligible when its requests in flight are at most the least
            loaded replica's plus this (0: only the least loaded ones).

    Raises:
        ValueError: ``max_imbalance`` < 0.
    """

    name = "prefix_aware"

    def __init__(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0 requests, got {max_imbalance}")
        self.max_imbalance = max_imbalance

    def choose(self, request: Request, replicas: Sequence) -> int:
        load = [outstanding(r) for r in replicas]
        bound = min(load) + self.max_imbalance
        eligible = [i for i in range(len(replicas)) if load[i] <= bound]
        hashes: dict[int, list] = {}  # block_size -> the prompt's hashes, computed once per request
        hits = {i: self.cached_blocks(request, replicas[i], hashes) for i in eligible}
        return min(eligible, key=lambda i: (-hits[i], load[i], i))

    @staticmethod
    def cached_blocks(request: Request, replica, hashes: dict[int, list]) -> int:
        """Leading full prompt blocks of ``request`` in ``replica``'s prefix cache (0 without paged KV or
        with prefix caching off)."""
        kv = replica.scheduler.kv
        if not isinstance(kv, PagedKVCacheManager) or not kv.enable_caching:
            return 0
        if kv.block_size not in hashes:
            hashes[kv.block_size] = prompt_block_hashes(request, kv.block_size)
        return kv.num_cached_prefix_blocks(hashes[kv.block_size])


def make_router(name: str, max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> Router:
    """A fresh router by name (:data:`ROUTERS`); ``max_imbalance`` (requests) is for ``prefix_aware``.

    Raises:
        ValueError: an unknown name, or ``max_imbalance`` < 0.
    """
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "least_kv":
        return LeastKV()
    if name == "prefix_aware":
        return PrefixAware(max_imbalance)
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
