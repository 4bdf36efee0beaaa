"""Static batching baseline behind the same scheduler interface (no torch, no clock).

A batch of up to ``max_batch_size`` waiting requests is admitted only when the previous batch has
completely finished. Each member reserves contiguous KV up front by a ``reservation`` policy
(``max``, ``pow2``, ``oracle``: the three Orca variants of the PagedAttention paper, Fig. 2 and
Sec. 6). The batch runs until its longest member ends: members that finish early stay in the batch as
padding rows and keep their reservation, as a padded batch on a contiguous KV tensor does. A padding
row is a decode row of its batch: one token at the batch's current length (the longest live member's
context length in that step, the length a contiguous KV tensor is padded to), attending over the
scratch block only (``PAD_BLOCK``, which the model runner maps to its scratch block), never sampled,
output discarded; so it costs what a live decode row costs. Prompts are prefilled in one step without
padding (a ragged prefill, which favours the baseline slightly).

``completion`` (``SchedulerConfig``) says when a member's answer is returned: ``batch_end`` (default)
holds a finished member's output until the step in which its batch's last member finishes, as a
static-batching server returns a batch's answers; ``own_end`` returns it at its own last token.
"""

from __future__ import annotations

from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import ContiguousKVCacheManager, KVStats, reservation_tokens
from engines.core.request import Request, RequestStatus
from engines.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput

PAD_BLOCK = -1  # block id of padding rows; the model runner maps it to a scratch block


class StaticScheduler(Scheduler):
    """Whole-batch admission with contiguous per-request reservations.

    Args:
        config: ``max_batch_size``, ``reservation``, ``max_model_len``, ``completion``.
        kv: the contiguous KV allocator.

    Raises:
        ValueError: a bad knob (see ``SchedulerConfig.validate``).
    """

    def __init__(self, config: SchedulerConfig, kv: ContiguousKVCacheManager) -> None:
        super().__init__(config)
        self.kv = kv
        self.batch: list[Request] = []
        self._held: list[Request] = []  # finished members whose answers wait for their batch's end
        self._ended: set[str] = set()  # members of batches that ended since the last ``completed``

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
        live = {r.request_id: self._seq(r) for r in self.batch if not r.is_finished}
        seqs = []
        if live:  # a batch of padding rows only computes nothing
            length = max(q.context_len for q in live.values())
            seqs = [live.get(r.request_id) or self._padding_seq(r, length) for r in self.batch]
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

    def _padding_seq(self, req: Request, context_len: int) -> ScheduledSeq:
        """The padding row of finished member ``req``: one decode token at position ``context_len - 1``
        (``context_len``: the batch's current length, tokens), its block table ``PAD_BLOCK`` repeated
        ceil(context_len / block_size) times (the scratch block, read and written in place of real KV),
        never sampled."""
        blocks = [PAD_BLOCK] * -(-context_len // self.kv.block_size)
        return ScheduledSeq(req.request_id, [0], context_len - 1, blocks, False, req.sampling_params,
                            is_padding=True)

    def _seq(self, req: Request) -> ScheduledSeq:
        start = req.num_computed_tokens
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:],
            start_pos=start,
            block_table=self.kv.block_table(req.request_id),
            sample=True,
            sampling_params=req.sampling_params,
            request=req,
            scatter=0.0,  # one contiguous run of blocks
        )

    def _release(self, request: Request) -> None:
        # reservations are held until the whole batch has ended; aborted waiting requests hold none
        if self.batch and all(r.is_finished for r in self.batch):
            for r in self.batch:
                self.kv.free(r)
            self._ended.update(r.request_id for r in self.batch)
            self.batch = []

    @property
    def completes_at_batch_end(self) -> bool:
        """Whether members' answers are returned when their batch ends (``completion: batch_end``)."""
        return self.config.completion == "batch_end"

    def completed(self, finished: list[Request]) -> list[Request]:
        """The requests whose answers are returned now, given those that finished in this step (in
        order): all of them with ``own_end``; with ``batch_end`` the finished members of every batch that
        has ended, held since they finished. (An aborted member is answered by ``abort`` at once.)"""
        if not self.completes_at_batch_end:
            return finished
        self._held.extend(finished)
        done = [r for r in self._held if r.request_id in self._ended]
        self._held = [r for r in self._held if r.request_id not in self._ended]
        self._ended.clear()  # every finished member of an ended batch is in ``done`` now
        return done

    def has_unfinished(self) -> bool:
        """Requests queued or running, or answers held for their batch's end."""
        return super().has_unfinished() or bool(self._held)

    def num_unanswered(self) -> int:
        """Requests queued or running plus finished members whose answers wait for their batch's end (a
        closed-loop user waits for its answer)."""
        return super().num_unanswered() + len(self._held)

    def release_held(self) -> list[Request]:
        held, self._held = self._held, []
        return held

    def kv_stats(self, scheduled: dict[str, int] | None = None) -> KVStats:
        return self.kv.stats(self.batch, scheduled)
