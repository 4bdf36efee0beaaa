"""Reading a scenario: YAML with line numbers, validation into :class:`Scenario`, one-line errors, the
files it names and the devices its real engines ask for."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Annotated, Any, Mapping, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from workbench.scenario.common import BUILTIN_PREFIX, FIELD_ERROR, ScenarioError, builtin_traces, resolve_path
from workbench.scenario.engine_spec import ANALYTIC, AUTO, REAL_KINDS
from workbench.scenario.overrides import apply_overrides
from workbench.scenario.schema import Scenario

NO_FILE = "<scenario>"  # the file name of a scenario validated from a mapping


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_line(text: str | None, loc: tuple) -> int | None:
    """1-based line of the deepest node along ``loc`` that the YAML text has (None when unknown)."""
    if text is None:
        return None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None)
            if nxt is None:
                break
            line = next(k for k, v in node.value if v is nxt).start_mark.line + 1
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _unwrap(ann: Any) -> Any:
    """The model (or list) behind an annotation: Optional and Annotated stripped; a union discriminated on a
    field becomes ``{tag: model}``."""
    if get_origin(ann) is Annotated:
        base, *meta = get_args(ann)
        disc = next((m.discriminator for m in meta if isinstance(m, FieldInfo) and m.discriminator), None)
        if disc is not None and get_origin(base) in (Union, types.UnionType):
            return {get_args(m.model_fields[disc].annotation)[0]: m for m in get_args(base)}
        return _unwrap(base)
    if get_origin(ann) in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else ann
    return ann


def _resolve_loc(loc: tuple) -> tuple[tuple, Any]:
    """A pydantic error location without the union tags pydantic puts in it (``engines, 1, static,
    reservation`` -> ``engines, 1, reservation``), and what the schema has there: a model class, a
    ``{tag: model}`` union, or None (a value, or nothing)."""
    node: Any = Scenario
    clean: list = []
    for part in loc:
        node = _unwrap(node)
        if isinstance(node, dict):  # a discriminated union: this part is the tag
            node = node.get(part)
            continue
        clean.append(part)
        if get_origin(node) is list and isinstance(part, int):
            node = get_args(node)[0]
        elif isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node = node.model_fields[part].annotation
        else:
            node = None
    return tuple(clean), _unwrap(node)


def _or_list(tags: list[str]) -> str:
    return tags[0] if len(tags) == 1 else ", ".join(tags[:-1]) + " or " + tags[-1]


def _describe(err: Mapping[str, Any]) -> tuple[tuple, str]:
    """(location in the scenario, message) of one pydantic error."""
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    where, node = _resolve_loc(loc)
    msg = err.get("msg", "invalid")
    if kind == "extra_forbidden":
        parent = _resolve_loc(loc[:-1])[1]
        allowed = list(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else None
        return where, "unknown field" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    if kind == FIELD_ERROR:
        return where + (ctx["field"],), msg
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        field = str(ctx.get("discriminator", "")).strip("'")
        tags = [repr(t) for t in node] if isinstance(node, dict) else []
        if kind == "union_tag_invalid":
            return where + (field,), f"Input should be {_or_list(tags)}, got {ctx.get('tag')!r}"
        return where + (field,), f"required field is missing; one of {_or_list(tags)}"
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    elif kind == "missing":
        msg = "required field is missing"
    elif "input" in err and not isinstance(err["input"], (dict, list)):
        msg = f"{msg}, got {err['input']!r}"
    return where, msg


def _engine_name(data: Any, loc: tuple) -> str:
    """The engine's name when ``loc`` points into ``engines[i]`` and that engine has one, else ``""``."""
    if len(loc) >= 2 and loc[0] == "engines" and isinstance(loc[1], int) and isinstance(data, dict):
        engines = data.get("engines")
        if isinstance(engines, list) and loc[1] < len(engines) and isinstance(engines[loc[1]], dict):
            name = engines[loc[1]].get("name")
            if isinstance(name, str) and name:
                return name
    return ""


def _error(file: Path | str, field: str, msg: str, line: int | None = None, engine: str = "") -> ScenarioError:
    """``<file>: <field>: <msg> (engine NAME, line N)`` on one line."""
    where = ", ".join(x for x in (f"engine {engine}" if engine else "", f"line {line}" if line else "") if x)
    text = f"{file}: {field}: {msg}" + (f" ({where})" if where else "")
    return ScenarioError(" ".join(text.split()))


def _error_at(file: Path | str, loc: tuple, msg: str, text: str | None, data: Any) -> ScenarioError:
    """:func:`_error` for the field at ``loc``: its dotted path, its YAML line, its engine's name."""
    return _error(file, ".".join(map(str, loc)) or "(scenario)", msg, _yaml_line(text, loc), _engine_name(data, loc))


def validate_scenario(data: Any, file: str | Path = NO_FILE, text: str | None = None,
                      base_dir: str | Path | None = None, check_files: bool = True) -> Scenario:
    """Validate a scenario mapping; ``file`` and ``text`` (the YAML it came from) only improve the message.

    Args:
        data: the scenario as plain data (a parsed YAML file).
        file: where it came from (named in errors; its folder is the default ``base_dir``).
        text: the YAML text, for line numbers in errors.
        base_dir: the folder relative paths resolve against (default: ``file``'s folder, else the cwd).
        check_files: the trace file, a synthetic lengths file and sim cost-model profiles must exist, and
            a real engine's ``device`` must be on this machine.

    Raises:
        ScenarioError: ``<file>: <field path>: <what is wrong / what is allowed> (engine NAME, line N)``
            for the first problem.
    """
    if not isinstance(data, dict):
        raise _error(file, "(top level)", f"expected a mapping of scenario fields, got {type(data).__name__}")
    try:
        sc = Scenario.model_validate(data)
    except ValidationError as e:
        loc, msg = _describe(e.errors(include_url=False)[0])
        raise _error_at(file, loc, msg, text, data) from None
    sc._base_dir = Path(base_dir) if base_dir is not None else Path(file).parent if file != NO_FILE else Path.cwd()
    if check_files:
        _check_files(sc, file, text, data)
        _check_devices(sc, file, text, data)
    return sc


def _check_files(sc: Scenario, file: Path | str, text: str | None, data: Any) -> None:
    """The trace, a synthetic lengths file and every sim engine's profile JSON exist.

    Raises:
        ScenarioError: ``no such file: <resolved path>`` (with the builtin traces for a ``builtin:`` path).
    """
    checks: list[tuple[tuple, str | None]] = [(("trace", "path"), sc.trace.path)]
    if sc.trace.synthetic is not None:
        checks.append((("trace", "synthetic", "lengths_path"), sc.trace.synthetic.lengths_path))
    for i, eng in enumerate(sc.engines):
        if eng.kind == "sim" and not eng.cost_model.startswith(BUILTIN_PREFIX) and eng.cost_model not in (ANALYTIC, AUTO):
            checks.append((("engines", i, "cost_model"), eng.cost_model))
    for loc, value in checks:
        if value is None:
            continue
        p = resolve_path(value, sc.base_dir)
        if not p.is_file():
            hint = f"; builtin traces: {', '.join(builtin_traces())}" if value.startswith(BUILTIN_PREFIX) else ""
            raise _error_at(file, loc, f"no such file: {p}{hint}", text, data)


def _check_devices(sc: Scenario, file: Path | str, text: str | None, data: Any) -> None:
    """A real engine's ``device`` exists on this machine, checked before any engine starts (asks torch,
    imported only when an engine names a device other than ``auto`` or ``cpu``).

    Raises:
        ScenarioError: the device is not there (e.g. ``cuda`` where torch sees no CUDA device).
    """
    for i, eng in enumerate(sc.engines):
        if eng.kind in REAL_KINDS and eng.device not in ("auto", "cpu"):
            from engines.real.model import resolve_device

            try:
                resolve_device(eng.device)
            except ValueError as err:
                raise _error_at(file, ("engines", i, "device"), str(err), text, data) from None


def load_scenario(path: str | Path, overrides: Mapping[str, Any] | None = None,
                  check_files: bool = True) -> Scenario:
    """Read and validate a scenario YAML file; relative paths inside resolve against its folder.

    Args:
        path: the YAML file.
        overrides: dotted-path settings applied before validation (see ``apply_overrides``); errors then
            carry no line numbers (the file's lines no longer describe the scenario).
        check_files: require the trace (and cost-model) files to exist and real engines' devices to be here.

    Raises:
        ScenarioError: one line ``<file>: <field path>: <what is wrong / what is allowed>``: missing file,
            YAML syntax error or duplicate key (``line N: ...``), validation error (the first one, with
            a dotted path such as ``engines.1.reservation``, the engine's name and the YAML line), bad
            override.
    """
    p = Path(path)
    if not p.is_file():
        raise _error(p, "(file)", "no such file" if not p.exists() else "not a regular file")
    try:
        text: str | None = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _error(p, "(file)", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        where = f"line {mark.line + 1}" if mark is not None else "(yaml)"
        detail = f"{problem} ({context})" if context else problem
        col = f" column {mark.column + 1}" if mark is not None else ""
        raise _error(p, where + col, f"YAML syntax error: {detail}") from None
    if data is None:
        raise _error(p, "(top level)", "file is empty; expected a mapping with name, trace, engines")
    if overrides:
        if not isinstance(data, dict):
            raise _error(p, "(top level)", f"expected a mapping of scenario fields, got {type(data).__name__}")
        try:
            data = apply_overrides(data, overrides)
        except ScenarioError as e:
            raise ScenarioError(f"{p}: {e}") from None
        text = None  # line numbers no longer match the file
    return validate_scenario(data, p, text, p.parent, check_files)
