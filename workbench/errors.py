"""The one error type the CLI turns into a one-line message and exit code 2.

Bad input (a scenario field, a trace row, a command-line option, a results file) raises
:class:`UsageError` or a subclass (``ScenarioError``, ``TraceError``) with one line that names the file,
field or request and says what is wrong; ``workbench.cli`` catches it in one place, prints
``error: <message>`` and exits 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input: the message is one line naming the file, field, option or request and what is wrong."""


__all__ = ["UsageError"]
