"""workbench quality: the agreement and window formulas, the committed text slice, bad options, and (real
model) a small run of the command: fp32 agrees with itself, perplexities are finite and ordered, bytes
shrink with the format."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
from typer.testing import CliRunner

from workbench.quality import FORMULAS, PROMPTS, TEXT_PATH, QualitySettings, agreement, text_windows


def test_agreement_counts_positions_up_to_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    assert agreement(ref, ref) == (1.0, 1.0)
    got = [[1, 2, 0, 4], [5, 6], [7]]  # diverges at 2; identical; stops early
    pos, same = agreement(ref, got)
    assert pos == pytest.approx((2 + 2 + 1) / 9) and same == pytest.approx(1 / 3)
    assert agreement([[1, 2]], [[1, 2, 3]]) == (1.0, 0.0)  # longer than fp32: every fp32 position matches
    with pytest.raises(ValueError, match="one output per reference prompt"):
        agreement(ref, got[:2])


def test_windows_are_whole_and_non_overlapping():
    ids = list(range(1000))
    w = text_windows(ids, 300)
    assert [x[0] for x in w] == [0, 300, 600] and all(len(x) == 300 for x in w)
    assert text_windows(ids, 300, max_windows=1) == [ids[:300]]


def test_the_committed_text_slice_matches_its_attribution():
    data = TEXT_PATH.read_bytes()
    note = (TEXT_PATH.parent / "ATTRIBUTION.md").read_text()
    assert 20_000 < len(data) < 50_000 and f"{len(data):,} bytes" in note
    assert hashlib.sha256(data).hexdigest() in note and "sentencepiece-0.2.3" in note and "public domain" in note
    assert b"Gutenberg" not in data and data.decode("ascii").startswith("CHAPTER I\n")
    assert len(PROMPTS) == 32 and len(set(PROMPTS)) == 32
    assert set(FORMULAS) >= {"agreement_positions", "prompts_identical", "perplexity", "weight_bytes", "output_tok_s"}


@pytest.mark.parametrize("args, msg", [
    (["--weight-dtype", "fp8"], "--weight-dtype fp8 is not one of fp32, bf16, int8, int4"),
    (["--dtype", "float16"], "--dtype must be float32 or bfloat16, got 'float16'"),
    (["--window-tokens", "1"], "--window-tokens must be >= 2"),
    (["--speed-prompts", "-1"], "--speed-prompts must be >= 0"),
    (["--text", "/no/such/file.txt"], "--text /no/such/file.txt: no such file"),
])
def test_bad_options_are_one_line_errors(args, msg):
    from workbench.cli import app

    res = CliRunner().invoke(app, ["quality", *args])
    assert res.exit_code == 2 and msg in res.output and len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.real_model
def test_quality_command_on_a_small_setting(tmp_path, smollm2_dir, one_thread):
    from workbench.cli import app

    out = tmp_path / "q.json"
    res = CliRunner().invoke(app, ["quality", "--prompts", "4", "--max-tokens", "8", "--windows", "1",
                                   "--window-tokens", "256", "--speed-prompts", "4", "--speed-tokens", "4",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "| weight_dtype |" in res.output and "agreement_positions: sum_i m_i / sum_i n_i" in res.output
    report = json.loads(out.read_text())
    r = {x["weight_dtype"]: x for x in report["results"]}
    assert list(r) == ["fp32", "bf16", "int8", "int4"]
    assert r["fp32"]["agreement_positions"] == r["fp32"]["prompts_identical"] == 1.0
    assert r["bf16"]["dtype"] == "bfloat16" and r["int8"]["dtype"] == r["int4"]["dtype"] == "float32"
    assert all(math.isfinite(x["perplexity"]) and x["perplexity"] > 1 for x in r.values())
    assert all(x["predicted_tokens"] == 255 for x in r.values())  # one window: 255 predicted tokens
    # bf16 and int8 are close to fp32, int4 (round-to-nearest) is worse
    assert abs(r["bf16"]["perplexity"] / r["fp32"]["perplexity"] - 1) < 0.03
    assert abs(r["int8"]["perplexity"] / r["fp32"]["perplexity"] - 1) < 0.05
    assert r["int4"]["perplexity"] > r["fp32"]["perplexity"]
    b = {k: x["weight_bytes"] for k, x in r.items()}
    assert b["int4"] < b["int8"] < b["bf16"] < b["fp32"]
    assert all(x["output_tok_s"] > 0 and x["single_stream_tok_s"] > 0 for x in r.values())
    assert report["machine"]["cpu"] and report["machine"]["cpu_capability"] and report["formulas"] == FORMULAS
    assert report["text"]["windows"] == 1 and report["settings"]["num_prompts"] == 4
    assert r["int8"]["kernels"]["linear_layer"] == "Int8Linear" and r["int4"]["kernels"]["linear_layer"] == "Int4Linear"
    assert QualitySettings().problems() == []
