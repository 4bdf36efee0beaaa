"""Trace loaders, transforms and stats (workbench.traces), on the committed slices and tiny in-test files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from workbench.traces import (
    BUILTIN_TRACE_DIR,
    FORMATS,
    TraceError,
    TraceRequest,
    apply_transforms,
    ensure_prompt_ids,
    load_trace,
    mooncake_prompt_ids,
    synthesize_prompt_ids,
    synthetic_arrivals,
    trace_stats,
)

AZURE_CONV = BUILTIN_TRACE_DIR / "azure_conv_slice.csv"
AZURE_CODE = BUILTIN_TRACE_DIR / "azure_code_slice.csv"
MOONCAKE = BUILTIN_TRACE_DIR / "mooncake_slice.jsonl"
SARATHI = BUILTIN_TRACE_DIR / "sarathi_sharegpt_lengths_slice.csv"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def raises_one_line(match_parts, fn, *args, **kwargs):
    """Call fn, expect a TraceError whose single-line message contains every part."""
    with pytest.raises(TraceError) as ei:
        fn(*args, **kwargs)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for part in match_parts:
        assert str(part) in msg, f"{part!r} not in {msg!r}"
    return msg


def assert_trace_ok(reqs):
    assert reqs and reqs[0].arrival_s == 0.0
    arr = [r.arrival_s for r in reqs]
    assert arr == sorted(arr)
    assert len({r.request_id for r in reqs}) == len(reqs)
    for r in reqs:
        assert r.prompt_tokens >= 0 and r.output_tokens >= 0
        if r.prompt_token_ids is not None:
            assert len(r.prompt_token_ids) == r.prompt_tokens


# ------------------------------------------------------------------------------------------- slices


def test_slices_are_small_and_attributed():
    for name in ("azure_conv_slice.csv", "azure_code_slice.csv", "mooncake_slice.jsonl",
                 "sarathi_sharegpt_lengths_slice.csv"):
        p = BUILTIN_TRACE_DIR / name
        assert p.stat().st_size < 100_000
        assert name in (BUILTIN_TRACE_DIR / "ATTRIBUTION.md").read_text()


# -------------------------------------------------------------------------------------------- azure


def test_azure_conv_slice_units_and_counts():
    reqs = load_trace("azure", AZURE_CONV)
    assert len(reqs) == 400
    assert_trace_ok(reqs)
    first, second, last = reqs[0], reqs[1], reqs[-1]
    assert (first.request_id, first.prompt_tokens, first.output_tokens) == ("azure-0", 374, 44)
    assert first.prompt_token_ids is None and first.prompt_text is None
    # 18:15:50.9951690 - 18:15:46.6805900 and 18:17:33.0108020 - 18:15:46.6805900, in seconds
    assert second.arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert last.arrival_s == pytest.approx(106.330212, abs=1e-9)


def test_azure_code_slice():
    reqs = load_trace("azure", AZURE_CODE)
    assert len(reqs) == 400
    assert_trace_ok(reqs)
    assert (reqs[0].prompt_tokens, reqs[0].output_tokens) == (4808, 10)
    assert reqs[1].arrival_s == pytest.approx(0.052, abs=1e-9)


def test_azure_timestamp_precision_zones_and_order(tmp_path):
    p = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 23:59:59.9999999,10,1\n"
              "2023-11-16 23:59:59.9999997,20,2\n"  # out of order: sorted, and it becomes the first
              "2023-11-17 00:00:01,30,3\n"
              "2023-11-17T01:00:01.5+01:00,40,4\n")  # same instant as 00:00:01.5 UTC
    reqs = load_trace("azure", p)
    assert [r.prompt_tokens for r in reqs] == [20, 10, 30, 40]
    assert reqs[1].arrival_s == pytest.approx(2e-7, abs=1e-12)
    assert reqs[2].arrival_s == pytest.approx(1.0000003, abs=1e-9)
    assert reqs[3].arrival_s == pytest.approx(1.5000003, abs=1e-9)
    assert len(load_trace("azure", AZURE_CONV, limit=7)) == 7


# ----------------------------------------------------------------------------------------- mooncake


def test_mooncake_slice_units_and_shared_prefixes():
    reqs = load_trace("mooncake", MOONCAKE, block_tokens=16)
    assert len(reqs) == 200
    assert_trace_ok(reqs)
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    assert reqs[-1].arrival_s == pytest.approx(rows[-1]["timestamp"] / 1000.0)  # ms -> s
    assert reqs[-1].arrival_s == pytest.approx(58.501)
    # input 40160 = 78 full blocks + 224 tokens -> 78*16 + ceil(224*16/512) at 16 tokens per block
    assert rows[0]["input_length"] == 40160 and reqs[0].prompt_tokens == 78 * 16 + 7
    assert reqs[0].output_tokens == 6 and reqs[0].hash_ids == rows[0]["hash_ids"]
    ids = np.concatenate([r.prompt_token_ids for r in reqs])
    assert ids.min() >= 100 and ids.max() < 49000
    shared = 0
    by_id = {r.request_id: r for r in reqs}
    for i, a in enumerate(rows):
        for j in range(i):
            b = rows[j]
            k = 0
            while k < min(len(a["hash_ids"]), len(b["hash_ids"])) and a["hash_ids"][k] == b["hash_ids"][k]:
                k += 1
            if k == 0:
                continue
            shared += 1
            ra, rb = by_id[f"mooncake-{i}"], by_id[f"mooncake-{j}"]
            n = min(k * 16, ra.prompt_tokens, rb.prompt_tokens)
            assert ra.prompt_token_ids[:n] == rb.prompt_token_ids[:n]
            if k < min(len(a["hash_ids"]), len(b["hash_ids"])) and min(ra.prompt_tokens, rb.prompt_tokens) > k * 16:
                assert ra.prompt_token_ids[k * 16:(k + 1) * 16] != rb.prompt_token_ids[k * 16:(k + 1) * 16]
    assert shared >= 5  # the slice has requests that continue earlier conversations


def test_mooncake_full_blocks_partial_last_and_tail(tmp_path):
    lines = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 2500, "input_length": 512, "output_length": 1, "hash_ids": [7, 11]},
        {"timestamp": 3000, "input_length": 700, "output_length": 2, "hash_ids": [7]},  # longer than its blocks
    ]
    p = write(tmp_path, "m.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = load_trace("mooncake", p, seed=3)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.5, 2.0]
    assert [r.prompt_tokens for r in reqs] == [1100, 600, 512, 700]
    a, b, c, d = (r.prompt_token_ids for r in reqs)
    assert a[:600] == b  # b's second block is partial: 88 tokens of block 8
    assert a[:512] == c == d[:512]
    assert d[512:] != a[512:700]  # beyond its only block: per-request tokens
    assert a == mooncake_prompt_ids([7, 8, 9], 1100, seed=3)
    assert load_trace("mooncake", p, seed=4)[0].prompt_token_ids[:512] != a[:512]
    # lazily made ids match the loader's
    lazy = ensure_prompt_ids(load_trace("mooncake", p, seed=3, token_ids=False), seed=3)
    assert [r.prompt_token_ids for r in lazy[:3]] == [a, b, c]
    assert load_trace("mooncake", p, token_ids=False)[0].prompt_token_ids is None


# ----------------------------------------------------------------------------------------- burstgpt


def test_burstgpt_filters_and_rebase(tmp_path):
    p = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
              "5,ChatGPT,100,20,120,Conversation log\n"
              "7.5,GPT-4,50,0,50,Conversation log\n"
              "9,GPT-4,30,10,40,API log\n"
              "12,ChatGPT,60,6,66,API log\n")
    reqs = load_trace("burstgpt", p)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 100, 20), (4.0, 30, 10), (7.0, 60, 6)]  # the failed row (0 response tokens) is dropped
    assert len(load_trace("burstgpt", p, drop_failed=False)) == 4
    gpt4 = load_trace("burstgpt", p, model="GPT-4")
    assert [r.prompt_tokens for r in gpt4] == [30] and gpt4[0].arrival_s == 0.0
    assert [r.prompt_tokens for r in load_trace("burstgpt", p, log_type="API log")] == [30, 60]
    raises_one_line([p, "empty"], load_trace, "burstgpt", p, model="Claude")


# ----------------------------------------------------------------------------------------- sharegpt


def toy_tokenizer(text: str) -> list[int]:
    return [100 + (sum(map(ord, w)) % 1000) for w in text.split()]


class EncodeTokenizer:
    def encode(self, text):
        return toy_tokenizer(text)


SHAREGPT = [
    {"id": "a1", "conversations": [{"from": "human", "value": "tell me a story about a cat"},
                                   {"from": "gpt", "value": "once there was a cat"}]},
    {"id": "b2", "conversations": [{"from": "gpt", "value": "hello"}]},  # no human turn: skipped
    {"id": "c3", "conversations": [{"from": "system", "value": "be brief"},
                                   {"from": "human", "value": "what is two plus two"}]},
    {"id": "a1", "conversations": [{"from": "human", "value": "again"}, {"from": "gpt", "value": "ok"}]},
]


def test_sharegpt_prompt_text_ids_and_output_lengths(tmp_path):
    p = write(tmp_path, "s.json", json.dumps(SHAREGPT))
    reqs = load_trace("sharegpt", p, tokenizer=toy_tokenizer, default_output_tokens=33)
    assert_trace_ok(reqs)
    assert [r.request_id for r in reqs] == ["a1", "c3", "a1#3"]
    assert all(r.arrival_s == 0.0 for r in reqs)
    assert reqs[0].prompt_text == "tell me a story about a cat"
    assert reqs[0].prompt_token_ids == toy_tokenizer("tell me a story about a cat")
    assert (reqs[0].prompt_tokens, reqs[0].output_tokens) == (7, 5)
    assert reqs[1].output_tokens == 33  # no reply: the default
    same = load_trace("sharegpt", p, tokenizer=EncodeTokenizer(), default_output_tokens=33)
    assert [r.prompt_token_ids for r in same] == [r.prompt_token_ids for r in reqs]
    # a synthetic arrival process on a trace without timing
    timed = apply_transforms(reqs, request_rate=2.0, seed=1)
    assert timed[0].arrival_s == 0.0 and timed[-1].arrival_s > 0


def test_sharegpt_errors(tmp_path):
    p = write(tmp_path, "s.json", json.dumps(SHAREGPT))
    raises_one_line(["tokenizer"], load_trace, "sharegpt", p)
    bad = write(tmp_path, "bad.json", '[\n {"id": "x",\n  "conversations": [}\n]')
    raises_one_line([bad, ":3:", "invalid JSON"], load_trace, "sharegpt", bad, tokenizer=toy_tokenizer)
    wrong = write(tmp_path, "w.json", json.dumps([SHAREGPT[0], {"id": "y", "conversations": "hi"}]))
    raises_one_line([wrong, "entry 1", "conversations"], load_trace, "sharegpt", wrong, tokenizer=toy_tokenizer)
    none = write(tmp_path, "n.json", json.dumps([SHAREGPT[1]]))
    raises_one_line([none, "empty"], load_trace, "sharegpt", none, tokenizer=toy_tokenizer)


# -------------------------------------------------------------------------------------- vidur/sarathi


def test_vidur_and_sarathi_lengths(tmp_path):
    p = write(tmp_path, "v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens,extra\n"
              "10.5,100,20,x\n11.0,200,30,y\n12.25,300,40,z\n")
    reqs = load_trace("vidur", p)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 100, 20), (0.5, 200, 30), (1.75, 300, 40)]
    lengths = load_trace("vidur", SARATHI)
    assert len(lengths) == 400
    assert_trace_ok(lengths)
    assert all(r.arrival_s == 0.0 for r in lengths)
    assert (lengths[0].prompt_tokens, lengths[0].output_tokens) == (74, 918)


# ---------------------------------------------------------------------------------------- synthetic


def test_synthetic_arrivals_rate_and_burstiness():
    a = synthetic_arrivals(4000, request_rate=8.0, burstiness=1.0, seed=0)
    assert a[0] == 0.0 and a == sorted(a)
    st = trace_stats([TraceRequest(str(i), t, 1, 1) for i, t in enumerate(a)])
    assert st["rate"] == pytest.approx(8.0, rel=0.06)
    assert st["burstiness"] == pytest.approx(1.0, abs=0.08)  # Poisson: CV 1
    bursty = synthetic_arrivals(4000, request_rate=8.0, burstiness=0.25, seed=0)
    st = trace_stats([TraceRequest(str(i), t, 1, 1) for i, t in enumerate(bursty)])
    assert st["burstiness"] == pytest.approx(2.0, rel=0.12)  # gamma shape k: CV 1/sqrt(k)
    assert synthetic_arrivals(5, math.inf) == [0.0] * 5
    assert synthetic_arrivals(50, 3.0, seed=1) == synthetic_arrivals(50, 3.0, seed=1)
    assert synthetic_arrivals(50, 3.0, seed=1) != synthetic_arrivals(50, 3.0, seed=2)


def test_synthetic_length_distributions():
    fixed = load_trace("synthetic", num_requests=20, request_rate=4.0, input_tokens=64, output_tokens=8)
    assert len(fixed) == 20 and fixed[0].arrival_s == 0.0
    assert {(r.prompt_tokens, r.output_tokens) for r in fixed} == {(64, 8)}
    assert all(r.prompt_token_ids is None for r in fixed)
    uni = load_trace("synthetic", num_requests=300, request_rate=4.0, lengths="uniform",
                     input_range=(10, 20), output_range=[1, 3], seed=5)
    assert {r.prompt_tokens for r in uni} == set(range(10, 21))
    assert {r.output_tokens for r in uni} == {1, 2, 3}
    logn = load_trace("synthetic", num_requests=2000, request_rate=4.0, lengths="lognormal", input_tokens=200,
                      input_sigma=0.5, output_tokens=50, output_sigma=1.0, output_max=120, seed=1)
    st = trace_stats(logn)
    assert st["prompt_tokens"]["mean"] == pytest.approx(200, rel=0.06)
    assert st["output_tokens"]["max"] == 120 and min(r.output_tokens for r in logn) >= 1
    same = load_trace("synthetic", num_requests=2000, request_rate=4.0, lengths="lognormal", input_tokens=200,
                      input_sigma=0.5, output_tokens=50, output_sigma=1.0, output_max=120, seed=1)
    assert same == logn
    pairs = {(r.prompt_tokens, r.output_tokens) for r in load_trace("vidur", SARATHI)}
    drawn = load_trace("synthetic", SARATHI, num_requests=50, request_rate=2.0, seed=2)
    assert len(drawn) == 50 and all((r.prompt_tokens, r.output_tokens) in pairs for r in drawn)
    capped = load_trace("synthetic", num_requests=50, request_rate=2.0, lengths="file", lengths_path=AZURE_CONV,
                        input_max=100)
    assert max(r.prompt_tokens for r in capped) <= 100


def test_synthetic_errors():
    raises_one_line(["input_range"], load_trace, "synthetic", num_requests=5, request_rate=1.0, lengths="uniform")
    raises_one_line(["request_rate"], load_trace, "synthetic", num_requests=5, request_rate=0)
    raises_one_line(["num_requests"], load_trace, "synthetic", num_requests=0, request_rate=1.0)
    raises_one_line(["lengths must be one of", "lognormal"], load_trace, "synthetic", num_requests=5,
                    request_rate=1.0, lengths="zipf")
    raises_one_line(["lengths_path"], load_trace, "synthetic", num_requests=5, request_rate=1.0, lengths="file")


# ---------------------------------------------------------------------------------------- token ids


def test_synthesize_prompt_ids_deterministic():
    a = synthesize_prompt_ids(50, seed=1, request_index=3)
    assert a == synthesize_prompt_ids(50, 1, 3)
    assert a[:20] == synthesize_prompt_ids(20, 1, 3)
    assert a != synthesize_prompt_ids(50, 1, 4) and a != synthesize_prompt_ids(50, 2, 3)
    assert all(100 <= t < 49000 for t in a)
    assert all(5 <= t < 9 for t in synthesize_prompt_ids(40, 0, 0, vocab_lo=5, vocab_hi=9))
    assert synthesize_prompt_ids(0, 0, 0) == []
    raises_one_line(["vocab"], synthesize_prompt_ids, 3, 0, 0, 10, 10)
    filled = ensure_prompt_ids(load_trace("azure", AZURE_CONV, limit=3), seed=0, vocab_hi=1000)
    assert [len(r.prompt_token_ids) for r in filled] == [374, 396, 879]
    assert filled == ensure_prompt_ids(load_trace("azure", AZURE_CONV, limit=3), seed=0, vocab_hi=1000)


# --------------------------------------------------------------------------------------- transforms


def test_transforms_limit_sample_time():
    reqs = load_trace("azure", AZURE_CONV)
    assert [r.request_id for r in apply_transforms(reqs, limit=5)] == [f"azure-{i}" for i in range(5)]
    s = apply_transforms(reqs, sample=30, seed=4)
    assert len(s) == 30 and s[0].arrival_s == 0.0
    assert [r.arrival_s for r in s] == sorted(r.arrival_s for r in s)
    assert s == apply_transforms(reqs, sample=30, seed=4) and s != apply_transforms(reqs, sample=30, seed=5)
    assert len(apply_transforms(reqs, limit=100, sample=10)) == 10
    slow = apply_transforms(reqs, time_scale=2.0)
    assert slow[-1].arrival_s == pytest.approx(2 * reqs[-1].arrival_s)
    fast = apply_transforms(reqs, request_rate=10.0)
    assert trace_stats(fast)["rate"] == pytest.approx(10.0)
    assert trace_stats(fast)["burstiness"] == pytest.approx(trace_stats(reqs)["burstiness"])  # shape kept
    assert all(r.arrival_s == 0 for r in apply_transforms(reqs, request_rate=math.inf))
    poisson = apply_transforms(reqs, request_rate=3.0, burstiness=1.0, seed=0)  # replaced by a gamma process
    assert [r.prompt_tokens for r in poisson] == [r.prompt_tokens for r in reqs]
    assert reqs[1].arrival_s == pytest.approx(4.314579)  # the input is not changed


def test_transforms_lengths_and_ids(tmp_path):
    reqs = load_trace("vidur", SARATHI, limit=20)
    half = apply_transforms(reqs, length_scale=0.01)
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in half)
    assert half[0].prompt_tokens == 1 and half[0].output_tokens == 9  # 74 * 0.01 -> 1 (min), 918 -> 9
    capped = apply_transforms(reqs, max_input_tokens=100, max_output_tokens=50)
    assert max(r.prompt_tokens for r in capped) == 100 and max(r.output_tokens for r in capped) == 50
    p = write(tmp_path, "s.json", json.dumps(SHAREGPT))
    text = load_trace("sharegpt", p, tokenizer=toy_tokenizer)
    cut = apply_transforms(text, max_input_tokens=3)
    assert cut[0].prompt_token_ids == text[0].prompt_token_ids[:3] and cut[0].prompt_text is None
    assert cut[2].prompt_text == "again"  # unchanged length keeps the text
    grown = apply_transforms(text, length_scale=2.0)
    assert grown[0].prompt_token_ids[:7] == text[0].prompt_token_ids and len(grown[0].prompt_token_ids) == 14


def test_transform_errors():
    reqs = load_trace("azure", AZURE_CONV, limit=10)
    raises_one_line(["sample=11", "10 requests"], apply_transforms, reqs, sample=11)
    raises_one_line(["limit"], apply_transforms, reqs, limit=0)
    raises_one_line(["time_scale"], apply_transforms, reqs, time_scale=-1)
    raises_one_line(["request_rate"], apply_transforms, reqs, request_rate=0)
    raises_one_line(["length_scale"], apply_transforms, reqs, length_scale=0)
    raises_one_line(["max_input_tokens"], apply_transforms, reqs, max_input_tokens=0)
    raises_one_line(["burstiness needs request_rate"], apply_transforms, reqs, burstiness=0.5)
    raises_one_line(["empty"], apply_transforms, [])


# -------------------------------------------------------------------------------------------- stats


def test_trace_stats():
    reqs = [TraceRequest(str(i), t, p, o) for i, (t, p, o) in enumerate(
        [(0.0, 10, 1), (1.0, 20, 2), (2.0, 30, 3), (4.0, 40, 4), (8.0, 100, 10)])]
    st = trace_stats(reqs)
    assert st["count"] == 5 and st["duration_s"] == 8.0 and st["rate"] == 0.5
    gaps = np.array([1.0, 1.0, 2.0, 4.0])
    assert st["burstiness"] == pytest.approx(gaps.std() / gaps.mean())
    assert st["prompt_tokens"] == {"mean": 40.0, "p50": 30.0, "p90": pytest.approx(76.0), "p99": pytest.approx(97.6),
                                   "max": 100.0}
    assert st["output_tokens"]["max"] == 10.0
    one = trace_stats(reqs[:1])
    assert one["rate"] is None and one["burstiness"] is None  # undefined, with the reason
    assert set(one["undefined"]) == {"rate", "burstiness"} and st["undefined"] == {}
    conv = trace_stats(load_trace("azure", AZURE_CONV))
    assert conv["count"] == 400 and conv["duration_s"] == pytest.approx(106.330212)
    raises_one_line(["empty"], trace_stats, [])


# ------------------------------------------------------------------------------------------- errors


AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize("body, line, what", [
    ("2023-11-16 18:15:46.6805900,374\n", 2, "expected 3 columns"),
    ("2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.0,abc,44\n", 3, "ContextTokens must be a non-negative integer"),
    ("2023-11-16 18:15:46.6805900,374,44\n\n2023-11-16 18:15:47.0,10,-3\n", 4, "GeneratedTokens must be a non-negative"),
    ("2023-11-16 18:15:46.6805900,374,44\nyesterday,1,1\n", 3, "not a timestamp"),
    ("2023-13-16 18:15:46.6805900,374,44\n", 2, "not a valid date"),
    ("2023-11-16 18:15:46.6805900,374,4.5\n", 2, "GeneratedTokens"),
])
def test_azure_malformed_rows(tmp_path, body, line, what):
    p = write(tmp_path, "a.csv", AZ_HEAD + body)
    raises_one_line([f"{p}:{line}:", what], load_trace, "azure", p)


def test_file_level_errors(tmp_path):
    missing = tmp_path / "nope.csv"
    for fmt in ("azure", "mooncake", "burstgpt", "vidur"):
        raises_one_line([missing, "no such file"], load_trace, fmt, missing)
    raises_one_line([missing, "no such file"], load_trace, "sharegpt", missing, tokenizer=toy_tokenizer)
    msg = raises_one_line(["unknown trace format 'splitwise'"], load_trace, "splitwise", AZURE_CONV)
    assert all(f in msg for f in FORMATS)
    header_only = write(tmp_path, "h.csv", AZ_HEAD)
    raises_one_line([header_only, "empty"], load_trace, "azure", header_only)
    empty = write(tmp_path, "e.csv", "")
    raises_one_line([empty, "empty"], load_trace, "azure", empty)
    wrong_header = write(tmp_path, "w.csv", "time,in,out\n1,2,3\n")
    raises_one_line([f"{wrong_header}:1:", "TIMESTAMP"], load_trace, "azure", wrong_header)
    raises_one_line([f"{wrong_header}:1:", "num_prefill_tokens"], load_trace, "vidur", wrong_header)
    raises_one_line([AZURE_CONV, "unexpected keyword"], load_trace, "azure", AZURE_CONV, tokenizer=toy_tokenizer)
    vid = write(tmp_path, "v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\nsoon,1,1\n")
    raises_one_line([f"{vid}:3:", "arrived_at must be a number"], load_trace, "vidur", vid)
    bg = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
               "1,ChatGPT,x,1,1,API log\n")
    raises_one_line([f"{bg}:2:", "Request tokens"], load_trace, "burstgpt", bg)


@pytest.mark.parametrize("line2, what", [
    ('{"timestamp": 1, "input_length": 5, "output_length": 1', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "missing key 'hash_ids'"),
    ('{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": []}', "input_length must be a non-negative"),
    ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp must be a number"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}', "hash_ids must be a list"),
])
def test_mooncake_malformed_lines(tmp_path, line2, what):
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}'
    p = write(tmp_path, "m.jsonl", good + "\n" + line2 + "\n")
    raises_one_line([f"{p}:2:", what], load_trace, "mooncake", p)


def test_mooncake_empty(tmp_path):
    p = write(tmp_path, "m.jsonl", "\n\n")
    raises_one_line([p, "empty"], load_trace, "mooncake", p)
