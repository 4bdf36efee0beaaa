"""Llama-family forward pass over a flattened batch, reading Hugging Face safetensors directly.

RMSNorm, rotary position embeddings (default, linear and ``llama3`` scaling), grouped-query attention
through ``wb_kernels.paged_attention``, SwiGLU MLP, optional q/k/v bias (Qwen2) and tied embeddings. The
numerics follow transformers' ``LlamaForCausalLM`` (RMSNorm in float32, RoPE tables in float32, residual
adds in the model dtype) so greedy outputs match it token for token in float32.

q/k/v and gate/up projections are fused into one matrix each (fewer, larger GEMMs).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from engines.core.config import ModelConfig
from engines.real.linear import (ONEDNN_WARM_MAX_ROWS, Linear, make_linear, model_weight_dtype,
                                 resolve_linear_backend, warm_onednn)
from wb_kernels.paged_attention import (paged_attention_decode, paged_attention_prefill, paged_attention_prefill_varlen,
                                     write_kv)


@dataclass
class AttentionMetadata:
    """How the flattened tokens of one step map to sequences and KV slots.

    The first ``num_decode_tokens`` tokens are decode tokens (one per sequence); the rest are
    ``num_prefills`` prefill chunks, back to back, described by the ``prefill_*`` tensors that one
    variable-length attention call per layer reads (chunk ``p``'s rows are ``num_decode_tokens +
    prefill_query_start[p] .. num_decode_tokens + prefill_query_start[p + 1] - 1``).

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 KV slot of every new token.
        decode_block_tables: ``[num_decode, max_blocks]`` int64.
        decode_context_lens: ``[num_decode]`` int64.
        num_prefills: P, the number of prefill chunks.
        prefill_query_start: ``[P + 1]`` int64, cumulative chunk lengths from 0 (rows counted from the
            first prefill token).
        prefill_start_pos: ``[P]`` int64, position of each chunk's first token (tokens cached before it).
        prefill_block_tables: ``[P, max_blocks]`` int64, each chunk's blocks covering its
            ``start_pos + length`` positions, padded with its first block id.
        prefill_max_query_len: the longest chunk, in tokens (the Triton kernel's launch size).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    num_prefills: int = 0
    prefill_query_start: torch.Tensor | None = None
    prefill_start_pos: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_max_query_len: int = 0


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim/2]`` (float32), with linear or llama3 scaling if configured.

    Formula: transformers' ``_compute_default_rope_parameters`` / ``_compute_llama3_parameters``.

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, inv_l)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


ATTENTION_BACKENDS = ("auto", "torch", "cpp", "triton")
CPP_DTYPES = (torch.float32, torch.bfloat16)  # what the compiled CPU kernels take
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> torch.device:
    """The torch device of a ``device`` knob: ``cpu``, ``cuda`` / ``cuda:N``, or ``auto`` (the current CUDA
    device when torch sees one, else the CPU); a CUDA device always carries its index (``cuda:0``).

    Raises:
        ValueError: an unknown name, or ``cuda`` asked for where torch sees no CUDA device.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if re.fullmatch(r"cuda(:\d+)?", device or ""):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device here (torch {torch.__version__}); "
                             "use device cpu or auto")
        dev = torch.device(device)
        return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {device!r}")


@dataclass(frozen=True)
class AttentionOps:
    """The attention implementations a model uses, picked once for its device and dtype.

    Attributes:
        decode: ``paged_attention_decode``-shaped function (one query token per sequence).
        prefill: ``paged_attention_prefill``-shaped function (one chunk after cached context).
        prefill_varlen: ``paged_attention_prefill_varlen``-shaped function (every prefill chunk of a step
            in one call); what the model's forward pass uses.
        fused_cpu: True when the compiled CPU ops (``wb_kernels.cpu_ops``) run the whole layer.
        name: what was picked, for logs and results (``cpp``, ``torch``, ``triton``).
    """

    decode: object
    prefill: object
    prefill_varlen: object
    fused_cpu: bool
    name: str


def pick_attention(backend: str, dtype: torch.dtype, device: torch.device) -> AttentionOps:
    """Attention implementations for a model on ``device``.

    ``torch``: the PyTorch reference (any device, any dtype). ``cpp``: the compiled CPU kernels (CPU,
    float32 or bfloat16). ``triton``: ``wb_kernels.triton_attention`` (CUDA; on CPU it runs in Triton's
    interpreter, which is how the tests exercise it). ``auto``: on CUDA the Triton kernels (the reference
    if Triton is not installed); on CPU the compiled kernels when the dtype is float32 or bfloat16 and they
    build, else the reference.

    Raises:
        ValueError: unknown backend, or ``cpp``/``triton`` requested but unavailable on this device.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    reference = AttentionOps(paged_attention_decode, paged_attention_prefill, paged_attention_prefill_varlen, False,
                             "torch")
    if backend == "torch":
        return reference
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        ops = _triton_ops(required=backend == "triton")
        if ops is None:
            return reference
        return AttentionOps(ops.paged_attention_decode, ops.paged_attention_prefill, ops.paged_attention_prefill_varlen,
                            False, "triton")
    from wb_kernels import cpu_ops

    if device.type != "cpu":
        raise ValueError(f"attention_backend 'cpp' is a CPU kernel; the model is on {device}")
    if dtype in CPP_DTYPES and cpu_ops.available():
        return AttentionOps(cpu_ops.paged_attention_decode, paged_attention_prefill,
                            cpu_ops.paged_attention_prefill_varlen, True, "cpp")
    if backend == "cpp":
        raise ValueError(f"attention_backend 'cpp' needs float32 or bfloat16 (got {dtype}) and a C++ compiler")
    return reference


def _triton_ops(required: bool = False):
    """``wb_kernels.triton_attention``, or None when Triton is not installed or cannot run its kernels in this
    process (ValueError if ``required``)."""
    try:
        from wb_kernels import triton_attention
    except ImportError as e:
        if required:
            raise ValueError(f"attention_backend 'triton' needs the triton package ({e})") from None
        return None
    if not triton_attention.available():
        if required:
            raise ValueError(f"attention_backend 'triton': {triton_attention.NO_INTERPRETER_ERROR}")
        return None
    return triton_attention


def load_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(str(model_dir / f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


class LlamaModel:
    """Weights and forward pass. Call ``forward`` with a step's flattened tokens.

    Args:
        cfg: architecture.
        weights: Hugging Face tensor names -> tensors.
        dtype: ``torch.float32`` (default) or ``torch.bfloat16``.
        attention_backend: see :func:`pick_attention`.
        device: ``cpu`` (default), ``cuda``/``cuda:N`` or ``auto`` (see :func:`resolve_device`); weights,
            RoPE tables and (through the executor) the KV cache and step tensors live there.
        weight_dtype: how the layers' linear weights are stored: None or the dtype's own name (``fp32``,
            ``bf16``: dense), ``int8`` or ``int4`` (weight-only quantized, ``engines.real.quant``). The
            embedding, the norms and the LM head stay dense in ``dtype``, as AWQ/GPTQ checkpoints keep them.
        linear_backend: the dense GEMM kernel (``engines.real.linear.resolve_linear_backend``).

    Raises:
        KeyError: a weight the architecture needs is missing.
        ValueError: a bad backend or device (one line).
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 attention_backend: str = "auto", device: str = "cpu", weight_dtype: str | None = None,
                 linear_backend: str = "auto"):
        self.cfg, self.dtype = cfg, dtype
        self.device = resolve_device(device)
        # on CUDA the Triton kernels, on CPU the compiled kernel (or the reference)
        self.attention = pick_attention(attention_backend, dtype, self.device)
        self.decode_attention = self.attention.decode
        self.fused = self.attention.fused_cpu
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        self.weight_dtype = weight_dtype or model_weight_dtype(dtype)
        self.linear_backend = resolve_linear_backend(linear_backend, self.device, dtype)
        backend = self.linear_backend

        def linear(weight, bias=None):
            return make_linear(weight, bias, self.weight_dtype, backend)

        self.embed = w["model.embed_tokens.weight"]
        head = self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
        self.lm_head = Linear(head, None, backend)
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
            bias = None
            if a + "q_proj.bias" in w:
                bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
            self.layers.append(
                dict(
                    ln1=w[p + "input_layernorm.weight"],
                    qkv=linear(qkv.contiguous(), bias),
                    o=linear(w[a + "o_proj.weight"]),
                    ln2=w[p + "post_attention_layernorm.weight"],
                    gate_up=linear(gate_up.contiguous()),
                    down=linear(w[p + "mlp.down_proj.weight"]),
                )
            )
        inv = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(self.device, dtype), emb.sin().to(self.device, dtype)
        self.scale = cfg.head_dim**-0.5

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32, attention_backend: str = "auto",
                 device: str = "cpu", weight_dtype: str | None = None, linear_backend: str = "auto") -> "LlamaModel":
        """The model of a Hugging Face folder (``config.json`` and safetensors); arguments as the class."""
        model_dir = Path(model_dir)
        return cls(ModelConfig.from_dir(model_dir), load_safetensors(model_dir), dtype, attention_backend, device,
                   weight_dtype, linear_backend)

    def warm_gemms(self, max_tokens: int, max_sampled_rows: int) -> int:
        """Build the oneDNN GEMM primitives of every row bucket up front (``engines.real.linear.warm_onednn``):
        the body's layers up to ``max_tokens`` rows per step, the LM head up to ``max_sampled_rows``. A no-op
        with ``F.linear``. Both are capped at ``ONEDNN_WARM_MAX_ROWS`` (4,096; warming scales with the rows, and
        larger steps are rare: their primitives are built when they come). Returns the number warmed."""
        body = [layer[k] for layer in self.layers[:1] for k in ("qkv", "o", "gate_up", "down")]
        return (warm_onednn(body, min(max_tokens, ONEDNN_WARM_MAX_ROWS))
                + warm_onednn([self.lm_head], min(max_sampled_rows, ONEDNN_WARM_MAX_ROWS)))

    def row_buckets(self) -> dict[str, str]:
        """How the GEMMs pad their rows (``engines.core.row_buckets``), for the simulator's cost model:
        ``{"body": scheme, "lm_head": scheme}``, ``"onednn"`` where those layers run oneDNN (padded to a row
        bucket), ``""`` where they run their rows as they are (``F.linear``, quantized layers)."""
        def scheme(layer) -> str:
            return "onednn" if isinstance(layer, Linear) and layer.backend == "onednn" else ""

        return {"body": scheme(self.layers[0]["qkv"]) if self.layers else "", "lm_head": scheme(self.lm_head)}

    def weight_bytes(self) -> int:
        """Bytes the weights take as stored: the layers' linear weights (quantized ones with their scales),
        the embedding, the LM head when it is not tied to it, and the norms."""
        lin = sum(layer[k].nbytes for layer in self.layers for k in ("qkv", "o", "gate_up", "down"))
        norms = sum(layer[k].numel() * layer[k].element_size() for layer in self.layers for k in ("ln1", "ln2"))
        dense = (self.embed.numel() + self.norm.numel()) * self.embed.element_size()
        head = 0 if self.cfg.tie_word_embeddings else self.lm_head.nbytes
        return lin + norms + dense + head

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return w * xf.to(self.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Run all layers on ``T`` new tokens.

        Args:
            input_ids: ``[T]`` int64.
            positions: ``[T]`` int64.
            meta: attention metadata of this step.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, kv_heads, head_dim]``.
        Returns:
            final hidden states ``[T, hidden_size]`` (after the last RMSNorm).
        """
        cfg = self.cfg
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if self.fused:
            return self._forward_fused(input_ids, positions, meta, kv_caches)
        t = input_ids.shape[0]
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x = self.embed[input_ids]
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            y = self._rms(x, layer["ln1"])
            qkv = layer["qkv"](y)
            q = qkv[:, : h * d].view(t, h, d)
            k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            write_kv(kc, vc, k, v, meta.slot_mapping)
            attn = self._attention(q, kc, vc, meta)
            x = x + layer["o"](attn.reshape(t, h * d))
            y = self._rms(x, layer["ln2"])
            gate, up = layer["gate_up"](y).chunk(2, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
        return self._rms(x, self.norm)

    def _forward_fused(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:
        """The same computation with compiled CPU ops: residual add + RMSNorm in one pass, RoPE in
        place, SiLU-and-mul in one pass (float32 or bfloat16, with the reference's rounding points)."""
        from wb_kernels import cpu_ops

        cfg = self.cfg
        h, kvh, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        t = input_ids.shape[0]
        x = self.embed[input_ids]
        delta = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            y = cpu_ops.fused_add_rms_norm(x, delta, layer["ln1"], eps)
            qkv = layer["qkv"](y)
            q = qkv[:, : h * d].view(t, h, d)
            k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
            cpu_ops.rope_inplace(q, positions, self.cos, self.sin)
            cpu_ops.rope_inplace(k, positions, self.cos, self.sin)
            write_kv(kc, vc, k, v, meta.slot_mapping)
            attn = self._attention(q, kc, vc, meta)
            o = layer["o"](attn.reshape(t, h * d))
            y = cpu_ops.fused_add_rms_norm(x, o, layer["ln2"], eps)
            delta = layer["down"](cpu_ops.silu_and_mul(layer["gate_up"](y)))
        return cpu_ops.fused_add_rms_norm(x, delta, self.norm, eps)

    def _attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of a step's queries over the KV cache (the step's own K/V already written): the decode
        rows in one batched decode call, every prefill chunk in one variable-length call.

        Args:
            q: ``[T, num_heads, head_dim]``, decode rows first.
            kc, vc: this layer's caches ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        Returns:
            ``[T, num_heads, head_dim]``.
        """
        nd = meta.num_decode_tokens
        dec = None
        if nd:
            dec = self.decode_attention(q[:nd], kc, vc, meta.decode_block_tables, meta.decode_context_lens, self.scale)
        if not meta.num_prefills:
            return dec if dec is not None else torch.empty_like(q)
        pre = self.attention.prefill_varlen(q[nd:], kc, vc, meta.prefill_block_tables, meta.prefill_query_start,
                                            meta.prefill_start_pos, self.scale, max_seqlen_q=meta.prefill_max_query_len)
        return pre if dec is None else torch.cat([dec, pre])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32 logits."""
        return self.lm_head(hidden).float()
