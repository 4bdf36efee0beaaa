"""Real-time replay of a trace on a cluster of real engines behind a router, in one process.

Each replica (an ``LLMEngine`` with a model executor) steps in its own Python thread; torch's kernels release
the GIL, so with one intra-op thread per replica (``torch.set_num_threads(1)`` for the run, restored after)
each replica gets about one core. A dispatcher (the calling thread) sends each request at its arrival time
(seconds on one shared relative clock, 0 when the replay starts, as ``workbench.replay.replay_realtime``) to
the replica ``router.choose(request, replicas)`` picks.

Consistency: each replica has a lock held for the whole of each of its steps; at an arrival the dispatcher
closes a gate (no replica starts a new step), takes every replica's lock (in index order) as the steps in
progress end, lets the router read them and adds the request, then opens the gate. The router therefore sees
each replica between steps, as the cluster simulator's router sees a busy replica at the end of its current
step, and ``add_request`` never races a step. The price: a request is added when the step in progress on
every replica has ended (at most one step late, counted in its TTFT since ``arrival_time`` stays the
trace's), and a replica whose step ended first waits for the others' meanwhile.

Every request ends finished, rejected or failed: a step that raises fails that replica's unfinished requests
with the error as reason, and the requests the router sends to it afterwards fail at once; the other replicas
go on. Requests a replica still holds at the end without being able to schedule them fail as stalled.
"""

from __future__ import annotations

import gc
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from engines.core.llm_engine import LLMEngine, RequestOutput
from engines.core.request import Request, RequestStatus
from engines.sim.cluster import ClusterRun
from workbench.replay import _fail_all, _RelativeClock

IDLE_WAIT_S = 0.05  # seconds an idle replica sleeps before looking again (a new request wakes it at once)
STALLED = "replica stalled: the request could never be scheduled"


@dataclass
class _Replica:
    """One replica's engine, its step lock and its worker's state."""

    index: int
    engine: LLMEngine
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)
    failed: str | None = None  # the reason, once a step raised


class _Gate:
    """Closed while the dispatcher routes a request: replicas start no step then (so the dispatcher, waiting
    for the steps in progress, is not overtaken by the next ones)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.closed = False

    def wait_open(self) -> None:
        with self.cond:
            while self.closed:
                self.cond.wait()

    @contextmanager
    def close(self):
        with self.cond:
            self.closed = True
        try:
            yield
        finally:
            with self.cond:
                self.closed = False
                self.cond.notify_all()


class _Outputs:
    """Outputs of every replica, appended under a lock (completion order)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[RequestOutput] = []

    def extend(self, outs: list[RequestOutput]) -> None:
        with self.lock:
            self.items.extend(outs)


def replay_cluster_realtime(replicas: list[LLMEngine], router, requests: list[Request],
                            max_concurrency: int | None = None, threads_per_replica: int = 1) -> ClusterRun:
    """Replay ``requests`` (``arrival_time`` in seconds from the start) on real ``replicas`` behind ``router``
    (``router.choose(request, replicas) -> index``, asked at each arrival when there are several replicas),
    each replica stepping in its own thread. Returns what ``engines.sim.cluster.simulate_cluster`` returns:
    every request's output (completion order) and the replica of each request.

    ``threads_per_replica``: torch intra-op threads during the replay (set process-wide and restored after).

    Raises:
        ValueError: no replicas, the same engine twice, ``max_concurrency`` set (closed-loop users are not
            supported on a real cluster) or ``threads_per_replica`` < 1.
        IndexError: the router returned no replica's index.
    """
    _check(replicas, max_concurrency, threads_per_replica)
    import torch

    reps = [_Replica(i, e) for i, e in enumerate(replicas)]
    run, outputs, done, gate = ClusterRun([], {}, list(replicas)), _Outputs(), threading.Event(), _Gate()
    before = torch.get_num_threads()
    torch.set_num_threads(threads_per_replica)
    gc.collect()
    gc.freeze()  # as replay_realtime: earlier heaps out of the collector's reach
    clock = _RelativeClock()  # time 0: after the collection, as the workers start
    for r in reps:
        r.engine.clock = clock
    workers = [threading.Thread(target=_worker, args=(r, outputs, done, gate, threads_per_replica),
                                name=f"replica-{r.index}", daemon=True) for r in reps]
    try:
        for w in workers:
            w.start()
        _dispatch(reps, router, sorted(requests, key=lambda q: q.arrival_time), run, outputs, clock, gate)
    finally:
        done.set()
        for r in reps:
            r.wake.set()
        for w in workers:
            w.join()
        gc.unfreeze()
        torch.set_num_threads(before)
    for r in reps:  # a replica left with requests it could never schedule: they fail, so counts add up
        if r.failed is None and r.engine.has_unfinished():
            outputs.extend(_fail_all(r.engine, STALLED))
    run.outputs = outputs.items
    return run


def _check(replicas: list[LLMEngine], max_concurrency: int | None, threads: int) -> None:
    if not replicas:
        raise ValueError("replay_cluster_realtime needs at least one replica")
    if len({id(r) for r in replicas}) != len(replicas):
        raise ValueError("replay_cluster_realtime: the same engine is listed twice; build one engine per replica")
    if max_concurrency is not None:
        raise ValueError("max_concurrency: closed-loop users are not supported on a real cluster; leave it unset")
    if threads < 1:
        raise ValueError(f"threads_per_replica must be >= 1, got {threads}")


def _dispatch(reps: list[_Replica], router, pending: list[Request], run: ClusterRun, outputs: _Outputs,
              clock: _RelativeClock, gate: _Gate) -> None:
    """Send each request, at its arrival time, to the replica the router picks."""
    engines = [r.engine for r in reps]
    for req in pending:
        time.sleep(max(0.0, req.arrival_time - clock()))
        with gate.close(), ExitStack() as stack:
            for r in reps:  # index order: no deadlock with a worker, which holds only its own lock
                stack.enter_context(r.lock)
            i = router.choose(req, engines) if len(reps) > 1 else 0
            if not 0 <= i < len(reps):
                raise IndexError(f"router {getattr(router, 'name', router)!r} chose replica {i} of {len(reps)}")
            run.replica_of[req.request_id] = i
            outputs.extend(_add(reps[i], req))
        reps[i].wake.set()


def _add(rep: _Replica, req: Request) -> list[RequestOutput]:
    """Add ``req`` to ``rep`` (its lock held); the outputs of a request that ended at once (rejected, or sent
    to a replica whose step failed)."""
    if rep.failed is not None:
        req.status, req.reject_reason = RequestStatus.FAILED, f"replica {rep.index} stopped after a failed step"
        req.finished_time = rep.engine.clock()
        return [rep.engine._output(req)]
    out = rep.engine.add_request(req)
    return [out] if out is not None else []


def _worker(rep: _Replica, outputs: _Outputs, done: threading.Event, gate: _Gate, threads: int) -> None:
    """Step ``rep`` while it has work; sleep when idle; return when the dispatcher is done and nothing is left."""
    import torch

    torch.set_num_threads(threads)  # this thread's intra-op pool, as the caller's
    while True:
        gate.wait_open()
        with rep.lock:
            busy = rep.failed is None and rep.engine.has_unfinished()
            if busy:
                outputs.extend(_step(rep))
                steps = rep.engine.steps
                busy = not steps or steps[-1].num_seqs > 0  # nothing could be scheduled: wait for an arrival
        if busy:
            continue
        if done.is_set():
            return
        rep.wake.wait(IDLE_WAIT_S)
        rep.wake.clear()


def _step(rep: _Replica) -> list[RequestOutput]:
    """One step of ``rep`` (its lock held); a step that raises fails the replica's unfinished requests."""
    try:
        return rep.engine.step()
    except Exception as e:  # keep every request accounted for
        rep.failed = f"engine step failed: {type(e).__name__}: {e}"
        return _fail_all(rep.engine, rep.failed)


def parallel_speedup(workers: int = 2, gemms: int = 40) -> float:
    """How many cores ``workers`` Python threads (one torch thread each) get now: the time of ``gemms``
    single-thread float32 GEMMs (512 x 576 x 1536, a SmolLM2 prefill's MLP shape) in one thread, times
    ``workers``, over the time of ``workers`` threads running ``gemms`` each at once. About ``workers`` when each
    replica of a real cluster has its own core; about 1 when other work leaves them one core between them.
    Takes about ``gemms`` x (1 + 1) x 20 ms on a 2-core AMD EPYC. torch's thread count is restored.

    Raises:
        ValueError: ``workers`` or ``gemms`` < 1.
    """
    if workers < 1 or gemms < 1:
        raise ValueError(f"workers and gemms must be >= 1, got {workers} and {gemms}")
    import torch

    a, b = torch.randn(512, 576), torch.randn(576, 1536)

    def work() -> None:
        torch.set_num_threads(1)
        for _ in range(gemms):
            a @ b

    before = torch.get_num_threads()
    try:
        work()  # warm
        t0 = time.perf_counter()
        work()
        one = time.perf_counter() - t0
        threads = [threading.Thread(target=work) for _ in range(workers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return workers * one / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
