"""Static batching baseline behind the same scheduler interface (no torch, no clock).

A batch of up to ``max_batch_size`` waiting requests is admitted only when the previous batch has
completely finished. Each member reserves contiguous KV up front by a ``reservation`` policy
(``max``, ``pow2``, ``oracle``: the three Orca variants of the PagedAttention paper, Fig. 2 and
Sec. 6). The batch runs until its longest member ends: members that finish early stay in the batch as
padding rows (computed, output discarded) and keep their reservation, as a padded batch on a
contiguous KV tensor does. Prompts are prefilled in one step without padding (a ragged prefill, which
favours the baseline slightly).
"""

from __future__ import annotations

from engines.config import SchedulerConfig
from engines.kv_cache_manager import ContiguousKVCacheManager, KVStats, reservation_tokens
from engines.request import Request, RequestStatus
from engines.scheduler import ScheduledSeq, Scheduler, SchedulerOutput

PAD_BLOCK = -1  # block id of padding rows; the model runner maps it to a scratch block


class StaticScheduler(Scheduler):
    """Whole-batch admission with contiguous per-request reservations.

    Args:
        config: ``max_batch_size``, ``reservation``, ``max_model_len``.
        kv: the contiguous KV allocator.
    """

    def __init__(self, config: SchedulerConfig, kv: ContiguousKVCacheManager) -> None:
        super().__init__(config)
        self.kv = kv
        self.batch: list[Request] = []

    def reservation(self, request: Request) -> int:
        return reservation_tokens(self.config.reservation, request, self.config.max_model_len)

    def validate(self, request: Request) -> str | None:
        reason = super().validate(request)
        if reason is None and not self.kv.fits_ever(self.reservation(request)):
            reason = (
                f"request {request.request_id}: its {self.config.reservation!r} reservation "
                f"({self.reservation(request)} tokens) exceeds the whole KV pool "
                f"({self.kv.num_blocks * self.kv.block_size} tokens)"
            )
        return reason

    def schedule(self) -> SchedulerOutput:
        if not self.batch:
            self._admit_batch()
        seqs = [self._seq(r) for r in self.batch]
        if seqs and all(s.is_padding for s in seqs):
            seqs = []
        return SchedulerOutput(
            seqs=seqs,
            kv_stats=self.kv_stats({q.request_id: q.num_tokens for q in seqs if not q.is_padding}),
            num_running=sum(not r.is_finished for r in self.batch),
            num_waiting=len(self.waiting),
        )

    def _admit_batch(self) -> None:
        while self.waiting and len(self.batch) < self.config.max_batch_size:
            req = self.waiting[0]
            if not self.kv.reserve(req, self.reservation(req)):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.batch.append(req)

    def _seq(self, req: Request) -> ScheduledSeq:
        if req.is_finished:
            return ScheduledSeq(req.request_id, [0], 0, [PAD_BLOCK], False, req.sampling_params, is_padding=True)
        start = req.num_computed_tokens
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:],
            start_pos=start,
            block_table=self.kv.block_table(req.request_id),
            sample=True,
            sampling_params=req.sampling_params,
        )

    def _release(self, request: Request) -> None:
        # reservations are held until the whole batch has ended; aborted waiting requests hold none
        if self.batch and all(r.is_finished for r in self.batch):
            for r in self.batch:
                self.kv.free(r)
            self.batch = []

    def kv_stats(self, scheduled: dict[str, int] | None = None) -> KVStats:
        return self.kv.stats(self.batch, scheduled)
