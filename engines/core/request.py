"""A request's state as the scheduler and executors see it (no torch here)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engines.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING -> (PREEMPTED -> WAITING ...) -> a FINISHED_* or REJECTED state."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens reached
    FINISHED_ABORTED = "finished_aborted"
    REJECTED = "rejected"  # never admitted: see Request.reject_reason
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


_UNFINISHED = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)  # members compare by identity


@dataclass(eq=False)  # identity semantics: queue membership tests must not compare fields
class Request:
    """One generation request.

    Token accounting follows vLLM V1: ``all_token_ids`` = prompt + output; ``num_computed_tokens``
    counts the tokens whose K/V are in the cache. A step schedules ``num_tokens`` new tokens for the
    request; after the step ``num_computed_tokens`` grows by that many. When it reaches
    ``num_tokens_total`` the request has logits for a new token.

    Attributes:
        request_id: unique id (string).
        prompt_token_ids: the prompt, in tokens.
        sampling_params: how to sample and stop.
        arrival_time: seconds on the driver's clock.
        eos_token_id: the id, or ids, that end generation (unless ``ignore_eos``); ``eos_token_ids`` is
            the same as a frozenset.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    prompt: str | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # one stop id or several (Llama 3 Instruct has three)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    reject_reason: str | None = None
    stop_reason: str | int | None = None
    # times on the driver's clock (seconds); filled by the engine
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    # prefix caching (chained hashes of full blocks, extended by the KV manager; cache_salt is
    # mixed into every block hash so requests with different salts never share blocks)
    block_hashes: list = field(default_factory=list)
    cache_salt: str | None = None
    # parallel sampling: a request with sampling_params.num_seqs > 1 forks num_seqs - 1 child
    # sequences (sharing its blocks) when its prompt's first token is sampled; children name it parent_id
    parent_id: str | None = None
    seq_index: int = 0
    forked: bool = False
    cumulative_logprob: float = 0.0
    # beam search: a beam-search request's finished hypotheses (engines.core.beam_search.Hypothesis),
    # best first, set when its search ends; its beams are internal sequences naming it parent_id
    beam_hypotheses: list = field(default_factory=list)
    # log-probabilities (SamplingParams.logprobs / prompt_logprobs): one TokenLogprob per output token, and
    # one per prompt position (None for position 0, which nothing predicts); filled by the scheduler's update
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None

    @property
    def fork_ids(self) -> list[str]:
        """Ids of the child sequences this request forks into (empty when it samples one sequence)."""
        if self.parent_id is not None or self.forked:
            return []
        return [f"{self.request_id}#{i}" for i in range(1, self.sampling_params.num_seqs)]

    def __post_init__(self) -> None:
        # prompt + outputs in one list, appended to in place, so a step's slice costs O(tokens scheduled)
        self._all: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)
        e = self.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(() if e is None else (e,) if isinstance(e, int) else e)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens (a live list: do not mutate)."""
        return self._all

    def append_output(self, token_id: int) -> None:
        """Record one generated token."""
        self.output_token_ids.append(token_id)
        self._all.append(token_id)

    def truncate_output(self, n: int) -> None:
        """Keep the first ``n`` output tokens: a stop string ended the request inside a speculative step's
        tokens, and the request is finishing (its block hashes past the kept tokens are left as they are)."""
        del self.output_token_ids[n:]
        del self._all[self.num_prompt_tokens + n:]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_total(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self._all)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most output tokens this request may produce."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status not in _UNFINISHED
