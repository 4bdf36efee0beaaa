"""Model executor: turns a ``SchedulerOutput`` into tensors, runs the model, samples.

One step is one flattened batch of mixed prefill and decode tokens: decode tokens first (one per
sequence, batched paged attention; static padding rows among them, over the scratch block), then prefill
chunks (one variable-length attention call over all of them). New K/V are written into their slots
(``slot_mapping``) before attention reads the blocks. Logits are computed only for the last token of
sequences that sample in this step.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from engines.core.beam_search import num_candidates
from engines.core.scheduler import ScheduledSeq, SchedulerOutput, StepResult
from engines.core.static_scheduler import PAD_BLOCK
from engines.real.allocator import keep_freed_memory
from engines.real.kv_cache import KVCache, SwapSpace
from engines.real.model import AttentionMetadata, LlamaModel
from engines.real.sampler import Sampler, process_logits, token_logprobs


class ModelExecutor:
    """Runs real forward passes.

    Args:
        model: the loaded model; the KV cache and every step's tensors go to its ``device``.
        num_blocks, block_size: KV pool geometry (must match the scheduler's KV manager).
        seed: seed of the shared sampling generator.
        step_delay_s: test-only knob: extra seconds of busy work added to every step.
        num_cpu_blocks: the CPU swap pool (0: none).
        draft_layers: speculative decoding with ``layers:N``: N, the target layers its draft runs (0: no draft
            model; the n-gram proposer needs none). Raises ValueError when N exceeds the model's layers.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0, step_delay_s: float = 0.0,
                 num_cpu_blocks: int = 0, draft_layers: int = 0):
        if draft_layers > model.cfg.num_hidden_layers:
            raise ValueError(f"speculative_model layers:{draft_layers}: the model has only "
                             f"{model.cfg.num_hidden_layers} layers")
        keep_freed_memory()
        self.draft_layers = draft_layers
        self.model = model
        self.device = model.device
        self.kv = KVCache(model.cfg, num_blocks, block_size, model.dtype, self.device)
        self.sampler = Sampler(seed)
        self.step_delay_s = step_delay_s
        self.swap = SwapSpace(self.kv, num_cpu_blocks) if num_cpu_blocks else None
        self.block_bytes = self.kv.block_bytes

    @classmethod
    def from_dir(cls, model_dir: str | Path, num_blocks: int, block_size: int, dtype=torch.float32, seed: int = 0):
        return cls(LlamaModel.from_dir(model_dir, dtype), num_blocks, block_size, seed)

    def release(self, request_id: str) -> None:
        """Forget per-request state (sampling generator) of a finished request."""
        self.sampler.release(request_id)

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step; returns sampled tokens of the sequences with ``sample`` and the duration (s)."""
        t0 = time.perf_counter()
        swap_time = self._copy_blocks(out)
        if out.is_empty:
            return StepResult({}, time.perf_counter() - t0, swap_time)
        seqs = sorted(out.seqs, key=lambda s: not s.is_decode)  # decode rows first
        if any(s.drafts_pending for s in seqs):
            self._fill_drafts([s for s in seqs if s.drafts_pending])
        input_ids, positions, meta, last_idx = self._prepare(seqs)
        hidden = self.model.forward(input_ids, positions, meta, self.kv.layers)
        spec_seqs = [s for s in seqs if s.num_spec and s.sample]
        spec_accepted = self._verify(spec_seqs, hidden, last_idx) if spec_seqs else {}
        sampled_spec = {rid: tok for rid, (_, tok) in spec_accepted.items()}
        sample_seqs = [s for s in seqs if s.sample and not s.is_padding and not s.num_spec]
        sampled, logprobs, beam_cands, tok_lps = {}, {}, {}, {}
        if sample_seqs:
            # a row that forks parallel-sampling children is sampled once per child too (same logits)
            rows, ids, params, reqs = [], [], [], []
            for s in sample_seqs:
                rows.append(last_idx[s.request_id])
                ids.append(s.request_id)
                params.append(s.sampling_params)
                reqs.append(s.request)
                for cid, cp in zip(s.fork_ids, s.fork_params):
                    rows.append(last_idx[s.request_id])
                    ids.append(cid)
                    params.append(cp)
                    reqs.append(s.request)  # a child's history at its first token is the parent's prompt
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            beam = [i for i, p in enumerate(params) if p.use_beam_search]  # beam rows give candidates
            if beam:
                width = max(params[i].beam_width for i in beam)
                beam_cands = {ids[i]: c for i, c in zip(beam, beam_candidates(logits[beam], width))}
                keep = [i for i in range(len(ids)) if not params[i].use_beam_search]
                logits, ids, params = logits[keep], [ids[i] for i in keep], [params[i] for i in keep]
                reqs = [reqs[i] for i in keep]
            toks = self.sampler.sample(process_logits(logits, params, reqs), ids, params) if ids else []
            sampled = dict(zip(ids, toks))
            # best_of ranks every sequence of the prompt (its children too) by cumulative log-probability
            ranks_all = any((s.sampling_params.best_of or 0) > s.sampling_params.n for s in sample_seqs)
            want = list(range(len(ids))) if ranks_all else [i for i, p in enumerate(params) if p.needs_logprobs]
            if want:
                lps = token_logprobs(logits[want], [toks[i] for i in want],
                                     [params[i].logprobs or 0 for i in want])
                logprobs = {ids[i]: lp.logprob for i, lp in zip(want, lps)}
                tok_lps = {ids[i]: lp for i, lp in zip(want, lps) if params[i].logprobs is not None}
        prompt_lps = self._prompt_logprobs(seqs, hidden, last_idx)
        if self.step_delay_s:
            _busy_wait(self.step_delay_s)
        if self.device.type == "cuda":  # a step that samples nothing has not waited for the GPU yet
            torch.cuda.synchronize(self.device)
        sampled.update(sampled_spec)
        return StepResult(sampled, time.perf_counter() - t0, swap_time, logprobs=logprobs, beam_candidates=beam_cands,
                          token_logprobs=tok_lps, prompt_logprobs=prompt_lps,
                          spec_accepted={rid: acc for rid, (acc, _) in spec_accepted.items()})

    def _verify(self, seqs: list[ScheduledSeq], hidden: torch.Tensor, last_idx: dict[str, int]
                ) -> dict[str, tuple[list[int], int]]:
        """Speculative rows: the target's logits at each row's last token and drafts, then
        ``Sampler.verify``. Returns ``{request id: (drafts kept, next token)}``."""
        rows = [r for s in seqs for r in range(last_idx[s.request_id] - s.num_spec, last_idx[s.request_id] + 1)]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        out, at = {}, 0
        for s in seqs:
            n = s.num_spec + 1
            out[s.request_id] = self.sampler.verify(logits[at:at + n], s.spec_token_ids, s.request_id,
                                                    s.sampling_params)
            at += n
        return out

    def _fill_drafts(self, seqs: list[ScheduledSeq]) -> None:
        """The draft model of ``speculative_model: layers:N``: the target's first N layers, its final norm and
        LM head, run greedily one position at a time over the target's own KV cache of those layers (the
        committed context's K/V there are exactly what the draft computes). Draft ``j`` of a row is written
        into its scheduled slot ``start_pos + j``; the verify pass rewrites those slots in every layer.
        Fills each row's draft positions of ``token_ids`` in place."""
        layers = self.kv.layers[: self.draft_layers]
        for j in range(max(s.num_spec for s in seqs)):
            rows = [s for s in seqs if s.num_spec > j]
            steps = [ScheduledSeq(s.request_id, [s.token_ids[j]], s.start_pos + j, s.block_table, True,
                                  s.sampling_params) for s in rows]
            ids, pos, meta, last = self._prepare(steps)
            hidden = self.model.forward(ids, pos, meta, layers)
            toks = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for s, tok in zip(rows, toks):
                s.token_ids[j + 1] = int(tok)
        for s in seqs:
            s.drafts_pending = False

    LOGITS_CHUNK = 512  # prompt positions whose logits are computed at once ([chunk, vocab] float32)

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], hidden: torch.Tensor, last_idx: dict[str, int]) -> dict:
        """``{request id: {position: TokenLogprob}}`` for the prefill chunks of requests that ask for prompt
        log-probabilities: the logits at position ``q`` score the prompt's token ``q + 1``."""
        out: dict[str, dict] = {}
        for s in seqs:
            p, req = s.sampling_params, s.request
            if p.prompt_logprobs is None or req is None or s.is_decode:
                continue
            first_row = last_idx[s.request_id] - s.num_tokens + 1  # the chunk's rows in ``hidden`` are contiguous
            end = min(s.start_pos + s.num_tokens, req.num_prompt_tokens - 1)  # positions with a next prompt token
            got: dict = {}
            for lo in range(s.start_pos, end, self.LOGITS_CHUNK):
                hi = min(lo + self.LOGITS_CHUNK, end)
                logits = self.model.compute_logits(hidden[first_row + lo - s.start_pos : first_row + hi - s.start_pos])
                targets = req.prompt_token_ids[lo + 1 : hi + 1]
                for q, lp in zip(range(lo, hi), token_logprobs(logits, targets, [p.prompt_logprobs] * (hi - lo))):
                    got[q + 1] = lp
            if got:
                out[s.request_id] = got
        return out

    def _copy_blocks(self, out: SchedulerOutput) -> float:
        """Run the step's swap-outs, swap-ins and block copies (in that order); returns the seconds the
        swaps took."""
        swap_time = 0.0
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            t = time.perf_counter()
            self.swap.swap_out(self.kv, out.blocks_to_swap_out)
            self.swap.swap_in(self.kv, out.blocks_to_swap_in)
            swap_time = time.perf_counter() - t
        self.kv.copy_blocks(out.blocks_to_copy)
        return swap_time

    def _prepare(self, seqs: list[ScheduledSeq]):
        bs = self.kv.block_size
        ids, pos, slots = [], [], []
        last_idx: dict[str, int] = {}
        dec_tables, dec_lens = [], []
        pre_tables, pre_lens, pre_starts = [], [], []
        for s in seqs:
            table = self._block_table(s)
            ids.extend(s.token_ids)
            p = range(s.start_pos, s.start_pos + s.num_tokens)
            pos.extend(p)
            slots.extend(table[i // bs] * bs + i % bs for i in p)
            last_idx[s.request_id] = len(ids) - 1
            if s.is_decode:
                if pre_tables:
                    raise ValueError("a step's decode rows must come before its prefill chunks")
                dec_tables.append(table)
                dec_lens.append(s.context_len)
            else:
                pre_tables.append(table[: -(-s.context_len // bs)])
                pre_lens.append(s.num_tokens)
                pre_starts.append(s.start_pos)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots))
        if pre_tables:  # prefill chunks follow the decode rows: one varlen attention call covers them all
            width = max(len(t) for t in pre_tables)
            meta.num_prefills = len(pre_tables)
            meta.prefill_query_start = self._tensor([0] + list(itertools.accumulate(pre_lens)))
            meta.prefill_start_pos = self._tensor(pre_starts)
            meta.prefill_block_tables = self._tensor([t + [t[0]] * (width - len(t)) for t in pre_tables])
            meta.prefill_max_query_len = max(pre_lens)
        if dec_tables:
            width = max(-(-n // bs) for n in dec_lens)
            padded = [t[:width] + [t[0]] * (width - len(t[:width])) for t in dec_tables]
            meta.num_decode_tokens = len(dec_tables)
            meta.decode_block_tables = self._tensor(padded)
            meta.decode_context_lens = self._tensor(dec_lens)
        return self._tensor(ids), self._tensor(pos), meta, last_idx

    def _block_table(self, s: ScheduledSeq) -> list[int]:
        """The KV blocks ``s`` reads and writes: its block table, with every ``PAD_BLOCK`` of a padding row
        mapped to the scratch block (a padding row decodes at its batch's length over the scratch block
        only; what it writes there is never read by a live row)."""
        if not s.is_padding:
            return s.block_table
        return [self.kv.scratch_block if b == PAD_BLOCK else b for b in s.block_table]

    def _tensor(self, values: list) -> torch.Tensor:
        """int64 tensor on the model's device (built on the CPU, then copied: one copy per tensor)."""
        t = torch.tensor(values)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)


def beam_candidates(logits: torch.Tensor, beam_width: int) -> list[list[tuple[int, float]]]:
    """Each row's ``2 x beam_width`` most likely next tokens and their log-probabilities, as transformers'
    beam search takes them (``log_softmax`` of float32 logits, then ``topk``).

    Args:
        logits: ``[rows, vocab]``.
        beam_width: W (the largest of the batch's beam-search requests: a request with a smaller W gets extra
            candidates, which cannot reach its top 2W and so change nothing).
    Returns:
        per row, ``[(token id, log p)]`` most likely first.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = torch.topk(logp, k=min(num_candidates(beam_width), logp.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
