"""What a weight format costs in output quality and buys in memory and speed, measured on the real model
through the engine (``engines.LLM``): greedy agreement with float32, perplexity on a committed text, weight
bytes as stored, and offline decode speed (``workbench quality``).

Variants (``--weight-dtype``): ``fp32`` (dtype float32, dense weights: the reference), ``bf16`` (dtype
bfloat16, dense), ``int8`` and ``int4`` (weight-only round-to-nearest quantized linear layers,
``engines.real.quant``, in the model dtype ``quant_dtype``, float32 by default). The formulas are in
:data:`FORMULAS` and in the JSON the command writes.
"""

from __future__ import annotations

import hashlib
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

WEIGHT_DTYPES = ("fp32", "bf16", "int8", "int4")
TEXT_PATH = Path(__file__).parent / "data" / "text" / "botchan_ch1-2.txt"

FORMULAS = {
    "agreement_positions": (
        "sum_i m_i / sum_i n_i, where n_i = the number of tokens fp32 generated for prompt i (greedy, up to "
        "max_new_tokens, its EOS included when it stops) and m_i = the length of the common prefix of the "
        "variant's tokens and fp32's (the positions that match fp32 up to the first divergence)"),
    "prompts_identical": "fraction of prompts whose generated tokens equal fp32's exactly (same tokens, same length)",
    "perplexity": (
        "exp(sum NLL / N): the text tokenized without special tokens and cut into non-overlapping windows of "
        "window_tokens tokens (the tail shorter than a window dropped); each window is one prompt scored from "
        "its own start, so its first token is context only and its other window_tokens - 1 tokens are "
        "predicted; NLL = -log softmax(logits)[next token] in float32 (the engine's prompt_logprobs); N = "
        "predicted tokens over all windows"),
    "perplexity_delta_pct": "100 x (perplexity / perplexity of fp32 - 1)",
    "weight_bytes": ("bytes of the weights as the engine stores them (LlamaModel.weight_bytes): the linear "
                     "layers (quantized ones with their scales and zero points), the embedding (tied to the LM "
                     "head), the norms"),
    "output_tok_s": ("output tokens / wall seconds of one LLM.generate call on speed_prompts prompts x "
                     "speed_tokens tokens (temperature 0, ignore_eos: every request makes exactly speed_tokens "
                     "tokens), all submitted at once, timed after one untimed run of the same call (first-call "
                     "costs: kernel loading, oneDNN primitive creation per shape); one timed run"),
    "single_stream_tok_s": ("the same for one request (the first speed prompt) x speed_tokens tokens: decode at "
                            "batch 1, where reading the weights bounds a step"),
    "speed_vs_fp32": "output_tok_s / output_tok_s of fp32",
}

# 32 fixed instructions for the agreement test (chat template applied), varied in topic and answer shape
PROMPTS = (
    "What is the capital of France?", "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.", "List three uses of a paperclip.",
    "What is 17 times 23?", "Translate 'good morning' into Spanish.",
    "Give me a short recipe for pancakes.", "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.", "What are the three states of water?",
    "Write a Python function that reverses a string.", "Why do we have seasons on Earth?",
    "Suggest a name for a friendly robot.", "What is the difference between weather and climate?",
    "Summarize the story of Cinderella in one paragraph.", "How many legs does a spider have?",
    "What does a librarian do?", "Give two tips for sleeping better.",
    "Explain what a prime number is.", "Write the opening line of a mystery novel.",
    "What is photosynthesis?", "Name the planets of the solar system in order.",
    "How do you make a paper airplane?", "What is the boiling point of water at sea level?",
    "Why is exercise good for health?", "Write a limerick about a teapot.",
    "What is the largest ocean on Earth?", "Explain gravity to a child.",
    "What are the primary colors?", "Give an example of a renewable energy source and explain it.",
    "What is a verb? Give three examples.", "Describe the smell of rain.",
)


@dataclass
class QualitySettings:
    """What ``workbench quality`` measures (see :data:`FORMULAS`).

    Attributes:
        model: a known model name or a local Llama-family folder.
        weight_dtypes: variants measured, from :data:`WEIGHT_DTYPES`; fp32 is always run (the reference)
            but only reported when listed.
        quant_dtype: the model dtype of the int8 and int4 variants (``float32`` or ``bfloat16``).
        num_prompts, max_new_tokens: the agreement test: the first ``num_prompts`` of :data:`PROMPTS`
            (cycled past 32), greedy, at most ``max_new_tokens`` tokens each, stopping at EOS.
        window_tokens, max_windows: perplexity windows (tokens; ``max_windows`` 0 = every whole window).
        speed_prompts, speed_tokens: the speed test (0 prompts: skip it); prompt ``k`` is the first
            ``speed_prompt_tokens`` tokens of line ``9 k`` of the text.
        kv_cache_tokens: each engine's KV pool (tokens).
        text: the perplexity text (default: the committed Botchan slice, ``workbench/data/text``).
    """

    model: str = "smollm2-135m"
    weight_dtypes: tuple[str, ...] = WEIGHT_DTYPES
    quant_dtype: str = "float32"
    num_prompts: int = 32
    max_new_tokens: int = 64
    window_tokens: int = 512
    max_windows: int = 0
    speed_prompts: int = 64
    speed_tokens: int = 64
    speed_prompt_tokens: int = 16
    kv_cache_tokens: int = 16384
    text: str = str(TEXT_PATH)

    def problems(self) -> list[str]:
        """Why these settings cannot run, one line each naming the option."""
        bad = [f"--weight-dtype {w} is not one of {', '.join(WEIGHT_DTYPES)}" for w in self.weight_dtypes
               if w not in WEIGHT_DTYPES]
        if not self.weight_dtypes:
            bad.append(f"--weight-dtype: give at least one of {', '.join(WEIGHT_DTYPES)}")
        if self.quant_dtype not in ("float32", "bfloat16"):
            bad.append(f"--dtype must be float32 or bfloat16, got {self.quant_dtype!r}")
        for name in ("num_prompts", "max_new_tokens", "speed_tokens", "speed_prompt_tokens", "kv_cache_tokens"):
            if getattr(self, name) < 1:
                bad.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.window_tokens < 2:
            bad.append(f"--window-tokens must be >= 2, got {self.window_tokens}")
        for name in ("max_windows", "speed_prompts"):
            if getattr(self, name) < 0:
                bad.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not Path(self.text).is_file():
            bad.append(f"--text {self.text}: no such file")
        return bad


@dataclass
class VariantResult:
    """One variant's measurements (units in the names; formulas in :data:`FORMULAS`)."""

    weight_dtype: str
    dtype: str
    agreement_positions: float
    prompts_identical: float
    generated_tokens: int
    perplexity: float
    perplexity_delta_pct: float
    predicted_tokens: int
    weight_bytes: int
    output_tok_s: float | None = None
    speed_vs_fp32: float | None = None
    speed_wall_s: float | None = None
    speed_output_tokens: int | None = None
    single_stream_tok_s: float | None = None
    kernels: dict = field(default_factory=dict)


def variant_engine_args(weight_dtype: str, quant_dtype: str = "float32") -> dict:
    """``LLM`` keyword arguments of a variant: its dtype and weight dtype."""
    dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(weight_dtype, quant_dtype)
    return {"dtype": dtype, "weight_dtype": weight_dtype}


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> tuple[float, float]:
    """``(agreement_positions, prompts_identical)`` of ``tokens`` against ``reference`` (one token list per
    prompt, the same prompts in the same order; formulas in :data:`FORMULAS`)."""
    if len(reference) != len(tokens):
        raise ValueError(f"agreement needs one output per reference prompt ({len(tokens)} != {len(reference)})")
    matched = total = 0
    for ref, got in zip(reference, tokens):
        total += len(ref)
        prefix = 0
        for a, b in zip(ref, got):
            if a != b:
                break
            prefix += 1
        matched += prefix
    identical = sum(ref == got for ref, got in zip(reference, tokens))
    return (matched / total if total else 1.0), identical / len(reference)


def text_windows(token_ids: list[int], window_tokens: int, max_windows: int = 0) -> list[list[int]]:
    """Non-overlapping windows of ``window_tokens`` tokens from the start (the tail shorter than a window is
    dropped); the first ``max_windows`` (0 = all)."""
    n = len(token_ids) // window_tokens
    if max_windows:
        n = min(n, max_windows)
    return [token_ids[i * window_tokens : (i + 1) * window_tokens] for i in range(n)]


def speed_prompts(text: str, tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` short prompts: the first ``prompt_tokens`` tokens of every 9th non-empty line of ``text``
    (cycled when the text has fewer lines)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    picked = [lines[(9 * k) % len(lines)] for k in range(n)]
    return [tokenizer(ln, add_special_tokens=False)["input_ids"][:prompt_tokens] for ln in picked]


def perplexity(llm, windows: list[list[int]]) -> tuple[float, int]:
    """``(perplexity, predicted tokens)`` of the windows, each one prompt (see :data:`FORMULAS`)."""
    from engines.core.sampling_params import SamplingParams

    outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    nll, n = 0.0, 0
    for o in outs:
        lps = [lp for lp in (o.prompt_logprobs or []) if lp is not None]
        if len(lps) != len(o.prompt_token_ids) - 1:
            raise RuntimeError(f"request {o.request_id}: {len(lps)} prompt logprobs for "
                               f"{len(o.prompt_token_ids)} prompt tokens")
        nll -= sum(lp.logprob for lp in lps)
        n += len(lps)
    return math.exp(nll / n), n


def timed_generate(llm, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    """``(wall seconds, output tokens)`` of one ``generate`` of ``prompts`` x ``tokens`` (greedy, ignore_eos),
    timed after one untimed run of the same call (the engine is built without prefix caching, so the timed
    run recomputes its prompts)."""
    from engines.core.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, sp)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    return wall, sum(len(o.token_ids) for o in outs)


def machine() -> dict:
    """The CPU and torch this ran on: model name, ISA flags, torch's kernel level, threads, versions."""
    import torch

    from engines.real.cpu_features import cpu_flags, cpu_name

    return {"cpu": cpu_name(), "isa": list(cpu_flags()), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "platform": platform.platform()}


def kernels_of(model) -> dict:
    """What the model's layers ran: attention, dense GEMM backend, the linear layers' class."""
    layer = model.layers[0]["gate_up"]
    return {"attention": model.attention.name, "linear_backend": model.linear_backend,
            "linear_layer": type(layer).__name__}


def measure_variant(settings: QualitySettings, weight_dtype: str, tokenizer, reference: list[list[int]] | None,
                    windows: list[list[int]], fast_prompts: list[list[int]], echo=None) -> tuple[VariantResult, list]:
    """One variant's measurements; returns ``(result, its greedy tokens per prompt)``. ``reference``: fp32's
    tokens (None: this is fp32, its own reference). ``perplexity_delta_pct`` and ``speed_vs_fp32`` are filled
    in by :func:`run_quality`."""
    import gc

    from engines.core.sampling_params import SamplingParams
    from engines.llm import LLM

    args = variant_engine_args(weight_dtype, settings.quant_dtype)
    llm = LLM(settings.model, kv_cache_tokens=settings.kv_cache_tokens, enable_prefix_caching=False, **args)
    try:
        model = llm.engine.executor.model
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(settings.num_prompts)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=settings.max_new_tokens, temperature=0), chat=True)
        tokens = [o.token_ids for o in outs]
        agree, identical = agreement(reference if reference is not None else tokens, tokens)
        ppl, n_pred = perplexity(llm, windows)
        wall = out_tokens = single = None
        if fast_prompts:
            wall, out_tokens = timed_generate(llm, fast_prompts, settings.speed_tokens)
            w1, n1 = timed_generate(llm, fast_prompts[:1], settings.speed_tokens)
            single = n1 / w1
        res = VariantResult(weight_dtype, args["dtype"], agree, identical, sum(map(len, tokens)), ppl, 0.0, n_pred,
                            model.weight_bytes(), out_tokens / wall if wall else None, None, wall, out_tokens,
                            single, kernels_of(model))
        if echo:
            echo(f"{weight_dtype}: agreement {agree:.3f}, perplexity {ppl:.3f}, "
                 + (f"{res.output_tok_s:.1f} tok/s" if res.output_tok_s else "no speed run"))
        return res, tokens
    finally:
        del llm
        gc.collect()


def run_quality(settings: QualitySettings, echo=None) -> dict:
    """Measure every variant (fp32 first, as the reference); returns the JSON-ready report:
    ``{"formulas", "settings", "machine", "text", "results": [VariantResult as dict]}``."""
    from transformers import AutoTokenizer

    from engines.real.model_store import resolve_model

    model_dir = resolve_model(settings.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text_path = Path(settings.text)
    text = text_path.read_text(encoding="utf-8")
    windows = text_windows(tokenizer(text, add_special_tokens=False)["input_ids"], settings.window_tokens,
                           settings.max_windows)
    if not windows:
        raise ValueError(f"--text {text_path}: shorter than one window of {settings.window_tokens} tokens")
    fast = speed_prompts(text, tokenizer, settings.speed_prompts, settings.speed_prompt_tokens)
    order = ["fp32"] + [w for w in settings.weight_dtypes if w != "fp32"]
    results, reference = {}, None
    for wd in order:
        res, tokens = measure_variant(settings, wd, tokenizer, reference, windows, fast, echo)
        if wd == "fp32":
            reference = tokens
        results[wd] = res
    base = results["fp32"]
    for res in results.values():
        res.perplexity_delta_pct = 100.0 * (res.perplexity / base.perplexity - 1.0)
        if res.output_tok_s and base.output_tok_s:
            res.speed_vs_fp32 = res.output_tok_s / base.output_tok_s
    reported = [asdict(results[w]) for w in order if w in settings.weight_dtypes]
    return {"formulas": FORMULAS, "settings": asdict(settings) | {"weight_dtypes": list(settings.weight_dtypes)},
            "machine": machine(),
            "text": {"path": str(text_path), "bytes": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                     "windows": len(windows)},
            "results": reported}


def format_table(report: dict) -> str:
    """The results as a Markdown table (the columns of ``reports/quantization.md``)."""
    head = ("| weight_dtype | dtype | agreement (positions) | prompts identical | perplexity | ppl vs fp32 | "
            "weight MiB | output tok/s | vs fp32 | 1-stream tok/s |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in report["results"]:
        tok_s = f"{r['output_tok_s']:.1f}" if r["output_tok_s"] else "-"
        vs = f"{r['speed_vs_fp32']:.2f}x" if r["speed_vs_fp32"] else "-"
        one = f"{r['single_stream_tok_s']:.1f}" if r["single_stream_tok_s"] else "-"
        lines.append(f"| {r['weight_dtype']} | {r['dtype']} | {r['agreement_positions']:.3f} | "
                     f"{r['prompts_identical']:.3f} | {r['perplexity']:.3f} | {r['perplexity_delta_pct']:+.2f}% | "
                     f"{r['weight_bytes'] / 2**20:.1f} | {tok_s} | {vs} | {one} |")
    return "\n".join(lines)
