"""The scheduler interface and the paged continuous-batching policy (no torch, no clock).

Every engine (real model or cost model) drives a scheduler the same way::

    scheduler.add_request(req)
    out = scheduler.schedule()          # SchedulerOutput: which requests, how many tokens, block tables
    result = executor.execute(out)      # StepResult: sampled tokens, duration
    finished = scheduler.update(out, result)

The paged policy follows vLLM V1: there are no prefill/decode phases, each request tracks
``num_computed_tokens`` and each step fills one token budget (``max_num_batched_tokens``), running
requests first, then waiting ones, at most ``max_num_seqs`` requests. A prompt larger than what is
left of the budget is split across steps (chunked prefill). When a block cannot be allocated, the most
recently admitted running request is preempted: by recompute (its blocks are freed and it goes back to
the head of ``waiting``) or by swap (its blocks are copied to a CPU swap pool and it waits in
``swapped``). With prefix caching a waiting request starts after its longest cached prefix. Beam search
(``engines/beam_search.py``) runs a request's beams as forked sequences; ``BeamSearch`` hooks into
``validate``, ``update``, preemption and ``finish_request``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engines.beam_search import BeamSearch
from engines.config import SchedulerConfig
from engines.kv_cache_manager import KVStats, PagedKVCacheManager
from engines.request import Request, RequestStatus
from engines.sampling_params import SamplingParams


@dataclass
class ScheduledSeq:
    """One request's share of a step.

    Attributes:
        request_id: the request.
        token_ids: the new tokens whose K/V this step computes (length = tokens scheduled).
        start_pos: position of ``token_ids[0]`` (= ``num_computed_tokens`` before the step).
        block_table: block ids holding positions ``0 .. start_pos + len(token_ids) - 1``.
        sample: whether logits of the last token are needed (the request reaches its end this step).
        sampling_params: how to sample the next token.
        is_padding: a static-batching padding row: a finished member of a static batch, run as one decode
            token at the batch's current length over the scratch block (it costs what a live decode row of
            its batch costs), never sampled, output discarded.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    is_padding: bool = False
    # issue 5: parallel sampling: child sequences to sample from this row's logits too (and their params)
    fork_ids: list[str] = field(default_factory=list)
    fork_params: list[SamplingParams] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token after a cached context (batched decode attention), or a static padding row (a
        decode row of its batch); else a prefill chunk."""
        return self.is_padding or (len(self.token_ids) == 1 and self.start_pos > 0)

    @property
    def context_len(self) -> int:
        """Tokens attended to by the last new token (cached + new)."""
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What one step runs: the scheduled sequences, plus what the scheduler did to get there."""

    seqs: list[ScheduledSeq]
    preempted_ids: list[str] = field(default_factory=list)
    kv_stats: KVStats | None = None
    num_running: int = 0
    num_waiting: int = 0
    # issue 5: swap preemption and copy-on-write (block copies the executor runs before the forward pass,
    # in this order: swap out, swap in, copy), preemptions by mode, prefix-cache lookups of admissions
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src gpu block, dst gpu block)
    num_preempted_swap: int = 0
    num_swapped: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class StepResult:
    """What an executor returns: sampled token per request (those with ``sample``), duration in seconds."""

    sampled: dict[str, int]
    duration: float
    swap_time: float = 0.0  # issue 5: seconds of the step spent copying swapped blocks (included in duration)
    logprobs: dict[str, float] = field(default_factory=dict)  # issue 5: log p of sampled tokens (best_of)
    # issue 5: beam search: for a beam-search row, its 2 x beam_width most likely next tokens as
    # [(token id, log p)], most likely first, instead of an entry in ``sampled``
    beam_candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sampling parameters of parallel-sampling child ``index`` (1..): one sequence each, and a seed
    offset by ``index`` so seeded children do not repeat the parent's samples."""
    import dataclasses

    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, best_of=None, seed=seed)


class Scheduler:
    """Common request bookkeeping; subclasses implement admission (``schedule``) and KV release.

    Args:
        config: batching limits (``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``...).
    """

    supports_beam_search = False  # issue 5: only the paged policy runs beam search (BeamSearch)

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_preemptions_swap = 0  # issue 5 (the rest of num_preemptions are by recompute)

    # -- interface ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> bool:
        """Queue a request, or reject it (status REJECTED, ``reject_reason`` set) and return False."""
        reason = self.validate(request)
        if reason is not None:
            request.status = RequestStatus.REJECTED
            request.reject_reason = reason
            return False
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return True

    def schedule(self) -> SchedulerOutput:  # pragma: no cover - abstract
        raise NotImplementedError

    def update(self, output: SchedulerOutput, result: StepResult) -> list[Request]:
        """Advance ``num_computed_tokens``, append sampled tokens, finish requests that stop.

        A request stops on an EOS token (unless ``ignore_eos``) or when it has ``max_tokens``
        outputs. Returns the requests that finished in this step.
        """
        finished = []
        for seq in output.seqs:
            if seq.is_padding:
                continue
            req = self.requests.get(seq.request_id)
            if req is None or req.is_finished:
                continue
            req.num_computed_tokens += seq.num_tokens
            if not seq.sample or seq.request_id in result.beam_candidates:  # beams: see BeamSearch.update
                continue
            tok = result.sampled[seq.request_id]
            req.append_output(tok)
            self._finish_if_done(req, tok, finished)
        return finished

    def _finish_if_done(self, req: Request, tok: int, finished: list[Request]) -> None:
        """Finish ``req`` (appending it to ``finished``) if its new token ``tok`` is EOS (unless
        ``ignore_eos``) or it has reached ``max_tokens``."""
        if not req.sampling_params.ignore_eos and req.eos_token_id is not None and tok == req.eos_token_id:
            self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=tok)
            finished.append(req)
        elif req.num_output_tokens >= req.sampling_params.max_tokens:
            self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
            finished.append(req)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason=None) -> Request | None:
        """End a request (stop string, abort, ...): release its KV and drop it from the queues."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.status = status
        req.stop_reason = stop_reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        """Abort a queued or running request; its KV is freed. None if unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_unanswered(self) -> int:
        """Requests added and not yet answered: queued, running, preempted or swapped, and (static
        batching with ``completion: batch_end``) finished but held until their batch ends. A request with
        parallel-sampling or beam sequences counts once, until its last sequence ends."""
        return len({r.parent_id or r.request_id for r in self.requests.values()})

    def release_held(self) -> list[Request]:
        """Finished requests whose answers are held back (none here; see ``StaticScheduler``), released
        now, e.g. when the engine stops after a failed step."""
        return []

    # -- hooks -------------------------------------------------------------------------------
    def validate(self, request: Request) -> str | None:
        """One-line reason to reject the request, or None."""
        bad = request.sampling_params.validate()
        if bad:
            return f"request {request.request_id}: {bad}"
        if request.num_prompt_tokens < 1:
            return f"request {request.request_id}: empty prompt"
        if request.sampling_params.use_beam_search and not self.supports_beam_search:
            return f"request {request.request_id}: beam search (beam_width > 1) needs the paged engine"
        if request.max_total_tokens > self.config.max_model_len:
            return (
                f"request {request.request_id}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) exceeds max_model_len ({self.config.max_model_len})"
            )
        return None

    def _release(self, request: Request) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def kv_stats(self, scheduled: dict[str, int] | None = None) -> KVStats:  # pragma: no cover - abstract
        """Slot accounting now; ``scheduled`` tokens (request id -> count) count as written."""
        raise NotImplementedError


class PagedScheduler(Scheduler):
    """Continuous batching over a paged KV cache (vLLM V1-style token budget).

    Each step: running requests first (preempting the newest when a block cannot be allocated), then,
    if nothing was preempted, swapped-out requests are swapped back in, then waiting requests are
    admitted (each first takes its longest cached prefix when prefix caching is on).

    Args:
        config: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, and the issue-5 knobs
            ``enable_prefix_caching``, ``enable_chunked_prefill``, ``long_prefill_token_threshold``,
            ``preemption_mode``.
        kv: the paged KV cache manager (``build_scheduler`` gives it ``enable_caching`` from the config).

    Raises:
        ValueError: a bad issue-5 knob (see ``SchedulerConfig.validate``).
    """

    supports_beam_search = True

    def __init__(self, config: SchedulerConfig, kv: PagedKVCacheManager) -> None:
        super().__init__(config)
        bad = config.validate()
        if bad:
            raise ValueError(bad)
        self.kv = kv
        self.swapped: deque[Request] = deque()
        self.beam_search = BeamSearch()  # issue 5

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
        return reason or self.beam_search.validate(request, self.kv)

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

        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                idx += 1
                continue
            if not self._allocate_or_preempt(req, n, out):
                break
            seqs.append(self._seq(req, n))
            budget -= n
            idx += 1

        # Swap in, then admit waiting requests, only when nothing was preempted in this step (as vLLM does).
        while not preempted and self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
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
            seqs.append(self._seq(req, n))
            budget -= n

        while (not preempted and not self.swapped and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hit_blocks, num_hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
            req.num_computed_tokens += num_hit  # provisionally, to size the new tokens
            n = self._num_new_tokens(req, budget)
            req.num_computed_tokens -= num_hit
            if n == 0 or not self.kv.allocate_slots(req, n, hit_blocks):
                break
            self.kv.record_prefix_query(req, num_hit)
            if self.kv.enable_caching and not req.num_preemptions:
                out.prefix_cache_queries += req.num_tokens_total
                out.prefix_cache_hits += num_hit
            req.num_computed_tokens += num_hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seqs.append(self._seq(req, n))
            budget -= n

        out.blocks_to_copy.extend(self.kv.pending_copies)
        self.kv.pending_copies.clear()
        out.kv_stats = self.kv_stats({q.request_id: q.num_tokens for q in seqs if not q.is_padding})
        out.num_running, out.num_waiting, out.num_swapped = len(self.running), len(self.waiting), len(self.swapped)
        return out

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

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start : start + n],
            start_pos=start,
            block_table=self.kv.block_table(req.request_id),
            sample=start + n == req.num_tokens_total,
            sampling_params=req.sampling_params,
        )
        if seq.sample and not req.output_token_ids and req.fork_ids:
            seq.fork_ids = req.fork_ids
            seq.fork_params = [child_params(req.sampling_params, i) for i in range(1, len(seq.fork_ids) + 1)]
        return seq

    # -- parallel sampling (issue 5) ---------------------------------------------------------
    def update(self, output: SchedulerOutput, result: StepResult) -> list[Request]:
        """As ``Scheduler.update``, and fork parallel-sampling children off a request whose first token
        was sampled in this step: each child shares the parent's blocks and starts with its own token."""
        children: list[Request] = []
        for seq in output.seqs:
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
                self.requests[cid] = child
                self.running.append(child)
                tok = result.sampled[cid]
                child.append_output(tok)
                child.cumulative_logprob += result.logprobs.get(cid, 0.0)
                children.append(child)
        for seq in output.seqs:
            req = self.requests.get(seq.request_id)
            if req is not None and seq.sample and seq.request_id in result.logprobs:
                req.cumulative_logprob += result.logprobs[seq.request_id]
        finished = super().update(output, result)
        for child in children:
            self._finish_if_done(child, child.output_token_ids[-1], finished)
        finished.extend(self.beam_search.update(self, output, result))  # issue 5: beam search
        return finished

    def _release(self, request: Request) -> None:
        self.kv.free(request)

    def kv_stats(self, scheduled: dict[str, int] | None = None) -> KVStats:
        return self.kv.stats(self.running, scheduled)
