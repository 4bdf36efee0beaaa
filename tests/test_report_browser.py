"""Open a generated report.html in headless Chromium and check that its tables and images render; without
Chromium the test skips on a developer machine and fails in CI (``CI=true`` or ``WORKBENCH_REQUIRE_ALL=1``)."""

import re
import shutil
import subprocess
import sys

import pytest
import yaml

from engines.sim.cost_model import CostModel
from workbench.runner import run_scenario
from workbench.scenario import load_scenario

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")

CHROMIUM_MISSING = "chromium is not installed"


def require_chromium(require) -> None:
    """Skip (developer machine) or fail (CI) when no Chromium binary is on PATH."""
    require(CHROMIUM is not None, CHROMIUM_MISSING,
            "looked for chromium, chromium-browser and google-chrome on PATH; .ci/run installs Debian's chromium "
            "with apt-get (see its output)")


def test_a_missing_chromium_skips_locally_and_fails_in_ci(monkeypatch, require):
    me = sys.modules[__name__]
    monkeypatch.setattr(me, "CHROMIUM", None)
    for var in ("CI", "WORKBENCH_REQUIRE_ALL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(pytest.skip.Exception, match=CHROMIUM_MISSING):
        require_chromium(require)
    for var, value in (("CI", "true"), ("CI", "True"), ("WORKBENCH_REQUIRE_ALL", "1")):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            with pytest.raises(pytest.fail.Exception, match=CHROMIUM_MISSING):
                require_chromium(require)
    monkeypatch.setattr(me, "CHROMIUM", "/usr/bin/chromium")
    monkeypatch.setenv("CI", "true")
    require_chromium(require)  # found: neither skips nor fails


def test_report_renders_in_headless_chromium(tmp_path, tiny_llama_dir, require):
    require_chromium(require)
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
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    dom = proc.stdout
    assert dom, f"chromium printed no DOM (exit status {proc.returncode}): {proc.stderr[-2000:]}"
    attrs = dict(re.findall(r'data-([a-z-]+)="(\d+)"', dom))
    assert attrs.get("images-total") == "6", dom[:500]  # 5 run plots + the sim-vs-real fidelity plot
    assert attrs.get("images-rendered") == "6"
    assert int(attrs.get("table-rows", 0)) >= 3  # 2 summary rows + 1 sim-error row
    assert "Simulator vs real" in dom and "<table>" in dom
