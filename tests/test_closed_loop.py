"""Closed-loop users (`trace.max_concurrency`): never more than N requests in flight on the real engine, the
simulator and `kind: openai` against `workbench serve`; every request accounted for; N=1 runs requests one
after another; the scenario field and the users sweep."""

import json

import pandas as pd
import pytest
import torch
import yaml
from typer.testing import CliRunner

from engines import LLM
from engines.core.config import SchedulerConfig
from engines.core.request import Request
from engines.core.sampling_params import SamplingParams
from engines.factory import build_scheduler
from engines.sim.cost_model import CostModel
from engines.sim.simulator import make_sim_engine, requests_in_flight, simulate
from server_helpers import running_server
from workbench.cli import app
from workbench.replay import replay_realtime
from workbench.scenario import ScenarioError, load_scenario, scenario_hash, validate_scenario
from workbench.traces import TraceRequest

CM = CostModel({"const": 0.01, "tokens": 0.001, "decode_ctx": 0.0, "prefill_attn": 0.0, "sampled": 0.0})
ENDED = {"stop", "length", "rejected", "failed"}


def make_reqs(n, arrival_gap=0.0, prompt=12, out=4):
    """``n`` greedy requests with prompts of ``prompt`` + i tokens, arriving ``arrival_gap`` seconds apart."""
    return [Request(f"r{i}", [3 + (7 * i + j) % 300 for j in range(prompt + i)],
                    SamplingParams(max_tokens=out + i % 3, temperature=0.0, ignore_eos=True),
                    arrival_time=i * arrival_gap)
            for i in range(n)]


def track_in_flight(engine):
    """Wrap ``engine.add_request`` and ``engine.step``; returns the list of in-flight counts they saw."""
    seen = []
    add, step = engine.add_request, engine.step

    def counted_add(r):
        out = add(r)
        seen.append(requests_in_flight(engine))
        return out

    def counted_step():
        seen.append(requests_in_flight(engine))
        return step()

    engine.add_request, engine.step = counted_add, counted_step
    return seen


def max_overlap(outs):
    """Most requests whose [arrival_time, finished_time] intervals overlap at one instant (ends first on ties)."""
    events = sorted([(o.arrival_time, 1) for o in outs] + [(o.finished_time, -1) for o in outs])
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def assert_one_after_another(outs):
    outs = sorted(outs, key=lambda o: o.arrival_time)
    for prev, nxt in zip(outs, outs[1:]):
        assert nxt.arrival_time >= prev.finished_time, (prev.request_id, nxt.request_id)


# ------------------------------------------------------------------------------------------- real engine


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_tokens=2048, max_model_len=128)


@pytest.mark.parametrize("n", [1, 3])
def test_real_engine_never_more_than_n_in_flight(tiny_llm, n):
    reqs = make_reqs(9)
    reqs.append(Request("too-long", [5] * 200, SamplingParams(max_tokens=4, ignore_eos=True)))  # > max_model_len
    seen = track_in_flight(tiny_llm.engine)
    try:
        outs = replay_realtime(tiny_llm.engine, reqs, max_concurrency=n)
    finally:
        del tiny_llm.engine.add_request, tiny_llm.engine.step
    assert max(seen) == n  # the limit binds, and holds at every add and every step
    assert sorted(o.request_id for o in outs) == sorted(r.request_id for r in reqs)
    assert {o.finish_reason for o in outs} <= ENDED
    assert sum(o.finish_reason == "length" for o in outs) == 9
    assert [o.request_id for o in outs if o.finish_reason == "rejected"] == ["too-long"]
    assert max_overlap([o for o in outs if o.finish_reason != "rejected"]) <= n
    if n == 1:
        assert_one_after_another(outs)


def test_real_engine_failed_step_keeps_every_request(tiny_llm):
    eng = tiny_llm.engine
    execute, calls = eng.executor.execute, []

    def flaky(out):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return execute(out)

    eng.executor.execute = flaky
    try:
        outs = replay_realtime(eng, make_reqs(8), max_concurrency=2)
    finally:
        del eng.executor.execute
    assert len(outs) == 8 and {o.finish_reason for o in outs} <= ENDED
    failed = [o for o in outs if o.finish_reason == "failed"]
    assert failed and all("boom" in o.error or "stopped" in o.error for o in failed)
    assert not eng.has_unfinished()


def test_real_engine_max_concurrency_through_the_runner(tiny_llama_dir):
    from engines.core.config import ModelConfig
    from workbench.runner import run_engine
    from workbench.scenario import load_scenario_trace

    sc = validate_scenario({"name": "cl", "model": str(tiny_llama_dir), "trace": {
        "format": "synthetic", "max_concurrency": 1,
        "synthetic": {"num_requests": 5, "request_rate": float("inf"), "input_tokens": 10, "output_tokens": 3}},
        "engines": [{"name": "paged", "kind": "paged", "kv_cache_tokens": 1024, "max_model_len": 128}]})
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    trace = load_scenario_trace(sc, vocab_hi=300)
    outs, _ = run_engine(sc, sc.engines[0], tiny_llama_dir, cfg, trace, cfg.eos_token_ids[0])
    assert len(outs) == 5 and all(o.finish_reason == "length" for o in outs)
    assert_one_after_another(outs)


# ------------------------------------------------------------------------------------------- simulator


def sim_engine(kv_blocks=256, **knobs):
    return make_sim_engine(build_scheduler("paged", SchedulerConfig(max_model_len=256, **knobs), kv_blocks, 16), CM)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_simulator_never_more_than_n_in_flight(n):
    eng = sim_engine()
    seen = track_in_flight(eng)
    reqs = make_reqs(12, arrival_gap=0.005) + [Request("empty", [], SamplingParams(max_tokens=2))]
    outs = simulate(eng, reqs, max_concurrency=n)
    assert max(seen) == n
    assert all(s.num_running + s.num_waiting <= n for s in eng.steps)
    assert len(outs) == 13 and {o.finish_reason for o in outs} == {"length", "rejected"}
    assert max_overlap([o for o in outs if o.finish_reason != "rejected"]) <= n
    if n == 1:
        assert_one_after_another(outs)


def test_simulator_sends_at_max_of_arrival_and_a_freed_user():
    # one user: requests scheduled at 0, 0 and 10 s; the second waits for the first, the third keeps its time
    eng = sim_engine()
    reqs = make_reqs(3)
    reqs[2].arrival_time = 10.0
    outs = {o.request_id: o for o in simulate(eng, reqs, max_concurrency=1)}
    assert outs["r0"].arrival_time == 0.0
    assert outs["r1"].arrival_time == pytest.approx(outs["r0"].finished_time)
    assert outs["r2"].arrival_time == 10.0 > outs["r1"].finished_time


def test_simulator_enough_users_is_the_open_loop():
    def run(n):
        return [(o.request_id, o.arrival_time, o.first_token_time, o.finished_time)
                for o in simulate(sim_engine(), make_reqs(10, arrival_gap=0.01), max_concurrency=n)]

    assert run(10) == run(None)
    assert run(2) != run(None)
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        simulate(sim_engine(), make_reqs(2), max_concurrency=0)


# ------------------------------------------------------------------------------------------- kind: openai


@pytest.mark.parametrize("n", [1, 2])
def test_openai_replay_never_more_than_n_in_flight(tiny_llama_dir, n):
    from workbench.openai_replay import replay_openai
    from workbench.serve.app import build_app

    llm = LLM(tiny_llama_dir, kv_cache_tokens=2048, max_model_len=128)
    server_seen = track_in_flight(llm.engine)  # measured server-side, in the engine loop
    trace = [TraceRequest(f"t{i}", 0.0, 10 + i, 8 + i % 3, prompt_token_ids=[3 + (5 * i + j) % 300 for j in range(10 + i)])
             for i in range(6)]
    with running_server(build_app(llm, "tiny")) as url:
        outs = replay_openai(url + "/v1", "tiny", trace, max_concurrency=n)
    assert max(server_seen) == n
    assert len(outs) == 6 and all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    assert max_overlap(outs) <= n  # client side: sent-to-ended intervals
    assert all(o.first_token_time >= o.arrival_time for o in outs)
    if n == 1:
        assert_one_after_another(outs)


# ------------------------------------------------------------------------------------------- scenario


def test_scenario_max_concurrency_field(tmp_path):
    base = {"name": "x", "trace": {"format": "synthetic", "synthetic": {"num_requests": 4, "request_rate": 1.0}},
            "engines": [{"name": "sim", "kind": "sim"}]}
    p = tmp_path / "sc.yaml"
    p.write_text(yaml.safe_dump({**base, "trace": {**base["trace"], "max_concurrency": 0}}))
    with pytest.raises(ScenarioError) as e:
        load_scenario(p)
    msg = str(e.value)
    assert "\n" not in msg and "trace.max_concurrency" in msg and "greater than or equal to 1" in msg
    assert validate_scenario({**base, "trace": {**base["trace"], "max_concurrency": 4}}).trace.max_concurrency == 4
    # unset, the field leaves every existing hash as it was (the CI baseline's included)
    baseline = json.loads(open("reports/baselines/ci-sim.json").read())
    assert scenario_hash(load_scenario("scenarios/ci-sim.yaml")) == baseline["scenario_hash"]
    assert scenario_hash(validate_scenario({**base, "trace": {**base["trace"], "max_concurrency": None}})) == \
        scenario_hash(validate_scenario(base))


# ------------------------------------------------------------------------------------------- users sweep


def test_sweep_over_users_plots_against_users(tmp_path, tiny_llama_dir):
    from workbench.sweep_report import sweep_figure

    CostModel({"const": 0.002, "tokens": 1e-4, "decode_ctx": 0, "prefill_attn": 0, "sampled": 0}).save(tmp_path / "cm.json")
    sc = tmp_path / "users.yaml"
    sc.write_text(yaml.safe_dump({
        "name": "users", "model": str(tiny_llama_dir), "seed": 1,
        "trace": {"format": "synthetic", "synthetic": {"num_requests": 16, "request_rate": float("inf"),
                                                       "lengths": "uniform", "input_range": [8, 40],
                                                       "output_range": [4, 8]}},
        "engines": [{"name": "sim-paged", "kind": "sim", "cost_model": "cm.json", "kv_cache_tokens": 2048,
                     "max_model_len": 128}]}))
    out = tmp_path / "sweep"
    before = torch.get_num_threads()
    try:
        r = CliRunner().invoke(app, ["sweep", str(sc), "--set", "trace.max_concurrency=1,2,4,8", "--jobs", "1",
                                     "--no-point-reports", "--out", str(out)])
    finally:
        torch.set_num_threads(before)
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "sweep.csv")
    assert list(df["max_concurrency"]) == [1, 2, 4, 8] and (df["num_finished"] == 16).all()
    tput = df["output_throughput"].to_numpy()
    assert (tput[1:] > tput[:-1]).all(), tput  # more users, bigger batches
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    fig = sweep_figure(df, ["trace.max_concurrency"])
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["output throughput vs users", "TTFT p50 / p99 vs users",
                                               "ITL p50 / p99 vs users", "E2EL p50 / p99 vs users",
                                               "goodput vs users"]
    assert {ax.get_xlabel() for ax in axes} == {"concurrent users (max_concurrency)"}
    assert len(axes[1].get_lines()) == 2  # p50 and p99 of the one engine


def test_static_batch_end_users_wait_for_their_batch():
    """Under completion batch_end a user gets its answer when its static batch ends, so with as many users as
    the batch size every later request is sent exactly at a batch end."""
    sched = build_scheduler("static", SchedulerConfig(max_batch_size=2, max_model_len=64), 64, 16)
    engine = make_sim_engine(sched, CM)
    reqs = [Request(f"r{i}", [5] * 8, SamplingParams(max_tokens=2 + 3 * (i % 2), temperature=0.0, ignore_eos=True))
            for i in range(6)]
    outs = {o.request_id: o for o in simulate(engine, reqs, max_concurrency=2)}
    assert len(outs) == 6 and all(o.finish_reason == "length" for o in outs.values())
    ends = sorted({o.finished_time for o in outs.values()})
    assert len(ends) == 3  # three batches, each answered at once
    for i in range(2, 6):
        assert outs[f"r{i}"].arrival_time in ends[:2]  # sent when the previous batch's answers came back
    assert max_overlap(list(outs.values())) <= 2


def test_failed_step_returns_held_static_answers():
    """A step that fails keeps every request accounted for, answers held for a batch's end included."""
    from workbench.replay import _fail_all

    sched = build_scheduler("static", SchedulerConfig(max_batch_size=2, max_model_len=64), 64, 16)
    engine = make_sim_engine(sched, CM)
    a, b = (Request(n, [5] * 8, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)) for n, m in
            (("a", 1), ("b", 6)))
    engine.add_request(a), engine.add_request(b)
    assert engine.step() == []  # a finished in the prefill step; its answer waits for b
    assert sched.num_unanswered() == 2
    outs = {o.request_id: o for o in _fail_all(engine, "boom")}
    assert outs["a"].finish_reason == "length" and outs["b"].finish_reason == "failed"
    assert not engine.has_unfinished()


def test_pilot_probes_run_between_busy_steps_with_the_replay_clock_stopped(tiny_llm):
    """Pilot probes (machine drift measured during a run) run after steps that computed something, on the KV
    cache's scratch block only, and the replay clock does not count them: the requests' tokens are those of a
    run without them, and the run's times add up to its steps, not to its wall time."""
    import time

    from engines.sim.profiler import PILOT_PROBES, PilotProbe

    class SlowPilot(PilotProbe):  # 20 ms more per pilot, so that a clock that counted them would show it
        def __call__(self, at):
            super().__call__(at)
            time.sleep(0.02)

    eng = tiny_llm.engine
    plain = {o.request_id: o.token_ids for o in replay_realtime(eng, make_reqs(6), max_concurrency=3)}
    pilot = SlowPilot(eng.executor, every_s=0.0)
    n0, t0 = len(eng.steps), time.perf_counter()
    outs = replay_realtime(eng, make_reqs(6), max_concurrency=3, pilot=pilot)
    wall = time.perf_counter() - t0
    steps = eng.steps[n0:]
    assert {o.request_id: o.token_ids for o in outs} == plain  # the pool's blocks are left as they were
    busy = sum(1 for s in steps if s.num_seqs)
    assert busy > 5 and len(pilot.records) == len(PILOT_PROBES) * busy  # after each busy step (every_s 0)
    assert {r["phase"] for r in pilot.records} == {"during"} and {r["probe"] for r in pilot.records} == set(PILOT_PROBES)
    ats = [r["at"] for r in pilot.records]
    assert ats == sorted(ats) and ats[0] >= 0
    end = max(o.finished_time for o in outs)
    assert wall - end >= 0.02 * busy  # the pilots' time is in the wall time ...
    assert end <= sum(s.duration + s.overhead for s in steps) + 0.01 * busy  # ... and not on the replay clock
