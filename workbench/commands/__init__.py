"""The ``workbench`` commands, one module per command: each checks its options, calls into the library
(``workbench.runner``, ``workbench.capacity``, ``workbench.sweep``, ``workbench.gate``,
``workbench.results``, ``engines``), prints what it found and returns its exit code when that can be 1.

Bad input raises :class:`workbench.errors.UsageError`; ``workbench.cli`` (which registers these commands
with their options and is imported by none of them) prints it as one line and exits 2.
"""

from __future__ import annotations

import os

from workbench.errors import UsageError


def set_torch_threads() -> None:
    """torch's intra-op threads from ``WORKBENCH_THREADS`` when it is set (commands that run engines)."""
    if os.environ.get("WORKBENCH_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["WORKBENCH_THREADS"]))


def check_real_engine(engine: str) -> None:
    """``--engine`` of ``generate`` and ``serve``: a real engine kind.

    Raises:
        UsageError: anything but ``paged`` or ``static``.
    """
    if engine not in ("paged", "static"):
        raise UsageError(f"--engine must be paged or static, got {engine!r}")


def table_console():
    """A rich console for a command's result table: the terminal's width, 200 columns when piped or logged
    (a table squeezed into 80 columns wraps every cell)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)
