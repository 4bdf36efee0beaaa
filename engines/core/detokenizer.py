"""Incremental detokenization that is right for multi-byte characters split across tokens.

Byte-level BPE can split one UTF-8 character over several tokens; decoding a prefix then ends in
U+FFFD. As in vLLM's ``detokenize_incrementally``, text is emitted only once the newest tokens decode
to complete characters: the decoder keeps a ``prefix_offset`` (tokens already turned into text, kept
as left context because some tokenizers change a token's text by what precedes it) and a
``read_offset`` (tokens whose text was emitted).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Feeds output tokens one by one; ``text`` grows only by complete characters.

    Deltas returned by ``step`` are safe to stream: when stop strings are set, the last
    ``len(longest stop) - 1`` characters are held back until they cannot begin a stop string, so text
    already streamed is never taken back; ``flush`` returns what is held back once generation ends.
    The deltas of ``step`` and ``flush`` always concatenate to ``text``.

    Args:
        tokenizer: a transformers tokenizer (``decode``).
        prompt_ids: the prompt's last few ids give the first output tokens their left context.
        stop: stop strings; ``step`` reports the earliest one that appears in the text.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str: keep a matched stop string at the end of the text.
        min_tokens: stop strings are looked for only once this many tokens have been added (text added
            before then never matches later, as in vLLM's stop checker).
    """

    CONTEXT = 5

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop_str: bool = False, min_tokens: int = 0):
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str = include_stop_str
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.tok = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = [s for s in (stop or []) if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._emitted = 0

    def step(self, token_id: int) -> tuple[str, str | None]:
        """Add one token; returns ``(text safe to stream now, stop string or None)``.

        When a stop string appears, ``text`` is cut just before it.
        """
        self.ids.append(token_id)
        self.num_tokens += 1
        skip = self.skip_special_tokens
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", None
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        before = len(self.text)
        self.text += delta
        # a match can only newly end inside the delta; the earliest match in the text wins; none before min_tokens
        stops = self.stop if self.num_tokens >= self.min_tokens else ()
        hits = [(at, s) for s in stops if (at := self.text.find(s, max(0, before - len(s) + 1))) != -1]
        if hits:
            at, s = min(hits)
            self.text = self.text[: at + len(s) if self.include_stop_str else at]
            return self.flush(), s
        return self._emit(len(self.text) - self._holdback), None

    @classmethod
    def for_request(cls, tokenizer, request) -> "IncrementalDetokenizer":
        """The detokenizer of an ``engines.core.request.Request``, with its sampling parameters' stop strings,
        ``skip_special_tokens``, ``include_stop_str_in_output`` and ``min_tokens``."""
        sp = request.sampling_params
        return cls(tokenizer, request.prompt_token_ids, sp.stop, skip_special_tokens=sp.skip_special_tokens,
                   include_stop_str=sp.include_stop_str_in_output, min_tokens=sp.min_tokens)

    def flush(self) -> str:
        """Text not yet returned (the held-back tail), once generation has ended."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out
