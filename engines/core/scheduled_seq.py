"""One request's share of a step, as the scheduler hands it to an executor (no torch).

Its own module so that ``engines.core.step_shape`` can type the rows it reads (compiled by mypyc, a typed row's
fields are read natively) without importing the scheduler, which imports the step shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engines.core.request import Request
from engines.core.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step (slotted: the simulator builds one per running request per step).

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
    # speculative decoding: the last ``num_spec`` of ``token_ids`` are draft tokens to verify (the target's
    # logits are taken at every one of them and at the token before them); ``drafts_pending``: the
    # executor's draft model fills them in before the forward pass (the scheduler reserved their slots)
    num_spec: int = 0
    drafts_pending: bool = False
    # parallel sampling: child sequences to sample from this row's logits too (and their params); the
    # shared empty tuple when there are none (never mutated: a forking row is given its own lists)
    fork_ids: Sequence[str] = ()
    fork_params: Sequence[SamplingParams] = ()
    # the request itself (None for synthetic rows, e.g. the profiler's): logits processors read its tokens
    # so far (penalties, min_tokens) and prompt log-probabilities its prompt
    request: Request | None = field(default=None, repr=False, compare=False)
    # share of ``block_table``'s neighbouring entries that are not consecutive block ids, when the scheduler
    # keeps it (the paged KV manager counts it as the table grows); None: ``StepShape.of`` counts it
    scatter: float | None = field(default=None, repr=False, compare=False)

    # Written out rather than generated: mypyc compiles this one, while the ``__init__`` that ``dataclasses``
    # generates is interpreted even in the compiled build, and one runs per scheduled row per step (the same
    # fields and defaults as declared above).
    def __init__(self, request_id: str, token_ids: list[int], start_pos: int, block_table: list[int], sample: bool,
                 sampling_params: SamplingParams, is_padding: bool = False, num_spec: int = 0,
                 drafts_pending: bool = False, fork_ids: Sequence[str] = (), fork_params: Sequence[SamplingParams] = (),
                 request: Request | None = None, scatter: float | None = None) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.start_pos = start_pos
        self.block_table = block_table
        self.sample = sample
        self.sampling_params = sampling_params
        self.is_padding = is_padding
        self.num_spec = num_spec
        self.drafts_pending = drafts_pending
        self.fork_ids = fork_ids
        self.fork_params = fork_params
        self.request = request
        self.scatter = scatter

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def spec_token_ids(self) -> list[int]:
        """The draft tokens this step verifies (empty without speculation)."""
        return self.token_ids[len(self.token_ids) - self.num_spec:] if self.num_spec else []

    @property
    def is_decode(self) -> bool:
        """One new token after a cached context (batched decode attention), or a static padding row (a
        decode row of its batch); else a prefill chunk."""
        return self.is_padding or (len(self.token_ids) == 1 and self.start_pos > 0)

    @property
    def context_len(self) -> int:
        """Tokens attended to by the last new token (cached + new)."""
        return self.start_pos + len(self.token_ids)
