"""Causal-LM training forward with the chunked linear cross-entropy (hasten.ops.loss).

transformers' *ForCausalLM.forward computes `logits = lm_head(hidden)` for every token, upcasts
them to float32 and then takes the loss: for Qwen3-0.6B at 16k tokens that is 16,384 x 151,936
logits, about 10 GB with their gradient. The replacement forward runs the decoder (`self.model`,
or the class's base model: GPT-NeoX's `gpt_neox`) as transformers does and, when it trains with
labels, hands the hidden states to the fused op; `logits` is then None in the output.
Inference, evaluation without labels, and anything the fused path does not cover (router
auxiliary loss, a wrapped LM head) run transformers' own forward, the last with a one-time notice.
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F
from torch import nn

from hasten.instance_forward import HOOKED_REASON, hooked, replace_forward, restore_forward
from hasten.observability import record_fallback
from hasten.ops.loss import IGNORE_INDEX, linear_cross_entropy


class FusedLossUnsupported(ValueError):
    """The model's layout does not fit the fused loss (the message says why)."""


def _shifted_targets(labels: torch.Tensor, shift_labels: torch.Tensor | None) -> torch.Tensor:
    # transformers' ForCausalLMLoss: the label of position i is the token at i + 1
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


_FROM_CONFIG = "config"


def _decoder_attribute(model: nn.Module) -> str | None:
    """The attribute that holds the decoder the causal LM runs before its head: `model` in most
    *ForCausalLM classes, else the class's base model (`base_model_prefix`: GPT-NeoX's `gpt_neox`)."""
    for name in ("model", getattr(model, "base_model_prefix", None)):
        module = getattr(model, name, None) if name else None
        if isinstance(module, nn.Module) and module is not model:
            return name
    return None


def _head_attribute(model: nn.Module) -> str:
    """The attribute that holds the LM head: `lm_head` in most *ForCausalLM classes, else the child
    module the class names as its output embeddings (BioGPT's `output_projection`)."""
    if isinstance(getattr(model, "lm_head", None), nn.Module):
        return "lm_head"
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    return next((name for name, child in model.named_children() if head is not None and child is head), "lm_head")


def install_fused_cross_entropy(model: nn.Module, chunk_tokens: int = 0, softcap: float | None | str = _FROM_CONFIG,
                                logit_scale: float = 1.0):
    """Replace `model.forward` for training with labels; returns a function that undoes it.

    The loss is that of softcap(logit_scale * lm_head(hidden)): `softcap` the final logit
    softcapping (default: the config's `final_logit_softcapping`), `logit_scale` the factor the
    model multiplies its logits by (Cohere's logit_scale, 1 / Granite's logits_scaling). The scale
    is applied to the hidden states before the LM head, which is the same product for a head
    without bias (one rounding of the scaled hidden state in its dtype; exact for powers of two)."""
    decoder = _decoder_attribute(model)
    head_name = _head_attribute(model)
    for attribute in (decoder or "model", head_name):
        if not isinstance(getattr(model, attribute, None), nn.Module):
            raise FusedLossUnsupported(f"{type(model).__name__} has no `{attribute}` module (not a transformers "
                                       "*ForCausalLM layout)")
    head = getattr(model, head_name)
    if hooked(model) or hooked(head):
        raise FusedLossUnsupported(f"the model or its LM head: {HOOKED_REASON}")
    if not isinstance(head, nn.Linear):
        raise FusedLossUnsupported(f"the LM head is a {type(head).__name__}, not a plain nn.Linear "
                                   "(wrapped by PEFT or quantized); the fused loss reads its weight directly")
    if type(head).forward is not nn.Linear.forward:
        # a subclass with its own forward computes something beyond x @ W^T + b (Dory's head scales
        # its logits by a learned vector), which reading the weight would drop
        raise FusedLossUnsupported(f"the LM head is a {type(head).__name__} with a forward of its own, not "
                                   "a plain nn.Linear; the fused loss reads its weight directly and would skip it")
    if logit_scale != 1.0 and head.bias is not None:
        raise FusedLossUnsupported(f"a logit scale ({logit_scale:g}) with an LM head bias: the fused loss scales the "
                                   "hidden states, which scales the bias too")
    original = model.forward
    if softcap == _FROM_CONFIG:
        softcap = getattr(model.config, "final_logit_softcapping", None)
    output_class = None
    cache_fields = None  # (field of the model's output, field of ours): `cache` from transformers 5.24

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        nonlocal output_class, cache_fields
        if past_key_values is not None:  # passed on only when given: transformers >= 5.24 calls it `cache`
            kwargs["past_key_values"] = past_key_values
        if labels is None or not self.training or not torch.is_grad_enabled():
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, labels=labels,
                            use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        if getattr(self.config, "output_router_logits", False) or kwargs.get("output_router_logits"):
            record_fallback("fused_cross_entropy", "the router's auxiliary loss is on (output_router_logits); "
                            "transformers' own loss path runs")
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, labels=labels,
                            use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        outputs = getattr(self, decoder)(input_ids=input_ids, attention_mask=attention_mask,
                                         position_ids=position_ids, inputs_embeds=inputs_embeds,
                                         use_cache=use_cache, **kwargs)
        hidden = outputs.last_hidden_state
        if logit_scale != 1.0:
            hidden = hidden * logit_scale
        targets = _shifted_targets(labels, kwargs.get("shift_labels"))
        lm_head = getattr(self, head_name)
        loss = linear_cross_entropy(hidden, lm_head.weight, targets.to(hidden.device), bias=lm_head.bias,
                                    num_items_in_batch=kwargs.get("num_items_in_batch"),
                                    ignore_index=IGNORE_INDEX, softcap=softcap, chunk_tokens=chunk_tokens)
        if output_class is None:
            from transformers.modeling_outputs import CausalLMOutputWithPast

            output_class = CausalLMOutputWithPast
        if cache_fields is None:  # reading `past_key_values` on transformers >= 5.24 logs a deprecation
            cache_fields = tuple("cache" if "cache" in {f.name for f in dataclasses.fields(c)} else "past_key_values"
                                 for c in (outputs, output_class))
        return output_class(loss=loss, logits=None, **{cache_fields[1]: outputs.get(cache_fields[0])},
                            hidden_states=getattr(outputs, "hidden_states", None),
                            attentions=getattr(outputs, "attentions", None))

    replace_forward(model, types.MethodType(forward, model))

    def undo() -> None:
        restore_forward(model)

    return undo
