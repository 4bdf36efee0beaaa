"""The shape of one engine step: what its batch computes, in the units a cost model charges (no torch).

Both engines record it for every step (``StepRecord``), so a cost model can be checked step by step against
the real engine's own steps, and the simulator's cost model predicts a step's seconds from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engines.core.scheduled_seq import ScheduledSeq  # typed rows: compiled by mypyc, their fields are read natively


@dataclass(unsafe_hash=True)
class StepShape:
    """What one step computes.

    Attributes:
        tokens: rows of every GEMM: prefill chunk tokens + decode rows + static padding rows.
        decode_rows: live decode rows (one token each, after a cached context).
        padding_rows: static-batching padding rows (decode rows at their batch's length, never sampled).
        decode_ctx: sum of the context lengths (tokens) that decode and padding rows attend to: KV read.
        padding_ctx: the padding rows' part of ``decode_ctx`` (they read the one scratch block over and over,
            which stays in cache: cheaper than a live row's KV read).
        scattered_ctx: the live decode rows' context weighted by how scattered their blocks are: sum over rows of
            context x (block-table neighbours that are not consecutive block ids / neighbours). Scattered KV reads
            cost more than contiguous ones; both engines run the same KV manager, so both know the layout.
        prefill_seqs: prefill chunks in the step (attention is run per chunk over its block table).
        prefill_tokens: tokens of those chunks.
        prefill_attn: sum over chunks of n * (start + n): query x key pairs (causal work up to a factor 2).
        prefill_ctx: sum over chunks of n * start: query x cached-key pairs (a later chunk of a chunked
            prefill, or a chunk after a prefix-cache hit, attends to its cached tokens too).
        sampled: rows that go through the LM head (a row sampled for several parallel-sampling children
            counts once per child; a speculative row counts its drafts too: the target's logits are taken at
            each). A speculative row (its token and drafts after a cached context) is a prefill chunk here,
            as the executor runs it.
    """

    tokens: int = 0
    decode_rows: int = 0
    padding_rows: int = 0
    decode_ctx: int = 0
    prefill_seqs: int = 0
    prefill_tokens: int = 0
    prefill_attn: int = 0
    prefill_ctx: int = 0
    sampled: int = 0
    padding_ctx: int = 0
    scattered_ctx: float = 0.0

    # Written out rather than generated, with the fields and defaults declared above: mypyc compiles this one,
    # while the ``__init__`` that ``dataclasses`` generates runs interpreted even in the compiled build (one per
    # step). Not frozen, since a frozen class's fields can only be set through the slow ``object.__setattr__``;
    # hashable by value all the same (``unsafe_hash``): treat a shape as immutable.
    def __init__(self, tokens: int = 0, decode_rows: int = 0, padding_rows: int = 0, decode_ctx: int = 0,
                 prefill_seqs: int = 0, prefill_tokens: int = 0, prefill_attn: int = 0, prefill_ctx: int = 0,
                 sampled: int = 0, padding_ctx: int = 0, scattered_ctx: float = 0.0) -> None:
        self.tokens = tokens
        self.decode_rows = decode_rows
        self.padding_rows = padding_rows
        self.decode_ctx = decode_ctx
        self.prefill_seqs = prefill_seqs
        self.prefill_tokens = prefill_tokens
        self.prefill_attn = prefill_attn
        self.prefill_ctx = prefill_ctx
        self.sampled = sampled
        self.padding_ctx = padding_ctx
        self.scattered_ctx = scattered_ctx

    @classmethod
    def of(cls, seqs: Sequence[ScheduledSeq]) -> "StepShape":
        """The shape of a step that runs ``seqs`` (``ScheduledSeq``)."""
        tokens = decode_rows = padding = decode_ctx = pseqs = ptok = pattn = pctx = sampled = pad_ctx = 0
        scattered = 0.0
        for s in seqs:
            n = len(s.token_ids)
            tokens += n
            if s.is_padding or (n == 1 and s.start_pos > 0):  # ScheduledSeq.is_decode, inlined: once per row
                decode_ctx += s.start_pos + 1
                if s.is_padding:
                    padding += 1
                    pad_ctx += s.start_pos + 1
                else:
                    decode_rows += 1
                    scattered += (s.start_pos + 1) * (s.scatter if s.scatter is not None else _scatter(s.block_table))
            else:
                pseqs += 1
                ptok += n
                pattn += n * (s.start_pos + n)
                pctx += n * s.start_pos
            if s.sample and not s.is_padding:
                sampled += 1 + len(s.fork_ids) + s.num_spec
        return cls(tokens, decode_rows, padding, decode_ctx, pseqs, ptok, pattn, pctx, sampled, pad_ctx, scattered)

    def as_dict(self) -> dict[str, float]:
        """The fields by name, in declaration order (what ``dataclasses.asdict`` gives, without its deep copy: the
        cost model asks for it every step)."""
        return {"tokens": self.tokens, "decode_rows": self.decode_rows, "padding_rows": self.padding_rows,
                "decode_ctx": self.decode_ctx, "prefill_seqs": self.prefill_seqs, "prefill_tokens": self.prefill_tokens,
                "prefill_attn": self.prefill_attn, "prefill_ctx": self.prefill_ctx, "sampled": self.sampled,
                "padding_ctx": self.padding_ctx, "scattered_ctx": self.scattered_ctx}

    @property
    def kind(self) -> str:
        """``decode``, ``prefill``, ``mixed`` (both), ``padded`` (decode rows with padding rows) or ``empty``."""
        if not self.tokens:
            return "empty"
        if self.prefill_seqs and (self.decode_rows or self.padding_rows):
            return "mixed"
        if self.prefill_seqs:
            return "prefill"
        return "padded" if self.padding_rows else "decode"


def _scatter(table) -> float:
    """Share of a block table's neighbouring entries that are not consecutive block ids (0: one contiguous run)."""
    n = len(table)
    if n < 2:
        return 0.0
    return sum(1 for a, b in zip(table, table[1:]) if b != a + 1) / (n - 1)
