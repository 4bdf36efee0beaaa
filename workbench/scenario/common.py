"""What every part of the scenario package shares: the error type, the strict pydantic base model, and
``builtin:`` paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from workbench.errors import UsageError
from workbench.traces import BUILTIN_TRACE_DIR

BUILTIN_PREFIX = "builtin:"
# pydantic error type of a problem a model validator finds in one field; its ctx names the field ("field")
FIELD_ERROR = "scenario_field"


class ScenarioError(UsageError):
    """A scenario file (or an override of it) is unusable; the message is one line naming the file and the
    field: ``<file>: <field path>: <what is wrong / what is allowed> (engine NAME, line N)``.

    A :class:`workbench.errors.UsageError`, so a ``ValueError`` too.
    """


class SpecModel(BaseModel):
    """Base of every scenario section: unknown fields are errors (typos are caught), infinities dump as
    ``Infinity`` in JSON, and only bool fields take YAML booleans."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    @model_validator(mode="before")
    @classmethod
    def _no_bools(cls, data: Any) -> Any:
        # only bool fields take booleans: reject YAML true/false/yes/no instead of reading them as 1/0 (a
        # model validator, not a field one: pydantic allows no before-validator on a union's discriminator)
        if isinstance(data, dict):
            for key, v in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                if isinstance(v, bool) and field is not None and field.annotation is not bool:
                    raise field_error(key, f"expected a value of this field's type, got a boolean ({str(v).lower()})")
        return data


def field_error(field: str, message: str) -> PydanticCustomError:
    """An error about ``field`` for a model validator to raise (pydantic would place it on the model):
    the scenario's error message names the field."""
    return PydanticCustomError(FIELD_ERROR, "{message}", {"message": message, "field": field})


def resolve_path(path: str, base_dir: str | Path) -> Path:
    """``builtin:<name>`` -> ``workbench/data/traces/<name>``; a relative path -> under ``base_dir``; ``~``
    expands; an absolute path stays as it is."""
    if path.startswith(BUILTIN_PREFIX):
        return BUILTIN_TRACE_DIR / path[len(BUILTIN_PREFIX):]
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def builtin_traces() -> list[str]:
    """Names usable as ``builtin:<name>`` (the files of ``workbench/data/traces/`` but its notes)."""
    return sorted(p.name for p in BUILTIN_TRACE_DIR.iterdir() if p.is_file() and not p.name.endswith(".md"))
