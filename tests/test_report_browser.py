"""Open a generated report.html in headless Chromium and check that its tables and images render."""

import os
import re
import shutil
import subprocess

import pytest
import yaml

from engines.sim.cost_model import CostModel
from workbench.runner import run_scenario
from workbench.scenario import load_scenario

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


# Skipped on a developer machine without Chromium; in CI (.ci/run installs it) a missing browser is a failure.
@pytest.mark.skipif(CHROMIUM is None and os.environ.get("CI") != "true",
                    reason="chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(tmp_path, tiny_llama_dir):
    assert CHROMIUM is not None, "CI: chromium is not installed (apt-get install chromium failed in .ci/run)"
    CostModel({"const": 0.002, "tokens": 1e-4, "decode_ctx": 0, "prefill_attn": 0, "sampled": 0}).save(tmp_path / "cm.json")
    scenario = {
        "name": "browser", "model": str(tiny_llama_dir),
        "trace": {"format": "synthetic", "synthetic": {"num_requests": 6, "request_rate": 50.0, "input_tokens": 20,
                                                       "output_tokens": 4}},
        "engines": [{"name": "paged", "kind": "paged", "kv_cache_tokens": 256, "max_model_len": 64},
                    {"name": "sim", "kind": "sim", "policy": "paged", "cost_model": "cm.json", "kv_cache_tokens": 256,
                     "max_model_len": 64}],
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(scenario))
    run_scenario(load_scenario(tmp_path / "s.yaml"), tmp_path / "out")
    page = (tmp_path / "out" / "report.html").resolve()
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120).stdout
    attrs = dict(re.findall(r'data-([a-z-]+)="(\d+)"', dom))
    assert attrs.get("images-total") == "6", dom[:500]  # 5 run plots + the sim-vs-real fidelity plot
    assert attrs.get("images-rendered") == "6"
    assert int(attrs.get("table-rows", 0)) >= 3  # 2 summary rows + 1 sim-error row
    assert "Simulator vs real" in dom and "<table>" in dom
