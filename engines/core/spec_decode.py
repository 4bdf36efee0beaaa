"""Speculative decoding on the paged policy: the configuration, the n-gram (prompt-lookup) proposer and the
acceptance counters (no torch).

How a speculative step works (vLLM V1's scheme):

* **Propose.** A running request in decode (one uncomputed token: the last sampled one) gets up to ``k`` =
  ``num_speculative_tokens`` draft tokens: from its own context (``ngram``: :class:`NgramProposer`, run by the
  scheduler) or from a draft model (``layers:N``: the target's first N layers, run by the executor before the
  verify pass; the scheduler reserves the ``k`` slots). Drafts never go past ``max_tokens`` or
  ``max_model_len``.
* **Verify.** The step computes ``1 + j`` query tokens for the request (the last token and its ``j`` drafts)
  over its paged KV, in the same forward pass as everything else, and takes the target's logits at all of
  them.
* **Accept.** Greedy: the longest prefix of drafts equal to the target's argmax at each position, then the
  target's own token at the first mismatch (or the bonus token after the last draft). Sampled: the
  speculative-sampling rule of Leviathan et al. (2023) / Chen et al. (2023): draft ``d`` at a position is kept
  with probability ``min(1, p(d) / q(d))``; on a rejection the token is drawn from ``max(0, p - q)``
  renormalised. Both proposers here propose deterministically (``q`` is a point mass on ``d``), so the rule is
  "keep with probability ``p(d)``, else draw from ``p`` with ``d`` removed", and the output distribution is
  exactly the target's.
* **Roll back.** ``num_computed_tokens`` advances over the last token and the accepted drafts only; the
  rejected drafts' slots are garbage and their blocks, beyond what the request's tokens need, are freed.

Requests that need per-token state the drafts would have to replay (logits processors: penalties,
``min_tokens``, ``logit_bias``; log-probabilities; beam search; the first token of a parallel-sampling
request) decode one token per step, as without speculation.

Counters follow vLLM's ``vllm:spec_decode_*`` metrics: drafts (requests x steps that got drafts), draft
tokens, accepted tokens, accepted tokens per draft position. Acceptance rate = accepted / draft tokens; mean
acceptance length = 1 + accepted / drafts (tokens per verify pass, the bonus token included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPEC_METHODS = ("ngram", "layers:N")


@dataclass(frozen=True)
class SpecDecodeConfig:
    """A real paged engine's speculative decoding.

    Attributes:
        method: ``ngram`` (prompt lookup) or ``layers`` (a draft that is the target's first ``draft_layers``
            layers, its final norm and its LM head: it reads the target's own KV cache of those layers).
        num_speculative_tokens: k, drafts per request per step (>= 1).
        prompt_lookup_min, prompt_lookup_max: ``ngram``: the shortest and longest suffix n-gram matched.
        draft_layers: ``layers``: N.
        placeholder_drafts: the scheduler only reserves ``k`` placeholder draft slots per decode row, whatever
            the method (the simulator: it has no real tokens to look up; its executor draws the acceptances).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_layers: int = 0
    placeholder_drafts: bool = False

    @classmethod
    def parse(cls, speculative_model: str, num_speculative_tokens: int | None, prompt_lookup_min: int | None = None,
              prompt_lookup_max: int | None = None) -> "SpecDecodeConfig":
        """The config of ``speculative_model`` (``ngram`` or ``layers:N``).

        Raises:
            ValueError: an unknown method, a bad ``N``, k < 1 or a bad prompt-lookup range (one line).
        """
        k = num_speculative_tokens
        if k is None or k < 1:
            raise ValueError(f"speculative_model {speculative_model!r} needs num_speculative_tokens >= 1, got {k}")
        name = str(speculative_model)
        if name == "ngram":
            lo = 1 if prompt_lookup_min is None else prompt_lookup_min
            hi = max(lo, 4) if prompt_lookup_max is None else prompt_lookup_max
            if lo < 1 or hi < lo:
                raise ValueError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
            return cls("ngram", k, lo, hi)
        if prompt_lookup_min is not None or prompt_lookup_max is not None:
            raise ValueError(f"prompt_lookup_min/max are for speculative_model ngram, not {name!r}")
        if name.startswith("layers:"):
            n = name.split(":", 1)[1]
            if not n.isdigit() or int(n) < 1:
                raise ValueError(f"speculative_model {name!r}: N in layers:N must be a positive integer")
            return cls("layers", k, draft_layers=int(n))
        raise ValueError(
            f"speculative_model {name!r}: the real engine proposes by 'ngram' (prompt lookup) or by 'layers:N' (the "
            "target's first N layers as the draft; no smaller model with the same tokenizer is available locally)")

    @property
    def name(self) -> str:
        """``ngram`` or ``layers:N``, as a scenario names it."""
        return "ngram" if self.method == "ngram" else f"layers:{self.draft_layers}"

    @property
    def proposes_in_scheduler(self) -> bool:
        """Whether the scheduler fills the drafts (``ngram``) or only reserves their slots (a draft model, or
        ``placeholder_drafts``)."""
        return self.method == "ngram" and not self.placeholder_drafts


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram`` method): drafts are the tokens that followed an earlier occurrence of the
    context's last n tokens.

    For n from ``max_n`` down to ``min_n``, the most recent earlier occurrence of the last n tokens of the
    context wins; the drafts are the up-to-``k`` tokens after it. No occurrence: no drafts.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (prompt + output so far); ``[]`` when none match.
        Cost: O(len(tokens) x max_n) per call."""
        total = len(tokens)
        if k < 1:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n:]
            first = suffix[0]
            # scan right to left for the most recent earlier start of the suffix (start + n <= total - 1)
            for start in range(total - n - 1, -1, -1):
                if tokens[start] == first and tokens[start:start + n] == suffix:
                    return list(tokens[start + n:start + n + k])
        return []


@dataclass
class SpecDecodeStats:
    """Acceptance counters (vLLM's ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
    ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafts_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        """Count one request's verify: ``num_draft`` drafts proposed, the first ``num_accepted`` kept."""
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        while len(self.drafts_per_pos) < num_draft:
            self.drafts_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(num_draft):
            self.drafts_per_pos[i] += 1
            if i < num_accepted:
                self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / draft tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify pass: 1 + accepted / drafts (1 when nothing was drafted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        """Counters and rates, plus the acceptance rate at each draft position."""
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens, acceptance_rate=self.acceptance_rate,
                    mean_acceptance_length=self.mean_acceptance_length,
                    accepted_per_pos=list(self.accepted_per_pos),
                    acceptance_rate_per_pos=[a / d if d else 0.0
                                             for a, d in zip(self.accepted_per_pos, self.drafts_per_pos)])


def speculates(request) -> bool:
    """Whether ``request`` may get drafts: none of the per-token features the drafts cannot replay (see the
    module docstring)."""
    sp = request.sampling_params
    if sp.processes_logits or sp.needs_logprobs or sp.use_beam_search:
        return False
    return not (request.fork_ids and not request.output_token_ids)
