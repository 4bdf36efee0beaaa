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

    Args:
        tokenizer: a transformers tokenizer (``decode``).
        prompt_ids: the prompt's last few ids give the first output tokens their left context.
        stop: stop strings; ``step`` reports the first one that appears.
    """

    CONTEXT = 5

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | None = None):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = [s for s in (stop or []) if s]

    def step(self, token_id: int) -> tuple[str, str | None]:
        """Add one token; returns ``(new_text, stop_string_or_None)``.

        When a stop string appears, ``text`` is cut just before it.
        """
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", None
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        before = len(self.text)
        self.text += delta
        for s in self.stop:
            # search only where a match could newly end: the delta plus len(s)-1 characters before it
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at != -1:
                self.text = self.text[:at]
                return self.text[before:] if at > before else "", s
        return delta, None
