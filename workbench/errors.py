"""The one error type the CLI turns into a one-line message and exit code 2.

Bad input (a scenario field, a trace row, a command-line option, a results file, a baseline, a gate bound)
raises :class:`UsageError` or a subclass (``ScenarioError``, ``TraceError``, ``ResultsError``,
``GateError``) with one line that names the file, field or request and says what is wrong. The command
modules (``workbench.commands``) raise it; ``workbench.cli`` catches it in one place (with the errors of
``engines/`` a user can cause, which cannot subclass it: ``engines`` never imports ``workbench``), prints
``error: <message>`` and exits 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class UsageError(ValueError):
    """Bad input: the message is one line naming the file, field, option or request and what is wrong."""


@contextmanager
def usage_errors(*types: type[Exception]) -> Iterator[None]:
    """Inside the block, an exception of one of ``types`` is bad input: it is raised again as a
    :class:`UsageError` with the same message.

    For library calls that report a setting the user chose with a plain ``ValueError`` (an engine knob the
    factory refuses, an unreachable endpoint, a port in use): the command that makes the call knows the
    setting came from its user.
    """
    try:
        yield
    except UsageError:
        raise
    except types as e:
        raise UsageError(str(e)) from e


__all__ = ["UsageError", "usage_errors"]
