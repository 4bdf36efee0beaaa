"""Acceptance: lm-eval 0.4.13 scores SmolLM2-135M the same through ``workbench serve`` (its
``local-completions`` model: loglikelihoods from ``logprobs`` + ``echo``, greedy generations) as through
transformers (its ``hf`` model) on the same float32 weights.

Two small local tasks (``tests/data/lm_eval``): multiple choice by loglikelihood (``acc``, ``acc_norm``)
and greedy ``generate_until`` (``exact_match``). Asserted: identical scores, every per-request
loglikelihood within 1e-3 with the same ``is_greedy`` flag, identical generations. The lm-eval venv is
built once and cached (``benchmarks/peers/lm_eval_check.py``, which also runs this comparison by hand);
where it cannot be built the tests skip, and fail in CI (``WORKBENCH_REQUIRE_ALL=1``).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_prerequisite

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from peers import lm_eval_check as lec  # noqa: E402

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def runs(smollm2_dir, tmp_path_factory):
    """The comparison, both lm-eval runs and the venv's build record (one run of each for the module)."""
    try:
        venv = lec.ensure_lm_eval_venv(log=lambda m: print(m, flush=True))
    except (lec.LmEvalError, subprocess.SubprocessError, OSError) as e:
        require_prerequisite(False, f"the lm-eval {lec.LM_EVAL_VERSION} venv could not be built", str(e))
    return lec.check(Path(smollm2_dir), tmp_path_factory.mktemp("lm-eval"), venv=venv)


def test_scores_match(runs, capsys):
    c, hf, srv, venv = runs
    with capsys.disabled():
        print(f"\nlm-eval venv {lec.venv_dir()}: {'built now' if venv['built_now'] else 'cached'}, "
              f"build {venv['seconds']} s")
        print(lec.report(c, hf, srv))
    for key, (a, b) in c.metrics.items():
        assert a == b, f"{key}: hf {a} != server {b}"
    # the tasks are not degenerate: some answers right, some wrong
    assert 0 < hf.metric(lec.MC_TASK, "acc,none") < 1
    assert 0 < hf.metric(lec.GEN_TASK, "exact_match,strip") < 1


def test_loglikelihoods_match(runs):
    c, hf, srv, _ = runs
    n = sum(len(s["resps"]) for s in hf.samples[lec.MC_TASK])
    assert c.loglik_pairs == n == 4 * len(hf.samples[lec.MC_TASK]) > 0
    bad = [p for p in c.problems if p.startswith(lec.MC_TASK)]
    assert not bad, f"max |diff| {c.max_loglik_diff:.3e}; " + "\n".join(bad)
    assert c.max_loglik_diff <= lec.LOGLIK_TOL
    # the is_greedy comparison is not vacuous: some continuations are the model's greedy choice
    assert any(g for s in hf.samples[lec.MC_TASK] for _, g in lec.lls(s))


def test_generations_match(runs):
    c, hf, srv, _ = runs
    assert len(hf.samples[lec.GEN_TASK]) == len(srv.samples[lec.GEN_TASK]) > 0
    bad = [p for p in c.problems if p.startswith(lec.GEN_TASK)]
    assert not bad, "\n".join(bad)
