"""``workbench serve``: the OpenAI-compatible HTTP server (``workbench.serve``) over a real engine."""

from __future__ import annotations

from workbench.commands import check_real_engine, set_torch_threads
from workbench.errors import UsageError, usage_errors


def main(model: str = "smollm2-135m", host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
         served_model_name: str | None = None, engine: str = "paged", dtype: str = "float32", block_size: int = 16,
         kv_cache_tokens: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
         max_model_len: int | None = None, max_waiting: int = 1024, seed: int = 0, device: str = "auto",
         weight_dtype: str | None = None, speculative_model: str | None = None,
         num_speculative_tokens: int | None = None, tp: int = 1) -> None:
    """Serve until interrupted (``max_waiting`` 0: no limit on queued requests; ``weight_dtype`` None: the
    dense weights of ``dtype``, else ``fp32``/``bf16``/``int8``/``int4``; ``tp`` > 1: the model split over that
    many processes, ``engines.real.tensor_parallel``).

    Raises:
        UsageError: a bad option or engine setting, an unknown model, or an address that cannot be bound.
    """
    from workbench.commands.generate import spec_knobs
    from workbench.serve.app import serve as run_server

    set_torch_threads()
    check_real_engine(engine)
    if max_waiting < 0:
        raise UsageError(f"--max-waiting must be >= 0, got {max_waiting}")
    with usage_errors(ValueError, OSError):
        run_server(model, host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                   max_waiting=max_waiting or None, engine=engine, dtype=dtype, block_size=block_size,
                   kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, seed=seed,
                   device=device, weight_dtype=weight_dtype,
                   **spec_knobs(speculative_model, num_speculative_tokens), tp=tp)
