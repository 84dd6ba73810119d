"""The embedded default: a small Qwen3-architecture model initialised in place (no download)."""

from __future__ import annotations

from transformers import Qwen3Config

# Byte-level vocabulary of hasten.data.ByteTokenizer (256 bytes + pad, bos, eos).
_BYTE_VOCAB = 259

_SIZES = {
    # ~3.5M parameters: trains a few steps per second on a laptop CPU.
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
    # For tests: seconds on one CPU core.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    # Qwen3-0.6B's shape (W1 of the benchmarks) with random weights: benchmarks and GPU runs need no
    # download. The vocabulary keeps Qwen3's 151,936 rows so the LM head and loss cost what they do in
    # the real model; the byte tokenizer only ever emits ids below 259.
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151_936, max_position_embeddings=40_960),
}


def embedded_model_config(size: str = "small") -> Qwen3Config:
    if size not in _SIZES:
        raise ValueError(f"unknown embedded model size {size!r}; choose one of {sorted(_SIZES)}")
    shape = {"vocab_size": _BYTE_VOCAB, "max_position_embeddings": 8192, **_SIZES[size]}
    return Qwen3Config(tie_word_embeddings=True, pad_token_id=256, bos_token_id=257, eos_token_id=258,
                       use_cache=False, **shape)
