"""Day-long traces: streaming loaders, repeated traces, synthesized days, and what ``trace inspect`` reports."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from workbench.cli import app
from workbench.scenario import ScenarioError, load_scenario_trace, validate_scenario
from workbench.traces import (LoadStats, TraceError, apply_transforms, iter_trace, load_synthetic, load_trace,
                              repeat_stream, synthesize_day, trace_stats)

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:00:00.5000000,100,10
2023-11-16 18:00:01.5000000,200,0
2023-11-16 18:00:01.2500000,300,30
2023-11-16 18:00:03.5000000,400,40
2023-11-16 18:00:06.5000000,500,50
"""
VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,1\n0.25,20,2\n2.0,30,0\n"
MOONCAKE = "".join(json.dumps(r) + "\n" for r in (
    {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 2000, "input_length": 100, "output_length": 0, "hash_ids": [0]},
    {"timestamp": 1000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1]},
))


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def counts_add_up(st: LoadStats) -> bool:
    return st.rows_read == st.loaded + sum(st.skipped.values())


@pytest.mark.parametrize("fmt,name,text", [("azure", "a.csv", AZURE), ("vidur", "v.csv", VIDUR),
                                           ("mooncake", "m.jsonl", MOONCAKE)])
def test_iter_trace_yields_what_load_trace_loads(tmp_path, fmt, name, text):
    p = write(tmp_path, name, text)
    kw = {"token_ids": False} if fmt == "mooncake" else {}
    whole, streamed = LoadStats(), LoadStats()
    expected = load_trace(fmt, p, stats=whole, **kw)
    assert list(iter_trace(fmt, p, stats=streamed)) == expected
    assert streamed.to_dict() == whole.to_dict()
    assert streamed.out_of_order == 1 and sum(streamed.changed.values()) == 1 and counts_add_up(streamed)
    assert list(iter_trace(fmt, p, limit=2)) == load_trace(fmt, p, limit=2, **kw)


def test_iter_trace_loads_other_formats_whole(tmp_path):
    p = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                 "5,ChatGPT,10,3,13,Conversation log\n1,GPT-4,20,4,24,Conversation log\n")
    st = LoadStats()
    assert list(iter_trace("burstgpt", p, stats=st)) == load_trace("burstgpt", p) and st.loaded == 2
    assert list(iter_trace("synthetic", num_requests=5, request_rate=2.0)) == \
        load_trace("synthetic", num_requests=5, request_rate=2.0)
    with pytest.raises(TraceError, match="unknown trace format 'nope'"):
        list(iter_trace("nope", p))


def test_iter_trace_errors_are_one_line(tmp_path):
    p = write(tmp_path, "a.csv", AZURE)
    with pytest.raises(TraceError, match=r"a\.csv:4: arrives before a row already streamed.*reorder_window=0"):
        list(iter_trace("azure", p, reorder_window=0))
    bad = write(tmp_path, "bad.csv", AZURE.replace(",400,", ",many,"))
    with pytest.raises(TraceError, match=r"bad\.csv:5: ContextTokens must be a non-negative integer") as e:
        list(iter_trace("azure", bad))
    assert "\n" not in str(e.value)
    with pytest.raises(TraceError, match="reorder_window must be an integer >= 0"):
        list(iter_trace("azure", p, reorder_window=-1))
    with pytest.raises(TraceError, match="strict"):
        list(iter_trace("azure", p, strict=True))


@pytest.mark.parametrize("reread", [False, True])
def test_repeat_shifts_times_makes_ids_unique_and_counts_add_up(tmp_path, reread):
    p = write(tmp_path, "a.csv", AZURE)
    one = load_trace("azure", p)  # arrivals 0, 0.75, 1, 3, 6 s: span = 6 + mean gap 1.5 = 7.5 s
    st = LoadStats()
    day = list(repeat_stream(lambda s: iter_trace("azure", p, stats=s), 3, st, reread))
    assert len(day) == 15 and len({r.request_id for r in day}) == 15
    assert [r.arrival_s for r in day[5:10]] == pytest.approx([r.arrival_s + 7.5 for r in one])
    assert [r.arrival_s for r in day[10:]] == pytest.approx([r.arrival_s + 15.0 for r in one])
    assert [r.request_id for r in day[5:7]] == ["azure-0+r1", "azure-2+r1"]
    assert [(r.prompt_tokens, r.output_tokens) for r in day[10:]] == [(r.prompt_tokens, r.output_tokens) for r in one]
    assert st.rows_read == st.loaded == 15 and st.copies == 3 and st.out_of_order == 3 and counts_add_up(st)
    assert "counts summed over 3 copies" in st.summary()
    # the list form (scenario path) gives the same trace and counts
    st2 = LoadStats()
    listed = apply_transforms(load_trace("azure", p, stats=st2), repeat=3, stats=st2)
    assert [r.request_id for r in listed] == [r.request_id for r in day]
    assert [r.arrival_s for r in listed] == pytest.approx([r.arrival_s for r in day])
    assert st2.to_dict() == st.to_dict()


def test_bad_day_knobs_are_one_line_errors_naming_the_field(tmp_path):
    base = {"name": "t", "trace": {"format": "azure", "path": "builtin:azure_conv_slice.csv"},
            "engines": [{"name": "s", "kind": "sim"}]}
    for trace, field in (({"repeat": 0}, "trace.repeat"), ({"repeat": 1.5}, "trace.repeat"),
                         ({"duration_s": -1}, "trace.duration_s"), ({"duration_s": float("inf")}, "trace.duration_s"),
                         ({"repeat": 2, "duration_s": 60}, "repeat and duration_s"),
                         ({"duration_s": 60, "rate_profile": [1, -1]}, "trace.rate_profile.1"),
                         ({"duration_s": 60, "rate_profile": [0, 0]}, "rate_profile: at least one"),
                         ({"rate_profile": [1, 2]}, "rate_profile shapes a synthesized day")):
        with pytest.raises(ScenarioError, match=field) as e:
            validate_scenario({**base, "trace": {**base["trace"], **trace}})
        assert "\n" not in str(e.value)
    reqs = load_trace("azure", write(tmp_path, "a.csv", AZURE))
    for kw, msg in (({"repeat": 0}, "repeat must be an integer"), ({"duration_s": 0}, "duration_s must be a finite"),
                    ({"duration_s": 10, "repeat": 2}, "set one of them"),
                    ({"duration_s": 10, "rate_profile": [1, float("nan")]}, "rate_profile must be a list"),
                    ({"rate_profile": [1]}, "it needs duration_s")):
        with pytest.raises(TraceError, match=msg):
            apply_transforms(reqs, **kw)
    with pytest.raises(TraceError, match="at least 3 requests at different times"):
        list(synthesize_day(reqs[:2], 60.0))
    for args, msg in ((["--repeat", "0"], "repeat must be an integer"),
                      (["--duration-s", "60", "--rate-profile", "1,x"], "--rate-profile must be comma-separated"),
                      (["--rate-profile", "1,2"], "it needs --duration-s")):
        r = CliRunner().invoke(app, ["trace", "inspect", str(tmp_path / "a.csv"), *args])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output


def test_scenario_repeat_reaches_the_trace():
    s = validate_scenario({"name": "t", "trace": {"format": "azure", "path": "builtin:azure_conv_slice.csv",
                                                  "limit": 50, "repeat": 4}, "engines": [{"name": "s", "kind": "sim"}]})
    st = LoadStats()
    reqs = load_scenario_trace(s, with_token_ids=False, stats=st)
    assert len(reqs) == 200 and len({r.request_id for r in reqs}) == 200 and st.copies == 4 and counts_add_up(st)


def test_synthesized_day_is_reproducible_and_keeps_the_source_statistics():
    src = load_synthetic(2000, request_rate=2.0, burstiness=0.5, lengths="lognormal", input_tokens=800,
                         output_tokens=200, input_sigma=0.8, output_sigma=0.6, seed=3)
    a = list(synthesize_day(src, 20000.0, seed=1))
    assert a == list(synthesize_day(src, 20000.0, seed=1))
    assert [r.arrival_s for r in a[:50]] != [r.arrival_s for r in list(synthesize_day(src, 20000.0, seed=2))[:50]]
    s, d = trace_stats(src), trace_stats(a)
    assert a[0].arrival_s == 0.0 and a[-1].arrival_s < 20000.0 and a[-1].request_id == f"day-{len(a) - 1}"
    assert d["rate"] == pytest.approx(s["rate"], rel=0.05)  # ~40,000 requests at the source's ~2 req/s
    assert d["burstiness"] == pytest.approx(s["burstiness"], rel=0.1)  # ~1.41 for gamma shape 0.5
    for k in ("prompt_tokens", "output_tokens"):
        assert d[k]["mean"] == pytest.approx(s[k]["mean"], rel=0.05)
        assert d[k]["p50"] == pytest.approx(s[k]["p50"], rel=0.05)
        assert d[k]["p90"] == pytest.approx(s[k]["p90"], rel=0.08)
        assert d[k]["max"] <= s[k]["max"]
    pairs = {(r.prompt_tokens, r.output_tokens) for r in src}
    assert all((r.prompt_tokens, r.output_tokens) in pairs for r in a[:1000])  # whole requests drawn


def test_rate_profile_shapes_the_day_and_keeps_its_mean_rate():
    src = load_synthetic(500, request_rate=1.0, seed=4)
    flat = list(synthesize_day(src, 40000.0, seed=1))
    shaped = list(synthesize_day(src, 40000.0, seed=1, rate_profile=[1, 3, 0, 4]))  # mean 2: x0.5, 1.5, 0, 2
    t = np.array([r.arrival_s for r in shaped])
    per_slice = np.histogram(t, bins=4, range=(0, 40000))[0]
    expect = np.array([0.5, 1.5, 0.0, 2.0]) * trace_stats(src)["rate"] * 10000
    assert per_slice[2] == 0 and np.all(np.abs(per_slice - expect) <= 0.06 * expect + 1)
    assert len(shaped) == pytest.approx(len(flat), rel=0.01) and np.all(np.diff(t) >= 0)
    assert [(r.prompt_tokens, r.output_tokens) for r in shaped] == [(r.prompt_tokens, r.output_tokens) for r in flat]


def test_inspect_json_reports_cost_and_the_day(tmp_path):
    p = write(tmp_path, "azure_small.csv", AZURE)
    out = {}
    for mode in ("stream", "whole"):
        args = ["trace", "inspect", str(p), "--json", "--repeat", "2"] + (["--whole"] if mode == "whole" else [])
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        out[mode] = json.loads(r.output)
    s = out["stream"]
    assert s["count"] == 10 and s["duration_s"] == pytest.approx(13.5) and s["load"]["copies"] == 2
    c = s["cost"]
    assert c["mode"] == "stream" and c["repeat"] == 2 and c["day_duration_s"] is None
    assert c["load_s"] > 0 and c["rows_per_s"] > 0 and c["requests_per_s"] > 0
    assert c["peak_rss_bytes"] >= c["rss_before_bytes"] > 0
    assert out["whole"]["cost"]["mode"] == "whole"
    for k in ("count", "duration_s", "rate", "burstiness", "prompt_tokens", "output_tokens"):
        assert out["whole"][k] == s[k]
    assert out["whole"]["load"]["summary"] == s["load"]["summary"]
    r = CliRunner().invoke(app, ["trace", "inspect", str(p), "--json", "--duration-s", "30", "--seed", "1"])
    day = json.loads(r.output)
    assert r.exit_code == 0 and day["load"]["synthesized"] == day["count"] and day["duration_s"] < 30
    assert day["cost"]["day_duration_s"] == 30.0
    text = CliRunner().invoke(app, ["trace", "inspect", str(p), "--repeat", "2"]).output
    assert "read (stream) in" in text and "rows/s; peak RSS" in text
    args = ["trace", "inspect", str(p), "--json", "--repeat", "2", "--reread"]
    reread = json.loads(CliRunner().invoke(app, args).output)
    assert reread["cost"]["reread"] is True and reread["load"] == s["load"] and reread["count"] == s["count"]


def test_synthesized_prompt_ids_share_one_int_per_value():
    from workbench.traces import mooncake_prompt_ids, synthesize_prompt_ids

    a, b = synthesize_prompt_ids(3000, 0, 1), synthesize_prompt_ids(3000, 0, 2)
    rng = np.random.default_rng([0, 1, 0x5E17])
    assert a == rng.integers(100, 49000, size=3000, dtype=np.int64).tolist()  # the same ids as before interning
    common = set(a) & set(b)
    first = {x: x for x in a}
    assert len(common) > 20 and all(y is first[y] for y in b if y in common)
    m = mooncake_prompt_ids([7, 8], 600, seed=0)
    assert len(m) == 600 and all(type(x) is int for x in m) and m[:512] == mooncake_prompt_ids([7], 512, seed=0)
    assert synthesize_prompt_ids(5, 0, 1, vocab_lo=0, vocab_hi=1 << 40) == \
        np.random.default_rng([0, 1, 0x5E17]).integers(0, 1 << 40, size=5, dtype=np.int64).tolist()
