"""Beam search over paged sequences, with transformers' selection and stopping rules (no torch).

A beam-search request (``SamplingParams.beam_width`` = W > 1) runs its prompt like any other request.
From its first sampling step on, its *beams* are internal sequences (``Request`` objects ``<id>#b<k>``
whose ``parent_id`` is the request) that the paged scheduler runs like any request; they share KV
blocks by ref count:

- for every beam that reaches its end in a step, the executor returns its 2W most likely next tokens and
  their log-probabilities (``StepResult.beam_candidates``) instead of a sampled token;
- once every live beam of the request has its candidates (normally all in the same step),
  :meth:`BeamGroup.select` ranks all candidates by cumulative log-probability and keeps the top 2W
  (transformers' ``_get_top_k_continuations``). Those of the first W that end the sequence (EOS, or
  ``max_tokens`` reached) are scored ``sum logprob / (generated tokens ** length_penalty)`` (the length
  counts every generated token, EOS included) and offered to the W best finished hypotheses
  (``_update_finished_beams``); the best W that do not end become the next beams
  (``_get_running_beams_for_next_iteration``);
- a beam with several surviving continuations forks: the extra ones are new sequences that share its
  blocks (``PagedKVCacheManager.fork``); the partly filled last block is copied when one of them writes
  into it (copy-on-write in ``allocate_slots``). A beam with no surviving continuation is freed (its
  blocks' ref counts drop). The request itself holds no blocks once its beams exist;
- the search ends by transformers' ``early_stopping`` rule (``_check_early_stop_heuristic`` and
  ``_beam_search_has_unfinished_sequences``): with ``False`` (default) when W hypotheses have finished
  and the best running beam, scored at its current length, cannot beat the worst of them; with ``True``
  as soon as W hypotheses have finished; with ``"never"`` as with False but the running beam is scored at
  ``max_tokens`` when ``length_penalty`` > 0; and always when no continuation is left (``max_tokens``).
  The request then finishes with ``beam_hypotheses`` (best first) and its best hypothesis as output.

Source: transformers 5, ``generation/utils.py`` (``GenerationMixin._beam_search`` and the helpers named
above). Scores are rounded to float32 after each addition and division, as transformers' float32
tensors are, so equal log-probabilities give equal rankings. Ties between equal scores are broken by
beam rank, then by the candidate's rank within its beam (``torch.topk`` leaves the order of exact ties
unspecified).

Beams join ``running`` when forked, like parallel-sampling children; admission reserves ``beam_width``
sequences under ``max_num_seqs`` for a beam-search request (``PagedScheduler.num_seqs``). A beam that
got its candidates but is preempted before its siblings get theirs drops them and computes its last
token again before the selection can run; after a recompute preemption it comes back sharing the full
blocks a live sibling holds with the same tokens (``shared_prefix``), so its group needs no more blocks
than before. When every running request is a beam holding its candidates while the siblings it waits for
cannot get blocks, ``PagedScheduler`` lets the oldest such search go on and preempts the other searches'
beams (``_unblock_beams``), so the search never stalls.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from engines.core.request import Request, RequestStatus

CANDIDATES_PER_BEAM = 2  # transformers keeps max(2, 1 + number of EOS tokens) x num_beams candidates; 1 EOS here


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (a float32 tensor op on float32 inputs rounds the same way)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def num_candidates(beam_width: int) -> int:
    """Candidates kept per step (and asked of the executor per beam): 2 x ``beam_width``."""
    return CANDIDATES_PER_BEAM * beam_width


def synthetic_candidates(k: int, token_id: int = 0) -> list[tuple[int, float]]:
    """Placeholder candidates for executors without a model (the simulator): ``k`` pairs
    ``(token_id, -(j + 1))``, j = 0..k-1. Every beam then proposes the same log-probabilities, so the
    best beam keeps forking and the worst ones die, and no candidate is EOS (unless ``token_id`` is)."""
    return [(token_id, -float(j + 1)) for j in range(k)]


@dataclass
class Hypothesis:
    """A finished beam.

    Attributes:
        token_ids: generated tokens (EOS included when it ended on EOS).
        cumulative_logprob: sum of the tokens' log-probabilities (natural log).
        score: ``cumulative_logprob / len(token_ids) ** length_penalty`` (float32).
        finish_reason: ``stop`` (EOS) or ``length`` (``max_tokens``).
    """

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str


def group_id(req: Request) -> str:
    """The id of the request a sequence belongs to (its beam group's key): its parent's, or its own."""
    return req.parent_id or req.request_id


@dataclass
class BeamGroup:
    """The beam-search state of one request.

    Attributes:
        request: the beam-search request (its prompt's sequence; it holds no blocks once beams exist).
        beams: live beams, best first.
        scores: beam id -> cumulative log-probability (float32).
        pending: beam id -> its candidates ``[(token id, log p)]`` of this step, most likely first.
        hypotheses: finished hypotheses, best first (at most ``beam_width``).
        num_generated: tokens generated by the live beams so far.
    """

    request: Request
    beams: list[Request]
    scores: dict[str, float]
    pending: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    hypotheses: list[Hypothesis] = field(default_factory=list)
    num_generated: int = 0
    next_index: int = 1

    @property
    def ready(self) -> bool:
        """Every live beam has its candidates for this step."""
        return all(b.request_id in self.pending for b in self.beams)

    def select(self) -> tuple[list[tuple[Request, int, float]], bool]:
        """One beam-search step over the pending candidates (clears them).

        Returns:
            ``(continuations, done)``: the next beams as ``(parent beam, token id, cumulative log p)``, best
            first (at most ``beam_width``), and whether the search is over (then continuations are ignored).
        """
        sp = self.request.sampling_params
        width, lp_exp = sp.beam_width, sp.length_penalty
        cands = []
        for bi, beam in enumerate(self.beams):
            base = self.scores[beam.request_id]
            for rank, (tok, lp) in enumerate(self.pending[beam.request_id]):
                cands.append((f32(base + lp), bi, rank, tok))
        self.pending.clear()
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[: num_candidates(width)]
        new_len = self.num_generated + 1
        eos = frozenset() if sp.ignore_eos else self.request.eos_token_ids
        running: list[tuple[Request, int, float]] = []
        new_hyps: list[Hypothesis] = []
        full = len(self.hypotheses) >= width
        for i, (score, bi, _, tok) in enumerate(cands):
            beam = self.beams[bi]
            if not (tok in eos or new_len >= sp.max_tokens):
                if len(running) < width:
                    running.append((beam, tok, score))
                continue
            # only the first beam_width candidates may become hypotheses; none once full with early_stopping=True
            if i >= width or (sp.early_stopping is True and full):
                continue
            reason = "stop" if tok in eos else "length"
            new_hyps.append(Hypothesis([*beam.output_token_ids, tok], score, f32(score / f32(new_len ** lp_exp)), reason))
        if new_hyps:
            merged = sorted([*self.hypotheses, *new_hyps], key=lambda h: -h.score)  # stable: older first on ties
            self.hypotheses = merged[:width]
        self.num_generated = new_len
        return running, not running or self._stop(running[0][2])

    def _stop(self, best_running: float) -> bool:
        """transformers' stopping rule once some beam may still continue (see the module docstring)."""
        sp = self.request.sampling_params
        if len(self.hypotheses) < sp.beam_width:
            return False
        if sp.early_stopping is True:
            return True
        length = sp.max_tokens if sp.early_stopping == "never" and sp.length_penalty > 0 else self.num_generated
        best_possible = f32(best_running / f32(length ** sp.length_penalty))
        return not best_possible > min(h.score for h in self.hypotheses)


class BeamSearch:
    """The paged scheduler's beam-search groups, one per beam-search request that has sampled.

    The scheduler calls :meth:`validate` on admission, :meth:`update` after each step,
    :meth:`on_preempt` when it preempts a sequence and :meth:`on_finish` when a request ends.
    """

    def __init__(self) -> None:
        self.groups: dict[str, BeamGroup] = {}

    @staticmethod
    def validate(request: Request, kv) -> str | None:
        """One-line reason to reject a beam-search request whose W beams could never fit the pool together
        (the prompt's blocks plus, per beam, a copied partial block and its output blocks), or None."""
        sp = request.sampling_params
        if not sp.use_beam_search:
            return None
        bs = kv.block_size
        need = -(-request.num_prompt_tokens // bs) + sp.beam_width * (-(-sp.max_tokens // bs) + 1)
        if need > kv.num_blocks:
            return (f"request {request.request_id}: beam search with beam_width {sp.beam_width} may need {need} KV "
                    f"blocks, more than the pool's {kv.num_blocks}")
        return None

    def update(self, sched, output, result) -> list[Request]:
        """Collect the step's beam candidates; run the selection of every group whose beams all have theirs;
        fork, extend and free beams accordingly. Puts each advanced request's newest best token in
        ``result.sampled`` (so the engine times its tokens). Returns the requests whose search ended."""
        touched: list[BeamGroup] = []
        for seq in output.seqs:
            cands = result.beam_candidates.get(seq.request_id) if seq.sample else None
            req = sched.requests.get(seq.request_id)
            if cands is None or req is None or req.is_finished:
                continue
            group = self.groups.get(group_id(req))
            if group is None:  # the request's prompt has just been computed: it is the only beam
                group = self.groups[req.request_id] = BeamGroup(req, [req], {req.request_id: 0.0})
            if req not in group.beams:
                continue
            group.pending[req.request_id] = cands
            if group not in touched:
                touched.append(group)
        finished = []
        for group in touched:
            if not group.ready:
                continue
            conts, done = group.select()
            root = group.request
            if done:
                result.sampled[root.request_id] = group.hypotheses[0].token_ids[-1]
                finished.append(self._finish(sched, group))
            else:
                result.sampled[root.request_id] = conts[0][1]
                self._advance(sched, group, conts)
        return finished

    def _advance(self, sched, group: BeamGroup, conts: list[tuple[Request, int, float]]) -> None:
        root = group.request
        plan, used = [], set()
        for parent, tok, score in conts:  # a beam continues in place with its best continuation
            in_place = parent is not root and parent.request_id not in used
            used.add(parent.request_id)
            plan.append((parent, tok, score, in_place))
        new_beams = []
        for parent, tok, score, in_place in plan:  # fork before any beam appends its token
            new_beams.append((parent if in_place else self._fork(sched, group, parent), tok, score))
        for beam in group.beams:
            if beam is root:
                sched.running.remove(root)
                sched.kv.free(root)  # its blocks live on in the beams (ref counts)
            elif beam.request_id not in used:
                sched.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)
        group.beams, group.scores = [], {}
        for beam, tok, score in new_beams:
            beam.append_output(tok)
            group.beams.append(beam)
            group.scores[beam.request_id] = score

    @staticmethod
    def _fork(sched, group: BeamGroup, parent: Request) -> Request:
        root = group.request
        cid = f"{root.request_id}#b{group.next_index}"
        child = Request(cid, root.prompt_token_ids, root.sampling_params, arrival_time=root.arrival_time,
                        prompt=root.prompt, eos_token_id=root.eos_token_id,
                        output_token_ids=list(parent.output_token_ids), parent_id=root.request_id,
                        seq_index=group.next_index, forked=True, cache_salt=root.cache_salt)
        group.next_index += 1
        child.first_scheduled_time = root.first_scheduled_time
        child.num_computed_tokens = parent.num_computed_tokens
        sched.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        sched.add_fork(child)
        sched.running.append(child)
        return child

    def _finish(self, sched, group: BeamGroup) -> Request:
        root = group.request
        del self.groups[root.request_id]
        for beam in group.beams:
            if beam is not root:  # (the request itself is still a beam when its first step ends the search)
                sched.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)
        best = group.hypotheses[0]
        root.beam_hypotheses = list(group.hypotheses)
        root.output_token_ids = list(best.token_ids)
        root._all = [*root.prompt_token_ids, *best.token_ids]
        root.cumulative_logprob = best.cumulative_logprob
        if best.finish_reason == "stop":
            sched.finish_request(root.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=best.token_ids[-1])
        else:
            sched.finish_request(root.request_id, RequestStatus.FINISHED_LENGTH)
        return root

    def on_preempt(self, req: Request) -> None:
        """A beam waiting for its siblings' candidates is preempted: drop its candidates and make it compute
        its last token again (a swapped beam resumes with one token to compute)."""
        group = self.groups.get(group_id(req))
        if group is not None and group.pending.pop(req.request_id, None) is not None:
            req.num_computed_tokens -= 1

    def shared_prefix(self, req: Request, kv) -> tuple[list[int], int]:
        """For a beam coming back from a recompute preemption: the blocks of its longest run of leading full
        blocks whose tokens a live sibling beam holds and has computed, as ``(block ids, tokens)`` to pass to
        ``allocate_slots`` like a prefix-cache hit (``([], 0)`` when none, or when the request asks for
        prompt log-probabilities, which need every prompt position computed).

        Without it a re-admitted beam would recompute its whole sequence into blocks of its own, and its
        group, which fitted the pool only because forks share their prompt's blocks, could then need more
        blocks than the pool has while a sibling holds its candidates and waits: the search would stall.
        At most ``num_tokens_total - 1`` tokens are shared, so the last token is computed (its candidates
        are needed), as with a prefix-cache hit.
        """
        group = self.groups.get(req.parent_id) if req.parent_id is not None else None
        if group is None or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        bs, toks = kv.block_size, req.all_token_ids
        best: list[int] = []
        for sib in group.beams:
            table = kv.block_tables.get(sib.request_id) if sib is not req else None
            if not table:
                continue
            # a sibling's blocks before its last one are full and computed, or written in this step's forward
            # pass (K/V of every row are written before any row's attention reads them, as a prefix-cache hit
            # on a block allocated this step is); its last one only once computed
            limit = min((len(toks) - 1) // bs, max(sib.num_computed_tokens // bs, len(table) - 1))
            stoks, k = sib.all_token_ids, 0
            while k < limit and toks[k * bs : (k + 1) * bs] == stoks[k * bs : (k + 1) * bs]:
                k += 1
            if k > len(best):
                best = table[:k]
        return best, len(best) * bs

    def awaits_siblings(self, req: Request) -> bool:
        """Whether ``req`` is a beam holding its candidates for this step until its siblings have theirs."""
        group = self.groups.get(group_id(req))
        return group is not None and req.request_id in group.pending

    def on_finish(self, sched, request_id: str) -> None:
        """A beam-search request ends from outside (abort): free its beams."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for beam in group.beams:
            if beam is not group.request:
                sched.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)
