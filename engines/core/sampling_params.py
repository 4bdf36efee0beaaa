"""Per-request sampling and stopping parameters, in vLLM's shape (``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most top log-probabilities per position (vLLM's default max_logprobs)


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
        min_tokens: no stop (EOS, ``stop_token_ids``, stop strings) before this many output tokens: EOS and
            ``stop_token_ids`` are masked out of the logits until then (vLLM's ``min_tokens``).
        stop_token_ids: token ids that end generation like EOS (also with ``ignore_eos``); the token is kept
            in ``token_ids``; ``stop_reason`` is the id.
        include_stop_str_in_output: keep the matched stop string at the end of ``text``.
        skip_special_tokens: leave special tokens (EOS, chat markers) out of ``text``.
        presence_penalty, frequency_penalty: subtracted from a token's logit once if it occurs in the output
            so far, and once per occurrence (OpenAI's definitions, over output tokens only; in [-2, 2]).
        repetition_penalty: a logit of a token that occurs in the prompt or output is divided by it when
            positive and multiplied by it when negative (CTRL, Keskar et al. 2019; as transformers and vLLM;
            1.0 = off, must be > 0).
        logit_bias: token id -> value added to its logit (in [-100, 100], as OpenAI).
        min_p: drop tokens whose probability is below ``min_p`` x the most likely token's (0 = off).
        logprobs: return, for every generated token, its log-probability and the ``logprobs`` most likely
            tokens with theirs (0 = the sampled token only; None = none). Log-probabilities are the float32
            log-softmax of the model's raw logits, before penalties, biases and temperature (vLLM's default
            ``raw_logprobs``).
        prompt_logprobs: the same for every prompt token after the first (None = none). A request that asks
            for them does not read the prefix cache: every prompt position is computed.

    Logits processing order before sampling (``engines.real.sampler``): ``logit_bias``, the ``min_tokens``
    mask, repetition, frequency and presence penalties, temperature, ``min_p``, top-k, top-p.
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
    # stopping and output text (vLLM's extensions)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # logits processing
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    # log-probabilities returned with the output
    logprobs: int | None = None
    prompt_logprobs: int | None = None

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
        """True when sampling reduces to argmax (of the processed logits, see ``processes_logits``)."""
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """True when logits are changed before sampling (penalties, biases, the ``min_tokens`` mask)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def needs_logprobs(self) -> bool:
        """True when the sampled tokens' log-probabilities are needed (returned, or ranking ``best_of``)."""
        return self.logprobs is not None or (self.best_of or self.n) > self.n

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
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            return f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                return f"{name} must be in [-2, 2], got {getattr(self, name)}"
        if not self.repetition_penalty > 0:
            return f"repetition_penalty must be > 0, got {self.repetition_penalty}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p}"
        bad_bias = next((v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0), None)
        if bad_bias is not None:
            return f"logit_bias values must be in [-100, 100], got {bad_bias}"
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                return f"{name} must be in [0, {MAX_LOGPROBS}], got {v}"
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
            if self.processes_logits or self.logprobs is not None or self.prompt_logprobs is not None:
                return ("penalties, logit_bias, min_tokens and logprobs are not supported with beam search "
                        "(beam_width > 1)")
        return None
