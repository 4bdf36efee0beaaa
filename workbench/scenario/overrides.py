"""Command-line overrides of a scenario (``--set engines.paged.max_num_seqs=16``): parsed from
``KEY=VALUE`` items and applied to the scenario's plain data before it is validated."""

from __future__ import annotations

import copy
from typing import Any, Mapping

import yaml

from workbench.scenario.common import ScenarioError


def apply_overrides(scenario_dict: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """A deep copy of ``scenario_dict`` with dotted-path settings replaced.

    Keys are dotted paths; ``engines.<name>.<field>`` addresses an engine by its name (or by its index).
    Missing intermediate mappings are created (``slo.ttft_ms`` works without an ``slo`` section); a value
    of None removes the field. Validate the result with ``validate_scenario``: typos, and knobs the
    engine's kind or policy cannot use, are caught there.

    Example: ``apply_overrides(d, {"engines.paged.max_num_seqs": 16, "trace.request_rate": 2})``.

    Raises:
        ScenarioError: ``override <key>: <why>`` (no such engine, a path through a non-mapping, empty key).
    """
    out = copy.deepcopy(dict(scenario_dict))
    for key, value in overrides.items():
        parts = str(key).split(".")
        if not key or any(not p for p in parts):
            raise ScenarioError(f"override {key!r}: expected a dotted field path such as trace.request_rate")
        node: Any = out
        for depth, part in enumerate(parts[:-1]):
            here = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                idx = _engine_index(node, part) if depth >= 1 and parts[depth - 1] == "engines" else None
                if idx is None:
                    idx = int(part) if part.isdigit() and int(part) < len(node) else None
                if idx is None:
                    names = [e.get("name") for e in node if isinstance(e, dict)]
                    raise ScenarioError(f"override {key}: no engine named {part!r} at {here}; engines: "
                                        f"{', '.join(map(str, names)) or '(none)'}")
                node = node[idx]
            elif isinstance(node, dict):
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
            else:
                raise ScenarioError(f"override {key}: {'.'.join(parts[:depth])} is not a mapping")
            if not isinstance(node, (dict, list)):
                raise ScenarioError(f"override {key}: {here} is a value ({node!r}), not a mapping")
        last = parts[-1]
        if isinstance(node, list):
            idx = int(last) if last.isdigit() and int(last) < len(node) else None
            if idx is None:
                raise ScenarioError(f"override {key}: no item {last!r} in the list")
            node[idx] = value
        elif value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return out


def _engine_index(engines: list, name: str) -> int | None:
    """Index of the engine called ``name`` in a scenario's raw ``engines`` list, or None."""
    for i, e in enumerate(engines):
        if isinstance(e, dict) and e.get("name") == name:
            return i
    return None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["engines.paged.max_num_seqs=16", "trace.request_rate=2.5"]`` -> a dict; values parse as YAML
    (an empty value is None: the field is removed).

    Raises:
        ScenarioError: an item without ``=`` or with a value that is not valid YAML.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(f"override {item!r}: expected KEY=VALUE, e.g. trace.request_rate=2")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise ScenarioError(f"override {item!r}: value is not valid YAML") from None
    return out
