"""Per-request sampling and stopping parameters, in vLLM's shape (``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: output tokens to generate at most (>= 1; smaller is rejected by the engine).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it before softmax.
        top_k: keep the k most likely tokens (0 or -1 = all).
        top_p: keep the smallest set of tokens whose probability sums to at least p (1.0 = all).
        seed: per-request seed; two requests with the same seed and prompt sample the same tokens.
        stop: strings that end generation; the matched string is not included in ``text``.
        ignore_eos: keep generating past the end-of-sequence token (benchmarks do this).
        n: output sequences to return for the prompt (parallel sampling; they share the prompt's KV blocks).
        best_of: sequences to generate (>= n); the n with the highest cumulative log-probability are
            returned (None = n).
        beam_width: beam search when > 1: keep the ``beam_width`` most likely sequences at every
            step, as transformers' ``generate(num_beams=..., do_sample=False)`` does; the beams share KV
            blocks. Deterministic: ``temperature``, ``top_k``, ``top_p`` and ``seed`` are ignored; ``stop``
            strings and ``best_of`` are not allowed. ``output.outputs`` holds the ``beam_width`` best
            hypotheses (the ``n`` best when ``n`` > 1), best first. See ``engines/core/beam_search.py``.
        length_penalty: a finished hypothesis scores ``sum logprob / (generated tokens ** length_penalty)``
            (transformers' default 1.0; > 0 favours longer sequences, < 0 shorter ones).
        early_stopping: transformers' rule: ``False`` (default) stops when the best running beam, scored
            at its current length, cannot beat the worst of ``beam_width`` finished hypotheses; ``True``
            stops as soon as ``beam_width`` hypotheses have finished; ``"never"`` scores the running beam
            at ``max_tokens`` when ``length_penalty`` > 0.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # parallel sampling
    n: int = 1
    best_of: int | None = None
    # beam search (engines/core/beam_search.py)
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    @property
    def num_seqs(self) -> int:
        """Sequences generated for the prompt by parallel sampling: ``best_of`` or ``n`` (1 with beam search,
        whose beams are forked by the beam search itself)."""
        if self.beam_width > 1:
            return 1
        return self.best_of or self.n

    @property
    def use_beam_search(self) -> bool:
        """True when ``beam_width`` > 1."""
        return self.beam_width > 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self) -> str | None:
        """Return a one-line reason why these parameters are invalid, or None when they are fine."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if self.temperature < 0:
            return f"temperature must be >= 0, got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < -1:
            return f"top_k must be -1, 0 or positive, got {self.top_k}"
        if not isinstance(self.n, int) or self.n < 1:
            return f"n must be >= 1, got {self.n}"
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            return f"best_of must be >= n ({self.n}), got {self.best_of}"
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            return f"beam_width must be >= 1, got {self.beam_width}"
        if self.early_stopping not in (True, False, "never"):
            return f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
        if self.beam_width > 1:
            if self.n > self.beam_width:
                return f"n ({self.n}) must be <= beam_width ({self.beam_width}) with beam search"
            if self.best_of is not None:
                return "best_of cannot be combined with beam search (beam_width > 1)"
            if self.stop:
                return "stop strings are not supported with beam search (beam_width > 1)"
        return None
