"""The paged continuous-batching policy (no torch, no clock).

It follows vLLM V1: there are no prefill/decode phases, each request tracks ``num_computed_tokens`` and
each step fills one token budget (``max_num_batched_tokens``), running requests first, then waiting ones,
at most ``max_num_seqs`` requests. A prompt larger than what is left of the budget is split across steps
(chunked prefill). When a block cannot be allocated, the most recently admitted running request is
preempted: by recompute (its blocks are freed and it goes back to the head of ``waiting``) or by swap (its
blocks are copied to a CPU swap pool and it waits in ``swapped``). With prefix caching a waiting request
starts after its longest cached prefix. With speculative decoding (``engines/core/spec_decode.py``) a running
request in decode also gets draft tokens to verify; rejected drafts' blocks are freed after the step. Beam search (``engines/core/beam_search.py``) runs a request's
beams as forked sequences; ``BeamSearch`` hooks into ``validate``, ``update``, preemption and
``finish_request``.
"""

from __future__ import annotations

from collections import deque

from engines.core.beam_search import BeamSearch, group_id
from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import KVStats, PagedKVCacheManager
from engines.core.request import Request, RequestStatus
from engines.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput, StepResult, child_params
from engines.core.spec_decode import NgramProposer, SpecDecodeConfig, speculates

DRAFT_PLACEHOLDER = 0  # token id in a draft slot the executor's draft model fills before the forward pass


class PagedScheduler(Scheduler):
    """Continuous batching over a paged KV cache (vLLM V1-style token budget).

    Each step: running requests first (preempting the newest when a block cannot be allocated), then,
    if nothing was preempted, swapped-out requests are swapped back in, then waiting requests are
    admitted (each first takes its longest cached prefix when prefix caching is on).

    Args:
        config: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, and the memory knobs
            ``enable_prefix_caching``, ``enable_chunked_prefill``, ``long_prefill_token_threshold``,
            ``preemption_mode``.
        kv: the paged KV cache manager (``engines.factory.build_scheduler`` gives it ``enable_caching`` from
            the config).
        spec: speculative decoding (None: off).

    Raises:
        ValueError: a bad memory knob (see ``SchedulerConfig.validate``).
    """

    supports_beam_search = True

    def __init__(self, config: SchedulerConfig, kv: PagedKVCacheManager, spec: SpecDecodeConfig | None = None) -> None:
        super().__init__(config)
        self.kv = kv
        self.spec = spec
        self.proposer = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                         if spec is not None and spec.proposes_in_scheduler else None)
        self.swapped: deque[Request] = deque()
        self.beam_search = BeamSearch()
        self._multi_seq = False  # a request asking for several sequences was ever added (see _num_running_seqs)

    def validate(self, request: Request) -> str | None:
        reason = super().validate(request)
        if reason is None and not self.kv.fits_ever(request):
            reason = (
                f"request {request.request_id}: prompt + max_tokens ({request.max_total_tokens} tokens) "
                f"exceeds the whole KV pool ({self.kv.num_blocks * self.kv.block_size} tokens)"
            )
        if (reason is None and not self.config.enable_chunked_prefill
                and request.max_total_tokens > self.config.max_num_batched_tokens):
            reason = (
                f"request {request.request_id}: prompt + max_tokens ({request.max_total_tokens} tokens) exceeds "
                f"max_num_batched_tokens ({self.config.max_num_batched_tokens}) with chunked prefill off"
            )
        if reason is None and self.num_seqs(request) > self.config.max_num_seqs:
            reason = (f"request {request.request_id}: {self.num_seqs(request)} sequences (n, best_of or beam_width) "
                      f"exceed max_num_seqs ({self.config.max_num_seqs})")
        return reason or self.beam_search.validate(request, self.kv)

    @staticmethod
    def num_seqs(req: Request) -> int:
        """Sequences ``req`` occupies in ``running`` once it has forked: ``n``/``best_of`` (parallel sampling)
        or ``beam_width`` for a request that has not forked yet, 1 for a fork or a forked parent. Admission
        reserves them all, so forks never push ``running`` past ``max_num_seqs``."""
        if req.parent_id is not None or req.forked:
            return 1
        sp = req.sampling_params
        return sp.beam_width if sp.use_beam_search else sp.num_seqs

    def _num_running_seqs(self) -> int:
        """Sequences in ``running`` (``num_seqs`` summed): ``len(running)`` when no request ever added asked
        for several sequences (no forks then), else summed over every running request."""
        if not self._multi_seq:
            return len(self.running)
        return sum(map(self.num_seqs, self.running))

    def add_request(self, request: Request) -> bool:
        """As ``Scheduler.add_request``; notes a request that will fork (parallel sampling, beam search)."""
        if self.num_seqs(request) > 1:
            self._multi_seq = True
        return super().add_request(request)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens to compute for ``req`` this step (0 = it must wait): the rest of its tokens, capped by
        ``long_prefill_token_threshold`` and the budget; without chunked prefill all or nothing."""
        n = req.num_tokens_total - req.num_computed_tokens
        if not self.config.enable_chunked_prefill:
            return n if n <= budget else 0
        cap = self.config.long_prefill_token_threshold
        if cap and n > cap:
            n = cap
        return min(n, budget)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        out = SchedulerOutput(seqs=seqs)
        preempted = out.preempted_ids

        idx, running, kv = 0, self.running, self.kv  # kv.allocate_slots called as a method: mypyc calls it natively
        while idx < len(running) and budget > 0:
            req = running[idx]
            n = req.num_tokens_total - req.num_computed_tokens
            if n != 1:  # a decode row (one token, budget left) needs no caps; anything else does
                n = self._num_new_tokens(req, budget)
                if n == 0:
                    idx += 1
                    continue
            drafts = self._drafts(req, n, budget) if self.spec is not None else None
            if drafts and kv.allocate_slots(req, n + len(drafts)):
                seqs.append(self._seq(req, n, drafts))
                budget -= n + len(drafts)
                idx += 1
                continue
            if not kv.allocate_slots(req, n) and not self._allocate_or_preempt(req, n, out):  # it retries, preempting
                break
            seqs.append(self._seq(req, n))
            budget -= n
            idx += 1

        # Swap in, then admit waiting requests, only when nothing was preempted in this step (as vLLM does).
        if not preempted and (self.swapped or self.waiting):
            budget = self._admit(out, budget)
        # an empty step whose running requests are all beams waiting for their siblings' candidates: a deadlock
        if not seqs and self.running and (self.swapped or self.waiting) and self.beam_search.groups:
            budget = self._admit(out, self._unblock_beams(out, budget))

        out.blocks_to_copy.extend(self.kv.pending_copies)
        self.kv.pending_copies.clear()
        out.kv_stats = self.kv_stats({q.request_id: q.num_tokens for q in seqs if not q.is_padding})
        out.num_running, out.num_waiting, out.num_swapped = len(self.running), len(self.waiting), len(self.swapped)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Swap in swapped-out requests, then admit waiting ones, in order, while the token budget, the
        pool and ``max_num_seqs`` allow; appends their rows to ``out.seqs``. Returns the budget left."""
        seqs = out.seqs
        # A request is let in only when all the sequences it will fork into fit under max_num_seqs.
        max_seqs = self.config.max_num_seqs
        num_seqs = self._num_running_seqs()
        while self.swapped and budget > 0 and num_seqs + self.num_seqs(self.swapped[0]) <= max_seqs:
            req = self.swapped[0]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                break
            mapping = self.kv.swap_in(req, n)
            if mapping is None:
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(mapping)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_seqs += self.num_seqs(req)
            seqs.append(self._seq(req, n))
            budget -= n

        while (not self.swapped and self.waiting and budget > 0
               and num_seqs + self.num_seqs(self.waiting[0]) <= max_seqs):
            req = self.waiting[0]
            n = self._start(req, budget, out)
            if n == 0:
                break
            self.waiting.popleft()
            num_seqs += self.num_seqs(req)
            budget -= n
        return budget

    def _unblock_beams(self, out: SchedulerOutput, budget: int) -> int:
        """Break a beam-search deadlock, when nothing could be scheduled and every running request is a beam
        holding its candidates until its siblings have theirs, while those siblings (or requests ahead of
        them) wait for blocks the running beams hold. The oldest such search goes on: every other running
        beam is preempted by recompute (it drops its candidates; recorded in ``out.preempted_ids``), the
        oldest search's swapped-out beams are turned into recompute ones, and its waiting beams are let in
        first, sharing their running siblings' blocks (:meth:`BeamSearch.shared_prefix`). If none of them
        fits, its running beams are preempted too and the whole search comes back from recompute. Always
        favouring the oldest search (as preemption spares the oldest requests) means each deadlock ends
        with it advancing, so searches cannot take turns evicting each other forever. Returns the budget
        left; does nothing when some running request is not such a beam."""
        if not all(map(self.beam_search.awaits_siblings, self.running)):
            return budget
        held = {group_id(r) for r in self.running}
        keep = next(g for g in self.beam_search.groups if g in held)
        for req in [r for r in self.running if group_id(r) != keep]:
            self._preempt_to_recompute(req, out)
        for req in [r for r in self.swapped if group_id(r) == keep]:
            self.swapped.remove(req)
            self.kv.free(req)  # its CPU copy: it comes back sharing its siblings' blocks instead
            req.num_computed_tokens = 0
            self.waiting.append(req)
        beams = [r for r in self.waiting if group_id(r) == keep]
        if not beams:
            return budget
        for req in beams:
            self.waiting.remove(req)
        self.waiting.extendleft(reversed(beams))
        budget = self._start_beams(beams, budget, out)
        if not out.seqs:  # not even one fits beside its siblings: the whole search starts again
            for req in [r for r in self.running if group_id(r) == keep]:
                self._preempt_to_recompute(req, out)
            budget = self._start_beams([r for r in self.waiting if group_id(r) == keep], budget, out)
        return budget

    def _start_beams(self, beams: list[Request], budget: int, out: SchedulerOutput) -> int:
        """Let ``beams`` (waiting beams of one search) in, in order, while they fit; returns the budget left."""
        for req in beams:
            if budget <= 0 or self._num_running_seqs() >= self.config.max_num_seqs:
                break
            n = self._start(req, budget, out)
            if n == 0:
                break
            self.waiting.remove(req)
            budget -= n
        return budget

    def _preempt_to_recompute(self, req: Request, out: SchedulerOutput) -> None:
        """Preempt running ``req`` by recompute, queueing it at the front of ``waiting``."""
        self.running.remove(req)
        self._preempt(req)  # without ``out`` a preemption always frees the blocks (recompute)
        out.preempted_ids.append(req.request_id)

    def _start(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Let waiting request ``req`` run: reuse its prefix-cache hit (or, for a preempted beam, its live
        siblings' blocks when they cover more), allocate slots for the rest its budget allows, move it to
        ``running`` and append its row to ``out.seqs``. The caller takes it off ``waiting``. Returns the
        tokens scheduled (0: it does not fit the budget or the pool, and nothing changed)."""
        hit_blocks, num_hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
        if req.parent_id is not None and req.num_computed_tokens == 0 and self.beam_search.groups:
            shared = self.beam_search.shared_prefix(req, self.kv)  # a preempted beam: its siblings' blocks
            if shared[1] > num_hit:
                hit_blocks, num_hit = shared
        req.num_computed_tokens += num_hit  # provisionally, to size the new tokens
        n = self._num_new_tokens(req, budget)
        req.num_computed_tokens -= num_hit
        if n == 0 or not self.kv.allocate_slots(req, n, hit_blocks):
            return 0
        self.kv.record_prefix_query(req, num_hit)
        if self.kv.enable_caching and not req.num_preemptions:
            out.prefix_cache_queries += req.num_tokens_total
            out.prefix_cache_hits += num_hit
        req.num_computed_tokens += num_hit
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.seqs.append(self._seq(req, n))
        return n

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """Draft tokens for ``req`` this step (``[]``: none): only a request in decode (its one uncomputed
        token is its last output) that :func:`speculates`; at most ``num_speculative_tokens``, what is left of
        the token budget after its own token, and ``max_tokens`` - outputs - 1 (so accepting them all plus
        the bonus token reaches ``max_tokens`` at most). A draft model's drafts are placeholders its executor
        fills."""
        if self.spec is None or n != 1 or req.num_tokens_total - req.num_computed_tokens != 1:
            return []
        if not req.output_token_ids or not speculates(req):
            return []
        k = min(self.spec.num_speculative_tokens, budget - 1,
                req.sampling_params.max_tokens - req.num_output_tokens - 1)
        if k < 1:
            return []
        if self.proposer is None:
            return [DRAFT_PLACEHOLDER] * k
        return self.proposer.propose(req.all_token_ids, k)

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate for ``n`` tokens of ``req``, preempting the newest running requests as needed.

        Returns False if ``req`` itself had to be preempted.
        """
        while not self.kv.allocate_slots(req, n):
            victim = self.running.pop()
            self._preempt(victim, out)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput | None = None) -> None:
        self.beam_search.on_preempt(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and out is not None and self.kv.can_swap_out(req):
            out.blocks_to_swap_out.extend(self.kv.swap_out(req))
            out.num_preempted_swap += 1
            self.num_preemptions_swap += 1
            self.swapped.appendleft(req)
            return
        # recompute (also the fallback when the swap pool is full)
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason=None) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and req in self.swapped:
            self.swapped.remove(req)
        self.beam_search.on_finish(self, request_id)
        return super().finish_request(request_id, status, stop_reason)

    def _seq(self, req: Request, n: int, drafts: list[int] | None = None) -> ScheduledSeq:
        start, end, rid = req.num_computed_tokens, req.num_computed_tokens + n, req.request_id
        token_ids = req.all_token_ids[start:end]
        if drafts:
            token_ids += drafts
        table, scatter = self.kv.table_and_scatter(rid)
        seq = ScheduledSeq(
            request_id=rid,
            token_ids=token_ids,
            start_pos=start,
            block_table=table,
            scatter=scatter,
            sample=end == req.num_tokens_total,
            sampling_params=req.sampling_params,
            request=req,
            num_spec=len(drafts) if drafts else 0,
            drafts_pending=bool(drafts) and self.proposer is None,
        )
        if seq.sample and not req.output_token_ids and req.fork_ids:
            seq.fork_ids = req.fork_ids
            seq.fork_params = [child_params(req.sampling_params, i) for i in range(1, len(seq.fork_ids) + 1)]
        return seq

    # -- parallel sampling ---------------------------------------------------------------------
    def update(self, output: SchedulerOutput, result: StepResult) -> list[Request]:
        """As ``Scheduler.update``, and fork parallel-sampling children off a request whose first token
        was sampled in this step: each child shares the parent's blocks and starts with its own token."""
        children: list[Request] = []
        for seq in output.seqs if self._multi_seq else ():  # only a request asking for several sequences forks
            if not seq.fork_ids or any(c not in result.sampled for c in seq.fork_ids):
                continue
            parent = self.requests.get(seq.request_id)
            if parent is None or parent.is_finished or parent.forked:
                continue
            parent.forked = True
            for i, (cid, sp) in enumerate(zip(seq.fork_ids, seq.fork_params), 1):
                child = Request(cid, parent.prompt_token_ids, sp, arrival_time=parent.arrival_time,
                                prompt=parent.prompt, eos_token_id=parent.eos_token_id, parent_id=parent.request_id,
                                seq_index=i, forked=True, cache_salt=parent.cache_salt)
                child.first_scheduled_time = parent.first_scheduled_time
                child.num_computed_tokens = seq.start_pos + seq.num_tokens
                self.kv.fork(parent, child)
                child.status = RequestStatus.RUNNING
                self.add_fork(child)
                self.running.append(child)
                tok = result.sampled[cid]
                child.append_output(tok)
                child.cumulative_logprob += result.logprobs.get(cid, 0.0)
                if cid in result.token_logprobs:
                    child.output_logprobs.append(result.token_logprobs[cid])
                child.prompt_logprobs = parent.prompt_logprobs
                children.append(child)
        for seq in output.seqs if result.logprobs else ():
            req = self.requests.get(seq.request_id)
            if req is not None and seq.sample and seq.request_id in result.logprobs:
                req.cumulative_logprob += result.logprobs[seq.request_id]
        finished = super().update(output, result)
        for child in children:
            self._finish_if_done(child, child.output_token_ids[-1], finished)
        for seq in output.seqs if self.spec is not None else ():  # speculative rows: free rejected drafts' blocks
            if seq.num_spec:
                req = self.requests.get(seq.request_id)
                if req is not None and not req.is_finished:
                    self.kv.trim(req, req.num_tokens_total)
        if result.beam_candidates:  # beams: pick the survivors, fork and free
            finished.extend(self.beam_search.update(self, output, result))
        return finished

    def _release(self, request: Request) -> None:
        self.kv.free(request)

    def kv_stats(self, scheduled: dict[str, int] | None = None) -> KVStats:
        return self.kv.stats(self.running, scheduled)
