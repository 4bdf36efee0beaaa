"""Trace loaders on awkward files: load counts (skipped, changed, warned, out of order) and strict mode,
short one-line errors, the APEX+ JSONL loader, and ``workbench trace inspect`` on traces whose rate or
burstiness is undefined. Every file is made up here or in tests/data (hand-made, see its README)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from workbench.commands.trace import guess_format, inspect
from workbench.scenario import load_scenario, load_scenario_trace
from workbench.traces import (BUILTIN_TRACE_DIR, LoadStats, TraceError, apply_transforms, load_trace,
                              trace_stats)
from workbench.traces.burstgpt import FAILED
from workbench.traces.common import MAX_SHOWN, clip, shown
from workbench.traces.mooncake import BLOCKS_MISMATCH

SARATHI = BUILTIN_TRACE_DIR / "sarathi_sharegpt_lengths_slice.csv"
AZURE_CONV = BUILTIN_TRACE_DIR / "azure_conv_slice.csv"
APEX_EXAMPLE = Path(__file__).parent / "data" / "apex_example.jsonl"
AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BG_HEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
VID_HEAD = "arrived_at,num_prefill_tokens,num_decode_tokens\n"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def one_line_error(fn, *args, **kwargs) -> str:
    """The message of the TraceError ``fn`` raises, checked to be one line."""
    with pytest.raises(TraceError) as ei:
        fn(*args, **kwargs)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    return msg


def adds_up(st: LoadStats) -> None:
    assert st.rows_read == st.loaded + sum(st.skipped.values()), st


# ------------------------------------------------------------------------------- trace inspect


def test_inspect_trace_without_arrival_times(capsys):
    inspect(str(SARATHI))  # a sarathi lengths file: every arrival at 0
    out = capsys.readouterr().out
    assert "format vidur, 400 requests over 0.0 s" in out
    assert ("rate and burstiness (inter-arrival CV) n/a (all 400 requests arrive at the same time; "
            "set request_rate") in out
    assert "400 rows read, 400 loaded" in out
    inspect(str(SARATHI), as_json=True)
    st = json.loads(capsys.readouterr().out)
    assert st["rate"] is None and st["burstiness"] is None
    assert "same time" in st["undefined"]["rate"] and "same time" in st["undefined"]["burstiness"]
    assert st["load"]["rows_read"] == st["load"]["loaded"] == 400


@pytest.mark.parametrize("rows, rate, why_cv", [
    ("0,10,5\n", "rate n/a (needs at least 2 requests, the trace has 1)", "the trace has 1"),
    ("0,10,5\n2.5,20,6\n", "rate 0.400 req/s", "the trace has 2"),
])
def test_inspect_one_or_two_requests(tmp_path, capsys, rows, rate, why_cv):
    p = write(tmp_path, "few.csv", VID_HEAD + rows)
    inspect(str(p))
    out = capsys.readouterr().out
    assert rate in out and "burstiness (inter-arrival CV) n/a (needs at least 3 requests" in out and why_cv in out
    inspect(str(p), as_json=True)
    st = json.loads(capsys.readouterr().out)
    assert st["burstiness"] is None and why_cv in st["undefined"]["burstiness"]


def test_trace_stats_says_why_a_figure_is_undefined():
    st = trace_stats(load_trace("vidur", SARATHI))
    assert (st["rate"], st["burstiness"]) == (None, None) and set(st["undefined"]) == {"rate", "burstiness"}
    full = trace_stats(load_trace("azure", AZURE_CONV))
    assert full["undefined"] == {} and full["rate"] > 0 and full["burstiness"] > 0


# ------------------------------------------------------------------------------- short errors


def test_wrong_file_error_is_short(tmp_path):
    # a Mooncake line (1 KB, commas in it) read as an Azure CSV: the header it reports is cut
    line = json.dumps({"timestamp": 0, "input_length": 40000, "output_length": 5, "hash_ids": list(range(250))})
    assert len(line) > 1000
    p = write(tmp_path, "azure_wrong.csv", line + "\n")
    msg = one_line_error(load_trace, "azure", p)
    assert f"{p}:1: header lacks column(s) TIMESTAMP" in msg and "..." in msg
    assert len(msg) < len(str(p)) + 250, msg


@pytest.mark.parametrize("fmt, text, where", [
    ("azure", AZ_HEAD + "2023-11-16 18:15:46.6805900,10," + "9" * 500 + "x\n", ":2: GeneratedTokens"),
    ("azure", AZ_HEAD + "2023-11-16 18:15:46,1,1\n" + "y" * 500 + ",1,1\n", ":3: TIMESTAMP"),
    ("vidur", VID_HEAD + "z" * 500 + ",1,1\n", ":2: arrived_at"),
    ("burstgpt", BG_HEAD + "1,ChatGPT," + "q" * 500 + ",1,1,API log\n", ":2: Request tokens"),
    ("vidur", "a,b," + "c" * 500 + "\n1,2,3\n", ":1: header lacks"),
    ("vidur", VID_HEAD.strip() + ",notes " + "w" * 500 + "\n1,2\n", ":2: expected 4 columns"),
])
def test_long_values_are_cut_in_every_loader(tmp_path, fmt, text, where):
    p = write(tmp_path, "t.csv", text)
    msg = one_line_error(load_trace, fmt, p)
    assert where in msg and len(msg) < len(str(p)) + 250, msg


def test_jsonl_values_are_cut(tmp_path):
    p = write(tmp_path, "m.jsonl", json.dumps({"timestamp": "x" * 900, "input_length": 5, "output_length": 1,
                                               "hash_ids": [0]}) + "\n")
    msg = one_line_error(load_trace, "mooncake", p)
    assert ":1: timestamp must be a number" in msg and msg.endswith("...") and len(msg) < len(str(p)) + 150
    q = write(tmp_path, "a.jsonl", json.dumps({"StartTimeOffset": 0, "ContextTokens": "7\n" * 300,
                                               "GeneratedTokens": 1}) + "\n")
    msg = one_line_error(load_trace, "apex", q)
    assert ":1: ContextTokens must be a non-negative integer" in msg and len(msg) < len(str(q)) + 150


def test_clip_and_shown():
    assert clip("short") == "short" and shown("ab") == "'ab'"
    cut = clip("x" * 500)
    assert len(cut) == MAX_SHOWN and cut.endswith("...")
    assert clip("a\nb\rc") == "a\\nb\\rc"  # one line
    assert len(shown(list(range(1000)))) == MAX_SHOWN


# ------------------------------------------------------------------------------- APEX+ JSONL


def test_apex_example_units():
    st = LoadStats()
    reqs = load_trace("apex", APEX_EXAMPLE, stats=st)
    assert [(r.request_id, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        ("apex-0", 120, 35), ("apex-1", 2048, 1), ("apex-2", 17, 512), ("apex-3", 600, 64), ("apex-4", 95, 210)]
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 1.0, 1.0, 2.750000123]  # ns -> s
    assert all(r.prompt_token_ids is None and r.hash_ids is None for r in reqs)
    assert (st.rows_read, st.loaded, st.skipped, st.changed, st.out_of_order) == (5, 5, {}, {}, 0)
    assert len(load_trace("apex", APEX_EXAMPLE, limit=2)) == 2
    assert guess_format(str(APEX_EXAMPLE)) == "apex"
    assert guess_format(str(BUILTIN_TRACE_DIR / "mooncake_slice.jsonl")) == "mooncake"


def test_apex_spellings_rebase_and_exact_ns(tmp_path):
    rows = [{"StartTimeOffset": 10**18 + 7, "InputTokens": 5, "OutputTokens": 2},
            {"StartTimeOffset": 10**18 + 3, "input_length": 6, "output_length": 3, "extra": "ignored"},
            {"StartTimeOffset": 1.5e18, "prompt_tokens": 7, "completion_tokens": 4}]
    p = write(tmp_path, "lmsys.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    st = LoadStats()
    reqs = load_trace("apex", p, stats=st)
    assert [r.prompt_tokens for r in reqs] == [6, 5, 7]
    assert reqs[1].arrival_s == 4e-9  # integers are subtracted exactly before the division
    assert st.out_of_order == 1 and st.rows_read == 3


@pytest.mark.parametrize("line2, what", [
    ('{"StartTimeOffset": 1, "ContextTokens": 5', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"ContextTokens": 5, "GeneratedTokens": 1}', "missing key 'StartTimeOffset'"),
    ('{"StartTimeOffset": "soon", "ContextTokens": 5, "GeneratedTokens": 1}', "StartTimeOffset must be a non-negative"),
    ('{"StartTimeOffset": -1, "ContextTokens": 5, "GeneratedTokens": 1}', "StartTimeOffset must be a non-negative"),
    ('{"StartTimeOffset": 1, "GeneratedTokens": 1}', "missing the prompt length (one of ContextTokens, InputTokens"),
    ('{"StartTimeOffset": 1, "ContextTokens": 5}', "missing the output length (one of GeneratedTokens"),
    ('{"StartTimeOffset": 1, "ContextTokens": 5, "InputTokens": 5, "GeneratedTokens": 1}',
     "prompt length given twice (ContextTokens and InputTokens)"),
    ('{"StartTimeOffset": 1, "ContextTokens": -5, "GeneratedTokens": 1}', "ContextTokens must be a non-negative"),
    ('{"StartTimeOffset": 1, "ContextTokens": 5, "OutputTokens": 2.5}', "OutputTokens must be a non-negative"),
])
def test_apex_bad_rows(tmp_path, line2, what):
    good = '{"StartTimeOffset": 0, "ContextTokens": 5, "GeneratedTokens": 1}'
    p = write(tmp_path, "a.jsonl", good + "\n" + line2 + "\n")
    msg = one_line_error(load_trace, "apex", p)
    assert f"{p}:2:" in msg and what in msg, msg


def test_apex_empty_and_listed(tmp_path):
    p = write(tmp_path, "a.jsonl", "\n")
    assert "empty" in one_line_error(load_trace, "apex", p)
    assert "apex" in one_line_error(load_trace, "splitwise", p)


# ------------------------------------------------------------------------------- zero-token outputs


def test_burstgpt_failed_rows_are_counted(tmp_path):
    p = write(tmp_path, "b.csv", BG_HEAD + "5,ChatGPT,100,20,120,Conversation log\n"
              "7.5,GPT-4,50,0,50,Conversation log\n9,GPT-4,30,10,40,API log\n12,ChatGPT,60,6,66,API log\n")
    st = LoadStats()
    assert len(load_trace("burstgpt", p, stats=st)) == 3
    assert st.rows_read == 4 and st.skipped == {FAILED: 1} and st.first[f"skipped: {FAILED}"] == f"{p}:3"
    adds_up(st)
    assert any(FAILED in n for n in st.notes())
    kept = load_trace("burstgpt", p, drop_failed=False, stats=st)
    assert [r.output_tokens for r in kept] == [20, 1, 10, 6]
    assert st.changed == {"0 Response tokens raised to 1 (an engine generates at least 1 token)": 1}
    load_trace("burstgpt", p, model="GPT-4", log_type="API log", stats=st)
    assert st.skipped == {"Model is not 'GPT-4'": 2, "Log Type is not 'API log'": 1} and st.loaded == 1
    adds_up(st)


def test_azure_zero_output_is_counted_and_length_scale_too(tmp_path):
    p = write(tmp_path, "a.csv", AZ_HEAD + "2023-11-16 18:15:46.0,100,0\n2023-11-16 18:15:47.0,200,1\n"
              "2023-11-16 18:15:48.0,300,40\n")
    st = LoadStats()
    reqs = load_trace("azure", p, stats=st)
    assert [r.output_tokens for r in reqs] == [1, 1, 40]
    reason = "0 GeneratedTokens raised to 1 (an engine generates at least 1 token)"
    assert st.changed == {reason: 1} and st.first[f"changed: {reason}"].startswith(f"{p}:2: GeneratedTokens is 0")
    half = apply_transforms(reqs, length_scale=0.5, stats=st)
    assert [r.output_tokens for r in half] == [1, 1, 20]
    assert st.changed["output_tokens rounded to 0 by length_scale 0.5, raised to 1"] == 2
    assert any("request azure-0" in n for n in st.notes())
    capped = apply_transforms(reqs, limit=2, max_input_tokens=150, stats=st)
    assert len(capped) == 2 and st.loaded == 2 and st.skipped == {"after the first limit=2 requests": 1}
    assert st.changed["prompt_tokens clipped to max_input_tokens 150"] == 1
    adds_up(st)
    msg = one_line_error(load_trace, "azure", p, strict=True)
    assert f"{p}:2: GeneratedTokens is 0" in msg and "strict" in msg


def test_scenario_trace_reports_load_counts(tmp_path):
    write(tmp_path, "a.csv", AZ_HEAD + "2023-11-16 18:15:46.0,100,0\n2023-11-16 18:15:45.0,200,3\n"
          "2023-11-16 18:15:48.0,300,40\n")
    sc_path = write(tmp_path, "s.yaml", textwrap.dedent("""\
        name: zeros
        trace: {format: azure, path: a.csv, length_scale: 0.5, sample: 2}
        engines: [{name: paged, kind: paged}]
        """))
    st = LoadStats()
    reqs = load_scenario_trace(load_scenario(sc_path), stats=st)
    assert len(reqs) == 2 and st.loaded == 2 and st.rows_read == 3 and st.out_of_order == 1
    assert st.skipped == {"not drawn by sample=2": 1}
    assert "0 GeneratedTokens raised to 1 (an engine generates at least 1 token)" in st.changed
    adds_up(st)
    assert load_scenario_trace(load_scenario(sc_path)) == reqs  # stats change nothing


# ------------------------------------------------------------------------------- arrival order


def test_unsorted_vidur_is_sorted_and_counted(tmp_path, capsys):
    p = write(tmp_path, "v.csv", VID_HEAD + "3.0,1,1\n0.0,2,1\n2.25,3,1\n0.5,4,1\n0.5,5,1\n")
    st = LoadStats()
    reqs = load_trace("vidur", p, stats=st)
    assert [r.prompt_tokens for r in reqs] == [2, 4, 5, 3, 1] and [r.arrival_s for r in reqs] == [0, .5, .5, 2.25, 3]
    assert st.out_of_order == 2  # 0.0 after 3.0, 0.5 after 2.25
    assert st.first["out of arrival order"] == f"{p}:3: arrived_at 0.0 is earlier than the row before it (3.0)"
    assert "2 out of arrival order" in st.summary()
    msg = one_line_error(load_trace, "vidur", p, strict=True)
    assert msg.startswith(f"{p}:3: arrived_at 0.0 is earlier") and "arrival order" in msg
    inspect(str(p))
    out = capsys.readouterr().out
    assert f"note: 2 row(s) out of arrival order, sorted by arrival (first {p}:3:" in out
    assert f"{p}:3:" in one_line_error(inspect, str(p), strict=True)


def test_scenario_trace_strict_reaches_the_loader(tmp_path):
    write(tmp_path, "v.csv", VID_HEAD + "3.0,1,1\n0.0,2,1\n")
    sc = load_scenario(write(tmp_path, "s.yaml", "name: x\ntrace: {format: vidur, path: v.csv}\n"
                                                  "engines: [{name: paged, kind: paged}]\n"))
    assert len(load_scenario_trace(sc)) == 2
    strict = load_scenario(write(tmp_path, "t.yaml", "name: x\ntrace: {format: vidur, path: v.csv, strict: true}\n"
                                                     "engines: [{name: paged, kind: paged}]\n"))
    msg = one_line_error(load_scenario_trace, strict)
    assert msg.startswith(f"{tmp_path / 'v.csv'}:3: arrived_at 0.0 is earlier") and "strict" in msg


def test_cli_strict_and_an_apex_scenario(tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    p = write(tmp_path, "v.csv", VID_HEAD + "3.0,1,1\n0.0,2,1\n")
    res = CliRunner().invoke(app, ["trace", "inspect", str(p), "--strict"])
    assert res.exit_code == 2 and f"{p}:3:" in res.output and "Traceback" not in res.output
    assert CliRunner().invoke(app, ["trace", "inspect", str(p)]).exit_code == 0
    sc = load_scenario(write(tmp_path, "a.yaml", f"name: x\ntrace: {{format: apex, path: {APEX_EXAMPLE}}}\n"
                                                 "engines: [{name: paged, kind: paged}]\n"))
    assert len(load_scenario_trace(sc)) == len(load_trace("apex", APEX_EXAMPLE))


def test_every_loader_counts_rows_out_of_order(tmp_path):
    az = write(tmp_path, "a.csv", AZ_HEAD + "2023-11-16 18:15:47.5,1,1\n2023-11-16 18:15:47.4999999,2,2\n")
    bg = write(tmp_path, "b.csv", BG_HEAD + "5,ChatGPT,1,1,2,API log\n4,ChatGPT,1,1,2,API log\n")
    mc = write(tmp_path, "m.jsonl", '{"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
               '{"timestamp": 8, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n')
    for fmt, p, line in (("azure", az, 3), ("burstgpt", bg, 3), ("mooncake", mc, 2)):  # a JSONL has no header
        st = LoadStats()
        load_trace(fmt, p, stats=st)
        assert st.out_of_order == 1, fmt
        assert f"{p}:{line}:" in one_line_error(load_trace, fmt, p, strict=True), fmt
    ordered = LoadStats()
    load_trace("mooncake", BUILTIN_TRACE_DIR / "mooncake_slice.jsonl", token_ids=False, stats=ordered)
    assert ordered.out_of_order == 0 and ordered.warned == {} and ordered.notes() == []


# ------------------------------------------------------------------------------- Mooncake blocks


def test_mooncake_block_count_is_checked(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2]},  # needs 4
            {"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [1, 2, 3, 4, 5]},  # needs 2
            {"timestamp": 2, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 3, "input_length": 0, "output_length": 3, "hash_ids": []}]
    p = write(tmp_path, "m.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    st = LoadStats()
    reqs = load_trace("mooncake", p, stats=st)
    assert len(reqs) == 4 and reqs[0].prompt_tokens == 1600 and len(reqs[0].prompt_token_ids) == 1600
    assert st.warned == {BLOCKS_MISMATCH: 2}
    assert st.first[f"warned: {BLOCKS_MISMATCH}"] == f"{p}:1: input_length 1600 needs 4 hash_ids of 512 tokens, got 2"
    assert any(BLOCKS_MISMATCH in n for n in st.notes())
    msg = one_line_error(load_trace, "mooncake", p, strict=True)
    assert msg.startswith(f"{p}:1: input_length 1600 needs 4 hash_ids") and "strict" in msg
    ok = write(tmp_path, "ok.jsonl", "\n".join(json.dumps(r) for r in rows[2:]) + "\n")
    assert len(load_trace("mooncake", ok, strict=True)) == 2


def test_a_fixed_output_length_is_set_and_counted():
    st = LoadStats()
    reqs = load_trace("apex", APEX_EXAMPLE, stats=st)
    out = apply_transforms(reqs, output_tokens=64, stats=st)
    assert [r.output_tokens for r in out] == [64] * 5
    # apex-3 already had 64: four requests changed, each counted under one reason
    assert st.changed == {"output_tokens set to output_tokens 64": 4}
    with pytest.raises(TraceError, match="output_tokens must be a positive integer"):
        apply_transforms(reqs, output_tokens=0)
