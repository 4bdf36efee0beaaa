"""Llama-family forward pass over a flattened batch, reading Hugging Face safetensors directly.

RMSNorm, rotary position embeddings (default, linear and ``llama3`` scaling), grouped-query attention
through ``kernels.paged_attention``, SwiGLU MLP, optional q/k/v bias (Qwen2) and tied embeddings. The
numerics follow transformers' ``LlamaForCausalLM`` (RMSNorm in float32, RoPE tables in float32, residual
adds in the model dtype) so greedy outputs match it token for token in float32.

q/k/v and gate/up projections are fused into one matrix each (fewer, larger GEMMs).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from engines.config import ModelConfig
from kernels.paged_attention import causal_attention, paged_attention_decode, paged_attention_prefill, write_kv


@dataclass
class AttentionMetadata:
    """How the flattened tokens of one step map to sequences and KV slots.

    The first ``num_decode_tokens`` tokens are decode tokens (one per sequence); the rest are prefill
    chunks, each ``(token_offset, num_tokens, start_pos, block_table)``.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 KV slot of every new token.
        decode_block_tables: ``[num_decode, max_blocks]`` int64.
        decode_context_lens: ``[num_decode]`` int64.
        prefills: list of ``(offset, n, start_pos, block_table [nb] int64)``.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefills: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)


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


def _pick_decode_attention(backend: str, dtype: torch.dtype):
    """Decode attention implementation: ``torch`` (reference, any dtype), ``cpp`` (compiled CPU kernel,
    float32), ``triton`` (``kernels.triton_attention``; interpreter on CPU) or ``auto`` (cpp when float32
    and it builds, else torch; on a machine with CUDA and Triton, CUDA tensors go to the Triton kernel).

    Raises:
        ValueError: unknown backend, or ``cpp``/``triton`` requested but unavailable.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return paged_attention_decode
    # -- issue 7: Triton kernels
    if backend == "triton":
        return _triton_ops(required=True).paged_attention_decode
    cpu_fn = _pick_cpu_decode_attention(backend, dtype)
    if backend == "auto" and torch.cuda.is_available():
        ops = _triton_ops()
        if ops is not None:
            return _by_device(ops.paged_attention_decode, cpu_fn)
    return cpu_fn


def _pick_cpu_decode_attention(backend: str, dtype: torch.dtype):
    """``cpp`` or ``auto`` on CPU tensors (see ``_pick_decode_attention``)."""
    from kernels import cpu_ops

    if dtype == torch.float32 and cpu_ops.available():
        return cpu_ops.paged_attention_decode
    if backend == "cpp":
        raise ValueError("attention_backend 'cpp' needs float32 and a C++ compiler")
    return paged_attention_decode


def _cpp_decode():
    from kernels import cpu_ops

    return cpu_ops.paged_attention_decode


def _triton_ops(required: bool = False):
    """``kernels.triton_attention``, or None when Triton is not installed (ValueError if ``required``)."""
    try:
        from kernels import triton_attention
    except ImportError as e:
        if required:
            raise ValueError(f"attention_backend 'triton' needs the triton package ({e})") from None
        return None
    return triton_attention


def _by_device(cuda_fn, cpu_fn):
    """Attention that calls ``cuda_fn`` for CUDA tensors and ``cpu_fn`` otherwise."""
    def attend(q, *args, **kwargs):
        return (cuda_fn if q.is_cuda else cpu_fn)(q, *args, **kwargs)
    attend.cpu_fn = cpu_fn
    return attend


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

    Raises:
        KeyError: a weight the architecture needs is missing.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 attention_backend: str = "auto"):
        self.cfg, self.dtype = cfg, dtype
        self.decode_attention = _pick_decode_attention(attention_backend, dtype)
        # compiled CPU ops available (the CPU choice is the cpp kernel)
        self.fused = getattr(self.decode_attention, "cpu_fn", self.decode_attention) is _cpp_decode()
        # issue 7: chunked-prefill attention over cached context by Triton for CUDA tensors (or when asked)
        self.triton_ops = _triton_ops() if attention_backend == "triton" or torch.cuda.is_available() else None
        self.triton_prefill_always = attention_backend == "triton"
        w = {k: v.to(dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
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
                    qkv=qkv.contiguous(),
                    qkv_bias=bias,
                    o=w[a + "o_proj.weight"],
                    ln2=w[p + "post_attention_layernorm.weight"],
                    gate_up=gate_up.contiguous(),
                    down=w[p + "mlp.down_proj.weight"],
                )
            )
        inv = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.scale = cfg.head_dim**-0.5

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32, attention_backend: str = "auto") -> "LlamaModel":
        model_dir = Path(model_dir)
        return cls(ModelConfig.from_dir(model_dir), load_safetensors(model_dir), dtype, attention_backend)

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
            qkv = F.linear(y, layer["qkv"], layer["qkv_bias"])
            q = qkv[:, : h * d].view(t, h, d)
            k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            write_kv(kc, vc, k, v, meta.slot_mapping)
            attn = self._attention(q, k, v, kc, vc, meta)
            x = x + F.linear(attn.reshape(t, h * d), layer["o"])
            y = self._rms(x, layer["ln2"])
            gate, up = F.linear(y, layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        return self._rms(x, self.norm)

    def _forward_fused(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:
        """The same computation with compiled CPU ops: residual add + RMSNorm in one pass, RoPE in
        place, SiLU-and-mul in one pass (float32 only)."""
        from kernels import cpu_ops

        cfg = self.cfg
        h, kvh, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        t = input_ids.shape[0]
        x = self.embed[input_ids]
        delta = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            y = cpu_ops.fused_add_rms_norm(x, delta, layer["ln1"], eps)
            qkv = F.linear(y, layer["qkv"], layer["qkv_bias"])
            q = qkv[:, : h * d].view(t, h, d)
            k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
            cpu_ops.rope_inplace(q, positions, self.cos, self.sin)
            cpu_ops.rope_inplace(k, positions, self.cos, self.sin)
            write_kv(kc, vc, k, v, meta.slot_mapping)
            attn = self._attention(q, k, v, kc, vc, meta)
            o = F.linear(attn.reshape(t, h * d), layer["o"])
            y = cpu_ops.fused_add_rms_norm(x, o, layer["ln2"], eps)
            delta = F.linear(cpu_ops.silu_and_mul(F.linear(y, layer["gate_up"])), layer["down"])
        return cpu_ops.fused_add_rms_norm(x, delta, self.norm, eps)

    def _attention(self, q, k, v, kc, vc, meta: AttentionMetadata) -> torch.Tensor:
        nd = meta.num_decode_tokens
        decode = self.decode_attention
        if nd and not meta.prefills:
            return decode(q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, self.scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode(q[:nd], kc, vc, meta.decode_block_tables, meta.decode_context_lens, self.scale)
        for off, n, start, table in meta.prefills:
            sl = slice(off, off + n)
            if start == 0:  # nothing cached before: attend to this step's own K/V
                out[sl] = causal_attention(q[sl], k[sl], v[sl], 0, self.scale)
            else:
                prefill = paged_attention_prefill
                if self.triton_ops is not None and (q.is_cuda or self.triton_prefill_always):
                    prefill = self.triton_ops.paged_attention_prefill
                out[sl] = prefill(q[sl], kc, vc, table, start, self.scale)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32 logits."""
        return F.linear(hidden, self.lm_head).float()
