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


def add_workload_args(ap) -> None:
    """The workload options every offline peer benchmark takes (an ``argparse.ArgumentParser``): model folder,
    prompt count, output tokens per request, prompt truncation (tokens) and the result file."""
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--out", required=True)


def parse_workload(text: str) -> tuple[str, int, int]:
    """``NAME:NUM_PROMPTS:MAX_PROMPT_TOKENS`` (e.g. ``short-64:64:12``) -> ``(name, n, max_prompt_tokens)``.

    Raises:
        argparse.ArgumentTypeError: not three fields, or counts that are not positive integers.
    """
    import argparse

    parts = text.split(":")
    if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts[1:]):
        raise argparse.ArgumentTypeError(f"workload {text!r}: want NAME:NUM_PROMPTS:MAX_PROMPT_TOKENS")
    return parts[0], int(parts[1]), int(parts[2])


def write_result(out: str, engine: str, mode: str, batch_size, num_requests: int, output_tokens: int,
                 max_tokens: int, elapsed_s: float, load0: float, threads: int | None,
                 extra: dict | None = None) -> dict:
    """Write one peer benchmark's result record (JSON, ``out``) and print it; returns it. Throughput is
    ``output_tokens / elapsed_s`` (tok/s); the 1-minute load average before and after says how noisy the host
    was. ``extra``: more fields for the record."""
    result = {
        "engine": engine,
        "mode": mode,
        "batch_size": batch_size,
        "num_requests": num_requests,
        "output_tokens": output_tokens,
        "requested_output_tokens": num_requests * max_tokens,
        "elapsed_s": round(elapsed_s, 3),
        "output_tok_per_s": round(output_tokens / elapsed_s, 2),
        "loadavg_1m_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "torch_threads": threads,
        **(extra or {}),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result
