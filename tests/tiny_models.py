"""Tiny transformers models of the architectures hasten patches, and a packed batch for them
(shared by the model-level tests of the fused loss and the dense kernels)."""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

import hasten

VOCAB = 211
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(intermediate_size=64, **SMALL)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(intermediate_size=64, head_dim=8, **SMALL)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16,
                                                            num_experts=4, num_experts_per_tok=2, head_dim=8,
                                                            **SMALL)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=4,
                                                        num_experts_per_tok=2, **SMALL)),
}


def packed_batch() -> dict:
    """Four samples (one of a single token) packed into one row, seeded."""
    gen = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in (7, 1, 19, 12)]
    return hasten.PackingCollator(max_tokens=64)(samples)
