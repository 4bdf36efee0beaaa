"""The layering the tree shows, checked on the source: every import statement of every ``.py`` file of the
project (module-level and inside functions), read with ``ast``, never executed.

Rules:

* ``engines/`` never imports ``workbench/`` (the workbench drives engines, not the other way round).
* ``engines/core/`` (requests, KV managers, policies, the engine loop) imports no torch and nothing of the
  torch side (``engines.real``, ``kernels``, ``transformers``, ``safetensors``, ``triton``), nor anything
  built on top of it (``engines.sim``, ``engines.factory``, ``engines.llm``): it is the layer both the real
  engine and the simulator stand on.
* ``engines/sim/`` imports no torch at module level (the profiler, which times the real executor, imports it
  inside its functions), and nothing of ``engines.real`` at module level; ``engines/real/`` never imports
  ``engines.sim``.
* ``wb_kernels/`` imports neither ``engines`` nor ``workbench``.
* Nothing in the packages imports ``workbench.cli`` (the Typer app that registers the commands): the
  command modules (``workbench.commands``) and the library stand without it.
* No import cycle between the project's modules, counting imports inside functions too: a deferred import
  hides a cycle from Python, not from the design.

A failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engines", "wb_kernels", "workbench")
SCRIPT_DIRS = ("tests", "benchmarks")  # run as scripts or by pytest: their folder is on sys.path
TORCH_SIDE = ("torch", "triton", "transformers", "safetensors", "wb_kernels", "engines.real")


@dataclass(frozen=True)
class Import:
    file: Path  # relative to ROOT
    line: int
    module: str  # the importing module
    target: str  # the module imported, fully qualified (``torch.nn``, ``engines.core.request``)
    in_function: bool
    text: str  # the statement as written

    def __str__(self) -> str:
        where = "inside a function" if self.in_function else "at module level"
        return f"{self.file}:{self.line}: {self.text!r} ({where})"


def module_name(path: Path) -> str:
    """``engines/core/request.py`` -> ``engines.core.request``; ``engines/__init__.py`` -> ``engines``; a
    script folder's files are top-level modules (``tests/tiny_model.py`` -> ``tiny_model``)."""
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[0] in SCRIPT_DIRS:
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_files() -> list[Path]:
    files = []
    for top in PACKAGES + SCRIPT_DIRS:
        files += [p for p in sorted((ROOT / top).rglob("*.py")) if "__pycache__" not in p.parts]
    return files


def _imports(path: Path, known: set[str]) -> list[Import]:
    """Every import statement of ``path``; ``from A import B`` targets ``A.B`` when that is a project module."""
    tree = ast.parse(path.read_text(), str(path))
    mod = module_name(path)
    is_pkg = path.name == "__init__.py"
    lines = path.read_text().splitlines()
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                text = " ".join(lines[child.lineno - 1: child.end_lineno]).strip()
                rel = path.relative_to(ROOT)
                if isinstance(child, ast.Import):
                    for a in child.names:
                        out.append(Import(rel, child.lineno, mod, a.name, in_function, text))
                else:
                    base = child.module or ""
                    if child.level:  # relative: resolve against this module's package
                        pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                        pkg = pkg[: len(pkg) - (child.level - 1)]
                        base = ".".join(pkg + ([base] if base else []))
                    if base.split(".")[0] in SCRIPT_DIRS and base.split(".", 1)[-1] in known:
                        base = base.split(".", 1)[1]  # ``benchmarks.prompts``: the script folder as a package
                    for a in child.names:
                        sub = f"{base}.{a.name}" if base else a.name
                        out.append(Import(rel, child.lineno, mod, sub if sub in known else base, in_function, text))
            visit(child, fn)

    visit(tree, False)
    return out


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    files = project_files()
    known = {module_name(p) for p in files}
    return [i for p in files for i in _imports(p, known)]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(imports: list[Import], importer: str, forbidden: tuple[str, ...], module_level_only: bool = False):
    return [f"{i} imports {i.target}" for i in imports
            if _under(i.module, importer) and any(_under(i.target, f) for f in forbidden)
            and not (module_level_only and i.in_function)]


def _check(bad: list[str], rule: str) -> None:
    assert not bad, f"{rule}; offending imports:\n  " + "\n  ".join(bad)


def test_the_walk_sees_the_tree(imports):
    files = {str(i.file) for i in imports}
    for f in ("engines/factory.py", "engines/core/llm_engine.py", "engines/sim/simulator.py",
              "engines/real/model_runner.py", "workbench/runner.py"):
        assert f in files, f"{f}: no imports found (moved? update the import-rule test)"
    assert any(i.in_function for i in imports), "function-level imports are not being seen"


def test_engines_never_import_workbench(imports):
    _check(_violations(imports, "engines", ("workbench",)), "engines/ must not import workbench/")


def test_core_imports_no_torch_nor_the_layers_above_it(imports):
    _check(_violations(imports, "engines.core", TORCH_SIDE + ("engines.sim", "engines.factory", "engines.llm")),
           "engines/core/ must not import torch, the torch side (engines.real, wb_kernels) or the layers above it")


def test_sim_imports_no_torch_at_module_level(imports):
    _check(_violations(imports, "engines.sim", TORCH_SIDE, module_level_only=True),
           "engines/sim/ must not import torch or engines.real at module level (only inside functions)")


def test_real_never_imports_the_simulator(imports):
    _check(_violations(imports, "engines.real", ("engines.sim",)), "engines/real/ must not import engines.sim")


def test_kernels_import_neither_engines_nor_workbench(imports):
    _check(_violations(imports, "wb_kernels", ("engines", "workbench")), "wb_kernels/ must not import engines/ or workbench/")


def test_nothing_imports_the_cli(imports):
    bad = [f"{i} imports {i.target}" for i in imports
           if _under(i.target, "workbench.cli") and i.module.split(".")[0] in PACKAGES
           and i.module != "workbench.__main__"]  # ``python -m workbench``: the CLI's other entry point
    _check(bad, "workbench.cli registers the commands; no module of engines/, wb_kernels/ or workbench/ (but "
                "workbench/__main__.py, which runs it) may import it")


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, {})))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def test_no_import_cycles(imports):
    known = {module_name(p) for p in project_files()}
    edges: dict[str, dict[str, Import]] = {m: {} for m in known}
    for i in imports:
        if i.target in known and i.target != i.module:
            edges[i.module].setdefault(i.target, i)
    bad = []
    for comp in _cycles(edges):
        loop = _shortest_cycle(edges, set(comp))
        steps = [str(edges[a][b]) for a, b in zip(loop, loop[1:])]
        bad.append(f"cycle {' -> '.join(loop)} (one of the loops among {', '.join(comp)}):\n    "
                   + "\n    ".join(steps))
    _check(bad, "the module import graph must be acyclic (function-level imports included)")


def _shortest_cycle(edges: dict[str, dict[str, Import]], members: set[str]) -> list[str]:
    """The shortest loop ``[a, b, ..., a]`` inside one strongly connected component (breadth-first)."""
    best: list[str] = []
    for start in sorted(members):
        prev = {start: None}
        queue = [start]
        while queue:
            v = queue.pop(0)
            if start in edges[v]:  # v closes the loop: walk back from v to start
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                loop = path[::-1] + [start]
                if not best or len(loop) < len(best):
                    best = loop
                break
            for w in sorted(edges[v]):
                if w in members and w not in prev:
                    prev[w] = v
                    queue.append(w)
    return best


def test_core_and_sim_load_without_torch():
    """What the ``ast`` walk cannot see: a third-party module that pulls torch in. Importing every core and
    sim module and the factory must leave torch unloaded."""
    mods = sorted(module_name(p) for p in project_files()
                  if module_name(p).startswith(("engines.core", "engines.sim")) or module_name(p) == "engines.factory")
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in mods) + \
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert r.stdout.strip() == "[]", f"importing {', '.join(mods)} loaded {r.stdout.strip()}"


def test_no_top_level_package_shadows_an_installed_distribution():
    """Our top-level packages are on ``sys.path`` twice (the editable install and the checkout as the working
    directory), so a package of another distribution with the same import name is hidden by ours. That is how
    a top-level ``kernels/`` broke ``import transformers`` once transformers (5.25) began to depend on
    Hugging Face's ``kernels`` package: hence ``wb_kernels``."""
    import importlib.metadata

    owners = importlib.metadata.packages_distributions()
    ours = {"llm-serving-workbench", "llm_serving_workbench"}
    clashes = {p: sorted(set(owners.get(p, [])) - ours) for p in PACKAGES}
    assert not {p: d for p, d in clashes.items() if d}, f"import names shared with other distributions: {clashes}"
