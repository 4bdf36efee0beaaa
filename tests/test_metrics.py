"""Metrics with vllm bench serve's definitions, on hand-made records."""

from types import SimpleNamespace

import pytest

from engines.core.llm_engine import StepRecord
from workbench.metrics import dist, kv_summary, request_metrics, summarize


def out(rid, arrival, token_times, status="length", prompt=10, error=None):
    return SimpleNamespace(request_id=rid, arrival_time=arrival, first_token_time=token_times[0] if token_times else None,
                           finished_time=token_times[-1] if token_times else arrival, token_times=token_times,
                           token_ids=[1] * len(token_times), prompt_token_ids=[0] * prompt, finish_reason=status,
                           error=error, num_preemptions=0, first_scheduled_time=arrival)


def step(start, dur, alloc, states, reserved=0, internal=0, external=0, pre=0):
    return StepRecord(0, start, dur, 1, 0, 1, 0, 1, 0, pre, 100, alloc, states, reserved, internal, external)


def test_request_metrics_follow_vllm_definitions():
    m = request_metrics(out("a", 1.0, [1.5, 1.7, 2.0, 2.5]))
    assert m.ttft == pytest.approx(0.5)
    assert m.e2el == pytest.approx(1.5)
    assert m.tpot == pytest.approx((1.5 - 0.5) / 3)  # excludes the first token
    assert m.itls == pytest.approx([0.2, 0.3, 0.5])


def test_summary_throughputs_goodput_and_counts():
    outs = [out("a", 0.0, [1.0, 2.0]), out("b", 1.0, [3.0, 4.0, 5.0]), out("c", 2.0, [], status="rejected", error="too long")]
    s = summarize(outs, [step(0, 1, 10, 9)], 3, slo={"ttft_ms": 1500, "tpot_ms": None, "e2el_ms": None})
    assert s["duration_s"] == pytest.approx(5.0)
    assert s["request_throughput"] == pytest.approx(2 / 5)
    assert s["output_throughput"] == pytest.approx(5 / 5)
    assert s["total_token_throughput"] == pytest.approx((5 + 20) / 5)
    assert s["goodput"] == pytest.approx(1 / 5)  # only "a" has TTFT <= 1.5 s
    assert (s["num_finished"], s["num_rejected"], s["num_failed"]) == (2, 1, 0)
    assert s["ttft_ms"]["p50"] == pytest.approx(1500.0)
    assert s["reject_reasons"] == ["too long"]


def test_counts_must_add_up():
    with pytest.raises(ValueError, match="!= 3 requests"):
        summarize([out("a", 0.0, [1.0])], [], 3)


def test_kv_waste_is_time_weighted():
    steps = [step(0, 1.0, 100, 50, reserved=30, internal=20), step(1, 3.0, 100, 100)]
    k = kv_summary(steps)
    assert k["kv_waste_frac"] == pytest.approx(1 - (50 + 300) / 400)
    assert k["kv_breakdown"]["reserved"] == pytest.approx(30 / 400)
    assert k["kv_breakdown"]["internal_frag"] == pytest.approx(20 / 400)
    assert k["kv_usage_mean"] == pytest.approx(1.0)


def test_dist_percentiles_in_ms():
    d = dist([0.001 * i for i in range(1, 101)])
    assert d["p50"] == pytest.approx(50.5) and d["p99"] == pytest.approx(99.01) and d["mean"] == pytest.approx(50.5)
