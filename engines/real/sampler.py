"""Token sampling: logits processors (logit bias, ``min_tokens``, penalties), greedy, temperature, min-p,
top-k, top-p, with per-request seeded generators; and the log-probabilities returned with outputs."""

from __future__ import annotations

import torch

from engines.core.logprobs import TokenLogprob
from engines.core.request import Request
from engines.core.sampling_params import SamplingParams


def process_logits(logits: torch.Tensor, params: list[SamplingParams], requests: list[Request | None]) -> torch.Tensor:
    """Apply each row's logits processors; rows without any are returned unchanged (no copy when none has).

    In this order, as ``SamplingParams`` documents: ``logit_bias`` added; EOS and ``stop_token_ids`` set to
    -inf while the request has fewer than ``min_tokens`` outputs; repetition penalty over prompt and output
    tokens (positive logits divided by it, negative ones multiplied); frequency penalty x each token's count
    in the output and presence penalty x (count > 0) subtracted (vLLM's ``apply_penalties``).

    Args:
        logits: ``[N, vocab]`` raw logits (float32).
        params, requests: one per row; a row's request gives its tokens so far (None: no history).
    Returns:
        ``[N, vocab]`` float32.
    """
    todo = [i for i, p in enumerate(params) if p.processes_logits]
    if not todo:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    for i in todo:
        p, req, row = params[i], requests[i], out[i]
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long, device=row.device)
            vals = torch.tensor([v for t, v in p.logit_bias.items() if 0 <= t < vocab], dtype=row.dtype,
                                device=row.device)
            row.index_add_(0, ids, vals)
        n_out = req.num_output_tokens if req is not None else 0
        if p.min_tokens and n_out < p.min_tokens:
            stops = set(p.stop_token_ids) | (set(req.eos_token_ids) if req is not None and not p.ignore_eos else set())
            stops = [t for t in stops if 0 <= t < vocab]
            if stops:
                row[torch.tensor(stops, device=row.device)] = float("-inf")
        if req is None:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and n_out:
            outs = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(outs, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens`` under ``logits`` (float32 log-softmax), with ranks and top lists.

    Args:
        logits: ``[N, vocab]`` raw logits.
        tokens: N token ids (the sampled ones, or the prompt's next tokens).
        num_top: per row, how many of the most likely tokens to list (0: none).
    Returns:
        N ``TokenLogprob``.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(tokens, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, idx[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(dim=-1) + 1
    k = max(num_top, default=0)
    top_v, top_i = (torch.topk(logp, k, dim=-1) if k else (None, None))
    chosen, ranks = chosen.tolist(), ranks.tolist()
    top_v = top_v.tolist() if k else None
    top_i = top_i.tolist() if k else None
    out = []
    for r, tok in enumerate(tokens):
        top = list(zip(top_i[r][: num_top[r]], top_v[r][: num_top[r]])) if k and num_top[r] else []
        out.append(TokenLogprob(int(tok), float(chosen[r]), int(ranks[r]), top))
    return out


class Sampler:
    """Samples one token per row of logits.

    Each request with a ``seed`` gets its own ``torch.Generator`` (kept until ``release``), so its
    samples do not depend on what else is in the batch; requests without a seed share one generator
    seeded by ``seed`` (the engine's).
    """

    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(seed)
        self._gens: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._gens.pop(request_id, None)

    def _gen(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        g = self._gens.get(request_id)
        if g is None:
            g = self._gens[request_id] = torch.Generator().manual_seed(params.seed)
        return g

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """Pick a token for each row (greedy rows: argmax).

        Args:
            logits: ``[N, vocab]`` float32 (any device), already through :func:`process_logits`.
            request_ids, params: one per row.
        Returns:
            N token ids.
        """
        out = logits.argmax(dim=-1).tolist()
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            if not p.greedy:
                # on the CPU whatever the logits' device: the generators are CPU generators, so a seeded
                # request samples the same tokens on any device
                out[i] = self._sample_row(logits[i].cpu(), p, self._gen(rid, p))
        return out

    def verify(self, logits: torch.Tensor, drafts: list[int], request_id: str, params: SamplingParams
               ) -> tuple[list[int], int]:
        """Speculative decoding's acceptance of one request's drafts (``engines.core.spec_decode``).

        Greedy: the longest prefix of ``drafts`` equal to the argmax at each position, then the argmax at
        the first mismatch (or after the last draft). Sampled: draft ``d`` at position ``i`` is kept with
        probability ``p_i(d)`` (the speculative-sampling rule ``min(1, p/q)`` with the proposers' point-mass
        ``q``); at the first rejection the token is drawn from ``p_i`` with ``d`` removed and renormalised
        (``max(0, p - q)``); all kept: the bonus token is drawn from ``p_k``. ``p_i`` is the distribution
        :meth:`sample` draws from (temperature, min-p, top-k, top-p), drawn with the request's generator.

        Args:
            logits: ``[k + 1, vocab]`` float32: the target's logits at the request's last token and at each of
                its ``k`` drafts (row ``i`` predicts the token after draft ``i``; row 0 after the last token).
            drafts: the k draft token ids.
        Returns:
            (the drafts kept, the token that follows them).
        """
        k = len(drafts)
        if params.greedy:
            t = logits.argmax(dim=-1).tolist()
            a = 0
            while a < k and drafts[a] == t[a]:
                a += 1
            return list(drafts[:a]), int(t[a])
        gen = self._gen(request_id, params)
        rows = logits.cpu()
        for i, d in enumerate(drafts):
            probs = self._probs(rows[i], params)
            if probs is None:  # logits / T overflowed: the greedy limit
                tok = int(rows[i].argmax())
                if tok != d:
                    return list(drafts[:i]), tok
                continue
            if float(torch.rand((), generator=gen)) < float(probs[d]):
                continue
            residual = probs.clone()
            residual[d] = 0.0
            if float(residual.sum()) <= 0.0:  # p(d) = 1 up to rounding: d is the only token left
                continue
            return list(drafts[:i]), int(torch.multinomial(residual, 1, generator=gen).item())
        return list(drafts), self._sample_row(rows[k], params, gen)

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        probs = Sampler._probs(logits, p)
        if probs is None:  # a temperature so small that logits / T overflowed: the limit
            return int(logits.argmax())
        return int(torch.multinomial(probs, 1, generator=gen).item())

    @staticmethod
    def _probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
        """The distribution a non-greedy row is drawn from (``[vocab]``), or None when ``logits / temperature``
        overflowed."""
        x = logits / p.temperature
        if p.min_p > 0.0:  # tokens less likely than min_p x the most likely one (vLLM's min_p)
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k and p.top_k > 0 and p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, idx = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # drop tokens once the mass before them already reaches top_p (keep at least one)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            drop[0] = False
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
        probs = torch.softmax(x, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            return None
        return probs
