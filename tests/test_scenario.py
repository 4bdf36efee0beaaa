"""Scenario YAML files (workbench.scenario): validation, the engine kinds and the knobs each takes, one-line
errors, overrides, hashing (pinned for every committed scenario)."""

from __future__ import annotations

import json
import math
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import TypeAdapter

from workbench.errors import UsageError
from workbench.scenario import (
    ENGINE_KINDS,
    EngineSpec,
    OpenAIEngineSpec,
    PagedEngineSpec,
    Scenario,
    ScenarioError,
    SimEngineSpec,
    StaticEngineSpec,
    apply_overrides,
    builtin_traces,
    load_scenario,
    load_scenario_trace,
    parse_overrides,
    scenario_hash,
    validate_scenario,
)
from workbench.traces import BUILTIN_TRACE_DIR

ROOT = Path(__file__).resolve().parents[1]

VALID = """\
name: conv-small
description: Azure conversation slice on both engines
seed: 7
trace:
  format: azure
  path: traces/conv.csv
  limit: 40
  request_rate: 4.0
  max_input_tokens: 1024
engines:
  - name: paged
    kind: paged
    kv_cache_tokens: 16384
  - name: static
    kind: static
    reservation: pow2
    max_batch_size: 8
  - {name: sim-paged, kind: sim}
slo:
  ttft_ms: 2000
  tpot_ms: 150
"""


@pytest.fixture
def scen_dir(tmp_path):
    (tmp_path / "traces").mkdir()
    shutil.copy(BUILTIN_TRACE_DIR / "azure_conv_slice.csv", tmp_path / "traces" / "conv.csv")
    return tmp_path


def write(folder, text, name="s.yaml"):
    p = folder / name
    p.write_text(textwrap.dedent(text))
    return p


def scenario_error(path, **kwargs) -> str:
    with pytest.raises(ScenarioError) as ei:
        load_scenario(path, **kwargs)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{path}: "), msg
    return msg


# ------------------------------------------------------------------------------------------- valid


def test_valid_scenario_defaults_paths_and_round_trip(scen_dir):
    p = write(scen_dir, VALID)
    sc = load_scenario(p)
    assert sc.name == "conv-small" and sc.model == "smollm2-135m" and sc.seed == 7
    assert sc.trace_path() == scen_dir / "traces" / "conv.csv"
    assert sc.base_dir == scen_dir
    paged, static, sim = sc.engines
    assert (paged.block_size, paged.max_num_seqs, paged.max_num_batched_tokens, paged.dtype) == (16, 256, 2048, "float32")
    assert (static.reservation, static.max_batch_size, static.completion) == ("pow2", 8, None)
    assert not hasattr(static, "policy") and not hasattr(paged, "reservation")  # each kind has its own knobs
    assert (sim.policy, sim.cost_model) == ("paged", "auto") and sc.cost_model_path(sim) is None
    assert sc.slo.ttft_ms == 2000 and sc.slo.e2el_ms is None
    assert sc.engine("static") is static
    with pytest.raises(KeyError, match="paged, static, sim-paged"):
        sc.engine("nope")
    # dump -> YAML -> load gives the same scenario and hash
    again = write(scen_dir, yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False), "again.yaml")
    sc2 = load_scenario(again)
    assert sc2 == sc and scenario_hash(sc2) == scenario_hash(sc)
    reqs = load_scenario_trace(sc)
    assert len(reqs) == 40 and reqs[0].arrival_s == 0.0
    assert max(r.prompt_tokens for r in reqs) <= 1024
    assert all(len(r.prompt_token_ids) == r.prompt_tokens for r in reqs)
    assert load_scenario_trace(sc) == reqs  # deterministic from the seed


def test_builtin_paths_synthetic_and_mooncake(tmp_path):
    assert "mooncake_slice.jsonl" in builtin_traces() and "ATTRIBUTION.md" not in builtin_traces()
    p = write(tmp_path, """\
        name: mc
        trace: {format: mooncake, path: "builtin:mooncake_slice.jsonl", block_tokens: 16, sample: 20,
                max_output_tokens: 32}
        engines: [{name: paged, kind: paged}]
        """)
    sc = load_scenario(p)
    assert sc.trace_path() == BUILTIN_TRACE_DIR / "mooncake_slice.jsonl"
    reqs = load_scenario_trace(sc, vocab_hi=1000)
    assert len(reqs) == 20 and all(len(r.prompt_token_ids) == r.prompt_tokens for r in reqs)
    assert all(100 <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    assert max(r.output_tokens for r in reqs) <= 32
    syn = write(tmp_path, """\
        name: syn
        trace:
          format: synthetic
          synthetic: {num_requests: 30, request_rate: .inf, lengths: file,
                      lengths_path: "builtin:sarathi_sharegpt_lengths_slice.csv", input_max: 256}
        engines: [{name: s, kind: static}]
        """, "syn.yaml")
    sc = load_scenario(syn)
    reqs = load_scenario_trace(sc)
    assert len(reqs) == 30 and all(r.arrival_s == 0 for r in reqs)
    assert max(r.prompt_tokens for r in reqs) <= 256
    assert sc.trace.synthetic.request_rate == math.inf


# ------------------------------------------------------------------------------------------ errors


def test_missing_file_and_yaml_syntax(tmp_path):
    missing = tmp_path / "none.yaml"
    assert "no such file" in scenario_error(missing)
    bad = write(tmp_path, "name: x\ntrace:\n  format: azure\n   path: a.csv\nengines: []\n")
    msg = scenario_error(bad)
    assert "line 4" in msg and "YAML syntax error" in msg
    dup = write(tmp_path, "name: x\nname: y\n", "dup.yaml")
    msg = scenario_error(dup)
    assert "line 2" in msg and "duplicate key 'name'" in msg
    empty = write(tmp_path, "", "empty.yaml")
    assert "empty" in scenario_error(empty)
    lst = write(tmp_path, "- a\n- b\n", "list.yaml")
    assert "(top level): expected a mapping" in scenario_error(lst)


@pytest.mark.parametrize("old, new, field, what", [
    ("reservation: pow2", "reservation: maxx", "engines.1.reservation", "'max', 'pow2' or 'oracle', got 'maxx' (engine static, line 16)"),
    ("    max_batch_size: 8", "    max_batch_sise: 8", "engines.1.max_batch_sise", "unknown field; allowed: name, kind"),
    ("  limit: 40", "  limt: 40", "trace.limt", "unknown field; allowed: format, path, limit"),
    ("name: conv-small\n", "", "name", "required field is missing"),
    ("format: azure", "format: splitwise", "trace.format", "'azure', 'mooncake'"),
    ("request_rate: 4.0", "request_rate: -1", "trace.request_rate", "greater than 0"),
    ("kind: static", "kind: dynamic", "engines.1.kind", "'paged', 'static', 'sim' or 'openai'"),
    ("max_batch_size: 8", "max_batch_size: 8.5", "engines.1.max_batch_size", "integer"),
    ("max_batch_size: 8", "max_batch_size: yes", "engines.1.max_batch_size", "got a boolean (true)"),
    ("name: static", "name: paged", "engines", "'paged' is engines.0 and engines.1"),
    ("kv_cache_tokens: 16384", "kv_cache_tokens: 16384\n    kv_cache_bytes: 100", "engines.0",
     "kv_cache_tokens or kv_cache_bytes, not both"),
    ("reservation: pow2", "policy: static", "engines.1.policy", "policy is only for kind sim (kind is static)"),
    ("reservation: pow2", "max_num_seqs: 4", "engines.1.max_num_seqs", "paged- and orca-policy engines"),
    ("{name: sim-paged, kind: sim}", "{name: sim-paged, kind: sim, cost_model: builtin:gpu}", "engines.2",
     "builtin cost models: builtin:ci-reference"),
    ("{name: sim-paged, kind: sim}", "{name: sim-paged, kind: sim, cost_model: prof.json}", "engines.2.cost_model",
     "(engine sim-paged"),
    ("path: traces/conv.csv", "path: traces/other.csv", "trace.path", "no such file"),
    ("path: traces/conv.csv", "path: builtin:nope.csv", "trace.path", "builtin traces: azure_code_slice.csv"),
    ("  path: traces/conv.csv\n", "", "trace", "format azure needs a path"),
    ("  limit: 40", "  block_tokens: 16", "trace", "block_tokens is only for format mooncake"),
    ("  ttft_ms: 2000\n  tpot_ms: 150\n", "  {}\n", "slo", "at least one of ttft_ms"),
    ("  tpot_ms: 150", "  tpot_ms: 0", "slo.tpot_ms", "greater than 0"),
    ("seed: 7", "seed: -1", "seed", "greater than or equal to 0"),
    ("  - {name: sim-paged, kind: sim}", "  - {name: 'a.b', kind: sim}", "engines.2.name", "letters, digits"),
])
def test_validation_errors_one_line(scen_dir, old, new, field, what):
    assert old in VALID
    p = write(scen_dir, VALID.replace(old, new))
    msg = scenario_error(p)
    assert f": {field}: " in msg, msg
    assert what in msg, msg


def test_synthetic_section_errors(tmp_path):
    base = "name: s\nengines: [{name: a, kind: paged}]\ntrace:\n  format: synthetic\n"
    msg = scenario_error(write(tmp_path, base))
    assert ": trace: format synthetic needs a 'synthetic' section" in msg
    msg = scenario_error(write(tmp_path, base + "  synthetic: {num_requests: 3, request_rate: 1, lengths: uniform}\n"))
    assert ": trace.synthetic: lengths uniform needs input_range" in msg
    msg = scenario_error(write(tmp_path, base + "  synthetic: {num_requests: 3, request_rate: 1, burst: 2}\n"))
    assert ": trace.synthetic.burst: unknown field; allowed: num_requests, request_rate, burstiness" in msg


# --------------------------------------------------------------------------------------- overrides


def test_overrides_by_engine_name_and_index(scen_dir):
    p = write(scen_dir, VALID)
    data = yaml.safe_load(p.read_text())
    out = apply_overrides(data, {"engines.static.max_batch_size": 16, "trace.request_rate": 2,
                                 "engines.0.block_size": 32, "slo.e2el_ms": 9000, "trace.max_input_tokens": None,
                                 "engines.sim-paged.policy": "static"})
    assert data["engines"][1]["max_batch_size"] == 8 and data["trace"]["request_rate"] == 4.0  # input unchanged
    sc = validate_scenario(out, base_dir=scen_dir)
    assert sc.engine("static").max_batch_size == 16 and sc.engine("paged").block_size == 32
    assert sc.trace.request_rate == 2.0 and sc.trace.max_input_tokens is None and sc.slo.e2el_ms == 9000
    assert sc.engine("sim-paged").policy == "static"
    with pytest.raises(ScenarioError, match="no engine named 'fast'.*engines: paged, static, sim-paged"):
        apply_overrides(data, {"engines.fast.max_num_seqs": 1})
    with pytest.raises(ScenarioError, match="name is a value"):
        apply_overrides(data, {"name.x": 1})
    # new sections are created; validation then catches typos
    no_slo = {k: v for k, v in data.items() if k != "slo"}
    assert apply_overrides(no_slo, {"slo.ttft_ms": 5})["slo"] == {"ttft_ms": 5}
    with pytest.raises(ScenarioError, match="engines.0.max_num_seq: unknown field"):
        validate_scenario(apply_overrides(data, {"engines.paged.max_num_seq": 4}), base_dir=scen_dir)
    # through load_scenario (strings from a command line parse as YAML)
    sc = load_scenario(p, overrides=parse_overrides(["engines.paged.max_num_seqs=16", "trace.limit=5"]))
    assert sc.engine("paged").max_num_seqs == 16 and sc.trace.limit == 5
    msg = scenario_error(p, overrides={"engines.static.reservation": "all"})
    assert ": engines.1.reservation: " in msg
    with pytest.raises(ScenarioError, match="expected KEY=VALUE"):
        parse_overrides(["trace.limit"])


# ------------------------------------------------------------------------------------------- hash


def test_scenario_hash_stable_and_sensitive(scen_dir):
    p = write(scen_dir, VALID)
    h = scenario_hash(load_scenario(p))
    assert len(h) == 16 and int(h, 16) >= 0
    assert scenario_hash(load_scenario(p)) == h
    # key order and spelled-out defaults do not matter
    data = yaml.safe_load(p.read_text())
    reordered = dict(reversed(list(data.items())))
    reordered["engines"][0] = {**reordered["engines"][0], "block_size": 16, "dtype": "float32"}
    assert scenario_hash(validate_scenario(reordered, base_dir=scen_dir)) == h
    # a knob changes it
    other = validate_scenario(apply_overrides(data, {"engines.paged.max_num_seqs": 8}), base_dir=scen_dir)
    assert scenario_hash(other) != h
    # paths hash as written, not resolved: a moved scenario keeps its hash
    moved = scen_dir / "moved"
    shutil.copytree(scen_dir / "traces", moved / "traces")
    assert scenario_hash(load_scenario(write(moved, VALID))) == h
    assert isinstance(Scenario.model_validate(data), Scenario)


# every committed scenario's hash (unchanged by the per-kind schema; a deliberate change of a scenario updates
# it here): results and gate baselines (reports/baselines/ci-sim.json) name their scenario by it
COMMITTED_HASHES = {
    # changed on purpose: sim engines default to cost_model auto (this machine's profile), ci-sim names the
    # committed builtin:ci-reference profile, prefix-sharing and chunked-prefill gained a static engine and its twin;
    # prefix-sharing offers a load relative to its no-cache engine's capacity; ci-fidelity sends every request at 0 s
    "scenarios/azure-code.yaml": "64ec2e6d6c2400c4",
    "scenarios/chunked-prefill.yaml": "de506d622d074c45",
    "scenarios/ci-fidelity.yaml": "f6e00498670b09b8",
    "scenarios/ci-real.yaml": "5b5166807eeb6a4d",
    "scenarios/ci-sim.yaml": "48cbf7ef2d9911f3",
    "scenarios/cluster-prefix.yaml": "8e7e3c6e2dc8c027",
    "scenarios/cluster-real.yaml": "87227a86cefc0d50",
    "scenarios/cluster-real-200.yaml": "744ff7ece32226e1",
    "scenarios/openai-quickstart.yaml": "dfc5a8ddcf2f75f2",
    "scenarios/paper/pagedattention_opt13b.yaml": "944a0520980a97f0",
    "scenarios/plan-70b-azure-conv.yaml": "c281f0ea274d1476",
    "scenarios/peers/concurrency.yaml": "60e33cb6be33e5f8",
    "scenarios/prefix-sharing.yaml": "51e8e2a38b978065",
    "scenarios/quickstart.yaml": "b17ac7f8aafcecb1",
}


def test_committed_scenarios_keep_their_hashes():
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scenarios").rglob("*.yaml"))
    assert found == sorted(COMMITTED_HASHES), "a scenario was added or removed: pin its hash here"
    for rel, h in COMMITTED_HASHES.items():
        assert scenario_hash(load_scenario(ROOT / rel, check_files=False)) == h, rel
    baseline = json.loads((ROOT / "reports/baselines/ci-sim.json").read_text())
    assert baseline["scenario_hash"] == COMMITTED_HASHES["scenarios/ci-sim.yaml"]


# ------------------------------------------------------------------------------- engine kinds


def engine_file(folder, engine_lines: str):
    """A scenario whose only engine (named ``e``) starts at line 4; its first knob is on line 6."""
    return write(folder, "name: k\ntrace: {format: azure, path: 'builtin:azure_conv_slice.csv', limit: 4}\n"
                 "engines:\n  - name: e\n" + "".join(f"    {x}\n" for x in engine_lines.split(";")))


@pytest.mark.parametrize("engine, model", [
    ({"kind": "paged"}, PagedEngineSpec), ({"kind": "static"}, StaticEngineSpec), ({"kind": "sim"}, SimEngineSpec),
    ({"kind": "openai", "base_url": "http://h:1/v1"}, OpenAIEngineSpec)])
def test_each_kind_validates_to_its_model(engine, model):
    spec = TypeAdapter(EngineSpec).validate_python({"name": "e", **engine})
    assert type(spec) is model and spec.kind == engine["kind"]
    assert spec.policy_name == {"paged": "paged", "static": "static", "sim": "paged", "openai": None}[spec.kind]


def test_unknown_or_missing_kind_is_one_line_listing_the_kinds(tmp_path):
    msg = scenario_error(engine_file(tmp_path, "kind: dynamic"))
    kinds = "'paged', 'static', 'sim' or 'openai'"
    assert msg.endswith(f": engines.0.kind: Input should be {kinds}, got 'dynamic' (engine e, line 5)"), msg
    assert ENGINE_KINDS == ("paged", "static", "sim", "openai")
    msg = scenario_error(engine_file(tmp_path, "block_size: 8"))
    assert msg.endswith(f": engines.0.kind: required field is missing; one of {kinds} (engine e, line 4)"), msg


@pytest.mark.parametrize("engine, field, what", [
    ("kind: paged;reservation: pow2", "reservation",
     "only for static- and orca-policy engines (kind static, or kind sim with policy static or orca; kind paged)"),
    ("kind: static;max_num_batched_tokens: 512", "max_num_batched_tokens",
     "only for paged- and orca-policy engines (kind paged, or kind sim with policy paged or orca; kind static)"),
    ("kind: paged;completion: own_end", "completion",
     "only for static-policy engines (kind static, or kind sim with policy static; kind paged)"),
    ("kind: static;enable_prefix_caching: false", "enable_prefix_caching", "only for paged-policy engines"),
    ("kind: paged;base_url: http://h:1/v1", "base_url", "only for kind openai (kind is paged)"),
    ("kind: static;hardware: h100-sxm", "hardware", "only for kind sim (kind is static)"),
    ("kind: sim;device: cpu", "device", "only for real engines (kind paged or static; kind is sim)"),
    ("kind: openai;base_url: http://h:1/v1;max_num_seqs: 4", "max_num_seqs",
     "an engine knob, set on the server, not for kind openai"),
    # a sim engine: its policy decides (policy paged when left out)
    ("kind: sim;reservation: pow2", "reservation", "(kind static, or kind sim with policy static or orca; "
                                                   "kind sim, policy paged)"),
    ("kind: sim;policy: static;max_num_seqs: 8", "max_num_seqs", "kind sim, policy static)"),
    ("kind: sim;policy: static;max_num_batched_tokens: 512", "max_num_batched_tokens", "kind sim, policy static)"),
    ("kind: sim;policy: orca;max_batch_size: 8", "max_batch_size", "only for static-policy engines"),
    ("kind: sim;policy: orca;enable_chunked_prefill: false", "enable_chunked_prefill", "kind sim, policy orca)"),
    ("kind: sim;policy: static;swap_bandwidth_bytes_per_s: 1.0e+9", "swap_bandwidth_bytes_per_s",
     "only for paged-policy engines (kind sim with policy paged; kind sim, policy static)"),
])
def test_a_knob_the_engine_cannot_use_names_file_engine_field_and_line(tmp_path, engine, field, what):
    p = engine_file(tmp_path, engine)
    line = 4 + engine.split(";").index(next(x for x in engine.split(";") if x.startswith(field + ":"))) + 1
    msg = scenario_error(p)
    assert msg.startswith(f"{p}: engines.0.{field}: {field} is "), msg
    assert what in msg and msg.endswith(f"(engine e, line {line})"), msg


def test_knob_defaults_never_trip_and_every_dump_validates_again(tmp_path):
    engines = [
        {"name": "p", "kind": "paged"}, {"name": "s", "kind": "static"}, {"name": "sp", "kind": "sim"},
        {"name": "ss", "kind": "sim", "policy": "static"}, {"name": "so", "kind": "sim", "policy": "orca"},
        {"name": "o", "kind": "openai", "base_url": "http://h:1/v1"},
        # each policy's own knobs, some written at their default values
        {"name": "p2", "kind": "paged", "max_num_seqs": 256, "preemption_mode": "swap", "swap_space_bytes": 1024},
        {"name": "s2", "kind": "static", "reservation": "max", "max_batch_size": 8, "completion": "own_end"},
        {"name": "sp2", "kind": "sim", "policy": "paged", "enable_prefix_caching": False,
         "swap_bandwidth_bytes_per_s": 1e9},
        {"name": "ss2", "kind": "sim", "policy": "static", "reservation": "pow2", "completion": "batch_end"},
        {"name": "so2", "kind": "sim", "policy": "orca", "reservation": "oracle", "max_num_seqs": 8,
         "max_num_batched_tokens": 512},
    ]
    data = {"name": "d", "trace": {"format": "synthetic", "synthetic": {"num_requests": 2, "request_rate": 1}},
            "engines": engines}
    sc = validate_scenario(data)
    assert [e.policy_name for e in sc.engines] == ["paged", "static", "paged", "static", "orca", None,
                                                   "paged", "static", "paged", "static", "orca"]
    # a full dump (results.json's scenario) holds each engine's own knobs only, so it validates again
    dumped = sc.model_dump(mode="json")
    for e in dumped["engines"]:
        kind_fields = set(type(sc.engine(e["name"])).model_fields)
        assert set(e) <= kind_fields
    assert "reservation" not in dumped["engines"][2] and "max_num_seqs" not in dumped["engines"][3]
    assert "max_batch_size" not in dumped["engines"][4] and "reservation" in dumped["engines"][4]
    again = validate_scenario(dumped)
    assert again == sc and scenario_hash(again) == scenario_hash(sc)


def test_overrides_of_a_knob_the_engine_lacks_are_one_line_errors(scen_dir):
    p = write(scen_dir, VALID)
    msg = scenario_error(p, overrides=parse_overrides(["engines.paged.reservation=pow2"]))
    assert ": engines.0.reservation: reservation is only for static- and orca-policy engines" in msg
    assert msg.endswith("; kind paged) (engine paged)"), msg
    msg = scenario_error(p, overrides=parse_overrides(["engines.static.max_num_seqs=8"]))
    assert ": engines.1.max_num_seqs: " in msg and "(engine static)" in msg
    # the policy an override picks decides which knobs a sim engine may keep
    msg = scenario_error(p, overrides={"engines.sim-paged.policy": "static", "engines.sim-paged.max_num_seqs": 4})
    assert ": engines.2.max_num_seqs: " in msg and "kind sim, policy static" in msg


def test_scenario_error_is_a_usage_error():
    assert issubclass(ScenarioError, UsageError) and issubclass(ScenarioError, ValueError)


# ----------------------------------------------------------------------------------- weight_dtype


@pytest.mark.parametrize("engine, what", [
    ("kind: paged;weight_dtype: fp8", "weight_dtype fp8 is a what-if of the analytic cost model; the real engine "
                                      "runs fp32, bf16, int8, int4"),
    ("kind: static;weight_dtype: awq", "weight_dtype awq is a what-if of the analytic cost model"),
    ("kind: paged;weight_dtype: bf16", "weight_dtype bf16 means dense weights in dtype bfloat16, but dtype is "
                                       "float32"),
    ("kind: paged;dtype: bfloat16;weight_dtype: fp32", "weight_dtype fp32 means dense weights in dtype float32"),
    ("kind: sim;weight_dtype: gptq", "weight_dtype gptq is a what-if of the analytic cost model; a measured "
                                     "profile (of the real engine) runs fp32, bf16, int8, int4"),
    ("kind: sim;hardware: h100-sxm;weight_dtype: int8", "weight_dtype int8 is not priced by the analytic cost "
                                                        "model (bf16, fp8, awq, gptq, int4)"),
    ("kind: openai;base_url: http://h:1/v1;weight_dtype: int8", "weight_dtype is an engine knob, set on the server"),
])
def test_a_weight_dtype_the_engine_cannot_run_is_one_line_naming_it(tmp_path, engine, what):
    msg = scenario_error(engine_file(tmp_path, engine))
    assert what in msg and "(engine e, line" in msg, msg


def test_weight_dtype_one_vocabulary_for_real_and_sim_engines(tmp_path):
    from workbench.runner import engine_config

    engines = [{"name": "p", "kind": "paged"}, {"name": "p8", "kind": "paged", "weight_dtype": "int8"},
               {"name": "s4", "kind": "static", "dtype": "bfloat16", "weight_dtype": "int4"},
               {"name": "pd", "kind": "paged", "dtype": "bfloat16", "weight_dtype": "bf16"},
               {"name": "sm", "kind": "sim", "weight_dtype": "int8"},
               {"name": "sa", "kind": "sim", "hardware": "h100-sxm", "model": "llama-3.1-8b", "weight_dtype": "awq"},
               {"name": "sd", "kind": "sim", "hardware": "h100-sxm", "model": "llama-3.1-8b"}]
    sc = validate_scenario({"name": "w", "trace": {"format": "synthetic",
                                                   "synthetic": {"num_requests": 2, "request_rate": 1}},
                            "engines": engines})
    assert [e.weight_dtype for e in sc.engines] == [None, "int8", "int4", "bf16", "int8", "awq", None]
    # real engines hand it to the factory (None: the dense weights of dtype) ...
    cfgs = {n: engine_config(sc, sc.engine(n), tmp_path, None) for n in ("p", "p8", "s4")}
    assert [(c.weight_dtype, c.real_weight_dtype) for c in cfgs.values()] == [
        (None, "fp32"), ("int8", "int8"), ("int4", "int4")]
    # ... and the analytic cost model prices it (unset: bf16)
    from engines.factory import analytic_cost_model

    for name, want in (("sa", "awq"), ("sd", "bf16")):
        assert analytic_cost_model(engine_config(sc, sc.engine(name), None, None)).weight_dtype == want
    # a default left out keeps the hash of a scenario written before the field existed
    plain = validate_scenario({"name": "w", "trace": {"format": "synthetic",
                                                      "synthetic": {"num_requests": 2, "request_rate": 1}},
                               "engines": [{"name": "p", "kind": "paged"}]})
    assert "weight_dtype" not in json.dumps(plain.model_dump(mode="json", exclude_defaults=True))
