"""The engine loop (schedule -> execute -> update), its per-step records and its outputs (no torch).

An engine is a scheduler (paged, static or Orca policy) plus an executor (the real model, or the
simulator's cost model) plus a clock (wall clock, or the simulator's virtual clock); ``engines.factory``
builds all three from an engine description. ``LLMEngine.step`` runs one iteration, records a
``StepRecord`` and turns finished requests into ``RequestOutput``s (output text through the incremental
detokenizer, stop strings).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from engines.core.detokenizer import IncrementalDetokenizer
from engines.core.kv_cache_manager import PagedKVCacheManager
from engines.core.request import Request, RequestStatus
from engines.core.scheduler import Scheduler, SchedulerOutput, StepResult
from engines.core.static_scheduler import StaticScheduler
from engines.core.step_shape import StepShape

try:  # compiled by mypyc (workbench/native.py), some classes stay open to interpreted subclasses
    from mypy_extensions import mypyc_attr
except ImportError:  # plain Python: the decorator does nothing
    def mypyc_attr(*attrs: str, **kwattrs: object):  # type: ignore[misc]
        return lambda cls: cls


@mypyc_attr(allow_interpreted_subclasses=True)  # workbench.openai_replay.StreamedOutput
@dataclass
class RequestOutput:
    """A finished (or rejected) request, as ``LLM.generate`` returns it.

    ``finish_reason`` is ``stop`` (EOS or a stop string), ``length`` (max_tokens), ``abort`` or
    ``rejected`` (then ``error`` says why).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    # parallel sampling: the sequence's parent request (None for a prompt's first sequence), its
    # index among the prompt's sequences, its cumulative log-probability (best_of), and, on the output
    # LLM.generate returns, the prompt's n best sequences (index order; [] when n = 1)
    parent_id: str | None = None
    seq_index: int = 0
    cumulative_logprob: float = 0.0
    outputs: list["RequestOutput"] = field(default_factory=list)
    # beam search: the hypothesis' length-penalised score (None without beam search); a beam-search
    # request's output is its best hypothesis and ``outputs`` its beam_width (or n) best, best first
    beam_score: float | None = None
    # when the engine returned the answer (s, engine clock), where that can be later than its last token: a
    # static batch member's batch end under completion batch_end (then equal to finished_time); None: the
    # answer came with its last token
    completion_time: float | None = None
    # SamplingParams.logprobs: one engines.core.logprobs.TokenLogprob per output token (None when not asked);
    # SamplingParams.prompt_logprobs: one per prompt token, the first None (None when not asked)
    logprobs: list | None = None
    prompt_logprobs: list | None = None


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.REJECTED: "rejected",
    RequestStatus.FAILED: "failed",
}


@dataclass(slots=True)
class StepRecord:
    """Accounting of one engine step (times in seconds on the engine's clock, sizes in token slots; slotted:
    a day-long simulation keeps millions)."""

    step: int
    start: float
    duration: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_padding_seqs: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_total_slots: int
    kv_allocated: int
    kv_token_states: int
    kv_reserved: int
    kv_internal_frag: int
    kv_external_frag: int
    # prefix cache lookups of the requests admitted in this step (tokens), preemptions by swap
    # (the rest of num_preemptions are by recompute), swap traffic, KV memory saved by block sharing
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions_swap: int = 0
    num_swapped: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    swap_bytes: int = 0
    swap_time: float = 0.0
    kv_shared_saved: int = 0
    # the step's shape (engines.core.step_shape.StepShape; num_tokens = every GEMM row), and the seconds the
    # engine spent on the step outside the executor: scheduling before it, updating requests, sampling
    # bookkeeping and detokenizing after it (0 on the simulator's virtual clock unless its cost model
    # charges it)
    num_tokens: int = 0
    decode_ctx: int = 0
    num_prefill_seqs: int = 0
    prefill_attn: int = 0
    prefill_ctx: int = 0
    num_sampled: int = 0
    padding_ctx: int = 0
    scattered_ctx: float = 0.0
    overhead: float = 0.0
    # speculative decoding: requests that got drafts, draft tokens verified and drafts accepted in this step;
    # tensor parallelism: seconds of the step in collective communication (all-reduces, logits gather)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    comm_time: float = 0.0

    # Written out rather than generated, with the fields and defaults declared above: mypyc compiles this one,
    # while the ``__init__`` that ``dataclasses`` generates runs interpreted even in the compiled build (one per step).
    def __init__(self, step: int, start: float, duration: float, num_seqs: int, num_prefill_tokens: int,
                 num_decode_tokens: int, num_padding_seqs: int, num_running: int, num_waiting: int,
                 num_preemptions: int, kv_total_slots: int, kv_allocated: int, kv_token_states: int,
                 kv_reserved: int, kv_internal_frag: int, kv_external_frag: int, prefix_cache_queries: int = 0,
                 prefix_cache_hits: int = 0, num_preemptions_swap: int = 0, num_swapped: int = 0,
                 swap_out_blocks: int = 0, swap_in_blocks: int = 0, swap_bytes: int = 0, swap_time: float = 0.0,
                 kv_shared_saved: int = 0, num_tokens: int = 0, decode_ctx: int = 0, num_prefill_seqs: int = 0,
                 prefill_attn: int = 0, prefill_ctx: int = 0, num_sampled: int = 0, padding_ctx: int = 0,
                 scattered_ctx: float = 0.0, overhead: float = 0.0, spec_drafts: int = 0, spec_draft_tokens: int = 0,
                 spec_accepted_tokens: int = 0, comm_time: float = 0.0) -> None:
        self.step = step
        self.start = start
        self.duration = duration
        self.num_seqs = num_seqs
        self.num_prefill_tokens = num_prefill_tokens
        self.num_decode_tokens = num_decode_tokens
        self.num_padding_seqs = num_padding_seqs
        self.num_running = num_running
        self.num_waiting = num_waiting
        self.num_preemptions = num_preemptions
        self.kv_total_slots = kv_total_slots
        self.kv_allocated = kv_allocated
        self.kv_token_states = kv_token_states
        self.kv_reserved = kv_reserved
        self.kv_internal_frag = kv_internal_frag
        self.kv_external_frag = kv_external_frag
        self.prefix_cache_queries = prefix_cache_queries
        self.prefix_cache_hits = prefix_cache_hits
        self.num_preemptions_swap = num_preemptions_swap
        self.num_swapped = num_swapped
        self.swap_out_blocks = swap_out_blocks
        self.swap_in_blocks = swap_in_blocks
        self.swap_bytes = swap_bytes
        self.swap_time = swap_time
        self.kv_shared_saved = kv_shared_saved
        self.num_tokens = num_tokens
        self.decode_ctx = decode_ctx
        self.num_prefill_seqs = num_prefill_seqs
        self.prefill_attn = prefill_attn
        self.prefill_ctx = prefill_ctx
        self.num_sampled = num_sampled
        self.padding_ctx = padding_ctx
        self.scattered_ctx = scattered_ctx
        self.overhead = overhead
        self.spec_drafts = spec_drafts
        self.spec_draft_tokens = spec_draft_tokens
        self.spec_accepted_tokens = spec_accepted_tokens
        self.comm_time = comm_time

    @property
    def shape(self) -> StepShape:
        """The step's ``StepShape``, rebuilt from the recorded fields."""
        return StepShape(self.num_tokens, self.num_decode_tokens, self.num_padding_seqs, self.decode_ctx,
                         self.num_prefill_seqs, self.num_prefill_tokens, self.prefill_attn, self.prefill_ctx,
                         self.num_sampled, self.padding_ctx, self.scattered_ctx)


@mypyc_attr(allow_interpreted_subclasses=True)  # engines.sim.spec_decode.SpecDecodeSimEngine
class LLMEngine:
    """Drives a scheduler and an executor.

    Args:
        scheduler: paged or static policy.
        executor: has ``execute(SchedulerOutput) -> StepResult`` and ``release(request_id)``.
        tokenizer: for stop strings and output text (None: no text).
        clock: seconds; wall clock by default.

    Attributes:
        on_schedule: called with each step's ``SchedulerOutput`` right after scheduling, before the
            forward pass (a server publishes its running/waiting gauges there); None: nothing.
    """

    def __init__(self, scheduler: Scheduler, executor, tokenizer=None, clock: Callable[[], float] = time.perf_counter):
        self.scheduler, self.executor, self.tokenizer, self.clock = scheduler, executor, tokenizer, clock
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None
        self.steps: list[StepRecord] = []  # a long-running caller may drop old records
        self.num_steps = 0  # steps recorded since the start (StepRecord.step numbers them)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._texts: dict[str, str] = {}
        self._last_swap_time = 0.0
        self._comm_of: object = None  # the executor _record_spec last looked at, and whether it has last_comm_time
        self._reports_comm = False

    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue a request; returns its output at once if it is rejected."""
        if not self.scheduler.add_request(request):
            request.finished_time = self.clock()
            return self._output(request)
        if self.tokenizer is not None and request.sampling_params.stop:
            self._detok[request.request_id] = IncrementalDetokenizer.for_request(self.tokenizer, request)
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        return self._finish(req) if req else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration; returns the requests that finished in it."""
        t_schedule = self.clock()
        out = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(out)
        start = self.clock()
        result: StepResult = self.executor.execute(out)  # typed: mypyc reads its fields natively
        now = self.clock()
        self._last_swap_time = result.swap_time
        self._record(out, start, now - start)
        self._record_spec(out, result)
        for seq in out.seqs:
            if seq.is_padding:
                continue
            req = self.scheduler.requests.get(seq.request_id)
            if req is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = start
        # speculative rows may emit several tokens: count them from the outputs before the update
        reqs = self.scheduler.requests
        before = {s.request_id: reqs[s.request_id].num_output_tokens for s in out.seqs
                  if s.num_spec and s.request_id in reqs}
        finished = self.scheduler.update(out, result)
        just_finished = {r.request_id: r for r in finished}
        for rid in result.sampled:
            req = self.scheduler.requests.get(rid) or just_finished.get(rid)
            if req is None:
                continue
            new = req.num_output_tokens - before[rid] if rid in before else 1
            if new == 1:
                req.token_times.append(now)
            else:
                req.token_times.extend([now] * new)
            if req.first_token_time is None:
                req.first_token_time = now
            det = self._detok.get(rid) if self._detok else None
            if det is None and req.parent_id is not None and req.sampling_params.stop and self.tokenizer is not None:
                det = self._detok[rid] = IncrementalDetokenizer.for_request(self.tokenizer, req)  # a forked child
            if det is None or req.status == RequestStatus.FINISHED_STOPPED:
                continue
            self._stop_strings(req, det, new, finished)
        outputs = self._complete(finished)
        rec = self.steps[-1]
        rec.overhead = max(0.0, (self.clock() - t_schedule) - (now - start))
        return outputs

    def _stop_strings(self, req: Request, det: IncrementalDetokenizer, new: int, finished: list[Request]) -> None:
        """Feed ``req``'s ``new`` last output tokens to its detokenizer; at the first that completes a stop
        string, drop the tokens after it (a speculative step may have emitted some) and stop the request."""
        first = req.num_output_tokens - new
        for i in range(first, req.num_output_tokens):
            _, stop = det.step(req.output_token_ids[i])
            if stop is None:
                continue
            dropped = req.num_output_tokens - (i + 1)
            if dropped:
                req.truncate_output(i + 1)
                del req.token_times[-dropped:]
            if req.is_finished:  # the last allowed token completed a stop string
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            else:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
                finished.append(req)
            return

    def _complete(self, finished: list[Request]) -> list[RequestOutput]:
        """Outputs of the requests answered in this step, given those that finished in it. A static
        scheduler with completion ``batch_end`` holds each member until its batch ends
        (``StaticScheduler.completed``); those outputs carry ``completion_time`` = ``finished_time``."""
        sched = self.scheduler
        if not isinstance(sched, StaticScheduler):
            return [self._finish(r) for r in finished]
        if not sched.completes_at_batch_end:
            return [self._finish(r) for r in sched.completed(finished)]
        end = self.clock()  # one completion time for the whole batch
        outs = [self._finish(r, end) for r in sched.completed(finished)]
        for o in outs:
            o.completion_time = end
        return outs

    def _finish(self, req: Request, at: float | None = None) -> RequestOutput:
        """End ``req``'s bookkeeping and build its output; ``finished_time`` = ``at`` (s, engine clock), else now."""
        req.finished_time = self.clock() if at is None else at
        self.executor.release(req.request_id)
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        det = self._detok.pop(req.request_id, None)
        if det is not None and req.status == RequestStatus.FINISHED_STOPPED and isinstance(req.stop_reason, str):
            text = det.text
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(output_text_ids(req), skip_special_tokens=req.sampling_params.skip_special_tokens)
        else:
            text = ""
        out = RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=text,
            finish_reason=_FINISH_REASON.get(req.status, req.status.value),
            error=req.reject_reason,
            num_preemptions=req.num_preemptions,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            token_times=req.token_times,
            parent_id=req.parent_id,
            seq_index=req.seq_index,
            cumulative_logprob=req.cumulative_logprob,
            logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
            prompt_logprobs=(list(req.prompt_logprobs or [None] * req.num_prompt_tokens)
                             if req.sampling_params.prompt_logprobs is not None else None),
        )
        if req.beam_hypotheses:
            self._beam_outputs(req, out)
        return out

    def _beam_outputs(self, req: Request, out: RequestOutput) -> None:
        """Fill a finished beam-search request's ``outputs``: its ``beam_width`` best hypotheses (the ``n``
        best when ``n`` > 1), best first; the first is ``out`` itself."""
        import dataclasses

        sp = req.sampling_params
        hyps = req.beam_hypotheses[: sp.n if sp.n > 1 else sp.beam_width]
        out.beam_score = hyps[0].score
        out.outputs = [out]
        for i, h in enumerate(hyps[1:], 1):
            text = self.tokenizer.decode(h.token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
            out.outputs.append(dataclasses.replace(
                out, token_ids=list(h.token_ids), text=text, finish_reason=h.finish_reason, seq_index=i,
                cumulative_logprob=h.cumulative_logprob, beam_score=h.score, outputs=[]))

    def _record(self, out: SchedulerOutput, start: float, duration: float) -> None:
        kv, shape = out.kv_stats, out.shape
        assert kv is not None, "a scheduler's output carries its KV statistics"
        n_out, n_in = len(out.blocks_to_swap_out), len(out.blocks_to_swap_in)
        # positional, in StepRecord's field order (keywords and a merged dict cost more than the rest of a
        # small simulated step)
        self.steps.append(StepRecord(
            self.num_steps, start, duration, len(out.seqs),
            shape.prefill_tokens, shape.decode_rows, shape.padding_rows,  # decode: live rows
            out.num_running, out.num_waiting, len(out.preempted_ids),
            kv.total_slots, kv.allocated, kv.token_states, kv.reserved, kv.internal_frag, kv.external_frag,
            # memory management: prefix-cache lookups, swap preemptions and traffic, KV saved by sharing
            out.prefix_cache_queries, out.prefix_cache_hits, out.num_preempted_swap, out.num_swapped,
            n_out, n_in, (n_out + n_in) * getattr(self.executor, "block_bytes", 0) if n_out + n_in else 0,
            self._last_swap_time,
            self._shared_saved(),
            shape.tokens, shape.decode_ctx, shape.prefill_seqs, shape.prefill_attn, shape.prefill_ctx,
            shape.sampled, shape.padding_ctx, shape.scattered_ctx,
        ))
        self.num_steps += 1

    def _shared_saved(self) -> int:
        """KV slots saved by block sharing now (``kv_shared_saved``; 0 without a paged KV manager)."""
        kv = getattr(self.scheduler, "kv", None)
        return kv_shared_saved(kv, self.scheduler.running) if isinstance(kv, PagedKVCacheManager) else 0

    def _record_spec(self, out: SchedulerOutput, result: StepResult) -> None:
        """The last step record's speculative-decoding counts and communication time."""
        rec = self.steps[-1]
        ex = self.executor
        if ex is not self._comm_of:  # whether the executor reports it, looked up once per executor: a failed
            self._comm_of, self._reports_comm = ex, hasattr(ex, "last_comm_time")  # lookup raises, every step
        rec.comm_time = result.comm_time or (ex.last_comm_time if self._reports_comm else 0.0)
        for s in out.seqs:
            if s.num_spec:
                rec.spec_drafts += 1
                rec.spec_draft_tokens += s.num_spec
                rec.spec_accepted_tokens += len(result.spec_accepted.get(s.request_id, ()))

    def run_to_completion(self) -> list[RequestOutput]:
        """Step until no request is left; returns outputs in finishing order."""
        done = []
        while self.has_unfinished():
            done.extend(self.step())
        return done


def output_text_ids(req: Request) -> list[int]:
    """The output tokens that make the text: all but a last token that stopped the request (EOS or one of
    ``stop_token_ids``), which is in ``token_ids`` but not in the text (as vLLM)."""
    ids = req.output_token_ids
    if req.status == RequestStatus.FINISHED_STOPPED and isinstance(req.stop_reason, int) and ids:
        return ids[:-1]
    return ids


def kv_shared_saved(kv: PagedKVCacheManager, requests) -> int:
    """KV slots saved by block sharing now: sum over held blocks of (ref count - 1) x block_size, i.e. the
    slots the same requests would need without prefix-cache or parallel-sampling sharing."""
    pool = kv.pool
    if not pool.num_shared_blocks:
        return 0
    tables = kv.block_tables
    if sum(len(tables.get(r.request_id, ())) for r in requests) == pool.num_used_blocks + pool.num_extra_refs:
        # the requests hold every reference, so their tables cover every used block: the sum is the pool's count
        return pool.num_extra_refs * kv.block_size
    seen: set[int] = set()
    saved = 0
    for r in requests:
        for b in kv.block_tables.get(r.request_id, ()):
            if b not in seen:
                seen.add(b)
                saved += kv.pool.blocks[b].ref_cnt - 1
    return saved * kv.block_size
