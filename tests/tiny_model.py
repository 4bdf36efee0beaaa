"""Builds tiny random-weight Llama-family folders (config, safetensors, byte-level BPE tokenizer) for fast tests."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "Continuous batching re-forms the batch after every forward pass.",
    "héllo wörld, naïve café, 日本語のテキスト, emoji 😀🚀 and more.",
    "def f(x):\n    return x * 2\n",
]


def make_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on a few sentences (no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")


def make_tiny_llama(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random-weight model folder at ``path``: ``llama`` (tied embeddings), ``qwen2`` (q/k/v bias,
    untied) or ``llama3`` (llama3 rope scaling)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    tok = make_tokenizer()
    common = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "llama":
        cfg = AutoConfig.for_model("llama", tie_word_embeddings=True, rope_theta=10000.0, **common)
    elif arch == "qwen2":
        cfg = AutoConfig.for_model("qwen2", tie_word_embeddings=False, rope_theta=1e6, **common)
    elif arch == "llama3":
        cfg = AutoConfig.for_model(
            "llama", tie_word_embeddings=False, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}, **common)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights make logits less flat, so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
