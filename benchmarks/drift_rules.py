"""How well each drift rule finds the speed a sim engine's real twin ran at, from runs already made.

For every sim engine with a twin in each ``results.json`` given (a run folder or the file), and for each drift
class (small steps: at most ``SCALE_SMALL_TOKENS`` tokens; large: at least ``SCALE_LARGE_TOKENS``), prints the
factor each rule derives from the probes the run recorded (``drift.probes``: seconds and the profile's
reference of each) beside the twin's own speed (``sim_error.speed_matched``: the geometric mean of its steps'
measured over predicted time), and the rule's error ``log(factor / twin speed)``; then, per rule and class, the
mean and max of ``|log(factor / twin speed)|`` over all of them. Rules:

- ``none``: no rescale (1);
- ``agreed``: the probes before and after the runs, the one nearer 1 when both are off by more than the margin
  on the same side, else 1 (``workbench.runner.agreed_factor``; the rule before pilot probes);
- ``ends``: the geometric mean over every probe before and after the runs;
- ``pilots``: the pilot probes timed between the runs' own steps (``workbench.runner.during_factor``; the rule
  a run applies to large steps when it has them);
- ``pooled``: every probe of the class, before, after and between the runs' steps, each timing one sample,
  through ``during_factor`` (the rule a run applies to small steps when it has pilots:
  ``workbench.runner.POOLED_CLASSES``).

Runs made before pilot probes existed have no ``pilots`` or ``pooled`` figure. Usage::

    python benchmarks/drift_rules.py reports/runs/ci-fidelity [more run folders ...]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.sim.cost_model import SCALE_LARGE_TOKENS, SCALE_SMALL_TOKENS  # noqa: E402 (after the path)
from workbench.runner import agreed_factor, during_factor  # noqa: E402

CLASSES = {"small": lambda t: t <= SCALE_SMALL_TOKENS, "large": lambda t: t >= SCALE_LARGE_TOKENS}


def ratio(probes: list[dict]) -> float | None:
    """Geometric mean of measured / reference seconds (None without probes)."""
    logs = [math.log(p["seconds"] / p["reference"]) for p in probes if p["seconds"] > 0 and p["reference"] > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def rules(steps: list[dict], cls: str) -> dict[str, float | None]:
    """Each rule's factor for drift class ``cls`` from one sim engine's recorded probe ``steps``."""
    mine = [p for p in steps if CLASSES[cls](p["features"].get("tokens", 0))]
    phase = {ph: ratio([p for p in mine if p["phase"] == ph]) for ph in ("before", "after", "during")}
    ends = ratio([p for p in mine if p["phase"] in ("before", "after")])
    return {"none": 1.0, "agreed": agreed_factor(phase["before"], phase["after"], ends), "ends": ends,
            "pilots": during_factor(phase["during"]) if phase["during"] is not None else None,
            "pooled": during_factor(ratio(mine)) if phase["during"] is not None else None}


def main(paths: list[str]) -> None:
    errors: dict[tuple[str, str], list[float]] = {}
    for arg in paths:
        path = Path(arg)
        res = json.loads((path / "results.json" if path.is_dir() else path).read_text())
        for name, eng in res["engines"].items():
            d = eng.get("drift")
            matched = ((eng.get("summary") or {}).get("sim_error") or {}).get("speed_matched")
            if not d or not matched:
                continue
            steps = [p for run in d["probes"] for p in run["steps"]]
            parts = []
            for cls in CLASSES:
                twin = matched.get(f"scale_{cls}")
                if twin is None:
                    continue
                cells = []
                for rule, f in rules(steps, cls).items():
                    if f is None:
                        continue
                    err = math.log(f / twin)
                    errors.setdefault((cls, rule), []).append(abs(err))
                    cells.append(f"{rule} {f:.3f} ({err:+.3f})")
                parts.append(f"{cls}: twin {twin:.3f}; " + ", ".join(cells))
            print(f"{arg} {name}: " + " | ".join(parts))
    for (cls, rule), v in sorted(errors.items()):
        print(f"{cls:5s} {rule:7s} mean |log(factor / twin)| {sum(v) / len(v):.3f}  max {max(v):.3f}  (n={len(v)})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
