"""Speculative decoding in the simulator over a measured cost model: the PagedScheduler's own speculative path
with placeholder drafts, and PagedSpecExecutor's seeded acceptance draws and charges."""

import pytest

from engines.core.request import Request
from engines.core.sampling_params import SamplingParams
from engines.factory import EngineConfig, build_engine
from engines.sim.catalog import get_model
from engines.sim.cost_model import CostModel
from engines.sim.simulator import simulate
from engines.sim.spec_decode import PagedSpecExecutor, SimSpecDecode, conditional_rates

# per step: 10 ms + 1 ms per token (a verify row of 1 + k tokens costs k ms more than a decode row)
CM = CostModel({"const": 0.01, "tokens": 0.001, "decode_ctx": 0.0, "prefill_attn": 0.0, "sampled": 0.0})
MC = get_model("smollm2-135m").to_model_config()  # 30 layers


def engine(**knobs):
    base = dict(kind="sim", cost_model=CM, model_config=MC, kv_cache_tokens=4096, max_model_len=1024,
                step_noise=False)
    return build_engine(EngineConfig(**{**base, **knobs}))


def reqs(n=4, prompt=32, out=64):
    return [Request(str(i), [1 + (i * 97 + j) % 500 for j in range(prompt)],
                    SamplingParams(max_tokens=out, ignore_eos=True)) for i in range(n)]


def run(eng, n=4, prompt=32, out=64):
    outs = simulate(eng, reqs(n, prompt, out))
    return {o.request_id: o for o in outs}


def assert_no_leaks(eng):
    pool = eng.scheduler.kv.pool
    assert not eng.scheduler.requests and pool.num_free_blocks == pool.num_blocks


def test_builds_the_paged_scheduler_with_placeholder_drafts():
    eng = engine(speculative_model="ngram", num_speculative_tokens=3, spec_acceptance_rate=0.5)
    spec = eng.scheduler.spec
    assert spec.placeholder_drafts and not spec.proposes_in_scheduler and eng.scheduler.proposer is None
    assert isinstance(eng.executor, PagedSpecExecutor)


def test_runs_are_deterministic_per_seed():
    def timeline(seed):
        eng = engine(speculative_model="ngram", num_speculative_tokens=4, spec_acceptance_rate=0.6, seed=seed)
        outs = run(eng)
        return [outs[r].token_times for r in sorted(outs)], eng.scheduler.spec_stats.as_dict()

    assert timeline(1) == timeline(1)
    assert timeline(1) != timeline(2)


@pytest.mark.parametrize("a,k", [(0.3, 2), (0.7, 4), (0.9, 8)])
def test_mean_tokens_per_verify_matches_the_formula(a, k):
    eng = engine(speculative_model="ngram", num_speculative_tokens=k, spec_acceptance_rate=a, max_model_len=4096,
                 kv_cache_tokens=65536)
    outs = run(eng, n=8, prompt=16, out=2000)
    assert all(len(o.token_ids) == 2000 for o in outs.values())
    st = eng.scheduler.spec_stats
    want = (1 - a ** (k + 1)) / (1 - a)
    # rows near max_tokens get fewer than k drafts; they are a few per request out of hundreds of verifies
    assert st.mean_acceptance_length == pytest.approx(want, rel=0.03)
    assert eng.executor.spec.expected_tokens_per_verify() == pytest.approx(want)
    assert_no_leaks(eng)


def test_no_block_leaks_with_prefix_caching_preemption_and_short_outputs():
    # a small pool forces preemptions; short and odd output lengths end requests inside a speculative step
    eng = engine(speculative_model="ngram", num_speculative_tokens=5, spec_acceptance_rate=0.8, kv_cache_tokens=640,
                 block_size=16)
    outs = simulate(eng, [Request(str(i), [7] * 40 + [i], SamplingParams(max_tokens=3 + 17 * i, ignore_eos=True))
                          for i in range(12)])
    assert sorted(len(o.token_ids) for o in outs) == sorted(3 + 17 * i for i in range(12))
    assert eng.scheduler.num_preemptions > 0
    assert_no_leaks(eng)


def test_zero_acceptance_is_k_drafts_all_rejected():
    k = 4
    eng = engine(speculative_model="ngram", num_speculative_tokens=k, spec_acceptance_rate=0.0)
    plain = engine()
    outs, base = run(eng, n=2, out=20), run(plain, n=2, out=20)
    st = eng.scheduler.spec_stats
    assert st.num_accepted_tokens == 0 and st.mean_acceptance_length == 1.0
    assert st.num_draft_tokens == sum(min(k, 20 - 1 - i) for i in range(1, 19)) * 2  # k, fewer near max_tokens
    # one token per step, as without speculation, but each verify row computes its k drafts too
    assert len(eng.steps) == len(plain.steps)
    assert all(s.spec_drafts == 2 for s in eng.steps[1:-1])
    assert outs["0"].finished_time > base["0"].finished_time
    assert_no_leaks(eng)


def test_speculation_shortens_latency_at_high_acceptance_and_charges_the_verify_shape():
    spec = engine(speculative_model="ngram", num_speculative_tokens=4, spec_acceptance_rate=1.0)
    plain = engine()
    s, p = run(spec, n=1, out=61), run(plain, n=1, out=61)
    # 1 prefill + 60 tokens: 12 verify steps of 5 tokens each (10 + 5 ms) vs 60 decode steps (11 ms)
    assert len(spec.steps) == 13 and len(plain.steps) == 61
    assert s["0"].finished_time - plain.steps[0].duration == pytest.approx(12 * 0.015)
    assert p["0"].finished_time - plain.steps[0].duration == pytest.approx(60 * 0.011)


def test_layers_draft_charges_n_over_l_of_k_decode_steps():
    # a = 1: every step is a full verify of k = 2 drafts, plus 2 draft steps of (N/L) x (10 + 1) ms
    n = 15
    eng = engine(speculative_model=f"layers:{n}", num_speculative_tokens=2, spec_acceptance_rate=1.0)
    outs = run(eng, n=1, out=31)
    verify = 0.010 + 0.003
    draft = 2 * (n / 30) * 0.011
    assert outs["0"].finished_time - eng.steps[0].duration == pytest.approx(10 * (verify + draft))
    assert eng.executor.draft_time == pytest.approx(10 * draft)


def test_draft_rate_prices_draftless_rows_as_decode_rows():
    eng = engine(speculative_model="ngram", num_speculative_tokens=3, spec_acceptance_rate=1.0, spec_draft_rate=0.0)
    plain = engine()
    assert run(eng, n=1, out=30)["0"].finished_time == pytest.approx(run(plain, n=1, out=30)["0"].finished_time)
    assert eng.executor.stats.num_drafts == 0
    assert_no_leaks(eng)


def test_per_position_rates_and_their_estimate_from_counters():
    sp = SimSpecDecode.build("ngram", 3, [0.5, 1.0, 0.0], 30)
    assert sp.expected_tokens_per_verify() == pytest.approx(1 + 0.5 + 0.5)
    stats = {"acceptance_rate_per_pos": [0.8, 0.4, 0.2]}
    assert conditional_rates(stats, 3) == pytest.approx([0.8, 0.5, 0.5])
    assert conditional_rates({"acceptance_rate_per_pos": [0.5]}, 3) == pytest.approx([0.5, 0.5, 0.5])


@pytest.mark.parametrize("knobs,msg", [
    (dict(speculative_model="ngram", num_speculative_tokens=3), "needs spec_acceptance_rate"),
    (dict(speculative_model="ngram", num_speculative_tokens=3, spec_acceptance_rate=1.5), "in [0, 1]"),
    (dict(speculative_model="ngram", num_speculative_tokens=3, spec_acceptance_rate=[0.5]), "3 drafts"),
    (dict(speculative_model="layers:31", num_speculative_tokens=2, spec_acceptance_rate=0.5), "only 30 layers"),
    (dict(speculative_model="ngram", num_speculative_tokens=2, spec_acceptance_rate=0.5, policy="orca"),
     "paged policy"),
    (dict(num_speculative_tokens=2), "need speculative_model"),
    (dict(speculative_model="medusa", num_speculative_tokens=2, spec_acceptance_rate=0.5), "'ngram'"),
])
def test_bad_fields_are_one_line_errors(knobs, msg):
    with pytest.raises(ValueError, match=None) as e:
        engine(**knobs)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_spec_draft_rate_is_refused_elsewhere():
    with pytest.raises(ValueError, match="spec_draft_rate"):
        build_engine(EngineConfig(kind="paged", model="smollm2-135m", spec_draft_rate=0.5))
    with pytest.raises(ValueError, match="spec_draft_rate: only for a sim over a measured"):
        build_engine(EngineConfig(kind="sim", hardware="h100-sxm", model="llama-3.1-8b", spec_draft_rate=0.5))


def test_spec_sweep_on_a_measured_profile_gains_less_as_batch_grows(tiny_llama_dir):
    from workbench.commands.spec_sweep import spec_sweep_profile

    rows = spec_sweep_profile(str(tiny_llama_dir), draft="ngram", k=4, acceptance=0.8, batches=(1, 8),
                              prompt_tokens=32, output_tokens=64, cost_model=CM)
    one, eight = rows
    assert one["tokens_per_step_expected"] == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert one["speedup"] > eight["speedup"] > 1.0
    assert one["decode_steps_spec"] < one["decode_steps"] == 63 and one["draft_time_s"] == 0.0
    (lay,) = spec_sweep_profile(str(tiny_llama_dir), draft="layers:1", k=2, acceptance=0.5, batches=(1,),
                                prompt_tokens=32, output_tokens=64, cost_model=CM)
    assert lay["draft_time_s"] > 0


def test_spec_sweep_cli_profile_mode_errors_are_one_line(tiny_llama_dir, tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    r = CliRunner().invoke(app, ["spec-sweep", "--profile", str(tmp_path / "none.json"), "--model",
                                 str(tiny_llama_dir), "--batches", "1", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "not a cost-model profile" in r.output
    r = CliRunner().invoke(app, ["spec-sweep", "--draft-rate", "0.5", "--batches", "1", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--draft-rate is for --profile" in r.output
    CM.save(tmp_path / "cm.json")
    r = CliRunner().invoke(app, ["spec-sweep", "--profile", str(tmp_path / "cm.json"), "--model", str(tiny_llama_dir),
                                 "--draft", "layers:99", "--k", "2", "--batches", "1", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "layers" in r.output
    r = CliRunner().invoke(app, ["spec-sweep", "--profile", str(tmp_path / "cm.json"), "--model", str(tiny_llama_dir),
                                 "--k", "4", "--acceptance", "0.8", "--batches", "1,4", "--prompt-tokens", "32",
                                 "--output-tokens", "32", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "this machine's profile" in r.output and (tmp_path / "spec_sweep.csv").exists()
