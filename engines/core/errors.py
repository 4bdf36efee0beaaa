"""Exceptions of the core bookkeeping (kept apart from the modules that raise them, which may be compiled:
mypyc cannot compile a class derived from a built-in exception other than ``Exception``)."""

from __future__ import annotations


class BlockPoolError(RuntimeError):
    """Raised on a bookkeeping bug: freeing a free block (ref count would go negative)."""
