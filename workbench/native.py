"""The simulator's hot modules compiled by mypyc: the same source files, built as C extension modules (opt-in).

The simulator's speed is the scheduler's and KV manager's Python work per request per step. mypyc
(https://mypyc.readthedocs.io) compiles type-annotated Python to C extension modules with the same behaviour, so
``activate()`` gives the very code the real engine runs, only faster (about 3x on the whole Azure conversation trace
here, 65.5 s plain against 19.3-21.3 s compiled on a 2-core AVX2 EPYC; outputs and step records hash-identical,
``tests/test_native.py``). The per-step classes declared as dataclasses write out their ``__init__``: mypyc compiles
a written one, while the one ``dataclasses`` generates at import runs interpreted even in a compiled module. Nothing
else changes: no second scheduler, no simplified model.

How: the ``engines`` package is copied to ``$WORKBENCH_CACHE/native/<digest>/`` (default ``~/.cache/workbench``;
digest: the sha256 of every ``engines/**/*.py``, the Python version and the mypy version), the modules in
``COMPILED`` are compiled there (about half a minute, once per digest), and that copy is put first on
``sys.path`` and ``PYTHONPATH`` (so worker processes get it too). Use it before anything imports ``engines``::

    from workbench import native
    native.activate()          # or: python benchmarks/sim_speed.py --native

What differs when compiled: classes in compiled modules are native classes, so their methods cannot be
replaced on an instance or a class (monkeypatching) and interpreted code cannot subclass them; tests run the
plain source. Needs mypy (the ``dev`` extra) and a C compiler.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the per-step path: requests, block pool, KV managers, the scheduler and its policies, the step shape, the engine
# loop and both cost models. A subclass of a compiled class must be compiled too, unless the class allows
# interpreted ones (LLMEngine and RequestOutput do); the event loops in engines/sim/ stay interpreted
COMPILED = (
    "engines/core/request.py",
    "engines/core/sampling_params.py",
    "engines/core/block_pool.py",
    "engines/core/scheduled_seq.py",
    "engines/core/kv_cache_manager.py",
    "engines/core/scheduler.py",
    "engines/core/paged_scheduler.py",
    "engines/core/static_scheduler.py",
    "engines/core/orca_scheduler.py",
    "engines/core/step_shape.py",
    "engines/core/llm_engine.py",
    "engines/core/router.py",
    "engines/sim/cost_model.py",
    "engines/sim/executor.py",
    "engines/sim/analytic_cost_model.py",
)

# mypyc needs the compiled modules type-clean; the modules they import (the factory, the torch side, the event
# loops) are read for their types only, so their own errors are not reported (whether mypy finds them depends on
# what else is installed); third-party packages are opaque (Any)
MYPY_INI = f"""[mypy]
ignore_missing_imports = True
ignore_errors = True

[mypy-{",".join(p[:-3].replace("/", ".") for p in COMPILED)}]
ignore_errors = False

[mypy-numpy.*,torch.*,scipy.*,transformers.*,pandas.*,triton.*]
follow_imports = skip
"""


def cache_root() -> Path:
    """``$WORKBENCH_CACHE/native`` (default ``~/.cache/workbench/native``)."""
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench")).expanduser() / "native"


def source_digest(root: Path = ROOT) -> str:
    """First 16 hex digits of the sha256 of every ``engines/**/*.py`` (path and bytes), the Python version and
    the mypy version: a build is reused only for the same source, interpreter and compiler."""
    import mypy.version

    h = hashlib.sha256(f"{sys.version}|{mypy.version.__version__}|{MYPY_INI}|{COMPILED}".encode())
    for p in sorted((root / "engines").rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def build(root: Path = ROOT, cache: Path | None = None) -> Path:
    """The folder holding a compiled copy of ``root/engines`` (built now unless cached). Returns it.

    Raises:
        RuntimeError: mypy is not installed, or mypyc failed (its last output lines are in the message).
    """
    try:
        source_digest(root)
    except ImportError:
        raise RuntimeError("compiled engines need mypy (pip install -e .[dev])") from None
    out = (cache or cache_root()) / source_digest(root)
    if (out / ".complete").exists():
        return out
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(root / "engines", tmp / "engines", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (tmp / "mypy.ini").write_text(MYPY_INI)
    proc = subprocess.run([sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *COMPILED], cwd=tmp,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"mypyc failed to compile the engines (in {tmp}):\n{tail}")
    shutil.rmtree(tmp / "build", ignore_errors=True)
    (tmp / ".complete").write_text(" ".join(COMPILED) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same build first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / ".complete").exists():
            raise RuntimeError(f"{out}: exists but holds no complete build; remove it and retry") from None
    return out


def activate(root: Path = ROOT) -> Path:
    """Build (or reuse) the compiled engines and import ``engines`` from them from now on, in this process and
    in the processes it starts. Returns the folder.

    Raises:
        RuntimeError: ``engines`` was imported already (from the plain source), or the build failed.
    """
    if "engines" in sys.modules:
        raise RuntimeError("workbench.native.activate() must run before anything imports engines")
    out = build(root)
    sys.path.insert(0, str(out))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(out), os.environ.get("PYTHONPATH")) if p)
    import engines.core.scheduler as probe

    if not probe.__file__ or not probe.__file__.endswith((".so", ".pyd")):
        raise RuntimeError(f"compiled engines not picked up: engines.core.scheduler came from {probe.__file__}")
    return out


def is_active() -> bool:
    """Whether ``engines.core.scheduler`` in this process is the compiled one."""
    mod = sys.modules.get("engines.core.scheduler")
    return bool(mod and getattr(mod, "__file__", "") and mod.__file__.endswith((".so", ".pyd")))
