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
}


def embedded_model_config(size: str = "small") -> Qwen3Config:
    if size not in _SIZES:
        raise ValueError(f"unknown embedded model size {size!r}; choose one of {sorted(_SIZES)}")
    return Qwen3Config(vocab_size=_BYTE_VOCAB, max_position_embeddings=8192, tie_word_embeddings=True,
                       pad_token_id=256, bos_token_id=257, eos_token_id=258, use_cache=False, **_SIZES[size])
