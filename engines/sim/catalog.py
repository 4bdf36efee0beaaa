"""Hardware and model catalogues (``engines/sim/data/hardware.yaml``, ``engines/sim/data/models.yaml``).

Scenario engines and ``workbench kv-calc`` refer to entries by name (``hardware: h100-sxm``,
``model: llama-3.1-70b``). Every entry carries its ``source`` (datasheet or Hugging Face config.json).
This module also does the memory arithmetic that follows from an entry: parameter counts, weight bytes
under a quantization scheme, KV bytes per token, and how many KV blocks fit on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

DATA_DIR = Path(__file__).parent / "data"
GIB = 1 << 30
MIB = 1 << 20

# bytes per element of the KV cache by dtype
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
WEIGHT_DTYPES = ("bf16", "fp8", "awq", "gptq", "int4")
QUANT_GROUP_SIZE = 128  # AWQ / GPTQ default group size (AutoAWQ and AutoGPTQ q_group_size=128)


class CatalogError(ValueError):
    """Unknown catalogue name or a bad setting; the message is one line listing what is allowed."""


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU model (dense peak FLOP/s, bytes, bytes/s; see ``engines/sim/data/hardware.yaml``)."""

    key: str
    name: str
    bf16_flops: float
    fp8_flops: float | None
    memory_bytes: int
    hbm_gb: float
    mem_bw: float
    nvlink_bw: float
    pcie_bw: float
    source: str

    def link_bw_one_way(self) -> float:
        """Bytes/s one GPU can send in one direction to its ring neighbour: half the bidirectional NVLink
        figure, or half of PCIe when the GPU has no NVLink (L40S)."""
        return (self.nvlink_bw or self.pcie_bw) / 2.0


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one model (from its ``config.json``; see ``engines/sim/data/models.yaml``)."""

    key: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    mlp: str
    source: str

    # -- parameter counts (biases and norms are < 0.1% and left out) ------------------------------
    @functools.cached_property  # frozen spec: computed once, then an instance attribute
    def attn_params_per_layer(self) -> int:
        """q, k, v and o projections: hidden x (heads + 2 kv_heads) x head_dim + heads x head_dim x hidden."""
        h, d = self.hidden_size, self.head_dim
        return h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d + self.num_attention_heads * d * h

    @functools.cached_property  # frozen spec: computed once, then an instance attribute
    def mlp_params_per_layer(self) -> int:
        """3 x hidden x intermediate (gated SwiGLU) or 2 x hidden x intermediate (plain fc1/fc2, OPT)."""
        return (3 if self.mlp == "gated" else 2) * self.hidden_size * self.intermediate_size

    @functools.cached_property  # frozen spec: computed once, then an instance attribute
    def linear_params(self) -> int:
        """Parameters of the transformer layers' matrices (what GEMMs read each step and what AWQ quantizes)."""
        return self.num_hidden_layers * (self.attn_params_per_layer + self.mlp_params_per_layer)

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head (counted once when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @functools.cached_property  # frozen spec: computed once, then an instance attribute
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        return self.linear_params + self.embedding_params

    # -- bytes ------------------------------------------------------------------------------------
    def weight_bytes(self, weight_dtype: str = "bf16") -> float:
        """Bytes of all weights under a quantization scheme.

        ``bf16``: 2 B/param. ``fp8``: linear layers 1 B/param, embeddings and LM head stay bf16 (as
        vLLM's fp8 checkpoints). ``awq``/``gptq``/``int4``: linear layers 4 bits plus, per group of
        128 weights, an fp16 scale and a 4-bit zero point (2.5 B per 128 weights); embeddings and LM
        head stay bf16 (AutoAWQ / AutoGPTQ do not quantize them).
        """
        emb = self.embedding_params * 2.0
        return emb + self.linear_params * linear_bytes_per_param(weight_dtype)

    def kv_bytes_per_token(self, kv_dtype: str = "bf16", tp: int = 1) -> int:
        """K and V bytes of one token over all layers on one GPU: 2 x layers x kv_heads/tp x head_dim x
        dtype bytes (KV heads replicated when tp > kv_heads, as vLLM does)."""
        return 2 * self.num_hidden_layers * kv_heads_per_gpu(self.num_key_value_heads, tp) * self.head_dim \
            * kv_dtype_bytes(kv_dtype)

    def to_model_config(self):
        """An ``engines.core.config.ModelConfig`` with these sizes (for the simulator's scheduler defaults)."""
        from engines.core.config import ModelConfig

        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
                           max_position_embeddings=self.max_position_embeddings,
                           tie_word_embeddings=self.tie_word_embeddings, model_type=self.key)


def kv_heads_per_gpu(kv_heads: int, tp: int) -> int:
    """KV heads each GPU holds: kv_heads / tp, at least 1 (replicated when tp > kv_heads)."""
    return max(1, kv_heads // tp)


def kv_dtype_bytes(kv_dtype: str) -> int:
    """Bytes per KV element. Raises CatalogError for an unknown dtype."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise CatalogError(f"kv cache dtype must be one of {', '.join(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    return KV_DTYPE_BYTES[kv_dtype]


def linear_bytes_per_param(weight_dtype: str) -> float:
    """Bytes per linear-layer weight: bf16 2, fp8 1, 4-bit (awq/gptq/int4) 0.5 + 2.5/128 for group scales
    and zeros. Raises CatalogError for an unknown dtype."""
    if weight_dtype == "bf16":
        return 2.0
    if weight_dtype == "fp8":
        return 1.0
    if weight_dtype in ("awq", "gptq", "int4"):
        return 0.5 + 2.5 / QUANT_GROUP_SIZE
    raise CatalogError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")


@functools.lru_cache(maxsize=None)
def _load(kind: str) -> dict:
    path = DATA_DIR / f"{kind}.yaml"
    return yaml.safe_load(path.read_text())[kind]


def hardware_names() -> list[str]:
    return sorted(_load("hardware"))


def model_names() -> list[str]:
    return sorted(_load("models"))


def get_hardware(name: str) -> HardwareSpec:
    """The catalogue entry ``name`` (case-insensitive). Raises CatalogError listing the known names."""
    d = _load("hardware").get(name.lower())
    if d is None:
        raise CatalogError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())}")
    # PyYAML reads 312.0e12 (no exponent sign) as a string: convert the numbers explicitly
    num = {k: (float(d[k]) if d[k] is not None else None) for k in
           ("bf16_flops", "fp8_flops", "hbm_gb", "mem_bw", "nvlink_bw", "pcie_bw")}
    return HardwareSpec(key=name.lower(), name=d["name"], memory_bytes=int(d["memory_bytes"]), source=d["source"], **num)


def get_model(name: str) -> ModelSpec:
    """The catalogue entry ``name`` (case-insensitive). Raises CatalogError listing the known names."""
    d = _load("models").get(name.lower())
    if d is None:
        raise CatalogError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    return ModelSpec(key=name.lower(), **{k: d[k] for k in ModelSpec.__dataclass_fields__ if k != "key"})


# ------------------------------------------------------------------------------------------- memory


def activation_reserve_bytes(model: ModelSpec, tp: int = 1, max_num_batched_tokens: int = 2048,
                             max_num_seqs: int = 256) -> float:
    """Memory held back from the KV cache for activations and runtime state on one GPU (bytes).

    An estimate of what vLLM's memory profiling run measures: 1 GiB of non-torch memory (CUDA context,
    NCCL buffers, CUDA graphs), plus the peak activations of the largest step
    (``max_num_batched_tokens`` x (4 x hidden + 2 x intermediate / tp) bf16 values: residual, normed
    input, q/k/v/o and the MLP's gate/up output), plus float32 logits of ``max_num_seqs`` rows (x2 for
    the sampler's copy). An assumption, not a measurement: set ``activation_reserve_gib`` to override.
    """
    act = max_num_batched_tokens * (4 * model.hidden_size + 2 * model.intermediate_size / tp) * 2
    logits = 2 * max_num_seqs * model.vocab_size * 4 / tp
    return GIB + act + logits


@dataclass
class MemoryPlan:
    """How one GPU's memory splits (bytes), for a model on ``tp`` GPUs of one kind."""

    usable: float          # gpu_memory_utilization x memory_bytes
    weights: float         # this GPU's share of the weights
    activation_reserve: float
    kv_bytes_per_token: int
    block_size: int

    @property
    def kv_pool_bytes(self) -> float:
        return self.usable - self.weights - self.activation_reserve

    @property
    def weights_fit(self) -> bool:
        """Weights plus the activation reserve fit and leave room for at least one KV block."""
        return self.kv_pool_bytes >= self.kv_bytes_per_token * self.block_size

    @property
    def num_blocks(self) -> int:
        """KV blocks that fit (0 when the weights do not)."""
        return max(0, int(self.kv_pool_bytes // (self.kv_bytes_per_token * self.block_size)))

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size


def memory_plan(model: ModelSpec, hw: HardwareSpec, tp: int = 1, weight_dtype: str = "bf16",
                kv_dtype: str = "bf16", gpu_memory_utilization: float = 0.9, block_size: int = 16,
                activation_reserve: float | None = None, max_num_batched_tokens: int = 2048,
                max_num_seqs: int = 256) -> MemoryPlan:
    """KV capacity from memory: ``gpu_memory_utilization`` x HBM - weights/tp - activation reserve,
    divided by the KV bytes of one block (vLLM's ``determine_num_available_blocks``).

    Raises:
        CatalogError: tp < 1, utilization outside (0, 1], unknown dtypes.
    """
    if tp < 1:
        raise CatalogError(f"tp must be >= 1, got {tp}")
    if not 0 < gpu_memory_utilization <= 1:
        raise CatalogError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    reserve = activation_reserve if activation_reserve is not None else activation_reserve_bytes(
        model, tp, max_num_batched_tokens, max_num_seqs)
    return MemoryPlan(usable=gpu_memory_utilization * hw.memory_bytes,
                      weights=model.weight_bytes(weight_dtype) / tp,
                      activation_reserve=reserve,
                      kv_bytes_per_token=model.kv_bytes_per_token(kv_dtype, tp),
                      block_size=block_size)
