"""The trace formats and :func:`load_trace`, which picks a format's loader by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from workbench.traces.apex import load_apex
from workbench.traces.azure import load_azure
from workbench.traces.burstgpt import load_burstgpt
from workbench.traces.common import LoadStats, TraceError, TraceRequest, shown
from workbench.traces.mooncake import load_mooncake
from workbench.traces.sharegpt import load_sharegpt
from workbench.traces.synthetic import load_synthetic
from workbench.traces.vidur import load_vidur

FORMATS: tuple[str, ...] = ("azure", "mooncake", "burstgpt", "sharegpt", "vidur", "apex", "synthetic")
# formats that load_trace (and ``workbench trace inspect``) read but a scenario cannot name (none now): the
# scenario schema's TraceFormat lists exactly FORMATS, so a format moves from here to FORMATS together with it
EXTRA_FORMATS: tuple[str, ...] = ()


_LOADERS: dict[str, Callable[..., list[TraceRequest]]] = {
    "azure": load_azure,
    "mooncake": load_mooncake,
    "burstgpt": load_burstgpt,
    "sharegpt": load_sharegpt,
    "vidur": load_vidur,
    "apex": load_apex,
}


def load_trace(format: str, path: str | Path | None = None, **kwargs: Any) -> list[TraceRequest]:
    """Load a trace of the given format (one of :data:`FORMATS` or :data:`EXTRA_FORMATS`); ``kwargs`` go to
    that format's loader.

    For ``synthetic`` ``path`` is optional and, when given, is the lengths CSV (``lengths="file"``). Every
    file loader takes ``strict`` and ``stats`` (a :class:`LoadStats` it fills); for ``synthetic`` ``stats``
    gets one row per request.

    Raises:
        TraceError: unknown format (the message lists the known ones), or any loader error.
    """
    if format == "synthetic":
        stats: LoadStats | None = kwargs.pop("stats", None)
        if path is not None:
            kwargs.setdefault("lengths_path", path)
            kwargs.setdefault("lengths", "file")
        try:
            reqs = load_synthetic(**kwargs)
        except TypeError as e:
            raise TraceError(f"synthetic: {e}") from None
        if stats is not None:
            stats.start("", "synthetic")
            stats.rows_read = stats.loaded = len(reqs)
        return reqs
    loader = _LOADERS.get(format)
    if loader is None:
        raise TraceError(f"unknown trace format {shown(format)}; known formats: {', '.join(FORMATS + EXTRA_FORMATS)}")
    if path is None:
        raise TraceError(f"{format}: a trace file path is required")
    try:
        return loader(path, **kwargs)
    except TypeError as e:  # an unknown keyword for this loader
        raise TraceError(f"{path}: {format} loader: {e}") from None
