"""The executor keeps the memory its steps free: a large tensor allocated again touches no new page."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# in a fresh process (the allocator setting is per process and cannot be undone): build a tiny executor, then
# allocate and free a 64 MiB tensor three times and print the minor page faults of the third allocation
CHILD = """
import resource, sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from pathlib import Path
from engines.real.allocator import allocator_setting
from engines.real.model import LlamaModel
from engines.real.model_runner import ModelExecutor
from tiny_model import make_tiny_llama
before = allocator_setting()
ModelExecutor(LlamaModel.from_dir(make_tiny_llama(Path({tmp!r}))), 8, 16)
def touch():
    x = torch.ones(16 * 1024 * 1024)  # 64 MiB, written
    del x
touch()
touch()  # the heap reaches its size in the first two rounds (measured: 16,384 faults in each, then none)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(before, "|", allocator_setting(), "|", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def run_child(tmp_path, keep: str) -> tuple[str, str, int]:
    env = {**os.environ, "WORKBENCH_KEEP_FREED_MEMORY": keep}
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"),
                                                              tmp=str(tmp_path / keep))],
                         env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    before, after, faults = (p.strip() for p in out.split("|"))
    return before, after, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_executor_keeps_freed_memory_so_a_large_step_touches_no_new_page(tmp_path):
    before, after, faults = run_child(tmp_path, "1")
    assert (before, after) == ("not set", "glibc, freed memory kept")
    assert faults < 256  # 64 MiB is 16,384 pages of 4 KiB: none of them is mapped again

    before, after, faults = run_child(tmp_path, "0")
    assert (before, after) == ("not set", "C library defaults")
    assert faults > 4096  # glibc's default: the tensor is mmapped afresh (the opt-out really is the default)
