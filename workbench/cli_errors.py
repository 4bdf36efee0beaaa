"""The command line's error exit, shared by ``workbench.cli`` and the command modules it dispatches to
(``capacity``, ``compare``, ``gate``, ``sweep``): they cannot import it from ``workbench.cli``, which
imports them (that would be an import cycle)."""

from __future__ import annotations

import typer


def fail(message: str) -> None:
    """Print a one-line error to stderr and exit 2 (bad input never shows a traceback)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
