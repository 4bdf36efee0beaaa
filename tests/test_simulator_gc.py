"""The simulators run with Python's cyclic garbage collector paused (``without_cycle_collection``), which is only
safe if a run leaves no reference cycles behind: every step's objects must be freed by reference counting, or a
day-long run would grow. Each workload here runs with the collector off, then a full collection must find
nothing; and the collector's state is restored after a run, also after one that fails."""

from __future__ import annotations

import gc

import pytest

from engines.core.config import SchedulerConfig
from engines.core.request import Request
from engines.core.router import make_router
from engines.core.sampling_params import SamplingParams
from engines.core.spec_decode import SpecDecodeConfig
from engines.factory import build_scheduler
from engines.sim.cluster import simulate_cluster
from engines.sim.cost_model import CostModel
from engines.sim.simulator import make_sim_engine, simulate

CM = CostModel({"const": 0.01, "tokens": 0.001, "decode_ctx": 1e-6, "prefill_attn": 1e-9, "sampled": 1e-4})


def _reqs(count: int, shared: int = 5, **sp) -> list[Request]:
    return [Request(f"r{i}", [3 + ((i % shared) * 131 + k * 17) % 900 for k in range(20 + (i * 37) % 200)],
                    SamplingParams(max_tokens=4 + (i * 13) % 40, **sp), arrival_time=i * 0.02) for i in range(count)]


def _engine(policy: str = "paged", num_blocks: int = 200, spec=None, **cfg):
    c = SchedulerConfig(max_model_len=1024, enable_prefix_caching=policy == "paged", **cfg)
    return make_sim_engine(build_scheduler(policy, c, num_blocks, 16, num_cpu_blocks=32, spec=spec), CM, seed=None)


WORKLOADS = {
    "prefix_hits_and_recompute": lambda: simulate(_engine(num_blocks=60, max_num_batched_tokens=256), _reqs(60)),
    "swap": lambda: simulate(_engine(num_blocks=60, preemption_mode="swap", max_num_batched_tokens=128), _reqs(40)),
    "parallel_sampling": lambda: simulate(_engine(), _reqs(12, n=3, temperature=1.0)),
    "beam_search": lambda: simulate(_engine(), [Request(f"b{i}", [5 + i] * 30, SamplingParams(max_tokens=8, beam_width=3),
                                                        arrival_time=0.1 * i) for i in range(4)]),
    "spec_decode": lambda: simulate(_engine(spec=SpecDecodeConfig.parse("ngram", 3)), _reqs(20, ignore_eos=True)),
    "static": lambda: simulate(_engine("static", max_batch_size=8), _reqs(30)),
    "closed_loop_lazy": lambda: simulate(_engine(), iter(_reqs(40)), max_concurrency=4),
    "cluster": lambda: simulate_cluster([_engine() for _ in range(3)], make_router("prefix_aware"), _reqs(60)).outputs,
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_simulation_leaves_no_reference_cycles(name):
    gc.collect()
    gc.disable()
    try:
        outs = WORKLOADS[name]()
        assert outs and all(o.finish_reason in ("stop", "length") for o in outs)
        beam_outputs = sum(1 for o in outs if o.outputs)
        del outs
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    # the one cycle by design: a finished beam search's output lists itself first in ``outputs`` (as LLM.generate
    # returns it), with its other hypotheses' outputs and their token lists: per beam-search request, not per step
    assert beam_outputs == (4 if name == "beam_search" else 0)
    assert set(garbage) <= {"RequestOutput", "list"}, f"{name}: left in cycles: {sorted(set(garbage))}"
    assert garbage.count("RequestOutput") == 3 * beam_outputs, f"{name}: left in cycles: {garbage}"


def test_the_collector_is_back_on_after_a_run_and_after_a_failed_one():
    assert gc.isenabled()
    simulate(_engine(), _reqs(3))
    assert gc.isenabled()
    with pytest.raises(TypeError, match="VirtualClock"):
        from engines.core.llm_engine import LLMEngine

        simulate(LLMEngine(build_scheduler("paged", SchedulerConfig(), 10, 16), executor=None), [])
    assert gc.isenabled()
    gc.disable()
    try:
        simulate(_engine(), _reqs(3))
        assert not gc.isenabled()  # left off when the caller had it off
    finally:
        gc.enable()
