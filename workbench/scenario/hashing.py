"""``scenario_hash``: what identifies a scenario in results.json, comparisons and gate baselines."""

from __future__ import annotations

import hashlib
import json

from workbench.scenario.schema import Scenario

# test-only knobs: a deliberately slowed run is still the same scenario
UNHASHED_ENGINE_FIELDS = ("test_step_delay_s",)


def scenario_hash(scenario: Scenario) -> str:
    """First 16 hex digits of the sha256 of the scenario's canonical JSON: sorted keys, no whitespace,
    fields left at their defaults omitted (so adding a schema field with a default, or moving a field to
    the kinds that use it, keeps existing hashes), test-only engine knobs omitted.

    Paths hash as written (not resolved), so a scenario keeps its hash when the project moves. A sim
    engine's ``policy`` and ``cost_model`` are filled in on validation, so they hash even when the file
    leaves them out.
    """
    data = scenario.model_dump(mode="json", exclude_defaults=True)
    for eng in data.get("engines", []):
        for name in UNHASHED_ENGINE_FIELDS:
            eng.pop(name, None)
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
