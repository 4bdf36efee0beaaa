"""A fair static baseline: padding rows are decode rows of their batch, answers come at the batch's end."""

from __future__ import annotations

import pytest
import torch

from engines.core.config import SchedulerConfig
from engines.core.kv_cache_manager import ContiguousKVCacheManager
from engines.core.request import Request
from engines.core.sampling_params import SamplingParams
from engines.core.static_scheduler import PAD_BLOCK, StaticScheduler
from engines.factory import build_scheduler
from engines.factory import build_sim_engine
from engines.llm import LLM
from engines.sim.cost_model import CostModel, step_features
from engines.sim.simulator import make_sim_engine, simulate
from workbench.metrics import request_metrics
from workbench.scenario import ScenarioError, scenario_hash, validate_scenario
from conftest import require_prerequisite

CM = CostModel({"const": 0.01, "tokens": 0.001, "decode_ctx": 0.0, "prefill_attn": 0.0, "sampled": 0.0})


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def req(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0) -> Request:
    return Request(rid, [5 + i % 7 for i in range(prompt_len)], greedy(max_tokens), arrival_time=arrival)


def step(sched, out, tok: int = 1):
    """Advance ``sched`` by ``out`` as an executor would, sampling ``tok`` for every sampled row."""
    from engines.core.scheduler import StepResult

    return sched.update(out, StepResult({s.request_id: tok for s in out.seqs if s.sample and not s.is_padding}, 0.0))


# ------------------------------------------------------------------------------ scheduler and cost model


def test_padding_row_is_a_decode_row_at_the_batch_length():
    kv = ContiguousKVCacheManager(num_blocks=64, block_size=4)
    sched = StaticScheduler(SchedulerConfig(max_batch_size=3, max_model_len=64, reservation="oracle"), kv)
    for r in (req("a", 3, 1), req("b", 9, 4), req("c", 5, 4)):
        sched.add_request(r)
    step(sched, sched.schedule())  # the ragged prefill; a ends with its only token
    out = sched.schedule()
    pad, b, c = out.seqs
    assert (pad.request_id, pad.is_padding) == ("a", True)
    assert b.is_decode and c.is_decode and b.context_len == 10 and c.context_len == 6
    # the padding row decodes at the longest live row's length, over scratch blocks only, unsampled
    assert pad.is_decode and pad.num_tokens == 1 and not pad.sample
    assert pad.context_len == b.context_len and pad.start_pos == 9
    assert pad.block_table == [PAD_BLOCK] * 3  # ceil(10 / 4)
    # charged as what it is: one more decode token attending over the batch's length, not sampled
    f = step_features(out.seqs)
    assert f["tokens"] == 3 and f["decode_ctx"] == 10 + 10 + 6 and f["sampled"] == 2
    assert f["prefill_attn"] == 0 and f["prefill_ctx"] == 0


def test_step_record_keeps_live_decode_and_padding_counts_apart():
    sched = build_scheduler("static", SchedulerConfig(max_batch_size=2, max_model_len=256), 64, 16)
    eng = make_sim_engine(sched, CM)
    simulate(eng, [req("0", 10, 2), req("1", 10, 5)])
    padded = [s for s in eng.steps if s.num_padding_seqs]
    assert padded and all(s.num_decode_tokens == 1 and s.num_prefill_tokens == 0 for s in padded)


# ------------------------------------------------------------------------------------- completion


def test_simulated_static_e2el_is_the_batch_end_by_default():
    # batch of 2: prefill 20 tokens (0.03 s), then steps of 2 rows (0.012 s): a live row and, once the
    # 2-token request has ended, its padding row; a third request waits for the next batch
    def run(**knobs):
        eng = make_sim_engine(build_scheduler("static", SchedulerConfig(max_batch_size=2, max_model_len=256,
                                                                          **knobs), 64, 16), CM)
        return {o.request_id: o for o in simulate(eng, [req("0", 10, 2), req("1", 10, 6), req("2", 10, 2)])}

    outs = run()
    short, long_ = outs["0"], outs["1"]
    assert short.token_times == pytest.approx([0.03, 0.042])
    assert long_.token_times[-1] == pytest.approx(0.03 + 5 * 0.012)
    assert short.finished_time == pytest.approx(long_.token_times[-1]) == short.completion_time
    m = request_metrics(short)
    assert m.e2el == pytest.approx(0.09) and m.ttft == pytest.approx(0.03)
    assert m.itls == pytest.approx([0.012])  # token times are kept
    assert m.tpot == pytest.approx(0.06)  # (e2el - ttft) / (n - 1): the client's view, waiting included
    assert outs["2"].first_scheduled_time == pytest.approx(0.09)

    own = run(completion="own_end")
    assert own["0"].completion_time is None and own["0"].finished_time == pytest.approx(0.042)
    assert request_metrics(own["0"]).e2el == pytest.approx(0.042)
    assert request_metrics(own["1"]).e2el == pytest.approx(m.e2el)


def test_build_sim_engine_takes_completion_for_the_static_policy_only(tiny_llama_dir):
    from engines.core.config import ModelConfig

    mc = ModelConfig.from_dir(tiny_llama_dir)
    eng = build_sim_engine("static", mc, CM, kv_cache_tokens=1024, max_batch_size=2, completion="own_end")
    assert not eng.scheduler.completes_at_batch_end
    assert build_sim_engine("static", mc, CM, kv_cache_tokens=1024, completion=None).scheduler.completes_at_batch_end
    with pytest.raises(ValueError, match="completion is only for the static policy"):
        build_sim_engine("paged", mc, CM, kv_cache_tokens=1024, completion="own_end")
    with pytest.raises(ValueError, match="completion must be one of batch_end, own_end"):
        build_sim_engine("static", mc, CM, kv_cache_tokens=1024, completion="sometime")


def test_an_abort_that_ends_the_batch_releases_the_held_answers():
    sched = build_scheduler("static", SchedulerConfig(max_batch_size=2, max_model_len=256), 64, 16)
    eng = make_sim_engine(sched, CM)
    for r in (req("0", 10, 1), req("1", 10, 50)):
        eng.add_request(r)
    assert eng.step() == []  # "0" ended with its only token; its answer waits for the batch
    assert eng.abort("1").finish_reason == "abort"
    assert eng.has_unfinished()
    outs = eng.run_to_completion()
    assert [o.request_id for o in outs] == ["0"] and not eng.has_unfinished()


# ---------------------------------------------------------------------------------------- real engine


def _prepared_steps(llm):
    """Wrap the executor's ``_prepare`` to keep each step's (seqs, attention metadata)."""
    ex = llm.engine.executor
    seen, prepare = [], ex._prepare

    def spy(seqs):
        got = prepare(seqs)
        seen.append((list(seqs), got[2]))
        return got

    ex._prepare = spy
    return seen


@pytest.mark.parametrize("device, backend", [("cpu", "torch"), ("cpu", "cpp"), ("cuda", "auto")])
def test_real_padded_batch_matches_each_prompt_alone(tiny_llama_dir, device, backend):
    from wb_kernels import cpu_ops

    if backend == "cpp":
        require_prerequisite(cpu_ops.available(), "the compiled CPU kernel did not build", cpu_ops.build_error())
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 40, 19)]
    params = [greedy(2), greedy(9), greedy(5)]
    llm = LLM(tiny_llama_dir, engine="static", max_batch_size=3, max_model_len=256, kv_cache_tokens=2048,
              block_size=16, attention_backend=backend, device=device)
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    seen = _prepared_steps(llm)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert [len(t) for t in alone] == [2, 9, 5]

    # padding rows went through batched decode attention at the longest live row's length
    scratch = llm.engine.executor.kv.scratch_block
    padded = [(seqs, meta) for seqs, meta in seen if any(s.is_padding for s in seqs)]
    assert padded
    for seqs, meta in padded:
        assert meta.num_prefills == 0 and meta.num_decode_tokens == len(seqs)
        lens = meta.decode_context_lens.tolist()
        live = max(n for s, n in zip(seqs, lens) if not s.is_padding)
        for s, n, row in zip(seqs, lens, meta.decode_block_tables.tolist()):
            if s.is_padding:
                assert n == live and set(row) == {scratch}
    steps = llm.engine.steps
    assert any(s.num_padding_seqs == 2 and s.num_decode_tokens == 1 for s in steps)

    # the 2- and 5-token requests are answered when the 9-token one ends
    short, long_, mid = outs
    assert short.finished_time == long_.finished_time == mid.finished_time == short.completion_time
    assert short.token_times[-1] < long_.token_times[-1] <= short.finished_time
    assert request_metrics(short).e2el == pytest.approx(short.finished_time - short.arrival_time)
    assert request_metrics(short).ttft == pytest.approx(short.first_token_time - short.arrival_time)


def test_real_own_end_answers_at_the_own_last_token(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, engine="static", max_batch_size=2, max_model_len=128, kv_cache_tokens=1024,
              completion="own_end", device="cpu")
    short, long_ = llm.generate([[5, 6, 7], [8, 9, 10, 11]], [greedy(2), greedy(6)])
    assert short.completion_time is None and short.finished_time < long_.token_times[-1]
    assert request_metrics(short).e2el == pytest.approx(short.token_times[-1] - short.arrival_time)
    with pytest.raises(ValueError, match="completion is only for the static engine"):
        LLM(tiny_llama_dir, engine="paged", completion="own_end")


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_decode_kernels_accept_a_repeated_scratch_block_table(backend):
    """A batch with padding rows (the scratch block repeated) gives live rows what they get alone."""
    from wb_kernels.paged_attention import paged_attention_decode as reference

    if backend == "cpp":
        from wb_kernels import cpu_ops

        require_prerequisite(cpu_ops.available(), "the compiled CPU kernel did not build", cpu_ops.build_error())
        decode = cpu_ops.paged_attention_decode
    elif backend == "triton":
        ops = pytest.importorskip("wb_kernels.triton_attention")
        decode = ops.paged_attention_decode
    else:
        decode = reference
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # else Triton's interpreter
    g = torch.Generator().manual_seed(0)
    nb, bs, kvh, h, d = 9, 16, 2, 4, 16
    kc, vc = torch.randn(nb, bs, kvh, d, generator=g), torch.randn(nb, bs, kvh, d, generator=g)
    q = torch.randn(3, h, d, generator=g)
    scratch, ctx = nb - 1, 40  # 3 blocks
    tables = torch.tensor([[0, 3, 5], [scratch] * 3, [scratch] * 3])
    lens = torch.tensor([ctx, ctx, ctx])
    out = decode(*(t.to(dev) for t in (q, kc, vc, tables, lens)), d ** -0.5).cpu()
    alone = reference(q[:1], kc, vc, tables[:1], lens[:1], d ** -0.5)
    torch.testing.assert_close(out[:1], alone, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------ scenarios


def _scenario(engine: dict):
    return validate_scenario({
        "name": "s", "model": "smollm2-135m",
        "trace": {"format": "azure", "path": "builtin:azure_conv_slice.csv", "limit": 4},
        "engines": [engine],
    }, check_files=False)


@pytest.mark.parametrize("engine", [
    {"name": "s", "kind": "static", "completion": "own_end"},
    {"name": "s", "kind": "sim", "policy": "static", "completion": "batch_end"},
])
def test_completion_is_a_static_policy_knob(engine):
    spec = _scenario(engine).engines[0]
    assert spec.completion == engine["completion"]
    from workbench.runner import _knobs

    assert _knobs(spec)["completion"] == engine["completion"]


@pytest.mark.parametrize("engine, where", [
    ({"name": "p", "kind": "paged", "completion": "own_end"}, "kind paged"),
    ({"name": "p", "kind": "sim", "completion": "own_end"}, "kind sim, policy paged"),
    ({"name": "p", "kind": "sim", "policy": "orca", "completion": "batch_end"}, "kind sim, policy orca"),
])
def test_completion_elsewhere_is_a_one_line_error(engine, where):
    with pytest.raises(ScenarioError) as ei:
        _scenario(engine)
    msg = str(ei.value)
    assert "\n" not in msg and "completion is only for static-policy engines" in msg and where in msg


def test_bad_completion_value_and_hash_leaves_the_default_out():
    with pytest.raises(ScenarioError, match="completion") as ei:
        _scenario({"name": "s", "kind": "static", "completion": "later"})
    assert "\n" not in str(ei.value)
    plain = _scenario({"name": "s", "kind": "static"})
    assert plain.engines[0].completion is None
    assert "completion" not in plain.model_dump(mode="json", exclude_defaults=True)["engines"][0]
    assert scenario_hash(plain) != scenario_hash(_scenario({"name": "s", "kind": "static", "completion": "own_end"}))
