"""Speculative decoding on this CPU: the real paged engine with and without drafts, beside the simulator's
prediction of the same speedup from this machine's measured profile and the real run's measured acceptance.

Workload (outputs repeat their input, where prompt lookup shines): SmolLM2-135M-Instruct chat-template
prompts asking to repeat, copy, or fix a typo in a passage of ``workbench/data/text/botchan_ch1-2.txt`` (a
different passage per request), greedy, up to ``--max-tokens`` outputs (EOS ends a request earlier; greedy
speculative decoding is token-identical to plain decoding, so both runs emit the same tokens). ``batch``
requests arrive together, ``max_num_seqs = batch``.

Per point (batch, k) with ``ngram``: one plain engine per batch and one speculative engine per k, built with
the same knobs, each warmed up (two short requests of another cache salt) before its timed run; every timed
run has its own cache salt (no prefix-cache hits across runs or repeats). Then the simulator (paged policy,
this machine's ``cost_model: auto`` profile, no step noise) replays the same prompt tokens with each request's
real output length, plain and with speculation at the real run's measured acceptance: per-position
conditional rates and draft rate (``sim``), and one geometric rate = the real acceptance rate (``sim_a``).
``layers:N`` (the target's first N layers as the draft) is measured at batch 1 for a few N.

    python benchmarks/spec_decode.py                       # full grid (about 10 minutes on 2 cores)
    python benchmarks/spec_decode.py --max-points 3        # the first 3 points only
    python benchmarks/spec_decode.py --batches 1,4 --ks 4 --layers ""

Formulas (also in the JSON's ``meta.formulas``):
- output_tok_s = output tokens of the batch / wall seconds of the batch's ``generate`` call.
- e2el_s = mean over requests of finished_time - arrival_time (s).
- speedup = plain e2el_s / speculative e2el_s (latency; > 1: speculation helps).
- acceptance_rate = accepted draft tokens / draft tokens; mean_acceptance_length = 1 + accepted / verifies
  (tokens per verify pass, bonus token included); draft_rate = rows that got drafts / (rows that got drafts +
  decode rows that could have: every decode row but each request's last).
- sim_speedup: the same ratio from the simulator; sim_e2el_s: its plain latency (vs the real e2el_s).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines import LLM, SamplingParams  # noqa: E402
from engines.core.request import Request  # noqa: E402
from engines.core.spec_decode import SpecDecodeStats  # noqa: E402
from engines.factory import EngineConfig, build_engine  # noqa: E402
from engines.sim.simulator import simulate  # noqa: E402
from engines.sim.spec_decode import conditional_rates  # noqa: E402

TEXT = ROOT / "workbench/data/text/botchan_ch1-2.txt"
MODEL = "smollm2-135m"
TASKS = ("Repeat this passage exactly:\n\n{p}", "Copy this text word for word:\n\n{p}",
         "Fix the typo in this passage and write out the whole passage:\n\n{p}")
FORMULAS = {
    "output_tok_s": "output tokens of the batch / wall seconds of the batch's generate call",
    "e2el_s": "mean over requests of finished_time - arrival_time (s)",
    "speedup": "plain e2el_s / speculative e2el_s",
    "acceptance_rate": "accepted draft tokens / draft tokens",
    "mean_acceptance_length": "1 + accepted draft tokens / verify rows (tokens per verify, bonus included)",
    "draft_rate": "rows that got drafts / (rows that got drafts + decode rows but each request's last)",
    "sim_speedup": "simulated plain mean E2EL / simulated speculative mean E2EL (measured profile, no noise)",
}


LINES_PER_PASSAGE = 6  # about 80 tokens; SmolLM2-135M copies it into 70-100 output tokens
DEMO, WARMUP = 90, (80, 81)  # passages of the demonstration turn and the warm-up requests (no request uses them)


def passage(i: int) -> str:
    """Passage ``i``: lines ``6i .. 6i + 5`` of the book's non-empty lines (wrapping; 90+ distinct ones)."""
    lines = [ln for ln in TEXT.read_text().splitlines() if ln.strip() and not ln.startswith("CHAPTER")]
    start = (i * LINES_PER_PASSAGE) % (len(lines) - LINES_PER_PASSAGE)
    return "\n".join(lines[start:start + LINES_PER_PASSAGE])


def with_typo(p: str, i: int) -> str:
    """``p`` with one word's two middle letters swapped (the ``i``-th long word, cyclically)."""
    words = p.split(" ")
    long = [j for j, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    if not long:
        return p
    j = long[i % len(long)]
    w = words[j]
    m = len(w) // 2
    words[j] = w[:m - 1] + w[m] + w[m - 1] + w[m + 1:]
    return " ".join(words)


def prompts(tokenizer, which) -> list[list[int]]:
    """Chat-template token ids of ``n`` requests (task and passage vary per request): one demonstration turn of
    the task (the same per task, on a passage no request uses; asked without it, SmolLM2-135M answers "I'm
    sorry..." instead of copying), then the task on the request's passage."""
    demo = passage(DEMO)
    out = []
    for i in which:
        p, task = passage(i), TASKS[i % len(TASKS)]
        typo = "typo" in task
        msgs = [{"role": "user", "content": task.format(p=with_typo(demo, 1) if typo else demo)},
                {"role": "assistant", "content": demo},
                {"role": "user", "content": task.format(p=with_typo(p, i) if typo else p)}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def cpu_info() -> dict:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        name = "?"
    return {"model_name": name, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "torch": torch.__version__}


def knobs(batch: int, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    longest = max(map(len, prompt_ids)) + max_tokens
    return dict(max_num_seqs=batch, max_num_batched_tokens=2048, max_model_len=longest + 64,
                kv_cache_tokens=(batch + 2) * (longest + 64) + 1024)


def real_run(batch: int, ids: list[list[int]], warm: list[list[int]], max_tokens: int, spec: dict,
             repeats: int) -> dict:
    """Build a real paged engine (``spec``: speculative fields, {} for none), warm it up, time ``repeats`` runs."""
    llm = LLM(MODEL, **knobs(batch, ids, max_tokens), **spec)
    llm.generate(warm, SamplingParams(max_tokens=16, temperature=0.0), cache_salt="warmup")
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = []
    for rep in range(repeats):
        sched = llm.engine.scheduler
        sched.spec_stats = SpecDecodeStats()  # counters of this timed run only
        first_step = len(llm.engine.steps)
        t0 = time.perf_counter()
        outs = llm.generate(ids, sp, cache_salt=f"timed-{rep}")
        wall = time.perf_counter() - t0
        steps = llm.engine.steps[first_step:]
        st = sched.spec_stats.as_dict()
        n_out = [len(o.token_ids) for o in outs]
        drafts = sum(s.spec_drafts for s in steps)
        decode_rows = sum(s.num_decode_tokens for s in steps)
        eligible = drafts + max(0, decode_rows - len(outs))
        runs.append(dict(wall_s=wall, output_tokens=sum(n_out), output_tok_s=sum(n_out) / wall,
                         e2el_s=statistics.mean(o.finished_time - o.arrival_time for o in outs),
                         steps=len(steps), out_lens=n_out, tokens=[o.token_ids for o in outs],
                         spec=st, draft_rate=drafts / eligible if eligible else 0.0))
    del llm
    gc.collect()
    return runs


def sim_e2el(cm, mc, batch: int, ids: list[list[int]], out_lens: list[int], warm: list[list[int]], max_tokens: int,
             spec: dict) -> float:
    """Mean simulated E2EL (s) of the batch (after the same warm-up requests), ``spec``: sim speculative fields."""
    eng = build_engine(EngineConfig(kind="sim", cost_model=cm, model_config=mc, step_noise=False, seed=0,
                                    **knobs(batch, ids, max_tokens), **spec))
    simulate(eng, [Request(f"w{i}", p, SamplingParams(max_tokens=16, ignore_eos=True), cache_salt="warmup")
                   for i, p in enumerate(warm)])
    t = eng.clock.now
    reqs = [Request(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True), arrival_time=t, cache_salt="timed")
            for i, (p, n) in enumerate(zip(ids, out_lens))]
    outs = simulate(eng, reqs)
    return statistics.mean(o.finished_time - o.arrival_time for o in outs)


def point(kind: str, batch: int, k: int, base: dict, runs: list[dict], sim: dict) -> dict:
    spec = runs
    sp = [b["e2el_s"] / s["e2el_s"] for b, s in zip(base, spec)]
    last = spec[-1]
    same = all(b["tokens"] == s["tokens"] for b, s in zip(base, spec))
    return dict(method=kind, batch=batch, k=k, repeats=len(spec),
                base_e2el_s=statistics.mean(b["e2el_s"] for b in base),
                spec_e2el_s=statistics.mean(s["e2el_s"] for s in spec),
                base_tok_s=statistics.mean(b["output_tok_s"] for b in base),
                spec_tok_s=statistics.mean(s["output_tok_s"] for s in spec),
                speedup=statistics.mean(sp), speedup_min=min(sp), speedup_max=max(sp),
                output_tokens=last["output_tokens"], mean_output_len=last["output_tokens"] / batch,
                acceptance_rate=last["spec"]["acceptance_rate"],
                mean_acceptance_length=last["spec"]["mean_acceptance_length"],
                acceptance_rate_per_pos=last["spec"]["acceptance_rate_per_pos"], draft_rate=last["draft_rate"],
                token_identical=same, **sim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--ks", default="2,4,8", help="num_speculative_tokens values for ngram")
    ap.add_argument("--layers", default="8,16,24", help="layers:N drafts measured at batch 1 ('' for none)")
    ap.add_argument("--layers-k", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--big-batch", type=int, default=64, help="batches from this size on use --big-batch-tokens")
    ap.add_argument("--big-batch-tokens", type=int, default=32)
    ap.add_argument("--big-batch-ks", default="4", help="k values at batches from --big-batch on")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per engine (each its own cache salt)")
    ap.add_argument("--max-points", type=int, default=0, help="stop after this many points (0: all)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("WORKBENCH_THREADS", "2")))
    ap.add_argument("--out", default="reports/runs/spec-decode-cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from engines.real.model_store import resolve_model
    from workbench.calibration import ensure_profile

    cpu = cpu_info()
    print(f"CPU: {cpu['model_name']} ({cpu['cpu_capability']}), {cpu['threads']} torch threads, torch {cpu['torch']}")
    cm, cm_path = ensure_profile(MODEL, resolve_model(MODEL), "float32", echo=print)
    print(f"profile: {cm_path}")
    from transformers import AutoTokenizer

    from engines.core.config import ModelConfig

    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))

    mc = ModelConfig.from_dir(resolve_model(MODEL))

    plan = [("ngram", b, k) for b in map(int, a.batches.split(","))
            for k in map(int, (a.big_batch_ks if b >= a.big_batch else a.ks).split(","))]
    plan += [(f"layers:{n}", 1, a.layers_k) for n in a.layers.split(",") if n.strip()]
    if a.max_points:
        plan = plan[:a.max_points]
    warm = prompts(tok, WARMUP)
    rows, bases, md = [], {}, ""
    t_start = time.perf_counter()
    for method, batch, k in plan:
        max_tokens = a.big_batch_tokens if batch >= a.big_batch else a.max_tokens
        ids = prompts(tok, range(batch))
        if batch not in bases:
            bases[batch] = real_run(batch, ids, warm, max_tokens, {}, a.repeats)
            bases[batch + 0.5] = sim_e2el(cm, mc, batch, ids, bases[batch][-1]["out_lens"], warm, max_tokens, {})
        base = bases[batch]
        spec = real_run(batch, ids, warm, max_tokens, dict(speculative_model=method, num_speculative_tokens=k),
                        a.repeats)
        st = spec[-1]
        sim_base = bases[batch + 0.5]
        common = dict(speculative_model=method, num_speculative_tokens=k)
        rates = conditional_rates(st["spec"], k)
        sim_full = sim_e2el(cm, mc, batch, ids, st["out_lens"], warm, max_tokens,
                            dict(common, spec_acceptance_rate=rates, spec_draft_rate=st["draft_rate"]))
        sim_a = sim_e2el(cm, mc, batch, ids, st["out_lens"], warm, max_tokens,
                         dict(common, spec_acceptance_rate=st["spec"]["acceptance_rate"]))
        row = point(method, batch, k, base, spec,
                    dict(max_tokens=max_tokens, sim_base_e2el_s=sim_base, sim_spec_e2el_s=sim_full,
                         sim_speedup=sim_base / sim_full, sim_speedup_scalar_a=sim_base / sim_a,
                         sim_rates=rates))
        rows.append(row)
        print(f"{method:9s} batch {batch:3d} k {k}: e2el {row['base_e2el_s']:.2f} -> {row['spec_e2el_s']:.2f} s "
              f"speedup {row['speedup']:.2f}x (sim {row['sim_speedup']:.2f}x, scalar a {row['sim_speedup_scalar_a']:.2f}x)"
              f"  accept {row['acceptance_rate']:.2f} len {row['mean_acceptance_length']:.2f}"
              f" drafts {row['draft_rate']:.2f}  tok/s {row['base_tok_s']:.0f} -> {row['spec_tok_s']:.0f}"
              f"  [{time.perf_counter() - t_start:.0f} s]", flush=True)
        md = write(Path(a.out), rows, dict(cpu=cpu, profile=str(cm_path), profile_source=cm.source, model=MODEL,
                                           args=vars(a), formulas=FORMULAS, seconds=time.perf_counter() - t_start))
    out = Path(a.out)
    print(md)
    print(f"{out / 'spec_decode.json'}\n{out / 'spec_decode.md'}")


def write(out: Path, rows: list[dict], meta: dict) -> str:
    """``spec_decode.json`` and ``spec_decode.md`` in ``out`` (rewritten after every point); returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_decode.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    md = markdown(rows, meta)
    (out / "spec_decode.md").write_text(md)
    return md


def markdown(rows: list[dict], meta: dict) -> str:
    cpu = meta["cpu"]
    lines = [f"CPU: {cpu['model_name']} ({cpu['cpu_capability']}), {cpu['threads']} torch threads; "
             f"{meta['model']} float32; greedy; {rows[0]['repeats'] if rows else 0} timed run(s) per engine", "",
             "| method | batch | k | out tok/req | plain tok/s | spec tok/s | plain E2EL s | spec E2EL s | speedup "
             "| sim speedup | sim (scalar a) | sim plain E2EL s | accept rate | mean accept len | draft rate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        spread = (f" ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})" if r["repeats"] > 1 else "")
        lines.append(
            f"| {r['method']} | {r['batch']} | {r['k']} | {r['mean_output_len']:.0f} | {r['base_tok_s']:.0f} "
            f"| {r['spec_tok_s']:.0f} | {r['base_e2el_s']:.2f} | {r['spec_e2el_s']:.2f} | "
            f"**{r['speedup']:.2f}x**{spread} | {r['sim_speedup']:.2f}x | {r['sim_speedup_scalar_a']:.2f}x "
            f"| {r['sim_base_e2el_s']:.2f} | {r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} "
            f"| {r['draft_rate']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
