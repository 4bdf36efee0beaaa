"""ShareGPT conversation JSON loader: the first human turn is the prompt, tokenized."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from workbench.traces.common import (LoadStats, TraceError, TraceRequest, begin_stats, check_file, check_limit, finish,
                                     output_count, shown)

# ``from`` values of a turn, compared lower-cased: ShareGPT dumps name the speakers differently
_HUMAN = ("human", "user")
_ASSISTANT = ("gpt", "chatgpt", "assistant", "bard", "model")


def _tokenize_fn(tokenizer: Any) -> Callable[[str], list[int]]:
    """text -> token ids from a transformers tokenizer (``.encode``) or a callable; TraceError otherwise."""
    if tokenizer is None:
        raise TraceError("sharegpt needs a tokenizer (a transformers tokenizer or a callable text -> list[int])")
    if hasattr(tokenizer, "encode"):
        return lambda text: list(tokenizer.encode(text))
    if callable(tokenizer):
        return lambda text: list(tokenizer(text))
    raise TraceError(f"tokenizer must have .encode or be callable, got {type(tokenizer).__name__}")


def load_sharegpt(
    path: str | Path,
    tokenizer: Any = None,
    default_output_tokens: int = 128,
    limit: int | None = None,
    strict: bool = False,
    stats: LoadStats | None = None,
) -> list[TraceRequest]:
    """ShareGPT JSON: a list of ``{"id", "conversations": [{"from", "value"}, ...]}``.

    The first human turn is the prompt (``prompt_text``, tokenized into ``prompt_token_ids``). The output
    length is the token count of the first assistant (``gpt``) turn after it, else ``default_output_tokens``.
    Conversations without a human turn are skipped. All arrivals are 0: apply ``request_rate`` (and
    ``burstiness``) in :func:`apply_transforms` for a synthetic arrival process. ``stats`` counts skipped
    conversations, outputs set to ``default_output_tokens`` and empty replies replayed as 1 token.

    Args:
        path: the JSON file.
        tokenizer: a transformers tokenizer (``.encode`` is used) or any callable text -> list[int].
        default_output_tokens: output length when a conversation has no assistant turn.
        limit: keep at most the first N usable conversations.
        strict: a conversation without a reply, or whose reply is 0 tokens, is an error (a conversation
            without a human turn is still skipped).
        stats: filled with the entry counts (see :class:`LoadStats`).

    Raises:
        TraceError: missing file, invalid JSON (with its line), an entry that is not a conversation (with its
            index), no tokenizer, no usable conversation; under ``strict`` the entries above.
    """
    p = check_file(path)
    check_limit(limit)
    tok = _tokenize_fn(tokenizer)
    if isinstance(default_output_tokens, bool) or not isinstance(default_output_tokens, int) or default_output_tokens < 1:
        raise TraceError(f"default_output_tokens must be a positive integer, got {shown(default_output_tokens)}")
    st = begin_stats(stats, p, "sharegpt")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TraceError(f"{p}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, list):
        raise TraceError(f"{p}: expected a JSON list of conversations, got {type(data).__name__}")
    reqs: list[TraceRequest] = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        where = f"{p}: entry {i}"
        st.rows_read += 1
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise TraceError(f"{where}: expected an object with a 'conversations' list")
        turns = entry["conversations"]
        for j, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
                raise TraceError(f"{where}: conversations[{j}] must be an object with string 'from' and 'value'")
        first = next((j for j, t in enumerate(turns) if t["from"].lower() in _HUMAN), None)
        if first is None:
            st.skip("no human turn", where)
            continue
        text = turns[first]["value"]
        ids = tok(text)
        reply = next((t["value"] for t in turns[first + 1:] if t["from"].lower() in _ASSISTANT), None)
        if reply is None:
            st.change(f"no reply: output_tokens = default_output_tokens ({default_output_tokens})", where,
                      "no assistant turn after the first human turn", strict)
            n_out = default_output_tokens
        else:
            n_out = output_count(len(tok(reply)), where, "reply tokens", st, strict)
        rid = str(entry.get("id", f"sharegpt-{i}"))
        if rid in seen:
            rid = f"{rid}#{i}"
        seen.add(rid)
        reqs.append(TraceRequest(rid, 0.0, len(ids), n_out, ids, text))
        if limit is not None and len(reqs) >= limit:
            break
    return finish(reqs, p, st, limit if limit is not None and len(reqs) >= limit else None)
