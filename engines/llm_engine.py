"""The engine loop (schedule -> execute -> update) and the vLLM-shaped offline API ``LLM``.

An engine is a scheduler (paged or static policy) plus an executor (real model here; the simulator
swaps in a cost model). ``LLMEngine.step`` runs one iteration and records a ``StepRecord``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engines.config import CacheConfig, ModelConfig, SchedulerConfig
from engines.detokenizer import IncrementalDetokenizer
from engines.kv_cache_manager import ContiguousKVCacheManager, PagedKVCacheManager
from engines.request import Request, RequestStatus
from engines.sampling_params import SamplingParams
from engines.scheduler import PagedScheduler, Scheduler, SchedulerOutput
from engines.static_scheduler import StaticScheduler

DEFAULT_KV_CACHE_TOKENS = 65536


@dataclass
class RequestOutput:
    """A finished (or rejected) request, as ``LLM.generate`` returns it.

    ``finish_reason`` is ``stop`` (EOS or a stop string), ``length`` (max_tokens), ``abort`` or
    ``rejected`` (then ``error`` says why).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    # issue 5: parallel sampling: the sequence's parent request (None for a prompt's first sequence), its
    # index among the prompt's sequences, its cumulative log-probability (best_of), and, on the output
    # LLM.generate returns, the prompt's n best sequences (index order; [] when n = 1)
    parent_id: str | None = None
    seq_index: int = 0
    cumulative_logprob: float = 0.0
    outputs: list["RequestOutput"] = field(default_factory=list)
    # issue 5: beam search: the hypothesis' length-penalised score (None without beam search); a beam-search
    # request's output is its best hypothesis and ``outputs`` its beam_width (or n) best, best first
    beam_score: float | None = None
    # when the engine returned the answer (s, engine clock), where that can be later than its last token: a
    # static batch member's batch end under completion batch_end (then equal to finished_time); None: the
    # answer came with its last token
    completion_time: float | None = None


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.REJECTED: "rejected",
    RequestStatus.FAILED: "failed",
}


@dataclass
class StepRecord:
    """Accounting of one engine step (times in seconds on the engine's clock, sizes in token slots)."""

    step: int
    start: float
    duration: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_padding_seqs: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_total_slots: int
    kv_allocated: int
    kv_token_states: int
    kv_reserved: int
    kv_internal_frag: int
    kv_external_frag: int
    # issue 5: prefix cache lookups of the requests admitted in this step (tokens), preemptions by swap
    # (the rest of num_preemptions are by recompute), swap traffic, KV memory saved by block sharing
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions_swap: int = 0
    num_swapped: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    swap_bytes: int = 0
    swap_time: float = 0.0
    kv_shared_saved: int = 0


class LLMEngine:
    """Drives a scheduler and an executor.

    Args:
        scheduler: paged or static policy.
        executor: has ``execute(SchedulerOutput) -> StepResult`` and ``release(request_id)``.
        tokenizer: for stop strings and output text (None: no text).
        clock: seconds; wall clock by default.
    """

    def __init__(self, scheduler: Scheduler, executor, tokenizer=None, clock: Callable[[], float] = time.perf_counter):
        self.scheduler, self.executor, self.tokenizer, self.clock = scheduler, executor, tokenizer, clock
        self.steps: list[StepRecord] = []
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._texts: dict[str, str] = {}
        self._last_swap_time = 0.0

    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue a request; returns its output at once if it is rejected."""
        if not self.scheduler.add_request(request):
            request.finished_time = self.clock()
            return self._output(request)
        if self.tokenizer is not None and request.sampling_params.stop:
            self._detok[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.sampling_params.stop
            )
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        return self._finish(req) if req else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        start = self.clock()
        result = self.executor.execute(out)
        now = self.clock()
        self._last_swap_time = result.swap_time
        self._record(out, start, now - start)
        for seq in out.seqs:
            if seq.is_padding:
                continue
            req = self.scheduler.requests.get(seq.request_id)
            if req is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = start
        finished = self.scheduler.update(out, result)
        just_finished = {r.request_id: r for r in finished}
        for rid in result.sampled:
            req = self.scheduler.requests.get(rid) or just_finished.get(rid)
            if req is None:
                continue
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            det = self._detok.get(rid)
            if det is None and req.parent_id is not None and req.sampling_params.stop and self.tokenizer is not None:
                det = self._detok[rid] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                                req.sampling_params.stop)  # a forked child
            if det is None or req.status == RequestStatus.FINISHED_STOPPED:
                continue
            _, stop = det.step(req.output_token_ids[-1])
            if stop is None:
                continue
            if req.is_finished:  # the last allowed token completed a stop string
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            else:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
                finished.append(req)
        return self._complete(finished)

    def _complete(self, finished: list[Request]) -> list[RequestOutput]:
        """Outputs of the requests answered in this step, given those that finished in it. A static
        scheduler with completion ``batch_end`` holds each member until its batch ends
        (``StaticScheduler.completed``); those outputs carry ``completion_time`` = ``finished_time``."""
        sched = self.scheduler
        if not isinstance(sched, StaticScheduler):
            return [self._finish(r) for r in finished]
        if not sched.completes_at_batch_end:
            return [self._finish(r) for r in sched.completed(finished)]
        end = self.clock()  # one completion time for the whole batch
        outs = [self._finish(r, end) for r in sched.completed(finished)]
        for o in outs:
            o.completion_time = end
        return outs

    def _finish(self, req: Request, at: float | None = None) -> RequestOutput:
        """End ``req``'s bookkeeping and build its output; ``finished_time`` = ``at`` (s, engine clock), else now."""
        req.finished_time = self.clock() if at is None else at
        self.executor.release(req.request_id)
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        det = self._detok.pop(req.request_id, None)
        if det is not None and req.status == RequestStatus.FINISHED_STOPPED and isinstance(req.stop_reason, str):
            text = det.text
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        else:
            text = ""
        out = RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=text,
            finish_reason=_FINISH_REASON.get(req.status, req.status.value),
            error=req.reject_reason,
            num_preemptions=req.num_preemptions,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            token_times=req.token_times,
            parent_id=req.parent_id,
            seq_index=req.seq_index,
            cumulative_logprob=req.cumulative_logprob,
        )
        if req.beam_hypotheses:
            self._beam_outputs(req, out)
        return out

    def _beam_outputs(self, req: Request, out: RequestOutput) -> None:
        """Fill a finished beam-search request's ``outputs``: its ``beam_width`` best hypotheses (the ``n``
        best when ``n`` > 1), best first; the first is ``out`` itself."""
        import dataclasses

        sp = req.sampling_params
        hyps = req.beam_hypotheses[: sp.n if sp.n > 1 else sp.beam_width]
        out.beam_score = hyps[0].score
        out.outputs = [out]
        for i, h in enumerate(hyps[1:], 1):
            text = self.tokenizer.decode(h.token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
            out.outputs.append(dataclasses.replace(
                out, token_ids=list(h.token_ids), text=text, finish_reason=h.finish_reason, seq_index=i,
                cumulative_logprob=h.cumulative_logprob, beam_score=h.score, outputs=[]))

    def _record(self, out, start: float, duration: float) -> None:
        kv = out.kv_stats
        seqs = out.seqs
        self.steps.append(
            StepRecord(
                step=len(self.steps),
                start=start,
                duration=duration,
                num_seqs=len(seqs),
                num_prefill_tokens=sum(s.num_tokens for s in seqs if not s.is_padding and not s.is_decode),
                num_decode_tokens=sum(1 for s in seqs if s.is_decode and not s.is_padding),  # live rows
                num_padding_seqs=sum(1 for s in seqs if s.is_padding),
                num_running=out.num_running,
                num_waiting=out.num_waiting,
                num_preemptions=len(out.preempted_ids),
                kv_total_slots=kv.total_slots,
                kv_allocated=kv.allocated,
                kv_token_states=kv.token_states,
                kv_reserved=kv.reserved,
                kv_internal_frag=kv.internal_frag,
                kv_external_frag=kv.external_frag,
                **self._memory_fields(out),
            )
        )

    def _memory_fields(self, out: SchedulerOutput) -> dict:
        """Issue-5 step fields: prefix-cache lookups, swap preemptions and traffic, KV saved by sharing."""
        block_bytes = getattr(self.executor, "block_bytes", 0)
        n_out, n_in = len(out.blocks_to_swap_out), len(out.blocks_to_swap_in)
        kv = getattr(self.scheduler, "kv", None)
        return dict(
            prefix_cache_queries=out.prefix_cache_queries,
            prefix_cache_hits=out.prefix_cache_hits,
            num_preemptions_swap=out.num_preempted_swap,
            num_swapped=out.num_swapped,
            swap_out_blocks=n_out,
            swap_in_blocks=n_in,
            swap_bytes=(n_out + n_in) * block_bytes,
            swap_time=self._last_swap_time,
            kv_shared_saved=kv_shared_saved(kv, self.scheduler.running) if isinstance(kv, PagedKVCacheManager) else 0,
        )

    def run_to_completion(self) -> list[RequestOutput]:
        """Step until no request is left; returns outputs in finishing order."""
        done = []
        while self.has_unfinished():
            done.extend(self.step())
        return done


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


def kv_shared_saved(kv: PagedKVCacheManager, requests) -> int:
    """KV slots saved by block sharing now: sum over held blocks of (ref count - 1) x block_size, i.e. the
    slots the same requests would need without prefix-cache or parallel-sampling sharing."""
    if not kv.pool.num_shared_blocks:
        return 0
    seen: set[int] = set()
    saved = 0
    for r in requests:
        for b in kv.block_tables.get(r.request_id, ()):
            if b not in seen:
                seen.add(b)
                saved += kv.pool.blocks[b].ref_cnt - 1
    return saved * kv.block_size


def build_scheduler(kind: str, sched_cfg: SchedulerConfig, num_blocks: int, block_size: int,
                    num_cpu_blocks: int = 0) -> Scheduler:
    """The policy for ``kind``: ``paged`` or ``static``. ``num_cpu_blocks``: the paged policy's CPU swap
    pool (swap preemption); prefix caching follows ``sched_cfg.enable_prefix_caching``.

    Raises:
        ValueError: unknown kind, or a bad knob.
    """
    if kind == "paged":
        kv = PagedKVCacheManager(num_blocks, block_size, enable_caching=sched_cfg.enable_prefix_caching,
                                 num_cpu_blocks=num_cpu_blocks)
        return PagedScheduler(sched_cfg, kv)
    if kind == "static":
        return StaticScheduler(sched_cfg, ContiguousKVCacheManager(num_blocks, block_size))
    raise ValueError(f"engine must be 'paged' or 'static', got {kind!r}")


class LLM:
    """Offline batch generation in vLLM's shape: ``LLM(model).generate(prompts, SamplingParams(...))``.

    Args:
        model: a known model name (``smollm2-135m``, pulled on first use) or a local Llama-family folder.
        engine: ``paged`` (continuous batching over a paged KV cache) or ``static`` (baseline).
        dtype: ``float32`` (default) or ``bfloat16``.
        block_size: tokens per KV block.
        kv_cache_tokens / kv_cache_bytes: KV pool size (default 65,536 tokens).
        max_num_seqs, max_num_batched_tokens: paged step limits.
        max_model_len: longest prompt + output (default: the model's max_position_embeddings).
        max_batch_size, reservation: static baseline knobs.
        completion: static only: when a request's answer is returned: ``batch_end`` (default: when the
            last member of its batch finishes, as a static-batching server answers) or ``own_end`` (its
            own last token).
        seed: seed of the shared sampling generator.
        step_delay_s: test-only: busy-wait added to every step.
        attention_backend: attention kernels: ``auto`` (Triton on CUDA; on CPU the compiled kernel when
            float32), ``torch`` (reference), ``cpp`` (CPU), ``triton`` (interpreter on CPU).
        device: ``auto`` (default: CUDA when torch sees a GPU, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        enable_prefix_caching: automatic prefix caching (paged; default on).
        enable_chunked_prefill: split prompts across steps (paged; default on).
        long_prefill_token_threshold: most prompt tokens of one request per step (0 = no cap).
        preemption_mode: ``recompute`` (default) or ``swap``.
        swap_space_bytes: CPU swap pool in bytes (swap preemption; default 0 = none, so swap falls back
            to recompute).

    Raises:
        ModelNotFoundError: ``model`` is neither a known name nor a folder.
        ValueError: a bad knob (unknown engine, dtype, reservation policy, completion or device; ``cuda``
            without a GPU; ``completion`` for an engine other than static).
    """

    def __init__(
        self,
        model: str | Path = "smollm2-135m",
        engine: str = "paged",
        dtype: str = "float32",
        block_size: int = 16,
        kv_cache_tokens: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        max_batch_size: int = 64,
        reservation: str = "max",
        seed: int = 0,
        step_delay_s: float = 0.0,
        attention_backend: str = "auto",
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        preemption_mode: str = "recompute",
        swap_space_bytes: int = 0,
        device: str = "auto",
        completion: str | None = None,
    ):
        import torch
        from transformers import AutoTokenizer

        from engines.model import LlamaModel, resolve_device
        from engines.model_runner import ModelExecutor
        from engines.model_store import resolve_model

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if dtype not in dtypes:
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        if reservation not in ("max", "pow2", "oracle"):
            raise ValueError(f"reservation must be max, pow2 or oracle, got {reservation!r}")
        if completion is not None and engine != "static":
            raise ValueError(f"completion is only for the static engine (engine is {engine!r})")
        resolve_device(device)  # a bad device fails before the weights load
        self.model_dir = resolve_model(model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        mc = self.model_config
        sched_cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len or mc.max_position_embeddings,
            max_batch_size=max_batch_size,
            reservation=reservation,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            preemption_mode=preemption_mode,
            completion=completion or "batch_end",
        )
        bad = sched_cfg.validate()
        if bad:
            raise ValueError(bad)
        cache = CacheConfig(block_size, kv_cache_tokens, kv_cache_bytes, swap_space_bytes=swap_space_bytes)
        elt = torch.tensor([], dtype=dtypes[dtype]).element_size()
        num_blocks = cache.num_blocks(mc.kv_bytes_per_token(elt), DEFAULT_KV_CACHE_TOKENS)
        num_cpu_blocks = cache.num_cpu_blocks(mc.kv_bytes_per_token(elt)) if engine == "paged" else 0
        model_obj = LlamaModel.from_dir(self.model_dir, dtypes[dtype], attention_backend, device)
        executor = ModelExecutor(model_obj, num_blocks, block_size, seed=seed, step_delay_s=step_delay_s,
                                 num_cpu_blocks=num_cpu_blocks)
        self.engine = LLMEngine(build_scheduler(engine, sched_cfg, num_blocks, block_size, num_cpu_blocks),
                                executor, self.tokenizer)
        self.eos_token_id = mc.eos_token_ids[0] if mc.eos_token_ids else self.tokenizer.eos_token_id
        self._ids = itertools.count()

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
    ) -> list[RequestOutput]:
        """Run all prompts as one batch to completion; outputs in prompt order.

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
                          prompt=prompt if isinstance(prompt, str) else None, eos_token_id=self.eos_token_id)
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
