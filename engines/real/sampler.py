"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators."""

from __future__ import annotations

import torch

from engines.core.sampling_params import SamplingParams


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
        """Pick a token for each row.

        Args:
            logits: ``[N, vocab]`` float32 (any device).
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

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        x = logits / p.temperature
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
        if not bool(torch.isfinite(probs).all()):  # a temperature so small that logits / T overflowed: the limit
            return int(logits.argmax())
        return int(torch.multinomial(probs, 1, generator=gen).item())
