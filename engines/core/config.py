"""Model, cache and scheduler configuration (plain dataclasses, no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path



def _eos_ids(value) -> tuple[int, ...]:
    """A config's ``eos_token_id`` (an int, a list of ints or null) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)

@dataclass(frozen=True)
class ModelConfig:
    """The Llama-family architecture fields the engine needs, read from a Hugging Face ``config.json``.

    Covers Llama 2/3 (incl. ``llama3`` rope scaling), SmolLM2, Mistral and Qwen2 (q/k/v bias).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """Read ``path/config.json``.

        Raises:
            ValueError: the file is missing or the architecture is not Llama-family.
        """
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{cfg_file}: no such file")
        c = json.loads(cfg_file.read_text())
        mtype = c.get("model_type", "llama")
        if mtype not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"{cfg_file}: model_type {mtype!r} is not supported (llama, mistral, qwen2)")
        rope = c.get("rope_parameters") or {}
        rope_scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        eos_ids = _eos_ids(c.get("eos_token_id"))
        gen_file = Path(path) / "generation_config.json"
        if gen_file.is_file():  # transformers' generate stops on generation_config's ids; keep both, in order
            gen_ids = _eos_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
            eos_ids = tuple(dict.fromkeys(gen_ids + eos_ids))
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            attention_bias=c.get("attention_bias", mtype == "qwen2"),
            rope_scaling=rope_scaling,
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=mtype,
        )

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V bytes of one token over all layers: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


@dataclass
class CacheConfig:
    """KV cache pool size and layout.

    Attributes:
        block_size: tokens per KV block (vLLM's default 16).
        kv_cache_tokens: pool capacity in tokens (rounded down to whole blocks).
        kv_cache_bytes: alternative to ``kv_cache_tokens``: pool capacity in bytes of K+V over all layers.
        swap_space_bytes: CPU swap pool for swap preemption, bytes of K+V over all layers (0 = none).
    """

    block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    swap_space_bytes: int = 0

    def num_blocks(self, bytes_per_token: int, default_tokens: int) -> int:
        """Blocks in the pool: from ``kv_cache_tokens``, else ``kv_cache_bytes``, else ``default_tokens``."""
        if self.kv_cache_tokens is not None:
            tokens = self.kv_cache_tokens
        elif self.kv_cache_bytes is not None:
            tokens = self.kv_cache_bytes // bytes_per_token
        else:
            tokens = default_tokens
        return max(1, tokens // self.block_size)

    def num_cpu_blocks(self, bytes_per_token: int) -> int:
        """Blocks in the CPU swap pool: ``swap_space_bytes // (bytes_per_token * block_size)``."""
        return self.swap_space_bytes // (bytes_per_token * self.block_size) if self.swap_space_bytes else 0


@dataclass
class SchedulerConfig:
    """Batching limits of the policies (paged, static, Orca).

    Attributes:
        max_num_seqs: most requests in one step (paged).
        max_num_batched_tokens: token budget of one step (paged).
        max_model_len: longest prompt + output a request may have, in tokens.
        max_batch_size: requests per batch (static).
        reservation: static KV reservation policy: ``max``, ``pow2`` or ``oracle``.
        enable_prefix_caching: automatic prefix caching of full blocks (paged).
        enable_chunked_prefill: split a prompt across steps when it does not fit the step's budget;
            off: it waits for a step with room for all of it (paged).
        long_prefill_token_threshold: most prompt tokens one request computes per step (0 = no cap;
            chunked prefill only).
        preemption_mode: ``recompute`` (free the blocks, recompute later) or ``swap`` (copy them to the
            CPU swap pool and back; recompute when the swap pool is full).
        completion: when a static batch member's answer is returned (static): ``batch_end`` (when the
            last member of its batch finishes, as a static-batching server answers) or ``own_end`` (at its
            own last token).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_batch_size: int = 64
    reservation: str = "max"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    completion: str = "batch_end"

    def validate(self) -> str | None:
        """One-line reason why the paged-policy knobs (preemption mode, prefill cap) or ``completion`` are
        invalid, or None."""
        if self.completion not in COMPLETIONS:
            return f"completion must be one of {', '.join(COMPLETIONS)}, got {self.completion!r}"
        if self.preemption_mode not in PREEMPTION_MODES:
            return f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}"
        if self.long_prefill_token_threshold < 0:
            return f"long_prefill_token_threshold must be >= 0 (0 = no cap), got {self.long_prefill_token_threshold}"
        return None


PREEMPTION_MODES = ("recompute", "swap")
COMPLETIONS = ("batch_end", "own_end")  # static batching: when a member's answer is returned
DEFAULT_SWAP_BANDWIDTH = 32e9  # bytes/s: PCIe 4.0 x16, one direction (~32 GB/s)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # bytes per element of the real model's weights and KV cache

# weight_dtype: how a model's linear-layer weights are stored, one vocabulary for real and simulated engines.
# The real engine (and so a measured profile of it) runs REAL_WEIGHT_DTYPES: fp32 / bf16 are the dense weights
# of dtype float32 / bfloat16, int8 / int4 weight-only quantized layers (engines.real.quant). The analytic cost
# model prices ANALYTIC_WEIGHT_DTYPES (engines.sim.catalog.linear_bytes_per_param).
REAL_WEIGHT_DTYPES = ("fp32", "bf16", "int8", "int4")
ANALYTIC_WEIGHT_DTYPES = ("bf16", "fp8", "awq", "gptq", "int4")
WEIGHT_DTYPES = ("fp32", "bf16", "int8", "int4", "fp8", "awq", "gptq")
DENSE_WEIGHT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}  # dtype -> the weight_dtype of its dense weights
ANALYTIC_DEFAULT_WEIGHT_DTYPE = "bf16"


def real_weight_dtype(weight_dtype: str | None, dtype: str) -> str:
    """The weight dtype a real engine (or a measured profile of one) in ``dtype`` runs: ``weight_dtype``, or
    the dense weights of ``dtype`` when None."""
    return weight_dtype or DENSE_WEIGHT_DTYPE.get(dtype, dtype)


def real_weight_dtype_problem(weight_dtype: str | None, dtype: str, who: str = "the real engine") -> str | None:
    """Why a real engine in ``dtype`` cannot run ``weight_dtype``, in one line naming the field; None when it
    can. ``who``: what runs it, for the message (``the real engine``, ``a measured profile``)."""
    if weight_dtype is None:
        return None
    if weight_dtype not in REAL_WEIGHT_DTYPES:
        what = ("a what-if of the analytic cost model" if weight_dtype in ANALYTIC_WEIGHT_DTYPES
                else "not a weight dtype")
        return f"weight_dtype {weight_dtype} is {what}; {who} runs {', '.join(REAL_WEIGHT_DTYPES)}"
    dense = DENSE_WEIGHT_DTYPE.get(dtype)
    if weight_dtype in DENSE_WEIGHT_DTYPE.values() and dense is not None and weight_dtype != dense:
        return (f"weight_dtype {weight_dtype} means dense weights in dtype "
                f"{next(k for k, v in DENSE_WEIGHT_DTYPE.items() if v == weight_dtype)}, but dtype is {dtype} "
                f"(set dtype, or weight_dtype {dense}, int8 or int4)")
    return None
