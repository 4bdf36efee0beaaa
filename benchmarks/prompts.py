"""Benchmark prompts read at run time from the shared ShareGPT trace.

The trace lives outside the repository (its licence is unclear), so its text is
never copied here: it is read when a benchmark runs. ``WORKBENCH_SHAREGPT``
overrides the default location.
"""

from __future__ import annotations

import json
import os
from itertools import cycle, islice
from pathlib import Path

DEFAULT_SHAREGPT = (
    Path(__file__).resolve().parents[2]
    / "shared/traces/sharegpt-prompts/ShareGPT_V3_filtered_1000.json"
)


def load_sharegpt_prompts(n: int, path: str | None = None) -> list[str]:
    """Return the first ``n`` prompts: the first human turn of each conversation.

    Conversations are taken in file order; empty turns are skipped. When ``n``
    exceeds the number of prompts in the file, the list is cycled.
    """
    src = Path(path or os.environ.get("WORKBENCH_SHAREGPT") or DEFAULT_SHAREGPT)
    with open(src, encoding="utf-8") as f:
        data = json.load(f)
    prompts = []
    for conv in data:
        turn = next((t for t in conv.get("conversations", []) if t.get("from") == "human"), None)
        if turn and turn.get("value", "").strip():
            prompts.append(turn["value"])
    if not prompts:
        raise ValueError(f"no human prompts found in {src}")
    return list(islice(cycle(prompts), n))


def truncate_prompts(prompts: list[str], tokenizer, max_tokens: int = 512) -> list[str]:
    """Cut each prompt to at most ``max_tokens`` tokens (decode of the first ids)."""
    out = []
    for p in prompts:
        ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        out.append(p if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens]))
    return out
