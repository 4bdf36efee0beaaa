"""The simulator drives the real schedulers with a cost model on a virtual clock."""

import pytest

from engines.core.config import SchedulerConfig
from engines.core.request import Request
from engines.core.sampling_params import SamplingParams
from engines.factory import build_scheduler
from engines.sim.cost_model import FEATURES, CostModel, step_features
from engines.sim.simulator import make_sim_engine, simulate

CM = CostModel({"const": 0.01, "tokens": 0.001, "decode_ctx": 0.0, "prefill_attn": 0.0, "sampled": 0.0})


def reqs(specs):
    return [Request(str(i), [5] * p, SamplingParams(max_tokens=o, ignore_eos=True), arrival_time=t)
            for i, (t, p, o) in enumerate(specs)]


def test_single_request_timeline_is_exact():
    eng = make_sim_engine(build_scheduler("paged", SchedulerConfig(max_model_len=512), 64, 16), CM)
    outs = simulate(eng, reqs([(1.0, 100, 3)]))
    (o,) = outs
    # prefill step: 0.01 + 100 * 0.001 = 0.11 s, then two decode steps of 0.011 s
    assert o.first_token_time == pytest.approx(1.11)
    assert o.token_times == pytest.approx([1.11, 1.121, 1.132])
    assert o.finished_time == pytest.approx(1.132)
    assert len(eng.steps) == 3


def test_requests_arriving_during_a_step_join_the_next_one():
    eng = make_sim_engine(build_scheduler("paged", SchedulerConfig(max_model_len=512), 64, 16), CM)
    outs = {o.request_id: o for o in simulate(eng, reqs([(0.0, 100, 2), (0.05, 10, 2)]))}
    assert outs["1"].first_scheduled_time == pytest.approx(0.11)  # after the first prefill step ends
    assert eng.steps[1].num_seqs == 2


def test_static_policy_waits_for_the_longest_member():
    eng = make_sim_engine(build_scheduler("static", SchedulerConfig(max_model_len=256, max_batch_size=2), 64, 16), CM)
    outs = {o.request_id: o for o in simulate(eng, reqs([(0, 10, 2), (0, 10, 6), (0, 10, 2)]))}
    # the third request is admitted only when the 6-token member ends
    assert outs["2"].first_scheduled_time == pytest.approx(outs["1"].finished_time)
    assert max(s.num_padding_seqs for s in eng.steps) == 1


def test_all_requests_accounted_for_including_rejections():
    eng = make_sim_engine(build_scheduler("paged", SchedulerConfig(max_model_len=128), 16, 16), CM)
    outs = simulate(eng, reqs([(0, 100, 10), (0, 200, 10), (0.5, 50, 0)]))
    assert sorted(o.finish_reason for o in outs) == ["length", "rejected", "rejected"]


def test_cost_model_fit_recovers_coefficients_and_round_trips(tmp_path):
    true = CostModel({"const": 0.02, "tokens": 0.003, "decode_ctx": 1e-6, "prefill_attn": 2e-9, "sampled": 4e-4})
    rows = []
    for b in (1, 4, 16, 64):
        for c in (64, 512):
            f = {"const": 1, "tokens": b, "decode_ctx": b * c, "prefill_attn": 0, "sampled": b}
            rows.append((f, true.predict_features(f)))
    for p in (32, 256, 1024):
        f = {"const": 1, "tokens": p, "decode_ctx": 0, "prefill_attn": p * p, "sampled": 1}
        rows.append((f, true.predict_features(f)))
    cm = CostModel.fit(rows)
    for f, t in rows:
        assert cm.predict_features(f) == pytest.approx(t, rel=1e-6)
    cm.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json").coef == pytest.approx(cm.coef)
    with pytest.raises(ValueError, match="not a cost-model profile"):
        CostModel.load(tmp_path / "missing.json")


def test_cost_model_fit_recovers_known_nonnegative_coefficients():
    # exact times from coefficients with one zero (prefill_attn): the fit returns them, the zero stays 0
    true = {"const": 0.015, "tokens": 2e-3, "decode_ctx": 5e-7, "prefill_attn": 0.0, "sampled": 3e-4}
    decodes = [{"const": 1, "tokens": b, "decode_ctx": b * c, "prefill_attn": 0, "sampled": b}
               for b in (1, 8, 32) for c in (16, 256)]
    prefills = [{"const": 1, "tokens": n, "decode_ctx": 0, "prefill_attn": n * n, "sampled": 1} for n in (16, 128, 512)]
    rows = [(f, sum(true[k] * f[k] for k in FEATURES)) for f in decodes + prefills]
    coef = CostModel.fit(rows).coef
    for k in FEATURES:
        assert coef[k] == pytest.approx(true[k], rel=1e-6, abs=1e-15), k


def _relative_sse(rows, c):
    return sum(((sum(c[i] * f[k] for i, k in enumerate(FEATURES)) - t) / t) ** 2 for f, t in rows)


def _nnls_by_enumeration(rows):
    """The exact minimiser of the fit's objective over c >= 0 (sum of squared relative errors): the best
    of the least-squares solutions on each subset of features that come out non-negative (the optimum is
    the least-squares solution on its own support)."""
    import itertools

    import numpy as np

    a = np.array([[f[k] / t for k in FEATURES] for f, t in rows])
    best = None
    for n in range(1, len(FEATURES) + 1):
        for support in itertools.combinations(range(len(FEATURES)), n):
            sol, *_ = np.linalg.lstsq(a[:, support], np.ones(len(rows)), rcond=None)
            if (sol >= 0).all():
                c = np.zeros(len(FEATURES))
                c[list(support)] = sol
                if best is None or _relative_sse(rows, c) < _relative_sse(rows, best):
                    best = c
    return best


def _drop_most_negative_column(rows):
    """The fit this project used before scipy's NNLS (columns scaled to a maximum of 1 as in
    ``CostModel.fit``): least squares, then drop the most negative coefficient's feature and refit until
    none is negative (not a true NNLS)."""
    import numpy as np

    x = np.array([[f[k] for k in FEATURES] for f, _ in rows], dtype=float)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    a = x / scale / np.array([t for _, t in rows])[:, None]
    active = list(range(len(FEATURES)))
    while True:
        sol, *_ = np.linalg.lstsq(a[:, active], np.ones(len(rows)), rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            c = np.zeros(len(FEATURES))
            c[active] = np.maximum(sol, 0) / scale[active]
            return c
        active.pop(int(np.argmin(sol)))


def test_cost_model_fit_is_the_true_nnls_where_dropping_columns_is_not():
    # unconstrained least squares gives tokens, decode_ctx and prefill_attn negative coefficients, prefill_attn
    # the most negative; the drop-a-column loop drops it first, then tokens and decode_ctx, and ends on const
    # alone. The optimum keeps prefill_attn (the largest coefficient) with const and a little tokens: about a
    # tenth of the loop's squared relative error.
    grid = [(1, 3, 2, 4), (0, 1, 3, 5), (2, 1, 2, 5), (3, 3, 1, 2), (1, 0, 3, 5)]  # tokens, decode_ctx, prefill_attn, s
    rows = [({"const": 1, "tokens": a, "decode_ctx": b, "prefill_attn": c, "sampled": 0}, float(t))
            for a, b, c, t in grid]
    best = _nnls_by_enumeration(rows)
    old = _drop_most_negative_column(rows)
    assert [k for k, v in zip(FEATURES, old) if v > 0] == ["const"]
    assert _relative_sse(rows, old) > 5 * _relative_sse(rows, best)
    coef = CostModel.fit(rows).coef
    assert [coef[k] for k in FEATURES] == pytest.approx(list(best), abs=1e-9)
    assert coef["prefill_attn"] > 1 and coef["decode_ctx"] == coef["sampled"] == 0


def test_step_features():
    from engines.core.scheduler import ScheduledSeq

    sp = SamplingParams()
    seqs = [ScheduledSeq("a", [1], 99, [0], True, sp), ScheduledSeq("b", [1] * 10, 20, [0], False, sp)]
    f = step_features(seqs)
    assert f == {"const": 1.0, "tokens": 11, "decode_ctx": 100, "prefill_attn": 300, "prefill_ctx": 200, "sampled": 1,
                 "decode_rows": 1, "padding_rows": 0, "prefill_seqs": 1, "prefill_tokens": 10, "rows": 1,
                 "padding_ctx": 0, "live_ctx": 100, "scattered_ctx": 0.0}


def _random_specs(n, seed=3):
    import random

    rnd, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rnd.choice((0.0, rnd.expovariate(8.0)))  # some requests arrive together
        out.append((round(t, 3), rnd.randint(1, 300), rnd.randint(0, 40)))
    return out


def _timeline(outs):
    return [(o.request_id, o.finish_reason, o.first_token_time, o.finished_time, tuple(o.token_times)) for o in outs]


@pytest.mark.parametrize("limit", [None, 3])
def test_lazily_read_requests_give_the_same_run_as_a_list(limit):
    """A generator of requests (read one arrival ahead) and the same requests as a list give identical outputs
    and step records, open loop and closed loop, rejections included (max_tokens 0 is rejected)."""
    specs = _random_specs(120)
    runs = []
    for lazy in (False, True):
        eng = make_sim_engine(build_scheduler("paged", SchedulerConfig(max_model_len=512, max_num_seqs=8), 24, 16), CM)
        rs = reqs(specs)
        outs = simulate(eng, (r for r in rs) if lazy else rs, max_concurrency=limit)
        runs.append((_timeline(outs), [(s.start, s.duration, s.num_seqs, s.num_preemptions) for s in eng.steps]))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) == 120 and any(r[1] == "rejected" for r in runs[0][0])
    assert sum(s[3] for s in runs[0][1]) > 0  # the small pool preempts: the paths agree there too


def test_streamed_outputs_and_steps_add_up_to_a_kept_run():
    """on_output gets every output (none is returned), on_steps every step record but the last ones, which
    stay on the engine: together exactly what a run that keeps everything has."""
    specs = _random_specs(80, seed=5)
    kept = make_sim_engine(build_scheduler("paged", SchedulerConfig(max_model_len=512), 64, 16), CM)
    want = simulate(kept, reqs(specs))
    eng = make_sim_engine(build_scheduler("paged", SchedulerConfig(max_model_len=512), 64, 16), CM)
    got, drained = [], []
    assert simulate(eng, iter(reqs(specs)), on_output=got.append, on_steps=drained.extend, steps_window=16) == []
    assert _timeline(got) == _timeline(want)
    assert len(eng.steps) <= 17 and len(drained) > 0
    assert [s.step for s in drained + eng.steps] == [s.step for s in kept.steps]


def test_lazily_read_requests_out_of_arrival_order_are_refused():
    rs = reqs([(0.0, 10, 2), (1.0, 10, 2), (0.5, 10, 2)])
    eng = make_sim_engine(build_scheduler("paged", SchedulerConfig(max_model_len=512), 64, 16), CM)
    with pytest.raises(ValueError, match=r"request 2: arrives at 0\.500000 s, before request 1"):
        simulate(eng, iter(rs))
