"""Activation checkpointing policies, applied per decoder layer through transformers' own switch.

  none       keep every activation
  full       keep only each decoder layer's input; recompute the layer in backward
  selective  keep the outputs of the attention kernels (torch's, hasten's varlen attention,
             flash-attn's) and grouped expert GEMMs; recompute the rest in backward (matmuls and
             hasten's fused LoRA projections, norms, activations, rotary, residual adds)

Why plain matmuls (aten mm, addmm, bmm, baddbmm) are not kept: torch's selective checkpointing
hands the model the very tensor it caches, and checks that nobody changes it in place by its
version counter. A linear layer on a 3-D input, or torch.matmul on batched inputs, returns its
matmul's output through `_unsafe_view`, which has its own version counter: an in-place change to
it changes the cached tensor unseen, and the recompute in backward then reads the changed values.
Gemma 3n's AltUp does exactly that (`predictions += hidden_states` on a matmul's output): its
router weight's gradient came out 0.81 off, silently, with these ops kept (hasten's zoo, float32,
torch 2.13). hasten's fused LoRA projection is recomputed too: its output reaches the model as
itself, so torch's check does see a change, but OLMo clamps its q/k/v projections in place and
stopped there. The ops kept here are attention kernels and the grouped expert GEMMs, whose outputs
only hasten's own code or the attention call's reshape reads; a model that changed one in place
would be stopped by torch's check, not miscomputed.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

POLICIES = ("none", "full", "selective")


def _expensive_ops() -> set:
    """The ops whose outputs selective checkpointing keeps: every attention kernel a hasten-patched
    layer can run (torch's, hasten's own cuDNN op and its per-sequence op, flash-attn's) and grouped
    expert GEMMs; not matmuls nor hasten's fused LoRA projection (module docstring: models change
    their outputs in place)."""
    from hasten.ops._lib import ExtensionError, load

    try:
        load()  # hasten's ops exist once hasten._C is loaded (accelerate() has loaded it)
    except ExtensionError:
        pass  # without the extension there are no hasten ops to keep
    aten = torch.ops.aten
    ops = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_cudnn_attention.default}
    optional = [("aten", "_grouped_mm"), ("torch_attn", "_varlen_attn"), ("aten", "_flash_attention_forward"),
                ("hasten", "varlen_attention"), ("hasten_host", "per_sequence_attention"),
                ("flash_attn", "_flash_attn_varlen_forward"), ("flash_attn", "_flash_attn_forward")]
    for namespace, name in optional:  # present depending on the torch build, hasten's build, flash-attn
        try:
            packet = getattr(getattr(torch.ops, namespace), name, None)
        except (AttributeError, RuntimeError):
            packet = None
        if packet is not None:
            ops.add(packet.default)
    return ops


_SAVE = None


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    global _SAVE
    if _SAVE is None:
        _SAVE = _expensive_ops()
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model, policy: str):
    """Switch the model's decoder layers to `policy`; returns a function that switches it back."""
    if policy not in POLICIES:
        raise ValueError(f"activation checkpointing policy must be one of {POLICIES}, got {policy!r}")
    if policy == "none":
        return lambda: None
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 (the old name goes in v6)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return model.activation_checkpointing_disable
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.gradient_checkpointing_disable
