"""A parsed trace row before its arrival is rebased (:class:`RawRow`), shared by the loaders and the streams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RawRow:
    """One row a loader parsed and counted, in file order.

    Attributes:
        key: the arrival as the format orders it (Azure: (whole s since the epoch, ns); Vidur: s;
            Mooncake: ms); the format's ``seconds(key, base)`` turns it into seconds from ``base``.
        request_id: ``<format>-<row index>``.
        prompt_tokens: prompt length in tokens (after any replay scaling the loader does).
        output_tokens: output tokens (at least 1).
        where: ``<file>:<line>`` for messages.
        hash_ids: Mooncake's prefix block ids, else None.
    """

    key: Any
    request_id: str
    prompt_tokens: int
    output_tokens: int
    where: str = ""
    hash_ids: list[int] | None = None
