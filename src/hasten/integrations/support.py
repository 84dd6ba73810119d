"""What hasten would do with a model, piece by piece, before any weights are loaded.

`describe(model)` reads the model table and the contract (integrations/contract.py) on a model
built from its config (on the meta device: no memory, no weights) and says, per piece, what
`accelerate()` will run: hasten's kernel, the model's own code (with the feature that keeps it
there), or a refusal of packed batches. `hasten doctor --model` prints it. The classes are
checked again against their kernels when `accelerate()` runs on the real model; a class that
computes something else then stays transformers', which this report cannot see.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hasten.integrations.architectures import ARCHITECTURES, model_type_of, spec_for
from hasten.integrations.contract import (STATEFUL_LAYER_TYPES, attention_features_not_implemented, logit_transforms,
                                         stateful_layers, text_config, uses_attention_interface)


@dataclass(frozen=True)
class Piece:
    name: str
    status: str  # "ok" (hasten's kernel), "info" (the model's own code, correct), "warn" (slower or refused)
    detail: str


_NORMS = {"rms": "hasten RMSNorm", "layer": "torch's fused LayerNorm (float32, no bias)",
          "torch": "the model's own LayerNorm (already one torch kernel)",
          "own": "the model's own norm code (a form hasten's kernels do not take)"}
_MLPS = {"swiglu": "hasten SwiGLU", "geglu_tanh": "hasten GeGLU (tanh GELU)",
         "ungated": "the model's own activation between its projections (no gate to fuse)",
         "own": "the model's own MLP code (a form hasten's kernels do not take)"}


def auto_model_class(config):
    """The transformers auto class that builds `config` for training on text: its causal LM, or,
    for a vision-language wrapper that is none (Qwen2.5-VL, Mistral 3), its image-text class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kind = type(config)
    if kind not in AutoModelForCausalLM._model_mapping and kind in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def describe(model: nn.Module) -> list[Piece]:
    model_type = model_type_of(model.config)
    spec = spec_for(model.config)
    pieces = [_attention(model, spec.attention if spec is not None else ())]
    if spec is None:
        known = ", ".join(sorted(ARCHITECTURES))
        pieces.append(Piece("table", "warn", f"model type '{model_type}' is not in hasten's table ({known}): its "
                            "norms, MLP, rotary and loss stay transformers'"))
        return pieces
    pieces.append(Piece("table", "ok", f"model type '{model_type}' ({spec.family})"
                        + (f"; the model's own code keeps: {', '.join(spec.model_code)}" if spec.model_code else "")))
    norm = _NORMS[spec.norm.kind] + (" with weight + 1" if spec.norm.weight_offset == 1.0 else "")
    where = {"pre": "before attention and MLP", "pre_post": "before and after attention and MLP",
             "post": "after attention and MLP"}[spec.norm.placement]
    pieces.append(Piece("norm", "ok" if spec.norm.fused else "info",
                        f"{norm}, {where}" + (", q/k norms too" if spec.norm.qk_norm else "")))
    mlp = _MLPS[spec.mlp.kind] + (" on one gate_up_proj" if spec.mlp.fused_gate_up else "")
    pieces.append(Piece("mlp", "ok" if spec.mlp.fused else "info",
                        mlp if spec.family == "dense" else f"{mlp} where a dense MLP or shared expert exists"))
    layout = "interleaved pairs" if spec.rotary.interleaved else "halves (rotate_half)"
    if spec.rotary.own:
        pieces.append(Piece("rotary", "info", f"the model's own rotary code, {spec.rotary.note}"))
    else:
        pieces.append(Piece("rotary", "ok", f"hasten RoPE, {layout}" + (", partial" if spec.rotary.partial else "")
                            + (f"; {spec.rotary.note}" if spec.rotary.note else "")))
    if spec.family == "moe" and spec.moe_block:
        pieces.append(Piece("experts", "ok", f"hasten fused MoE block ({spec.moe_block}: the chosen experts only, on "
                            "grouped GEMMs; checked at accelerate())"))
    elif spec.family == "moe" and spec.experts:
        pieces.append(Piece("experts", "warn", f"the model's own experts (slower): {spec.experts}"))
    elif spec.family == "moe":
        pieces.append(Piece("experts", "ok", "hasten fused MoE experts (one-kernel grouping, grouped GEMM) where "
                            "the experts' layout fits (checked at accelerate())"))
    pieces.append(_loss(model, spec))
    return pieces


def attention_features_missing(model: nn.Module) -> dict[str, str]:
    """attention_features_not_implemented, less what the model's table entry declares hasten does:
    a multimodal entry (`vision`) packs text only and refuses image batches itself."""
    missing = attention_features_not_implemented(model)
    spec = spec_for(model.config)
    if spec is not None and spec.vision:
        missing.pop("multimodal", None)
    return missing


def stateful_refusal(model: nn.Module, stateful: list[str], devices: bool = True) -> str | None:
    """Why hasten cannot keep packed samples apart in the model's stateful layers (`stateful`, from
    contract.stateful_layers); None: it can, through hasten.stateful's varlen functions. devices:
    also check that fla's kernels run on the CUDA devices the model's parameters are on."""
    from hasten.stateful import patch as stateful_patch
    from hasten.stateful.varlen import fla_problem

    spec = spec_for(model.config)
    carry = f"its {', '.join(stateful)} carry state along the sequence, from one packed sample into the next"
    if spec is None or spec.stateful is None:
        return f"{carry}, and hasten's table has no varlen form of them for this model type"
    missing = attention_features_missing(model)
    if missing:
        return (f"{carry}, and its attention has features hasten's varlen attention does not compute "
                f"({'; '.join(missing.values())})")
    types = getattr(text_config(model), "layer_types", None)
    count = sum(t in STATEFUL_LAYER_TYPES for t in types) if types else None
    problem = stateful_patch.unsupported(model, spec.stateful, count)
    if problem is not None:
        return f"{carry}: {problem}"
    for device in ({p.device for p in model.parameters() if p.is_cuda} if devices else ()):
        problem = fla_problem(device.index)
        if problem is not None:
            return f"{carry}, and their varlen kernels cannot run on {device}: {problem}"
    return None


def _attention(model: nn.Module, declared: tuple[str, ...]) -> Piece:
    stateful = stateful_layers(model)
    spec = spec_for(model.config)
    if stateful:
        from hasten.stateful.varlen import FLA_INSTALL

        refusal = stateful_refusal(model, stateful, devices=False)  # the model is not on its GPU here
        if refusal is not None:
            return Piece("attention", "warn", f"packed batches refused ({refusal}); padded batches train as "
                         "transformers wrote the model")
        return Piece("attention", "ok", f"hasten varlen attention and varlen stateful layers ({', '.join(stateful)}: "
                     "each packed sample from a zero state; on CUDA with flash-linear-attention, else packed batches "
                     f"are refused there: {FLA_INSTALL})")
    if not uses_attention_interface(model, spec):
        return Piece("attention", "warn", "packed batches refused: the model does not use transformers' attention "
                     "interface")
    missing = attention_features_missing(model)
    if missing:
        return Piece("attention", "info", "the model's own attention, packed rows kept apart by hasten's mask ("
                     + "; ".join(missing.values()) + ")")
    return Piece("attention", "ok", "hasten varlen attention (packed, no mask)"
                 + (f"; the table entry lists: {'; '.join(declared)}" if declared else "")
                 + (f"; vision: {spec.vision}" if spec is not None and spec.vision else ""))


def _loss(model: nn.Module, spec) -> Piece:
    declared = spec.logits.accounted_keys()
    undeclared = [line for key, line in logit_transforms(model).items() if key not in declared]
    if undeclared:
        return Piece("loss", "warn", "transformers' loss (logits materialised): " + "; ".join(undeclared)
                     + " is not in the table entry")
    text = text_config(model)
    applied = ([f"softcap {spec.logits.softcap(text):g}"] if spec.logits.softcap(text) else []) + (
        [f"logit scale {spec.logits.scale(text):g}"] if spec.logits.scale(text) != 1.0 else [])
    return Piece("loss", "ok", "hasten fused linear cross-entropy" + (f" ({', '.join(applied)})" if applied else ""))
