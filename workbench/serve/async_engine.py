"""One engine loop in a background thread, fed by asyncio handlers (continuous batching across clients).

The engine (``engines.LLMEngine``) is synchronous PyTorch, so it runs in its own thread. Handlers hand
requests to it through a thread-safe command queue (``add`` / ``abort``) and receive each request's
tokens on an ``asyncio.Queue`` that the engine thread feeds with ``loop.call_soon_threadsafe`` (one
call per step for all requests). Requests that arrive while others run join the running batch at the
next step. When nothing is queued or running, the thread blocks on an event (no spinning).

Every request ends with exactly one item whose ``finish_reason`` is set: ``stop``, ``length``,
``abort``, ``rejected`` (with ``error``) or ``error`` (the engine raised: a failed step ends every
request in flight, a failed ``add_request`` ends that request; the loop keeps serving).

The running/waiting gauges are set whenever those numbers change: when requests are submitted, when
the loop hands them to the scheduler or aborts them, right after the scheduler admits requests (before
the step's forward pass, which can take long) and after every step. They are read from the queues'
lengths, so they never go negative.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass

from engines.core.detokenizer import IncrementalDetokenizer
from engines.core.llm_engine import output_text_ids
from engines.core.logprobs import TokenLogprob
from engines.core.request import Request, RequestStatus

log = logging.getLogger("workbench.serve")


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already (the server answers 503)."""


@dataclass
class TokenDelta:
    """What one request produced since the last item: normally one token and the text it completes.

    ``text`` may be empty while bytes of a character or a possible stop string are held back; the last
    item carries ``finish_reason`` (and whatever text was held back).
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0  # the stream's position in its group (the choice index)
    logprob: TokenLogprob | None = None  # the token's log-probabilities (SamplingParams.logprobs)


@dataclass(eq=False)
class PromptRequest:
    """The sequences of one prompt of one API call (its ``n`` choices), counted as one request.

    ``vllm:request_success_total`` counts these: one per prompt when its last choice ends, under
    :meth:`finish_reason`.
    """

    num_left: int
    reasons: list[str]

    def finish_reason(self) -> str | None:
        """``abort`` if any choice was aborted, else ``error`` if any failed, else ``length`` if any hit
        max_tokens, else ``stop``; None when the engine rejected it (never admitted, not counted)."""
        for reason in ("abort", "error", "failed", "rejected", "length"):
            if reason in self.reasons:
                return {"failed": "error", "rejected": None}.get(reason, reason)
        return "stop"


@dataclass(eq=False)
class RequestStream:
    """A submitted request; its ``TokenDelta`` items (``index`` = ``self.index``) go to ``queue``."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0
    detok: IncrementalDetokenizer | None = None
    num_sent: int = 0
    done: bool = False
    prompt_request: PromptRequest | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(eq=False)
class RequestGroup:
    """Requests submitted together (a prompt list, or ``n`` choices) sharing one queue.

    ``async for delta in group`` yields every stream's items, interleaved as produced, until each
    stream has ended; ``delta.index`` tells them apart.
    """

    streams: list[RequestStream]
    queue: asyncio.Queue

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        left = len(self.streams)
        while left:
            item: TokenDelta = await self.queue.get()
            if item.finish_reason is not None:
                left -= 1
            yield item

    def unfinished(self) -> list[RequestStream]:
        """Streams whose last item has not been produced yet (abort these when the client leaves)."""
        return [s for s in self.streams if not s.done]


class AsyncEngine:
    """Runs ``engine.step()`` in a daemon thread while requests are queued or running.

    Args:
        engine: an ``LLMEngine`` (with a tokenizer: output text is detokenized incrementally here).
        max_waiting: most requests queued but not yet running; ``submit`` raises ``QueueFullError``
            beyond it (None = no limit).
        metrics: a ``ServerMetrics`` to keep up to date (optional).

    While the loop runs, ``engine.on_schedule`` sets the gauges right after each admission decision
    (cleared by :meth:`shutdown`).
    """

    # the engine's per-step records (``engine.steps``, ~2 KB each) are kept for inspection only: a server
    # runs for days, so past this many the oldest half is dropped (match records by ``StepRecord.step``)
    MAX_STEP_RECORDS = 2048

    def __init__(self, engine, max_waiting: int | None = 1024, metrics=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._cmds: collections.deque = collections.deque()  # append/popleft are thread-safe
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet handed to the scheduler
        self._num_waiting = 0  # the scheduler's waiting queue after the last step
        self._streams: dict[str, RequestStream] = {}
        self._stop = False
        self._gauge_lock = threading.Lock()  # compute-and-set of the gauges, from either thread
        self._thread = threading.Thread(target=self._run, name="workbench-engine", daemon=True)

    # -- handler side (event loop thread) --------------------------------------------------------
    def start(self) -> None:
        if self.metrics is not None:
            self.engine.on_schedule = lambda out: self._publish_gauges(out.kv_stats)
        self._thread.start()
        self._publish_gauges()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step (unfinished requests are left as they are)."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.on_schedule = None

    @property
    def num_waiting(self) -> int:
        """Requests queued but not running (submitted ones included)."""
        with self._lock:
            return self._num_waiting + self._pending

    def submit(self, requests: list[Request], choices_per_prompt: int = 1) -> RequestGroup:
        """Queue requests (all or none); call from the event loop that will read the streams.

        ``choices_per_prompt`` (the API's ``n``): consecutive runs of that many requests are one prompt's
        choices, counted as one request in ``vllm:request_success_total``.

        Raises:
            QueueFullError: admitting them would put more than ``max_waiting`` requests in the queue.
            RuntimeError: the engine loop has stopped.
        """
        if self._stop or not self._thread.is_alive():
            raise RuntimeError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.max_waiting is not None and self._num_waiting + self._pending + len(requests) > self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
            self._pending += len(requests)
        queue: asyncio.Queue = asyncio.Queue()
        streams = [RequestStream(r, loop, queue, i) for i, r in enumerate(requests)]
        k = max(1, choices_per_prompt)
        for start in range(0, len(streams), k):
            unit = PromptRequest(len(streams[start:start + k]), [])
            for s in streams[start:start + k]:
                s.prompt_request = unit
        for s in streams:
            self._cmds.append(("add", s))
        self._publish_gauges()
        self._wake.set()
        return RequestGroup(streams, queue)

    def abort(self, request_id: str) -> None:
        """Ask the loop to abort a request (frees its KV blocks); a no-op if it has ended."""
        self._cmds.append(("abort", request_id))
        self._wake.set()

    # -- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            try:
                self._iteration()
            except Exception as e:  # keep serving; every request in flight ends with an error
                log.exception("engine loop failed")
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")

    def _iteration(self) -> None:
        self._wake.clear()
        self._drain()
        if not self.engine.has_unfinished():
            self._update_metrics()
            self._wake.wait()
            return
        finished = self.engine.step()
        if len(self.engine.steps) > self.MAX_STEP_RECORDS:  # keep the recent half
            del self.engine.steps[: self.MAX_STEP_RECORDS // 2]
        out = self._emit({o.request_id: o for o in finished})
        self._update_metrics()  # before delivery: a client that saw its last token sees the gauges after it
        self._deliver(out)

    def _drain(self) -> None:
        out: list[tuple[RequestStream, TokenDelta]] = []
        while self._cmds:
            kind, arg = self._cmds.popleft()
            if kind == "add":
                self._add(arg, out)
            else:
                stream = self._streams.pop(arg, None)
                if stream is not None:
                    self.engine.abort(arg)
                    out.append((stream, self._final(stream, "abort")))
        with self._lock:
            self._num_waiting = len(self.engine.scheduler.waiting)
        self._publish_gauges()
        self._deliver(out)

    def _add(self, stream: RequestStream, out: list) -> None:
        req = stream.request
        with self._lock:
            self._pending -= 1
        try:
            rejected = self.engine.add_request(req)
        except Exception as e:  # e.g. a request id already in flight: this request fails, the loop goes on
            log.exception("engine refused request %s", req.request_id)
            out.append((stream, self._final(stream, "error", f"the engine refused the request: "
                                                             f"{type(e).__name__}: {e}")))
            return
        if rejected is not None:
            out.append((stream, self._final(stream, "rejected", rejected.error)))
            return
        stream.detok = IncrementalDetokenizer.for_request(self.tokenizer, req)
        self._streams[req.request_id] = stream

    def _emit(self, finished: dict) -> list:
        """Every request's new tokens (one item per token), ending the finished ones; returns the items."""
        out: list[tuple[RequestStream, TokenDelta]] = []
        m = self.metrics
        for rid, stream in list(self._streams.items()):
            req = stream.request
            new = req.output_token_ids[stream.num_sent:]
            o = finished.get(rid)
            # a last token that stopped the request (EOS, stop_token_ids) is sent but adds no text
            n_text = len(output_text_ids(req)) if o is not None else len(req.output_token_ids)
            for tok in new:
                k = stream.num_sent
                text = stream.detok.step(tok)[0] if k < n_text else ""
                if m is not None:
                    if k == 0:
                        m.prompt_tokens.inc(req.num_prompt_tokens)
                        m.ttft.observe(req.token_times[0] - req.arrival_time)
                    elif k < len(req.token_times):
                        m.itl.observe(req.token_times[k] - req.token_times[k - 1])
                    m.generation_tokens.inc()
                stream.num_sent += 1
                out.append((stream, TokenDelta([tok], text, logprob=_at(req.output_logprobs, k))))
            if o is not None:
                del self._streams[rid]
                tail = stream.detok.flush()
                if o.text.startswith(stream.detok.text):  # bytes of an unfinished character at the very end
                    tail += o.text[len(stream.detok.text):]
                if out and out[-1][0] is stream:
                    last = out[-1][1]
                    last.text += tail
                    last.finish_reason = o.finish_reason
                else:
                    out.append((stream, TokenDelta([], tail, o.finish_reason)))
                if m is not None:
                    end = req.token_times[-1] if req.token_times else req.finished_time
                    m.e2e.observe(end - req.arrival_time)
                self._ended(stream, o.finish_reason)
        return out

    def _final(self, stream: RequestStream, reason: str, error: str | None = None) -> TokenDelta:
        """The last item of a stream that ends without a token (abort, rejection, failure)."""
        self._ended(stream, reason)
        return TokenDelta([], "", reason, error)

    def _ended(self, stream: RequestStream, reason: str) -> None:
        """Mark the stream done; count its prompt's request when this was the prompt's last choice."""
        stream.done = True
        unit = stream.prompt_request
        if unit is None:
            return
        unit.num_left -= 1
        unit.reasons.append(reason)
        if unit.num_left == 0 and self.metrics is not None and unit.finish_reason() is not None:
            self.metrics.request_finished(unit.finish_reason())

    def _fail_all(self, reason: str) -> None:
        out = []
        for rid, stream in list(self._streams.items()):
            req = self.engine.scheduler.finish_request(rid, RequestStatus.FAILED)
            if req is not None:
                req.reject_reason = reason
                self.engine._finish(req)
            out.append((stream, self._final(stream, "error", reason)))
        self._streams.clear()
        self._deliver(out)

    def _update_metrics(self) -> None:
        """After a step (or when idle): the gauges, and the growth of the engine's counters."""
        sched = self.engine.scheduler
        with self._lock:
            self._num_waiting = len(sched.waiting)
        if self.metrics is not None:
            self._publish_gauges(sched.kv_stats())
            self.metrics.update_counters(self.engine)

    def _publish_gauges(self, kv_stats=None) -> None:
        """Set the running/waiting gauges (and KV usage, given the scheduler's ``KVStats``) from the queues.

        Waiting counts requests submitted but not yet handed to the scheduler, the scheduler's waiting
        queue (preempted requests included, as vLLM) and swapped-out requests. Either thread may call
        this; the lock makes compute-and-set atomic, so the last call's figures are the ones shown.
        """
        if self.metrics is None:
            return
        sched = self.engine.scheduler
        with self._gauge_lock:
            with self._lock:
                pending = self._pending
            waiting = pending + len(sched.waiting) + len(getattr(sched, "swapped", ()))
            self.metrics.set_gauges(len(sched.running), waiting,
                                    None if kv_stats is None else kv_stats.usage_frac)

    @staticmethod
    def _deliver(items: list[tuple[RequestStream, TokenDelta]]) -> None:
        """Hand items to their event loops: one ``call_soon_threadsafe`` per loop per step."""
        by_loop: dict = {}
        for stream, delta in items:
            delta.index = stream.index
            by_loop.setdefault(stream.loop, []).append((stream.queue, delta))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop has closed (server shutting down)
                pass


def _at(items: list, i: int):
    return items[i] if i < len(items) else None


def _put_all(batch) -> None:
    for queue, delta in batch:
        queue.put_nowait(delta)
