"""Log-probabilities returned with a request's output (no torch here).

A ``TokenLogprob`` describes one position: the token that is there (sampled, or the prompt's own), its
log-probability under the model, its rank among all tokens, and the most likely tokens at that position.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One position's log-probabilities.

    Attributes:
        token_id: the token at this position (the sampled one, or the prompt's).
        logprob: its log-probability (natural log, float32 log-softmax of the raw logits).
        rank: 1 + the number of tokens with a strictly higher log-probability (1 = the most likely).
        top: the most likely tokens, ``[(token id, logprob)]``, most likely first (as many as asked).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)
