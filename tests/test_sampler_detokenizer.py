"""Sampler (greedy, top-k, top-p, per-request seeds) and IncrementalDetokenizer on a byte-level BPE."""

import pytest
import torch

from engines.core.detokenizer import IncrementalDetokenizer
from engines.core.sampling_params import SamplingParams
from engines.real.sampler import Sampler

# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


def logits_of(n, vocab=50, seed=0, scale=3.0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax():
    x = logits_of(8)
    s = Sampler(seed=0)
    ids = [f"r{i}" for i in range(8)]
    out = s.sample(x, ids, [SamplingParams(temperature=0.0)] * 8)
    assert out == x.argmax(-1).tolist()


def test_top_k_1_is_greedy_even_at_temperature_1():
    x = logits_of(8, seed=1)
    s = Sampler(seed=0)
    p = SamplingParams(temperature=1.0, top_k=1)
    for _ in range(5):
        assert s.sample(x, [f"r{i}" for i in range(8)], [p] * 8) == x.argmax(-1).tolist()
    # and the top-k filter itself, bypassing the greedy shortcut
    g = torch.Generator().manual_seed(0)
    for row in x:
        assert Sampler._sample_row(row, SamplingParams(temperature=1.0, top_k=1), g) == int(row.argmax())


def test_tiny_top_p_is_argmax():
    x = logits_of(8, seed=2, scale=0.5)  # flat: plain sampling would often miss the argmax
    s = Sampler(seed=0)
    p = SamplingParams(temperature=1.0, top_p=1e-6)
    for _ in range(10):
        assert s.sample(x, [f"r{i}" for i in range(8)], [p] * 8) == x.argmax(-1).tolist()


def test_extreme_top_p_and_temperature_give_the_top_token_not_an_error():
    """top_p = the smallest float and a temperature whose logits / T overflow to inf: the limit of each
    (the most likely token), not a NaN that fails the whole step."""
    x = logits_of(8, seed=3)
    s = Sampler(seed=0)
    ids = [f"r{i}" for i in range(8)]
    for p in (SamplingParams(temperature=1.0, top_p=5e-324), SamplingParams(temperature=1e-310),
              SamplingParams(temperature=1e-310, top_p=5e-324)):
        assert s.sample(x, ids, [p] * 8) == x.argmax(-1).tolist(), p


def test_top_k_never_samples_outside_top_k():
    row = logits_of(1, vocab=100, seed=3, scale=1.0)[0]
    allowed = set(torch.topk(row, 5).indices.tolist())
    s = Sampler(seed=0)
    p = SamplingParams(temperature=1.0, top_k=5)
    draws = [s.sample(row[None], ["r"], [p])[0] for _ in range(200)]
    assert set(draws) <= allowed
    assert len(set(draws)) >= 3  # it does sample, not just argmax


def test_top_p_keeps_only_the_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    row = probs.log()
    s = Sampler(seed=0)
    # mass before token 2 (in sorted order: 0.5, 0.3, 0.15, 0.05) is 0.8 >= 0.75: dropped
    p = SamplingParams(temperature=1.0, top_p=0.75)
    draws = [s.sample(row[None], ["r"], [p])[0] for _ in range(200)]
    assert set(draws) == {1, 3}


def test_temperature_sampling_covers_distribution():
    row = torch.zeros(4)
    s = Sampler(seed=0)
    draws = [s.sample(row[None], ["r"], [SamplingParams(temperature=1.0)])[0] for _ in range(200)]
    assert set(draws) == {0, 1, 2, 3}


def run_seeded(sampler, steps, position, others, seed=1234):
    """Samples of request 'x' (seeded) over ``steps`` steps, with ``others`` rows around it."""
    out = []
    for t in range(steps):
        x_row = logits_of(1, seed=100 + t, scale=1.0)
        other_rows = logits_of(len(others), seed=200 + t + 31 * position, scale=1.0)
        rows = list(other_rows)
        rows.insert(position, x_row[0])
        ids = [rid for rid, _ in others]
        ids.insert(position, "x")
        params = [p for _, p in others]
        params.insert(position, SamplingParams(temperature=1.0, seed=seed))
        out.append(sampler.sample(torch.stack(rows), ids, params)[position])
    return out


def test_seeded_request_is_reproducible_regardless_of_batch():
    a = run_seeded(Sampler(seed=0), 30, 0, [])
    b = run_seeded(
        Sampler(seed=99),
        30,
        2,
        [("u1", SamplingParams(temperature=1.0)), ("g", SamplingParams(temperature=0)),
         ("s", SamplingParams(temperature=0.7, seed=7)), ("u2", SamplingParams(temperature=1.3, top_k=4))],
    )
    assert a == b
    assert len(set(a)) > 3  # really random, not degenerate
    c = run_seeded(Sampler(seed=0), 30, 0, [], seed=4321)
    assert c != a


def test_release_restarts_the_seeded_stream():
    s = Sampler()
    p = [SamplingParams(temperature=1.0, seed=5)]
    x = logits_of(1, scale=0.5)
    first = [s.sample(x, ["x"], p)[0] for _ in range(20)]
    s.release("x")
    again = [s.sample(x, ["x"], p)[0] for _ in range(20)]
    assert first == again


# --------------------------------------------------------------------------------------------
# IncrementalDetokenizer
# --------------------------------------------------------------------------------------------

CORPUS = [
    "héllo wörld 日本語 😀",
    "hello world, the quick brown fox jumps over the lazy dog",
    "stop here STOP now",
    "日本語のテキストです",
    "naïve café — ünïcödé ∑ 🙂🚀",
]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    # a small vocabulary so that most multi-byte characters stay split over several tokens
    bpe.train_from_iterator(CORPUS * 5, vocab_size=300, min_frequency=2, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


TEXTS = [
    "héllo wörld 日本語 😀",
    "a😀b日c",
    "ünïcödé ∑ 🙂🚀 naïve",
    "テキスト and café — done",
    "😀😀😀",
]


def feed(det, ids):
    deltas, stop = [], None
    for i in ids:
        d, stop = det.step(i)
        deltas.append(d)
        if stop is not None:
            break
    else:
        deltas.append(det.flush())
    return deltas, stop


def test_tokenizer_splits_multibyte_characters(tok):
    # the premise of the detokenizer tests: some tokens decode to partial characters
    ids = tok.encode("a😀b日c")
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert tok.decode(ids) == "a😀b日c"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "prompt: 日本", "x 😀"])
def test_deltas_concatenate_to_full_decode(tok, text, prompt):
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, tok.encode(prompt))
    deltas, stop = feed(det, ids)
    assert stop is None
    assert "".join(deltas) == tok.decode(ids) == text
    assert det.text == text
    for d in deltas:
        assert "\ufffd" not in d


def test_incomplete_trailing_character_is_held_back(tok):
    ids = tok.encode("ab😀")
    assert "\ufffd" in tok.decode(ids[:-1])
    det = IncrementalDetokenizer(tok, [])
    deltas, _ = feed(det, ids[:-1])
    assert det.text == "ab" and "".join(deltas) == "ab"
    d, _ = det.step(ids[-1])
    assert d == "😀" and det.text == "ab😀"


def test_stop_string_cuts_text_before_it(tok):
    text = "stop here STOP now"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas, stop = feed(det, ids)
    assert stop == "STOP"
    assert det.text == "stop here "
    assert len(deltas) < len(ids)  # found before the last token


def test_stop_string_inside_one_delta(tok):
    ids = tok.encode("héllo wörld")
    det = IncrementalDetokenizer(tok, [], stop=["ll"])
    deltas, stop = feed(det, ids)
    assert stop == "ll"
    assert det.text == "hé"
    assert "".join(deltas) == "hé"


def test_stop_string_spanning_two_tokens_is_found(tok):
    text = "héllo wörld 日本語"
    ids = tok.encode(text)
    stop = "o wö"
    # the stop string really spans a token boundary
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    det = IncrementalDetokenizer(tok, tok.encode("prompt "), stop=[stop])
    _, found = feed(det, ids)
    assert found == stop
    assert det.text == "héll"


def test_stop_string_spanning_a_split_character(tok):
    text = "a😀b日c"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, [], stop=["😀b"])
    _, found = feed(det, ids)
    assert found == "😀b"
    assert det.text == "a"


def test_no_stop_string_no_cut(tok):
    ids = tok.encode("héllo wörld")
    det = IncrementalDetokenizer(tok, [], stop=["xyz", ""])
    deltas, stop = feed(det, ids)
    assert stop is None and det.text == "héllo wörld"


def test_two_stop_strings_in_one_delta_cut_at_the_earliest(tok):
    # ' 日本語' is one token in this vocabulary, so both stop strings arrive in the same delta
    ids = tok.encode(" 日本語")  # often a single token here; either way "日" comes first
    det = IncrementalDetokenizer(tok, [], stop=["語", "日"])
    _, found = feed(det, ids)
    assert found == "日"
    assert det.text == " "


def test_deltas_concatenate_to_text_when_stop_spans_tokens(tok):
    ids = tok.encode("stop here STOP now")
    det = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas, stop = feed(det, ids)
    assert stop == "STOP"
    assert "".join(deltas) == det.text == "stop here "


def test_include_stop_str_keeps_the_stop_string(tok):
    ids = tok.encode("stop here STOP now")
    det = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str=True)
    deltas, stop = feed(det, ids)
    assert stop == "STOP" and det.text == "stop here STOP" == "".join(deltas)


def test_min_tokens_defers_the_stop_string_check(tok):
    """A stop string completed before ``min_tokens`` tokens never matches later (vLLM's stop checker looks
    only at text added once the minimum is reached)."""
    text = "ab STOP cd STOP ef"
    ids = tok.encode(text)
    first_stop_end = next(i for i in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:i]))
    det = IncrementalDetokenizer(tok, [], stop=["STOP"], min_tokens=first_stop_end + 1)
    deltas, stop = feed(det, ids)
    assert stop == "STOP" and det.text == "ab STOP cd "


def test_special_tokens_are_kept_when_asked():
    from tiny_model import make_tokenizer

    tok = make_tokenizer()
    ids = tok.encode("hi") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode("yo")
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tok, [])
    feed(kept, ids)
    feed(skipped, ids)
    assert kept.text == "hi<|im_end|>yo" and skipped.text == "hiyo"
