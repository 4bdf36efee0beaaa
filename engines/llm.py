"""The offline API in vLLM's shape: ``LLM(model).generate(prompts, SamplingParams(...))``.

``LLM`` builds its engine through ``engines.factory.build_engine`` (the same factory the workbench and
the server use), then runs a whole batch of prompts through ``LLMEngine.step`` until every one is done.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from engines.core.llm_engine import RequestOutput
from engines.core.request import Request
from engines.core.sampling_params import SamplingParams
from engines.factory import EngineConfig, build_engine


class LLM:
    """Offline batch generation in vLLM's shape: ``LLM(model).generate(prompts, SamplingParams(...))``.

    Args:
        model: a known model name (``smollm2-135m``, pulled on first use) or a local Llama-family folder.
        engine: ``paged`` (continuous batching over a paged KV cache) or ``static`` (baseline).
        **knobs: the real engine's ``engines.factory.EngineConfig`` fields:

            dtype: ``float32`` (default), ``bfloat16`` or ``auto`` (bfloat16 where the CPU has it natively).
            weight_dtype: the linear weights: None (default: the dense weights of ``dtype``), ``fp32`` /
                ``bf16`` (dense; must agree with ``dtype``), ``int8`` or ``int4`` (weight-only quantized,
                round-to-nearest, ``engines.real.quant``).
            block_size: tokens per KV block.
            kv_cache_tokens / kv_cache_bytes: KV pool size (default 65,536 tokens).
            max_num_seqs, max_num_batched_tokens: paged step limits.
            max_model_len: longest prompt + output (default: the model's max_position_embeddings).
            max_batch_size, reservation: static baseline knobs.
            completion: static only: when a request's answer is returned: ``batch_end`` (default: when the
                last member of its batch finishes, as a static-batching server answers) or ``own_end``
                (its own last token).
            seed: seed of the shared sampling generator.
            step_delay_s: test-only: busy-wait added to every step.
            attention_backend: attention kernels: ``auto`` (Triton on CUDA; on CPU the compiled kernel when
                float32), ``torch`` (reference), ``cpp`` (CPU), ``triton`` (interpreter on CPU).
            linear_backend: dense GEMM kernel: ``auto`` (oneDNN with reordered weights on CPU), ``onednn``
                or ``torch`` (``F.linear``).
            device: ``auto`` (default: CUDA when torch sees a GPU, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
            enable_prefix_caching: automatic prefix caching (paged; default on).
            enable_chunked_prefill: split prompts across steps (paged; default on).
            long_prefill_token_threshold: most prompt tokens of one request per step (0 = no cap).
            preemption_mode: ``recompute`` (default) or ``swap``.
            swap_space_bytes: CPU swap pool in bytes (swap preemption; default 0 = none, so swap falls
                back to recompute).
            tp: tensor parallelism (default 1): the model split over ``tp`` processes on this machine, this
                one being rank 0 (``engines.real.tensor_parallel``); at most the model's KV heads. Call
                :meth:`close` (or drop the ``LLM``) to stop the workers.

    Raises:
        ModelNotFoundError: ``model`` is neither a known name nor a folder.
        ValueError: a bad knob (unknown engine, dtype, reservation policy, completion or device; ``cuda``
            without a GPU; ``completion`` for an engine other than static; a simulator-only knob).
        TypeError: a keyword that is no ``EngineConfig`` field.
    """

    def __init__(self, model: str | Path = "smollm2-135m", engine: str = "paged", **knobs):
        from engines.real.model_store import resolve_model

        if engine not in ("paged", "static"):
            raise ValueError(f"engine must be 'paged' or 'static', got {engine!r}")
        self.engine = build_engine(EngineConfig(kind=engine, model=model, **knobs))
        self.model_dir = resolve_model(model)  # the folder the factory loaded (pulled by then)
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.executor.model.cfg
        mc = self.model_config
        # every stop id of the model (config.json and generation_config.json), not only the first
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = mc.eos_token_ids or (() if eos is None else (eos,))
        self._ids = itertools.count()

    def close(self) -> None:
        """Release what the engine holds outside this process (tensor-parallel workers); idempotent. The
        ``LLM`` cannot generate afterwards when it had workers."""
        close = getattr(self.engine.executor, "close", None)
        if close is not None:
            close()

    @property
    def eos_token_id(self) -> int | None:
        """The model's first EOS id (generation stops on any of ``eos_token_ids``); setting it makes it
        the only one."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @eos_token_id.setter
    def eos_token_id(self, token_id: int | None) -> None:
        self.eos_token_ids = () if token_id is None else (token_id,)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Tokenize a prompt, through the model's chat template when ``chat``."""
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = False,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts as one batch to completion; outputs in prompt order.

        ``cache_salt`` (as in vLLM) is mixed into every prefix-cache block hash of these prompts, so they
        share cached blocks only with requests of the same salt (tenant isolation).

        Rejected requests (over ``max_model_len``, ``max_tokens < 1``...) come back with
        ``finish_reason == "rejected"`` and ``error`` set, while the rest complete. With ``n`` > 1
        (parallel sampling) a prompt's output carries its n sequences in ``outputs`` (the first of them
        is the output itself). With ``beam_width`` > 1 (beam search) the output is the best hypothesis and
        ``outputs`` the ``beam_width`` (or ``n``) best, best first.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        order, results, nums = [], {}, {}
        for prompt, sp in zip(prompts, plist):
            ids = list(prompt) if not isinstance(prompt, str) else self.encode(prompt, chat)
            rid = str(next(self._ids))
            order.append(rid)
            nums[rid] = sp.n
            req = Request(rid, ids, sp, arrival_time=self.engine.clock(),
                          prompt=prompt if isinstance(prompt, str) else None, eos_token_id=self.eos_token_ids,
                          cache_salt=cache_salt)
            rejected = self.engine.add_request(req)
            if rejected is not None:
                results[rid] = rejected
        groups: dict[str, list[RequestOutput]] = {}
        for o in self.engine.run_to_completion():
            if o.parent_id is not None:
                groups.setdefault(o.parent_id, []).append(o)
            else:
                results[o.request_id] = o
        return [_group(results[r], groups.get(r, []), nums[r]) for r in order]


def _group(first: RequestOutput, children: list[RequestOutput], n: int) -> RequestOutput:
    """The prompt's output with ``outputs`` = its n sequences (parallel sampling): all of them for
    ``n``, the n of highest cumulative log-probability for ``best_of``; in sequence-index order."""
    if not children:
        return first
    seqs = sorted([first, *children], key=lambda o: o.seq_index)
    if len(seqs) > n:
        best = sorted(seqs, key=lambda o: -o.cumulative_logprob)[:n]
        seqs = sorted(best, key=lambda o: o.seq_index)
    first.outputs = seqs
    return first
