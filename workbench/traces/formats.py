"""The trace formats and :func:`load_trace`, which picks a format's loader by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from workbench.traces.azure import load_azure
from workbench.traces.burstgpt import load_burstgpt
from workbench.traces.common import TraceError, TraceRequest
from workbench.traces.mooncake import load_mooncake
from workbench.traces.sharegpt import load_sharegpt
from workbench.traces.synthetic import load_synthetic
from workbench.traces.vidur import load_vidur

FORMATS: tuple[str, ...] = ("azure", "mooncake", "burstgpt", "sharegpt", "vidur", "synthetic")


_LOADERS: dict[str, Callable[..., list[TraceRequest]]] = {
    "azure": load_azure,
    "mooncake": load_mooncake,
    "burstgpt": load_burstgpt,
    "sharegpt": load_sharegpt,
    "vidur": load_vidur,
}


def load_trace(format: str, path: str | Path | None = None, **kwargs: Any) -> list[TraceRequest]:
    """Load a trace of the given format (one of :data:`FORMATS`); ``kwargs`` go to that format's loader.

    For ``synthetic`` ``path`` is optional and, when given, is the lengths CSV (``lengths="file"``).

    Raises:
        TraceError: unknown format (the message lists the known ones), or any loader error.
    """
    if format == "synthetic":
        if path is not None:
            kwargs.setdefault("lengths_path", path)
            kwargs.setdefault("lengths", "file")
        try:
            return load_synthetic(**kwargs)
        except TypeError as e:
            raise TraceError(f"synthetic: {e}") from None
    loader = _LOADERS.get(format)
    if loader is None:
        raise TraceError(f"unknown trace format {format!r}; known formats: {', '.join(FORMATS)}")
    if path is None:
        raise TraceError(f"{format}: a trace file path is required")
    try:
        return loader(path, **kwargs)
    except TypeError as e:  # an unknown keyword for this loader
        raise TraceError(f"{path}: {format} loader: {e}") from None
