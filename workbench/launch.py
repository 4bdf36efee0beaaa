"""Servers the workbench starts itself: a ``kind: openai`` engine's ``launch:`` block.

The runner starts the engine's server before its replay and stops it afterwards, so one scenario can
measure ``workbench serve``, llama.cpp's ``llama-server`` and ``vllm serve`` one after another on the same
machine. A server runs in its own process group (``start_new_session``), so stopping it (SIGTERM, then
SIGKILL after ``stop_timeout_s``) also ends its worker processes, on success, on error and on Ctrl-C.

``LaunchPool`` keeps at most one launched server alive and reuses it while the next engine asks for the
same server (same rendered command, environment and readiness URL): a sweep over users launches each server
once for all its points, as long as its points come one after another (put ``engine=...`` first among the
``--set`` axes), and never measures one server while another runs.

Readiness: the server is ready when ``ready_url`` (default: ``base_url`` + ``/models``) answers HTTP 200.
A server that exits first, or is not ready within ``startup_timeout_s``, is a ``LaunchError`` whose
one-line message names the engine and the last line of its log.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from workbench.errors import UsageError

POLL_S = 0.25  # seconds between readiness probes


class LaunchError(UsageError):
    """A launched server could not be started or did not become ready (one-line message; the CLI prints it as
    ``error: ...`` and exits 2: the launch command is the user's)."""


@dataclass
class LaunchPlan:
    """A server to start, with every template variable filled in.

    Attributes:
        engine: the engine's name (for messages).
        argv: the command line.
        env: variables added to the runner's environment.
        ready_url: polled until it answers HTTP 200.
        startup_timeout_s: seconds to wait for readiness.
        stop_timeout_s: seconds between SIGTERM and SIGKILL when stopping.
        log_file: where the server's stdout and stderr go.
    """

    engine: str
    argv: list[str]
    env: dict[str, str]
    ready_url: str
    startup_timeout_s: float
    stop_timeout_s: float
    log_file: Path

    @property
    def key(self) -> tuple:
        """What makes two plans the same server (the engine name and log file do not)."""
        return (tuple(self.argv), tuple(sorted(self.env.items())), self.ready_url)


def template_vars(extra: dict | None = None) -> dict[str, str]:
    """Variables a ``launch`` command, environment or URL may use: ``{python}`` (this interpreter), ``{cache}``
    (``$WORKBENCH_CACHE``), ``{peers}`` (``$WORKBENCH_CACHE/peers``, where the peer install scripts build),
    ``{home}`` (the user's home folder),
    ``{model_dir:NAME}`` is resolved separately (see :func:`render`), plus ``extra`` (e.g. ``port``,
    ``max_concurrency``)."""
    from engines.real.model_store import cache_dir

    out = {"python": sys.executable, "cache": str(cache_dir()), "peers": str(cache_dir() / "peers"),
           "home": str(Path.home())}
    out.update({k: str(v) for k, v in (extra or {}).items()})
    return out


def render(text: str, variables: dict[str, str], where: str) -> str:
    """Fill ``{name}`` placeholders of ``text``; ``{model_dir:NAME}`` is the local folder of model NAME (pulled
    if needed).

    Raises:
        LaunchError: an unknown placeholder (the message names ``where`` and the variables known).
    """
    import re

    def model_dir(m: re.Match) -> str:
        from engines.real.model_store import resolve_model

        return str(resolve_model(m.group(1)))

    text = re.sub(r"\{model_dir:([^{}]+)\}", model_dir, text)
    try:
        return text.format(**variables)
    except (KeyError, IndexError) as e:
        raise LaunchError(f"{where}: unknown placeholder {e} (known: {', '.join(sorted(variables))}, "
                          f"model_dir:NAME)") from None
    except ValueError as e:
        raise LaunchError(f"{where}: bad placeholder syntax ({e}); write literal braces as {{{{ and }}}}") from None


class LaunchedServer:
    """One started server process (group); use :meth:`start` then :meth:`stop`, or as a context manager."""

    def __init__(self, plan: LaunchPlan):
        self.plan = plan
        self.proc: subprocess.Popen | None = None
        self.started_s: float | None = None  # seconds from start to ready

    def __enter__(self) -> "LaunchedServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until ``ready_url`` answers 200.

        Raises:
            LaunchError: something already answers at ``ready_url`` (another server would be measured), the
                command cannot be run, the server exits before it is ready, or it is not ready in time.
        """
        import httpx

        p = self.plan
        if _answers(p.ready_url):
            raise LaunchError(f"engine {p.engine}: something already answers at {p.ready_url} before the launch; "
                              f"stop it or give the launched server another port")
        p.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(p.log_file, "ab")
        t0 = time.perf_counter()
        try:
            self.proc = subprocess.Popen(p.argv, env={**os.environ, **p.env}, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise LaunchError(f"engine {p.engine}: cannot run {shlex.join(p.argv)[:200]}: {e}") from None
        finally:
            log.close()  # the server holds its own copy of the descriptor
        deadline = t0 + p.startup_timeout_s
        try:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise LaunchError(f"engine {p.engine}: the server exited with code {rc} before it was ready "
                                      f"(log {p.log_file}: {last_log_line(p.log_file)})")
                try:
                    if httpx.get(p.ready_url, timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() > deadline:
                    raise LaunchError(f"engine {p.engine}: the server was not ready at {p.ready_url} within "
                                      f"{p.startup_timeout_s:g} s (log {p.log_file}: {last_log_line(p.log_file)})")
                time.sleep(POLL_S)
        except BaseException:  # LaunchError, Ctrl-C: never leave the process behind
            self.stop()
            raise
        self.started_s = time.perf_counter() - t0

    def stop(self) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after ``stop_timeout_s``. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group (also once it has exited)
        for sig, wait in ((signal.SIGTERM, self.plan.stop_timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break  # nothing of the group is left
            end = time.perf_counter() + wait
            while (proc.poll() is None or _group_alive(pgid)) and time.perf_counter() < end:
                time.sleep(0.05)
            if proc.poll() is not None and not _group_alive(pgid):
                break

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _answers(url: str) -> bool:
    import httpx

    try:
        httpx.get(url, timeout=1.0)
        return True
    except httpx.HTTPError:
        return False


def last_log_line(path: Path) -> str:
    """The last non-empty line of a log file (at most 300 characters), or a note that there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "the log is empty"


@dataclass
class LaunchPool:
    """Keeps at most one launched server alive; :meth:`ensure` reuses it for the same plan, else stops it and
    starts the new one. :meth:`close` stops whatever runs (call it in a ``finally``)."""

    current: LaunchedServer | None = None
    launches: list[dict] = field(default_factory=list)  # one record per start: engine, command, seconds to ready

    def ensure(self, plan: LaunchPlan) -> LaunchedServer:
        """The running server for ``plan``, started (and any other stopped) if needed.

        Raises:
            LaunchError: see :meth:`LaunchedServer.start`.
        """
        cur = self.current
        if cur is not None and cur.plan.key == plan.key and cur.alive:
            return cur
        self.close()
        server = LaunchedServer(plan)
        server.start()
        self.current = server
        self.launches.append({"engine": plan.engine, "command": shlex.join(plan.argv), "ready_s": server.started_s,
                              "log_file": str(plan.log_file)})
        return server

    def close(self) -> None:
        cur, self.current = self.current, None
        if cur is not None:
            cur.stop()

    def __enter__(self) -> "LaunchPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan_for(engine: str, launch, base_url: str, out_dir: Path, max_concurrency: int | None = None) -> LaunchPlan:
    """The ``LaunchPlan`` of an engine's ``launch`` block (``workbench.scenario.launch_spec.LaunchSpec``), its
    placeholders filled: ``{port}`` from ``base_url``, ``{max_concurrency}`` (0 when open-loop).

    Raises:
        LaunchError: an unknown placeholder.
    """
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    port = u.port or (443 if u.scheme == "https" else 80)
    variables = template_vars({"port": port, "max_concurrency": max_concurrency or 0})
    where = f"engine {engine}: launch"
    argv = [render(a, variables, f"{where}.command") for a in launch.argv()]
    env = {k: render(v, variables, f"{where}.env.{k}") for k, v in launch.env.items()}
    ready = render(launch.ready_url, variables, f"{where}.ready_url") if launch.ready_url else \
        base_url.rstrip("/") + "/models"
    return LaunchPlan(engine, argv, env, ready, launch.startup_timeout_s, launch.stop_timeout_s,
                      launch.log_path(engine, out_dir))


_HELD: LaunchPool | None = None  # the pool a sweep keeps across its points (see keep_servers)


@contextlib.contextmanager
def keep_servers():
    """Within this block, every run in this process shares one ``LaunchPool`` (a sweep's real points, run one by
    one in the parent process, launch each server once while consecutive points need the same one); its server
    is stopped when the block ends."""
    global _HELD
    outer, _HELD = _HELD, LaunchPool()
    try:
        yield _HELD
    finally:
        _HELD.close()
        _HELD = outer


@contextlib.contextmanager
def held_pool():
    """The pool of :func:`keep_servers` when one is held (left running at the end), else a new one that is
    closed at the end of the block."""
    if _HELD is not None:
        yield _HELD
        return
    pool = LaunchPool()
    try:
        yield pool
    finally:
        pool.close()
