"""The scheduler interface every policy implements, and what a step passes between policy and executor
(no torch, no clock).

Every engine (real model or cost model) drives a scheduler the same way::

    scheduler.add_request(req)
    out = scheduler.schedule()          # SchedulerOutput: which requests, how many tokens, block tables
    result = executor.execute(out)      # StepResult: sampled tokens, duration
    finished = scheduler.update(out, result)

The policies: ``engines.core.paged_scheduler`` (continuous batching over paged KV),
``engines.core.static_scheduler`` (static batching baseline) and ``engines.core.orca_scheduler`` (Orca:
iteration-level batching over contiguous reservations).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import KVStats
from engines.core.logprobs import TokenLogprob
from engines.core.request import Request, RequestStatus
from engines.core.sampling_params import SamplingParams
from engines.core.scheduled_seq import ScheduledSeq  # noqa: F401  (defined there, part of this interface)
from engines.core.spec_decode import SpecDecodeStats
from engines.core.step_shape import StepShape


@dataclass
class SchedulerOutput:
    """What one step runs: the scheduled sequences, plus what the scheduler did to get there."""

    seqs: list[ScheduledSeq]
    preempted_ids: list[str] = field(default_factory=list)
    kv_stats: KVStats | None = None
    num_running: int = 0
    num_waiting: int = 0
    # swap preemption and copy-on-write (block copies the executor runs before the forward pass,
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

    # StepShape of ``seqs``, computed on first use (a plain attribute: functools.cached_property takes a lock,
    # which costs more than the rest of a small simulated step)
    _shape: StepShape | None = field(default=None, init=False, repr=False, compare=False)

    # Written out rather than generated, with the fields and defaults declared above: mypyc compiles this one,
    # while the ``__init__`` that ``dataclasses`` generates runs interpreted even in the compiled build (one per step).
    def __init__(self, seqs: list[ScheduledSeq], preempted_ids: list[str] | None = None, kv_stats: KVStats | None = None,
                 num_running: int = 0, num_waiting: int = 0, blocks_to_swap_out: list[tuple[int, int]] | None = None,
                 blocks_to_swap_in: list[tuple[int, int]] | None = None,
                 blocks_to_copy: list[tuple[int, int]] | None = None, num_preempted_swap: int = 0,
                 num_swapped: int = 0, prefix_cache_queries: int = 0, prefix_cache_hits: int = 0) -> None:
        self.seqs = seqs
        self.preempted_ids = [] if preempted_ids is None else preempted_ids
        self.kv_stats = kv_stats
        self.num_running = num_running
        self.num_waiting = num_waiting
        self.blocks_to_swap_out = [] if blocks_to_swap_out is None else blocks_to_swap_out
        self.blocks_to_swap_in = [] if blocks_to_swap_in is None else blocks_to_swap_in
        self.blocks_to_copy = [] if blocks_to_copy is None else blocks_to_copy
        self.num_preempted_swap = num_preempted_swap
        self.num_swapped = num_swapped
        self.prefix_cache_queries = prefix_cache_queries
        self.prefix_cache_hits = prefix_cache_hits
        self._shape = None

    @property
    def shape(self) -> StepShape:
        """What the step computes (computed once: the step record and the simulator's cost model both read it)."""
        if self._shape is None:
            self._shape = StepShape.of(self.seqs)
        return self._shape

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class StepResult:
    """What an executor returns: sampled token per request (those with ``sample``), duration in seconds."""

    sampled: dict[str, int]
    duration: float
    swap_time: float = 0.0  # seconds of the step spent copying swapped blocks (included in duration)
    logprobs: dict[str, float] = field(default_factory=dict)  # log p of sampled tokens (best_of, logprobs)
    # SamplingParams.logprobs: the sampled token's TokenLogprob per request (and per forked child)
    token_logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per request, {prompt position: TokenLogprob} computed in this step
    prompt_logprobs: dict[str, dict[int, TokenLogprob]] = field(default_factory=dict)
    # beam search: for a beam-search row, its 2 x beam_width most likely next tokens as
    # [(token id, log p)], most likely first, instead of an entry in ``sampled``
    beam_candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # speculative decoding: per request with drafts, the drafts kept (a prefix of them); its emitted tokens
    # are these followed by ``sampled[id]`` (the target's token at the first rejection, or the bonus token)
    spec_accepted: dict[str, list[int]] = field(default_factory=dict)
    # seconds of the step the executor spent in collective communication (tensor parallelism; 0 otherwise)
    comm_time: float = 0.0

    # Written out rather than generated, with the fields and defaults declared above: mypyc compiles this one,
    # while the ``__init__`` that ``dataclasses`` generates runs interpreted even in the compiled build (one per step).
    def __init__(self, sampled: dict[str, int], duration: float, swap_time: float = 0.0,
                 logprobs: dict[str, float] | None = None, token_logprobs: dict[str, TokenLogprob] | None = None,
                 prompt_logprobs: dict[str, dict[int, TokenLogprob]] | None = None,
                 beam_candidates: dict[str, list[tuple[int, float]]] | None = None,
                 spec_accepted: dict[str, list[int]] | None = None, comm_time: float = 0.0) -> None:
        self.sampled = sampled
        self.duration = duration
        self.swap_time = swap_time
        self.logprobs = {} if logprobs is None else logprobs
        self.token_logprobs = {} if token_logprobs is None else token_logprobs
        self.prompt_logprobs = {} if prompt_logprobs is None else prompt_logprobs
        self.beam_candidates = {} if beam_candidates is None else beam_candidates
        self.spec_accepted = {} if spec_accepted is None else spec_accepted
        self.comm_time = comm_time


def record_prompt_logprobs(req: Request, computed: dict[int, TokenLogprob] | None) -> None:
    """Store a step's prompt log-probabilities on ``req`` by position (a chunk recomputed after a preemption
    overwrites the same positions with the same values); position 0 stays None."""
    if not computed:
        return
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None] * req.num_prompt_tokens
    for pos, lp in computed.items():
        req.prompt_logprobs[pos] = lp


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

    Raises:
        ValueError: a bad knob (see ``SchedulerConfig.validate``).
    """

    supports_beam_search = False  # only the paged policy runs beam search (BeamSearch)

    def __init__(self, config: SchedulerConfig) -> None:
        bad = config.validate()
        if bad:
            raise ValueError(bad)
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._num_forks: dict[str, int] = {}  # parent id -> its forked sequences still in ``requests``
        self.num_preemptions = 0
        self.num_preemptions_swap = 0  # the rest of num_preemptions are by recompute
        self.spec_stats = SpecDecodeStats()  # speculative decoding's acceptance (empty without it)

    # -- interface ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> bool:
        """Queue a request, or reject it (status REJECTED, ``reject_reason`` set) and return False.

        Raises:
            ValueError: a request with this id is still in flight (queued, running, held, or one of its
                forked sequences is); its state would be overwritten.
        """
        if self.in_flight(request.request_id):
            raise ValueError(f"request {request.request_id}: a request with this id is already in flight")
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
        outputs. A speculative row advances over its last token and its accepted drafts only, then appends
        the accepted drafts and the sampled token one by one, stopping at the first that ends the request
        (the rest are dropped). Returns the requests that finished in this step.
        """
        finished: list[Request] = []
        requests, prompt_lps, beams = self.requests, result.prompt_logprobs, result.beam_candidates
        for seq in output.seqs:
            if seq.is_padding:
                continue
            req = requests.get(seq.request_id)
            if req is None or req.is_finished:
                continue
            accepted = result.spec_accepted.get(seq.request_id, []) if seq.num_spec else []
            if seq.num_spec:
                self.spec_stats.record(seq.num_spec, len(accepted))
            req.num_computed_tokens += len(seq.token_ids) - seq.num_spec + len(accepted)
            if prompt_lps:
                record_prompt_logprobs(req, prompt_lps.get(seq.request_id))
            if not seq.sample or (beams and seq.request_id in beams):  # beams: see BeamSearch.update
                continue
            for tok in accepted:
                req.append_output(tok)
                if self._finish_if_done(req, tok, finished):
                    break
            else:
                tok = result.sampled[seq.request_id]
                req.append_output(tok)
                lp = result.token_logprobs.get(seq.request_id) if result.token_logprobs else None
                if lp is not None:
                    req.output_logprobs.append(lp)
                sp = req.sampling_params
                # what _finish_if_done checks, loosened (EOS even when ignored), so most rows skip the call
                if tok in req.eos_token_ids or sp.stop_token_ids or len(req.output_token_ids) >= sp.max_tokens:
                    self._finish_if_done(req, tok, finished)
        return finished

    def _finish_if_done(self, req: Request, tok: int, finished: list[Request]) -> bool:
        """Finish ``req`` (appending it to ``finished``) if its new token ``tok`` is EOS (unless
        ``ignore_eos``) or one of ``stop_token_ids``, or it has reached ``max_tokens``. Before
        ``min_tokens`` outputs neither can be sampled (the sampler masks them). Returns whether it finished."""
        sp = req.sampling_params
        if (tok in req.eos_token_ids and not sp.ignore_eos) or (sp.stop_token_ids and tok in sp.stop_token_ids):
            self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=tok)
            finished.append(req)
            return True
        if len(req.output_token_ids) >= sp.max_tokens:
            self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
            finished.append(req)
            return True
        return False

    def in_flight(self, request_id: str) -> bool:
        """Whether ``request_id`` names a request not yet finished, or the parent of a forked sequence
        (parallel sampling, beam search) that is."""
        return request_id in self.requests or request_id in self._num_forks

    def add_fork(self, child: Request) -> None:
        """Register a sequence forked off ``child.parent_id`` (the caller puts it in a queue)."""
        self.requests[child.request_id] = child
        parent = child.parent_id
        if parent is None:
            raise ValueError(f"request {child.request_id}: a forked sequence must name its parent (parent_id)")
        self._num_forks[parent] = self._num_forks.get(parent, 0) + 1

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason=None) -> Request | None:
        """End a request (stop string, abort, ...): release its KV and drop it from the queues."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.parent_id is not None and req.parent_id in self._num_forks:
            left = self._num_forks[req.parent_id] - 1
            if left:
                self._num_forks[req.parent_id] = left
            else:
                del self._num_forks[req.parent_id]
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
