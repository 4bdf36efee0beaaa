"""``workbench generate``: completions for a batch of prompts with the offline API (``engines.LLM``)."""

from __future__ import annotations

import json
import sys

from workbench.commands import check_real_engine, set_torch_threads
from workbench.errors import UsageError, usage_errors


def main(prompts: list[str], model: str = "smollm2-135m", chat: bool = False, engine: str = "paged",
         max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
         seed: int | None = None, stop: list[str] = (), ignore_eos: bool = False, dtype: str = "float32",
         kv_cache_tokens: int | None = None, max_model_len: int | None = None, device: str = "auto",
         as_json: bool = False, beam_width: int = 1, length_penalty: float = 1.0,
         weight_dtype: str | None = None, speculative_model: str | None = None,
         num_speculative_tokens: int | None = None, tp: int = 1) -> int:
    """Generate completions for all prompts as one batch and print them (``as_json``:
    ``{"outputs": [{"prompt", "token_ids", "text", "finish_reason", ...}]}``). ``weight_dtype`` None: the
    dense weights of ``dtype``, else ``fp32``/``bf16``/``int8``/``int4``. ``speculative_model`` (``ngram`` or
    ``layers:N``) with ``num_speculative_tokens`` k: speculative decoding (paged engine). ``tp`` > 1: the model
    split over that many processes (``engines.real.tensor_parallel``).

    Returns 1 when a request was rejected, else 0.

    Raises:
        UsageError: a bad option, model, device or sampling parameter.
    """
    from engines.core.sampling_params import SamplingParams
    from engines.llm import LLM

    set_torch_threads()
    check_real_engine(engine)
    with usage_errors(ValueError):
        llm = LLM(model, engine=engine, dtype=dtype, kv_cache_tokens=kv_cache_tokens, max_model_len=max_model_len,
                  seed=seed or 0, device=device, weight_dtype=weight_dtype, **spec_knobs(speculative_model,
                                                                                       num_speculative_tokens),
                  tp=tp)
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        stop=list(stop), ignore_eos=ignore_eos, beam_width=beam_width, length_penalty=length_penalty)
    bad = sp.validate()
    if bad:
        raise UsageError(bad)
    outs = llm.generate(list(prompts), sp, chat=chat)
    if as_json:
        payload = [{"prompt": o.prompt, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                    **({"error": o.error} if o.error else {}),
                    **({"beams": [{"token_ids": b.token_ids, "text": b.text, "score": b.beam_score,
                                   "finish_reason": b.finish_reason} for b in o.outputs]} if beam_width > 1 else {})}
                   for o in outs]
        print(json.dumps({"outputs": payload}, ensure_ascii=False))
    else:
        for o in outs:
            if o.error:
                print(f"[rejected] {o.error}", file=sys.stderr)
            elif beam_width > 1:
                for b in o.outputs:
                    print(f"[{b.beam_score:.4f}] {b.text}")
            else:
                print(o.text)
    return 1 if any(o.error for o in outs) else 0


def spec_knobs(speculative_model: str | None, num_speculative_tokens: int | None) -> dict:
    """The ``LLM`` knobs of ``--speculative-model`` / ``--num-speculative-tokens`` (empty when neither is given;
    the factory refuses one without the other)."""
    knobs = {"speculative_model": speculative_model, "num_speculative_tokens": num_speculative_tokens}
    return {k: v for k, v in knobs.items() if v is not None}
