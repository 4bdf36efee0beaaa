"""Orca-style baseline: iteration-level (continuous) batching over contiguous KV reservations.

This is the baseline the PagedAttention paper (SOSP 2023, Sec. 6.1) compares vLLM against: Orca
(Yu et al., OSDI 2022) schedules at iteration granularity like vLLM, but, lacking paging, reserves
each request's KV as one contiguous chunk at admission, sized by what it knows of the output length:

* ``max``: the model's maximum sequence length (``max_model_len``), "Orca (Max)";
* ``pow2``: the prompt plus the output length rounded up to a power of two (over-reserving the output
  by at most 2x: "if the true output length is 25, it reserves 32 positions"), "Orca (Pow2)";
* ``oracle``: the prompt plus the true output length, "Orca (Oracle)".

Unlike ``StaticScheduler`` (batch-at-a-time: a new batch starts only when the whole previous batch
has finished), a finished request's reservation is freed at once and waiting requests join the
running batch at the next iteration. Reservations cover the whole output, so nothing is preempted.
A waiting request is admitted while a contiguous run of its reservation is free, ``max_num_seqs``
is not reached and its whole prompt fits the step's token budget (prompts are not chunked).
"""

from __future__ import annotations

from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import ContiguousKVCacheManager, KVStats, reservation_tokens
from engines.core.request import Request, RequestStatus
from engines.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput


def orca_reservation(policy: str, request: Request, max_model_len: int) -> int:
    """Slots Orca reserves for ``request`` (tokens): see the module docstring. ``pow2`` here rounds the
    OUTPUT length (``max_tokens``) up to a power of two, as the PagedAttention paper defines Orca (Pow2);
    ``max`` and ``oracle`` are ``reservation_tokens``'s.

    Raises:
        ValueError: unknown policy.
    """
    if policy == "pow2":
        out = request.sampling_params.max_tokens
        return min(max_model_len, request.num_prompt_tokens + (1 << max(0, (out - 1).bit_length())))
    return reservation_tokens(policy, request, max_model_len)


class OrcaScheduler(Scheduler):
    """Continuous batching with contiguous per-request reservations (Orca Max / Pow2 / Oracle).

    Args:
        config: ``reservation``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``.
        kv: the contiguous KV allocator.
    """

    def __init__(self, config: SchedulerConfig, kv: ContiguousKVCacheManager) -> None:
        super().__init__(config)
        self.kv = kv

    def reservation(self, request: Request) -> int:
        return orca_reservation(self.config.reservation, request, self.config.max_model_len)

    def validate(self, request: Request) -> str | None:
        reason = super().validate(request)
        if reason is None and not self.kv.fits_ever(self.reservation(request)):
            reason = (f"request {request.request_id}: its {self.config.reservation!r} reservation "
                      f"({self.reservation(request)} tokens) exceeds the whole KV pool "
                      f"({self.kv.num_blocks * self.kv.block_size} tokens)")
        if reason is None and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            reason = (f"request {request.request_id}: prompt ({request.num_prompt_tokens} tokens) exceeds "
                      f"max_num_batched_tokens ({self.config.max_num_batched_tokens}); orca does not chunk prompts")
        return reason

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs = []
        for req in self.running:
            seq = self._seq(req)
            seqs.append(seq)
            budget -= seq.num_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_tokens_total - req.num_computed_tokens > budget or not self.kv.reserve(req, self.reservation(req)):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seq = self._seq(req)
            seqs.append(seq)
            budget -= seq.num_tokens
        return SchedulerOutput(
            seqs=seqs,
            kv_stats=self.kv_stats({q.request_id: q.num_tokens for q in seqs}),
            num_running=len(self.running),
            num_waiting=len(self.waiting),
        )

    def _seq(self, req: Request) -> ScheduledSeq:
        start = req.num_computed_tokens
        return ScheduledSeq(request_id=req.request_id, token_ids=req.all_token_ids[start:], start_pos=start,
                            block_table=self.kv.block_table(req.request_id), sample=True,
                            sampling_params=req.sampling_params, request=req, scatter=0.0)  # contiguous run

    def _release(self, request: Request) -> None:
        self.kv.free(request)

    def kv_stats(self, scheduled: dict[str, int] | None = None) -> KVStats:
        return self.kv.stats(self.running, scheduled)
