"""Tensor parallelism for the real engine (``tp: N``): one model split N ways over N processes.

Layout (Megatron-style, per layer):

* attention: the q/k/v projection is column-parallel by whole GQA groups: rank ``r`` holds a contiguous
  range of KV heads and the query heads that read them (``num_attention_heads / num_key_value_heads`` per
  KV head). KV heads are split as evenly as possible, earlier ranks taking the extra one, so SmolLM2-135M
  (9 query heads, 3 KV heads) at tp 2 is rank 0: 2 KV / 6 query heads, rank 1: 1 KV / 3 query heads. The
  output projection is row-parallel (each rank multiplies its heads' slice of the input columns) and the
  partial outputs are summed with an all-reduce.
* MLP: gate/up column-parallel, down row-parallel over the same intermediate columns (as evenly as
  possible, earlier ranks taking the extra one), then an all-reduce. So two all-reduces of
  ``[tokens, hidden_size]`` per layer.
* embedding, norms and the residual stream are replicated (every rank holds the full hidden state).
* the KV cache of each rank holds only its KV heads: same ``num_blocks`` and block ids on every rank, so
  the block tables and the copy-on-write / swap lists of the one scheduler apply to every rank unchanged.
* LM head: **replicated on rank 0 only** (no vocabulary split, no logits gather). The sampling code calls
  ``compute_logits`` a varying number of times per step (sampling, speculative verification, prompt
  log-probabilities, draft proposals) on rows only rank 0 knows about; a vocabulary-parallel head would make
  every worker mirror that control flow, and the all-gather of ``[rows, vocab]`` float32 logits would cost
  about as much as the GEMM it splits for the few rows a decode step samples. Workers therefore skip the LM
  head entirely; ``gather`` time in the statistics is always 0.

Processes: rank 0 is the engine process; it runs the one scheduler, computes its own shard and samples. It
launches the N-1 workers itself (``torch.multiprocessing``, spawn context, daemon processes), which load
their shard from the model folder. The ranks rendezvous over a ``TCPStore`` that rank 0 hosts on a free
localhost port and form a process group of their own (gloo on CPU, NCCL on CUDA; not the global default
group, so several TP engines can live in one process).

Per step: rank 0 sends each worker one slim, pickled :class:`StepMessage` over a pipe (the "broadcast of the
SchedulerOutput": not the ``SchedulerOutput`` itself, but what a worker needs from it: the prepared
``input_ids``/``positions``, the ``AttentionMetadata`` and the block swaps and copies issued since the last
forward pass, in order), then every rank runs its shard, meeting in the all-reduces. Workers wait for their
next message on the pipe without any timeout (an idle engine is fine); collectives time out after
``timeout_s``.

Failures: a worker that raises sends its error back over its pipe and exits; a worker that dies closes its
sockets. Either way rank 0's pending all-reduce fails (at once, or after ``timeout_s`` when a worker hangs)
and rank 0 raises :class:`TensorParallelError` with one line naming the worker and its error; the engine is
unusable after that. Workers exit when the executor is closed (:meth:`TPModelExecutor.close`) or garbage
collected, when the interpreter exits (daemon processes), and when rank 0 dies (the pipe reaches EOF, and a
watchdog thread polls the parent pid).

Threads: each rank runs ``max(1, cores // N)`` torch threads (rank 0's process-wide setting is restored on
close). On the 2-core development machine tp 2 gives each rank one thread; the two ranks still compete for
the same cores with everything else on the machine, and tp 2 there measures the split's overheads (the
all-reduces, the uneven 6/3 head split), not a speed-up.

KV sizing: ``num_blocks`` comes from the factory as for tp 1 (``kv_cache_bytes`` is the pool over all ranks
together); rank ``r`` allocates its share ``kv_heads_r / num_key_value_heads`` of those bytes.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engines.core.config import ModelConfig
from engines.core.scheduler import SchedulerOutput, StepResult
from engines.real.allocator import keep_freed_memory
from engines.real.kv_cache import KVCache, SwapSpace
from engines.real.model import AttentionMetadata, LlamaModel, load_safetensors, resolve_device
from engines.real.model_runner import ModelExecutor

DEFAULT_TIMEOUT_S = 120.0  # a collective, the workers' start-up, and the rendezvous each wait at most this
TIMEOUT_ENV = "WORKBENCH_TP_TIMEOUT_S"  # overrides DEFAULT_TIMEOUT_S (seconds)


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed, died or did not answer in time (one line; the engine is unusable)."""


# ---------------------------------------------------------------------------------------------- sharding


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes as evenly as possible, earlier parts taking the extra one
    (``split_evenly(3, 2) == [2, 1]``)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


@dataclass(frozen=True)
class ShardSpec:
    """What rank ``rank`` of ``tp`` holds; ranges are half-open ``[start, stop)``.

    Attributes:
        kv_heads: the KV heads it holds.
        q_heads: the query heads reading them (whole GQA groups).
        mlp: the intermediate (gate/up output, down input) columns it holds.
    """

    rank: int
    tp: int
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    mlp: tuple[int, int]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def mlp_size(self) -> int:
        return self.mlp[1] - self.mlp[0]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raises ValueError (one line) when ``tp`` cannot split ``cfg``: ``tp < 1``, more ranks than KV heads
    (every rank needs at least one whole GQA group), or query heads that are not a multiple of the KV heads."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    kvh, h = cfg.num_key_value_heads, cfg.num_attention_heads
    if tp > kvh:
        raise ValueError(f"tp {tp} > the model's {kvh} KV heads: each rank needs at least one KV head")
    if h % kvh:
        raise ValueError(f"tp: {h} query heads are not a multiple of {kvh} KV heads (GQA groups cannot be kept whole)")
    if tp > cfg.intermediate_size:
        raise ValueError(f"tp {tp} > the model's {cfg.intermediate_size} MLP columns")


def shard_plan(cfg: ModelConfig, tp: int) -> list[ShardSpec]:
    """Every rank's :class:`ShardSpec` for ``cfg`` at ``tp`` ranks (see the module docstring for the split).

    Raises:
        ValueError: see :func:`check_tp`.
    """
    check_tp(cfg, tp)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    plan, kv0, m0 = [], 0, 0
    for r, (nkv, nm) in enumerate(zip(split_evenly(cfg.num_key_value_heads, tp),
                                      split_evenly(cfg.intermediate_size, tp))):
        plan.append(ShardSpec(r, tp, (kv0, kv0 + nkv), (kv0 * group, (kv0 + nkv) * group), (m0, m0 + nm)))
        kv0, m0 = kv0 + nkv, m0 + nm
    return plan


def shard_config(cfg: ModelConfig, spec: ShardSpec) -> ModelConfig:
    """The architecture one rank runs: its query heads, KV heads and MLP columns (``head_dim`` unchanged)."""
    return dataclasses.replace(cfg, num_attention_heads=spec.num_q_heads, num_key_value_heads=spec.num_kv_heads,
                               intermediate_size=spec.mlp_size)


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], spec: ShardSpec,
                  keep_lm_head: bool) -> dict[str, torch.Tensor]:
    """One rank's Hugging Face tensors (same names, sliced shapes; ``weights`` is not modified).

    Column-parallel (rows of ``[out, in]`` kept): ``q_proj`` ``[q_heads * head_dim, hidden]``, ``k_proj`` /
    ``v_proj`` ``[kv_heads * head_dim, hidden]`` (and their biases), ``gate_proj`` / ``up_proj``
    ``[mlp, hidden]``. Row-parallel (input columns kept): ``o_proj`` ``[hidden, q_heads * head_dim]``,
    ``down_proj`` ``[hidden, mlp]``. Everything else is replicated, except ``lm_head.weight``, which is
    dropped unless ``keep_lm_head`` (rank 0).
    """
    d = cfg.head_dim
    q = slice(spec.q_heads[0] * d, spec.q_heads[1] * d)
    kv = slice(spec.kv_heads[0] * d, spec.kv_heads[1] * d)
    m = slice(*spec.mlp)
    out = {}
    for name, t in weights.items():
        if name == "lm_head.weight" and not keep_lm_head:
            continue
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            t = t[q]
        elif any(name.endswith(f"self_attn.{p}.{w}") for p in ("k_proj", "v_proj") for w in ("weight", "bias")):
            t = t[kv]
        elif name.endswith("self_attn.o_proj.weight"):
            t = t[:, q]
        elif name.endswith("mlp.gate_proj.weight") or name.endswith("mlp.up_proj.weight"):
            t = t[m]
        elif name.endswith("mlp.down_proj.weight"):
            t = t[:, m]
        out[name] = t.contiguous()
    return out


# --------------------------------------------------------------------------------------------- comms


class _Comm:
    """One rank's collectives over its process group, timed (rank 0 reads the timings)."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.time = 0.0  # seconds in all-reduces since reset()
        self.count = 0  # all-reduces since reset()

    def reset(self) -> None:
        self.time, self.count = 0.0, 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (the time includes waiting for the slowest rank); returns ``t``."""
        cuda = t.is_cuda
        if cuda:  # time the collective, not the GEMMs queued before it
            torch.cuda.synchronize(t.device)
        t0 = time.perf_counter()
        self.group.allreduce([t]).wait()
        if cuda:
            torch.cuda.synchronize(t.device)
        self.time += time.perf_counter() - t0
        self.count += 1
        return t


class _RowParallel:
    """A row-parallel linear layer: the rank's partial product, summed over the ranks by an all-reduce.
    Attributes other than the call (``nbytes``, ``backend``, ...) are the wrapped layer's."""

    def __init__(self, inner, comm: _Comm):
        self.inner, self.comm = inner, comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in / tp]`` -> ``[T, out]``, the full sum over the ranks."""
        return self.comm.all_reduce(self.inner(x).contiguous())

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ShardedLlamaModel(LlamaModel):
    """One rank's shard of a :class:`LlamaModel`: ``cfg`` is the rank's own architecture
    (:func:`shard_config`: its heads and MLP columns; ``full_cfg`` the whole model's), the O and down
    projections are all-reduced (:class:`_RowParallel`).

    On rank 0, ``forward`` first sends the workers the step (``send_step``, set by :class:`TPModelExecutor`)
    and turns a failed collective into :class:`TensorParallelError`. ``compute_logits`` works on rank 0 only
    (workers hold no LM head).

    Args:
        full_cfg: the whole model's architecture.
        spec: this rank's shard.
        weights: the rank's tensors (:func:`shard_weights`).
        comm: the rank's collectives.
        **kwargs: as :class:`LlamaModel` (dtype, attention_backend, device, weight_dtype, linear_backend).
    """

    def __init__(self, full_cfg: ModelConfig, spec: ShardSpec, weights: dict[str, torch.Tensor], comm: _Comm,
                 **kwargs):
        super().__init__(shard_config(full_cfg, spec), weights, **kwargs)
        self.full_cfg, self.spec, self.comm = full_cfg, spec, comm
        self.send_step = None  # rank 0: callable(num_layers, input_ids, positions, meta)
        self.on_failure = None  # rank 0: callable(exc) -> TensorParallelError
        for layer in self.layers:
            layer["o"] = _RowParallel(layer["o"], comm)
            layer["down"] = _RowParallel(layer["down"], comm)

    def forward(self, input_ids, positions, meta, kv_caches):
        """As :meth:`LlamaModel.forward` (``kv_caches`` this rank's, ``[num_blocks + 1, block_size,
        rank's kv_heads, head_dim]``); runs ``len(kv_caches)`` layers on every rank.

        Raises:
            TensorParallelError: rank 0: a worker failed, died or timed out.
        """
        if self.send_step is None:
            return super().forward(input_ids, positions, meta, kv_caches)
        self.send_step(len(kv_caches), input_ids, positions, meta)
        try:
            return super().forward(input_ids, positions, meta, kv_caches)
        except Exception as e:
            raise self.on_failure(e) from None

    def warm_gemms(self, max_tokens: int, max_sampled_rows: int) -> int:
        """As :meth:`LlamaModel.warm_gemms`, on this rank's own layers (no all-reduce)."""
        from engines.real.linear import ONEDNN_WARM_MAX_ROWS, warm_onednn

        body = [getattr(layer[k], "inner", layer[k])
                for layer in self.layers[:1] for k in ("qkv", "o", "gate_up", "down")]
        return (warm_onednn(body, min(max_tokens, ONEDNN_WARM_MAX_ROWS))
                + warm_onednn([self.lm_head], min(max_sampled_rows, ONEDNN_WARM_MAX_ROWS)))


def _make_group(backend: str, store, rank: int, world: int, timeout_s: float):
    """A process group of ``world`` ranks over ``store`` (gloo or NCCL), outside torch's global group."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def threads_per_rank(tp: int) -> int:
    """torch threads each rank runs: ``max(1, cores // tp)`` (cores this process may run on)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // tp)


# ------------------------------------------------------------------------------------------- messages


@dataclass
class StepMessage:
    """What rank 0 sends a worker for one forward pass (pickled; tensors as numpy arrays).

    Attributes:
        num_layers: layers to run (the model's, or a draft pass's first N).
        input_ids, positions: ``[T]`` int64.
        meta: the step's :class:`AttentionMetadata` (its tensors as numpy arrays).
        block_ops: ``[(op, [(src, dst)])]`` with op ``swap_out``, ``swap_in`` or ``copy``: the KV block moves
            issued since the previous message, in order, run before the forward pass.
    """

    num_layers: int
    input_ids: object
    positions: object
    meta: dict
    block_ops: list = field(default_factory=list)


def _np(t):
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t


def _pack_meta(meta: AttentionMetadata) -> dict:
    return {f.name: _np(getattr(meta, f.name)) for f in dataclasses.fields(meta)}


def _unpack_meta(d: dict, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(**{k: torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v
                                for k, v in d.items()})


# -------------------------------------------------------------------------------------------- workers


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0] if text else type(e).__name__


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker as soon as its parent (rank 0) is gone (reparented)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def _worker_main(rank: int, tp: int, port: int, prefix: str, backend: str, model_dir: str, model_kwargs: dict,
                 num_blocks: int, block_size: int, num_cpu_blocks: int, threads: int, timeout_s: float,
                 parent_pid: int, conn) -> None:
    """A worker rank: load its shard, report ``("ready",)``, join the group, then run every
    :class:`StepMessage` until ``None`` (close), EOF (rank 0 gone) or an error (sent back as
    ``("error", one line)``)."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(threads)
    keep_freed_memory()  # as rank 0's executor does (engines.real.allocator)
    try:
        import torch.distributed as dist

        model_kwargs = dict(model_kwargs)
        device = torch.device(model_kwargs["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        cfg = ModelConfig.from_dir(model_dir)
        spec = shard_plan(cfg, tp)[rank]
        weights = shard_weights(cfg, load_safetensors(Path(model_dir)), spec, keep_lm_head=False)
        store = dist.TCPStore("127.0.0.1", port, tp, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        comm = _Comm(None, device)
        model = ShardedLlamaModel(cfg, spec, weights, comm, **model_kwargs)
        del weights
        kv = KVCache(model.cfg, num_blocks, block_size, model.dtype, device)
        swap = SwapSpace(kv, num_cpu_blocks) if num_cpu_blocks else None
        conn.send(("ready",))
        comm.group = _make_group(backend, dist.PrefixStore(prefix, store), rank, tp, timeout_s)
        while True:
            try:
                blob = conn.recv_bytes()
            except (EOFError, OSError):
                return  # rank 0 is gone
            msg = pickle.loads(blob)
            if msg is None:
                return
            for op, pairs in msg.block_ops:
                if op == "swap_out":
                    swap.swap_out(kv, pairs)
                elif op == "swap_in":
                    swap.swap_in(kv, pairs)
                else:
                    kv.copy_blocks(pairs)
            ids = torch.from_numpy(msg.input_ids).to(device)
            pos = torch.from_numpy(msg.positions).to(device)
            model.forward(ids, pos, _unpack_meta(msg.meta, device), kv.layers[: msg.num_layers])
    except BaseException as e:  # report, then exit: rank 0's collective fails and it raises this line
        try:
            conn.send(("error", _one_line(e)))
        except Exception:
            pass
        os._exit(1)


class _Workers:
    """Rank 0's handle on the worker processes: their pipes, the group, the block moves not sent yet."""

    def __init__(self, tp: int):
        self.tp = tp
        self.procs, self.conns = [], []
        self.group = None
        self.store = None
        self.pending: list = []
        self.error: str | None = None  # set once the group has failed
        self.closed = False

    def start(self, backend: str, model_dir: str, model_kwargs: dict, devices: list[str], num_blocks: int,
              block_size: int, num_cpu_blocks: int, threads: int, timeout_s: float) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.timeout_s = timeout_s
        # rank 0 hosts the rendezvous store on a free localhost port (port 0: the OS picks it)
        self.store = dist.TCPStore("127.0.0.1", 0, self.tp, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.prefix = f"tp{os.getpid()}-{id(self)}/"
        ctx = mp.get_context("spawn")
        for rank in range(1, self.tp):
            parent, child = ctx.Pipe()
            kwargs = dict(model_kwargs, device=devices[rank])
            p = ctx.Process(target=_worker_main, name=f"tp-worker-{rank}", daemon=True,
                            args=(rank, self.tp, self.store.port, self.prefix, backend, model_dir, kwargs,
                                  num_blocks, block_size, num_cpu_blocks, threads, timeout_s, os.getpid(), child))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def wait_ready(self, backend: str, timeout_s: float) -> None:
        """Wait for every worker's ``ready``, then join the group as rank 0.

        Raises:
            TensorParallelError: a worker reported an error, exited, or was not ready in ``timeout_s``.
        """
        import torch.distributed as dist

        deadline = time.monotonic() + timeout_s
        for rank, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
            while not c.poll(0.1):
                if not p.is_alive():
                    raise TensorParallelError(self._worker_failure(rank, p, c, "start-up"))
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel worker rank {rank} was not ready within "
                                              f"{timeout_s:.0f} s")
            try:
                msg = c.recv()
            except (EOFError, OSError):  # it exited before it could report (e.g. while starting Python)
                p.join(5.0)
                raise TensorParallelError(f"tensor-parallel worker rank {rank} exited at start-up with code "
                                          f"{p.exitcode} (its stderr has the reason)") from None
            if msg[0] != "ready":
                raise TensorParallelError(f"tensor-parallel worker rank {rank} failed at start-up: {msg[1]}")
        try:
            self.group = _make_group(backend, dist.PrefixStore(self.prefix, self.store), 0, self.tp, timeout_s)
        except Exception as e:
            raise self.failure(e) from None

    def _worker_failure(self, rank: int, p, c, when: str) -> str:
        """One line on what happened to worker ``rank`` (its error message if it sent one)."""
        try:
            if c.poll(1.0):
                msg = c.recv()
                if msg[0] == "error":
                    return f"tensor-parallel worker rank {rank} failed ({when}): {msg[1]}"
        except (EOFError, OSError):
            pass
        p.join(1.0)
        if p.exitcode is not None:
            return f"tensor-parallel worker rank {rank} exited with code {p.exitcode} ({when})"
        return ""

    def failure(self, e: BaseException) -> TensorParallelError:
        """What rank 0 raises when a collective (or a send) failed with ``e``: the first worker's own error
        where one came back, else rank 0's; the workers are stopped and the engine is unusable after it."""
        if self.error is None:
            lines = [self._worker_failure(r, p, c, "during a step")
                     for r, (p, c) in enumerate(zip(self.procs, self.conns), start=1)]
            lines = [x for x in lines if x]
            alive = [str(r) for r, p in enumerate(self.procs, start=1) if p.is_alive()]
            who = f" (worker rank {', '.join(alive)} still running, not answering)" if alive else ""
            self.error = (lines[0] if lines else f"tensor-parallel step failed on rank 0{who}: {_one_line(e)}")
            self.error += "; the engine cannot continue"
            self.close()
        return TensorParallelError(self.error)

    def queue_ops(self, out: SchedulerOutput) -> None:
        """Remember the step's swaps and copies for the next message (workers run them before the forward)."""
        for op, pairs in (("swap_out", out.blocks_to_swap_out), ("swap_in", out.blocks_to_swap_in),
                          ("copy", out.blocks_to_copy)):
            if pairs:
                self.pending.append((op, [tuple(p) for p in pairs]))

    def send_step(self, num_layers: int, input_ids, positions, meta) -> float:
        """Send every worker the step; returns the seconds it took (pickling and the pipe writes).

        Raises:
            TensorParallelError: the group failed before, or a worker is gone.
        """
        if self.error is not None or self.closed:
            raise TensorParallelError(self.error or "the tensor-parallel engine is closed")
        t0 = time.perf_counter()
        blob = pickle.dumps(StepMessage(num_layers, _np(input_ids), _np(positions), _pack_meta(meta), self.pending),
                            protocol=pickle.HIGHEST_PROTOCOL)
        self.pending = []
        try:
            for c in self.conns:
                c.send_bytes(blob)
        except (BrokenPipeError, EOFError, OSError) as e:
            raise self.failure(e) from None
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the workers (a ``None`` message, then terminate any that linger); idempotent."""
        if self.closed:
            return
        self.closed = True
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps(None))
            except Exception:
                pass
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for c in self.conns:
            c.close()
        self.group = None
        self.store = None


def _close_workers(workers: _Workers, threads_before: int) -> None:
    workers.close()
    torch.set_num_threads(threads_before)


# -------------------------------------------------------------------------------------------- executor


class TPModelExecutor(ModelExecutor):
    """:class:`ModelExecutor` over a model split ``tp`` ways (see the module docstring): rank 0 (this
    process) prepares, computes its shard and samples exactly as the single-process executor does; the
    forward pass and the KV block moves also run on the workers.

    Args:
        model_dir: the Hugging Face folder; rank 0 and every worker load their shard from it.
        tp: ranks (2 or more; 1 works too, without workers).
        num_blocks, block_size, seed, step_delay_s, num_cpu_blocks, draft_layers: as :class:`ModelExecutor`.
        dtype, attention_backend, device, weight_dtype, linear_backend: as :class:`LlamaModel`. On CUDA rank
            ``r`` runs on the device ``r`` after rank 0's (NCCL); on the CPU every rank runs there (gloo).
        timeout_s: the longest a collective, the rendezvous or the workers' start-up may take (None:
            ``$WORKBENCH_TP_TIMEOUT_S``, else 120 s).
        threads: torch threads per rank (None: :func:`threads_per_rank`); rank 0's is set process-wide
            until :meth:`close`.
        worker_model_dir: test hook: the folder the workers load from (None: ``model_dir``).

    Attributes (rank 0's measurements, refreshed every :meth:`execute`):
        last_comm_time: seconds rank 0 spent in all-reduces (and logits gathers: none, the LM head is
            replicated on rank 0) during the last step, waiting for the slowest rank included.
        comm_times: ``last_comm_time`` of every step so far (a list, one float per step); ``total_comm_time``
            their sum.
        last_all_reduces: all-reduces in the last step (2 per layer per forward pass: a draft pass adds
            2 x its layers); ``all_reduce_counts`` every step's, ``total_all_reduces`` their sum.
        last_gathers: logits gathers in the last step (always 0).
        last_broadcast_time: seconds spent sending the step to the workers (pickling and pipe writes).

    Raises:
        ValueError: a bad ``tp`` for the model (one line; :func:`check_tp`), or CUDA with fewer devices
            than ``tp``.
        TensorParallelError: a worker failed to start (one line).
    """

    def __init__(self, model_dir: str | Path, tp: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, attention_backend: str = "auto", device: str = "cpu",
                 weight_dtype: str | None = None, linear_backend: str = "auto", seed: int = 0,
                 step_delay_s: float = 0.0, num_cpu_blocks: int = 0, draft_layers: int = 0,
                 timeout_s: float | None = None, threads: int | None = None,
                 worker_model_dir: str | Path | None = None):
        keep_freed_memory()
        model_dir = Path(model_dir)
        timeout_s = float(timeout_s or os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
        full_cfg = ModelConfig.from_dir(model_dir)
        plan = shard_plan(full_cfg, tp)
        dev = resolve_device(device)
        if dev.type == "cuda":
            if torch.cuda.device_count() < dev.index + tp:
                raise ValueError(f"tp {tp} on {dev} needs {dev.index + tp} CUDA devices; torch sees "
                                 f"{torch.cuda.device_count()}")
            devices, backend = [f"cuda:{dev.index + r}" for r in range(tp)], "nccl"
        else:
            devices, backend = ["cpu"] * tp, "gloo"
        self.tp, self.timeout_s = tp, timeout_s
        self.threads = threads or threads_per_rank(tp)
        threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        self._workers = workers = _Workers(tp)
        self._finalizer = weakref.finalize(self, _close_workers, workers, threads_before)
        model_kwargs = dict(dtype=dtype, attention_backend=attention_backend, weight_dtype=weight_dtype,
                            linear_backend=linear_backend)
        try:
            # workers load their shards while rank 0 loads its own
            workers.start(backend, str(worker_model_dir or model_dir), model_kwargs, devices, num_blocks,
                          block_size, num_cpu_blocks, self.threads, timeout_s)
            comm = _Comm(None, dev)
            weights = shard_weights(full_cfg, load_safetensors(model_dir), plan[0], keep_lm_head=True)
            model = ShardedLlamaModel(full_cfg, plan[0], weights, comm, device=devices[0], **model_kwargs)
            del weights
            workers.wait_ready(backend, timeout_s)
        except BaseException:
            self._finalizer()
            raise
        comm.group = workers.group
        self.comm = comm
        model.send_step = self._send_step
        model.on_failure = workers.failure
        try:
            super().__init__(model, num_blocks, block_size, seed=seed, step_delay_s=step_delay_s,
                             num_cpu_blocks=num_cpu_blocks, draft_layers=draft_layers)
        except BaseException:
            self._finalizer()
            raise
        self.plan = plan
        self.last_comm_time = 0.0
        self.comm_times: list[float] = []
        self.total_comm_time = 0.0
        self.last_all_reduces = 0
        self.all_reduce_counts: list[int] = []
        self.total_all_reduces = 0
        self.last_gathers = 0
        self.last_broadcast_time = 0.0
        self._broadcast = 0.0

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids (rank 1 first)."""
        return [p.pid for p in self._workers.procs]

    def _send_step(self, num_layers, input_ids, positions, meta) -> None:
        self._broadcast += self._workers.send_step(num_layers, input_ids, positions, meta)

    def _copy_blocks(self, out: SchedulerOutput) -> float:
        """Rank 0's block moves now; the workers' go with the next step message (before its forward pass)."""
        swap_time = super()._copy_blocks(out)
        self._workers.queue_ops(out)
        return swap_time

    def execute(self, out: SchedulerOutput) -> StepResult:
        """:meth:`ModelExecutor.execute` over every rank; records the step's communication time and counts.

        Raises:
            TensorParallelError: a worker failed, died or timed out (this step or before).
        """
        if self._workers.error is not None or self._workers.closed:
            raise TensorParallelError(self._workers.error or "the tensor-parallel engine is closed")
        self.comm.reset()
        self._broadcast = 0.0
        result = super().execute(out)
        self.last_comm_time, self.last_all_reduces = self.comm.time, self.comm.count
        self.last_broadcast_time = self._broadcast
        self.comm_times.append(self.last_comm_time)
        self.all_reduce_counts.append(self.last_all_reduces)
        self.total_comm_time += self.last_comm_time
        self.total_all_reduces += self.last_all_reduces
        return result

    def close(self) -> None:
        """Stop the workers and restore rank 0's torch threads; idempotent (also runs when the executor is
        garbage collected or the interpreter exits)."""
        self._finalizer()
