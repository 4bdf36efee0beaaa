import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, os.cpu_count() or 1))
if not torch.cuda.is_available():  # Triton kernels run in its interpreter here, whichever test imports Triton first
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_llama_dir):
    from tiny_model import make_tiny_llama

    return {
        "llama": tiny_llama_dir,
        "qwen2": make_tiny_llama(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1),
        "llama3": make_tiny_llama(tmp_path_factory.mktemp("tiny-llama3"), "llama3", seed=2),
    }


@pytest.fixture
def one_thread(monkeypatch):
    """Real runs with one torch thread (``WORKBENCH_THREADS=1``, as the commands read it): robust when other
    processes share the 2 cores. torch's thread count is restored afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setenv("WORKBENCH_THREADS", "1")
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M folder; pulled on first use (about a minute)."""
    from engines.real.model_store import resolve_model

    return resolve_model("smollm2-135m")


def strict_prerequisites() -> bool:
    """True in CI (``CI=true``, as CI runners set it, or ``1``/``yes``) or with ``WORKBENCH_REQUIRE_ALL=1``
    (``.ci/run`` exports it): a test whose prerequisite is missing (a compiler for the CPU kernel, Chromium)
    must fail there, not skip."""
    return (os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
            or os.environ.get("WORKBENCH_REQUIRE_ALL", "").strip() == "1")


def require_prerequisite(ok: bool, what: str, detail: str | None = None) -> None:
    """Nothing when ``ok``; else skip the test on a developer machine, and fail it loudly in CI
    (:func:`strict_prerequisites`) with ``detail`` (say, a build's error output) in the failure text.

    ``what`` names the missing prerequisite in one line, e.g. ``"the CPU kernel did not build"``.
    """
    if ok:
        return
    if strict_prerequisites():
        pytest.fail(f"{what} (required in CI: CI=true or WORKBENCH_REQUIRE_ALL=1)"
                    + (f"\n{detail}" if detail else ""), pytrace=False)
    first = (detail or "").strip().splitlines()
    pytest.skip(f"{what}" + (f": {first[0]}" if first else "") + " (skipped outside CI; CI fails here)")


@pytest.fixture
def require():
    """:func:`require_prerequisite`, for tests: ``require(ok, what, detail)`` skips locally, fails in CI."""
    return require_prerequisite
