"""The contract between hasten and a transformers model: what may be patched, read from the model.

hasten patches a piece (attention, RMSNorm, MLP, rotary, loss, experts) only when what the
model's piece computes is exactly what hasten's kernel computes. This module reads the config and
the modules at `accelerate()` time and names, for each piece that must stay as transformers wrote
it, the feature that stops it. At call time the attention function refuses any argument it does
not implement (`check_attention_kwargs`), so a feature this module does not know yet raises
instead of being dropped.

Packing is part of the contract: a layer that carries state along the sequence (linear
attention, a state-space scan, a short causal convolution) would carry it from one packed sample
into the next; such models get a clear error when a packed batch reaches them.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
from torch import nn

from hasten.packing.meta import CHUNK_CU, CHUNK_MAX, CU_K, CU_Q, LINEAR_META, MAX_K, MAX_Q

# Layer types (config.layer_types) whose layers carry state along the sequence.
STATEFUL_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent",
                                  "rwkv", "short_conv"})
# Layer types hasten's attention computes (with the window or the chunks the mask gives).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# Module classes of such layers, for models without layer_types.
_STATEFUL_CLASS = re.compile(r"Mamba|DeltaNet|LinearAttention|ShortConv|Lightning|Rwkv|RWKV|Recurrent|SSM|Ssm[A-Z]|"
                             r"Retention|Hyena")

def text_config(model: nn.Module):
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def config_values(config, key: str) -> list:
    """Every value `key` takes across the model's layers: [config.key] (None where absent) for an
    ordinary config. A heterogeneous config (transformers >= 5.24: `per_layer_config`, e.g. dots3's
    head sizes, Gemma 4's head_dim) raises on the global read of an attribute that varies per layer;
    then each layer's own value, in layer order."""
    try:
        return [getattr(config, key, None)]
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError (a RuntimeError; its module moves)
        layers = getattr(config, "per_layer_config", None)
        if layers is None:
            raise
        return [getattr(layers[i], key, None) for i in range(len(layers))]


def positions_from_tokens(model: nn.Module) -> str | None:
    """Why the model's positions cannot come from a packed row's position_ids, or None. RoBERTa's
    embeddings (and CamemBERT's, XLM-R's, Data2Vec-Text's, X-MOD's...) derive positions from the
    tokens when no position_ids are given, fairseq's way: padding_idx + 1 + the count of non-padding
    tokens before, so a sample alone starts at padding_idx + 1, not at the 0 a packed row's
    position_ids give every sample (and a padding token inside a sample takes padding_idx)."""
    for module in model.modules():
        if callable(getattr(type(module), "create_position_ids_from_input_ids", None)):
            return (f"its {type(module).__name__} derives positions from the tokens (padding_idx + 1 + the count of "
                    "non-padding tokens before), which a packed row's position_ids would replace")
    return None


def stateful_layers(model: nn.Module) -> list[str]:
    """Descriptions of the layers that carry state along the sequence (empty: none)."""
    config = text_config(model)
    found: dict[str, int] = {}
    for layer_type in getattr(config, "layer_types", None) or []:
        if layer_type in STATEFUL_LAYER_TYPES:
            found[f"'{layer_type}' layers"] = found.get(f"'{layer_type}' layers", 0) + 1
    if not found:
        for module in model.modules():
            name = type(module).__name__
            depthwise = (isinstance(module, nn.Conv1d) and module.groups > 1
                         and module.groups == module.in_channels)
            if _STATEFUL_CLASS.search(name) or depthwise:
                label = f"{name} layers" if not depthwise else "depthwise causal convolutions (nn.Conv1d)"
                found[label] = found.get(label, 0) + 1
    return [f"{count} {label}" for label, count in found.items()]


def uses_attention_interface(model: nn.Module, spec) -> bool:
    """Whether the model's attention modules call transformers' attention interface (where hasten's
    varlen attention plugs in). transformers marks that on the model class
    (`_supports_attention_backend`); its hybrid models (Qwen3-Next, Qwen3.5, OLMo hybrid) leave the
    mark off although their full-attention modules call the interface, which their table entries
    (with a `stateful` spec, each proven by its parity case) vouch for; so does an entry's
    `attention_interface` (StableLM, whose decoder layer passes its attention position_ids only)."""
    return bool(getattr(model, "_supports_attention_backend", False)
                or (spec is not None and (spec.stateful is not None or bool(spec.attention_interface))))


def _nonzero(value) -> bool:
    return value is not None and value is not False and value != 0


def attention_features_not_implemented(model: nn.Module) -> dict[str, str]:
    """Attention features of this model that hasten's varlen attention does not compute, by name
    (mla, bidirectional, alibi, layer_types, multimodal) with a line for the report.
    (Chunked attention is computed: hasten's attention cuts each packed sample into chunks counted
    from its own first token, with the boundaries built once per batch; the model's own attention
    would count them along the packed row, so packing is refused when another feature leaves
    attention to the model: `attention_chunk_size` below.)
    (Multi-head latent attention, value heads smaller than query/key heads, is computed: the
    attention call zero-pads the values to the query/key size and slices the output back.)
    (Attention logit softcapping and sinks are computed: the attention call's `softcap` and `s_aux`
    are what each path reads: cuDNN's score modifier or flash-attn for the cap, hasten's op for
    sinks, else one sequence at a time; a module with sinks whose call passes none is refused at
    the call.)"""
    config = text_config(model)
    missing: dict[str, str] = {}
    sizes = [config_values(config, key) for key in ("qk_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")]
    layers = max(map(len, sizes))  # one value each, or each layer's where a heterogeneous config varies them
    for qk_dim, v_dim, nope, rope in zip(*(values * layers if len(values) == 1 else values for values in sizes)):
        if nope is not None and rope is not None:  # what MLA modules compute with (a config's qk_head_dim
            qk_dim = nope + rope                    # can be stale: GLM-4.7-Flash's after a head_dim override)
        if qk_dim is not None and v_dim is not None and v_dim > qk_dim:
            missing["mla"] = f"value heads ({v_dim}) wider than the query/key heads ({qk_dim})"
            break
    bidirectional = getattr(config, "use_bidirectional_attention", False)
    # Gemma 4's "vision": image and video tokens attend to each other both ways, text causally
    # (its attention modules are causal unless "all"); media make the model multimodal below, or
    # its table entry refuses packed batches with media itself (`vision`)
    if bidirectional and bidirectional != "vision":
        missing["bidirectional"] = f"bidirectional attention (use_bidirectional_attention={bidirectional!r})"
    if _nonzero(getattr(config, "alibi", None)):
        missing["alibi"] = "ALiBi position biases"
    other = sorted({t for t in getattr(config, "layer_types", None) or []
                    if t not in ATTENTION_LAYER_TYPES and t not in STATEFUL_LAYER_TYPES})
    if other:
        missing["layer_types"] = f"attention layer types {', '.join(other)}"
    root = model.config
    for sub in ("vision_config", "audio_config", "speech_config"):
        if getattr(root, sub, None) is not None:
            missing["multimodal"] = f"a multimodal model ({sub}: image or audio tokens can attend bidirectionally)"
            break
    return missing


def attention_chunk_size(model: nn.Module) -> int | None:
    """Llama 4's attention_chunk_size: chunked attention on its layers with rotary; None without."""
    size = getattr(text_config(model), "attention_chunk_size", None)
    return int(size) if _nonzero(size) else None


# DeepSeek-V3.2's sparse attention (DSA), as its forward merges the selection under transformers'
# "eager" and "sdpa": the indexer's top-k keys of each query (B, S, topk) scattered into a mask of
# the keys NOT chosen, which the attention mask then hides. A.X-K2, GLM-MoE-DSA, Hunyuan-v4,
# dots3 and Mistral-Large-4 write the same statements (transformers 5.25); under any other
# implementation name they pass the selection as `indices` instead.
_TOPK_SELECTION_MERGE = (".scatter(-1, topk_indices.long(), False)", "attention_mask & ~index_mask",
                         "attention_mask.masked_fill(index_mask, torch.finfo(hidden_states.dtype).min)",
                         "indices=sparse_indices")


def merges_topk_selection(module: nn.Module) -> bool:
    """Whether an attention module's own forward merges its indexer's top-k selection into the mask
    as DeepSeek-V3.2's does (_TOPK_SELECTION_MERGE, read from the class's source), so that the
    `indices` it passes to another attention function may be merged the same way there. Any other
    selection (Minimax-M3's key blocks, a mask built from the selection) is not this."""
    return _class_merges_topk_selection(type(module))


@functools.lru_cache(maxsize=None)
def _class_merges_topk_selection(cls: type) -> bool:  # read once per class: attention calls ask every layer
    try:
        source = inspect.getsource(cls.forward)
    except (AttributeError, OSError, TypeError):
        return False
    return all(statement in source for statement in _TOPK_SELECTION_MERGE)


def packed_row_limits(model: nn.Module) -> list[tuple[int, str, str]]:
    """(limit, what it bounds: "row" or "sample", why) for each part of a model's own code that
    would make the samples of a packed row compute otherwise than each alone past a length: the
    packed row's (its token count) or its longest sample's. Within every limit a packed row is
    exact; past one, a row holding several samples is refused when it arrives.

    - Llama 4's attention temperature tuning scales the queries of its layers without rotary by
      log1p(floor((i + 1) / floor_scale)), i the index along the row: 0 for every token of a row
      shorter than floor_scale, packed or not.
    - A "dynamic" (NTK) rotary rescales its frequencies for the whole batch once its largest
      position passes the original context: in a packed row, one long sample would change the
      frequencies of the others. Rows no longer than that context never rescale. A "longrope"
      rotary (Phi-3's 128k checkpoints, MiniCPM3) picks its long or short factors the same way,
      from the batch's largest position.
    - DeepSeek-V3.2's sparse attention keeps each query's index_topk highest-scoring keys. In a
      packed row the indexer sees the packed mask, so a query's candidates are its own sample's
      keys, as alone; while no sample is longer than index_topk every candidate is kept, in the
      row and alone. Past it the choice among equal scores (its ReLU makes zeros common) could
      fall otherwise along a row than along the sample alone."""
    config = text_config(model)
    limits = []
    topk = getattr(config, "index_topk", None)
    if _nonzero(topk) and any(merges_topk_selection(m) for m in model.modules() if hasattr(m, "indexer")):
        limits.append((int(topk), "sample", f"its sparse attention keeps each query's {topk} highest-scoring keys "
                                            f"(index_topk), every key only while a sample has at most {topk} tokens"))
    no_rope = [layer for layer, uses_rope in enumerate(getattr(config, "no_rope_layers", None) or []) if not uses_rope]
    floor_scale = getattr(config, "floor_scale", None)
    if getattr(config, "attn_temperature_tuning", False) and no_rope and floor_scale:
        limits.append((int(floor_scale) - 1, "row", f"attention temperature tuning (attn_temperature_tuning, floor_scale="
                                             f"{floor_scale}) on {len(no_rope)} layers without rotary counts positions "
                                             "along the packed row"))
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type == "dynamic":
        context = rope.get("original_max_position_embeddings") or getattr(config, "max_position_embeddings", None)
        if context:
            limits.append((int(context), "sample", f"its dynamic rotary rescales every sample's frequencies once "
                                                   f"one sample passes {context} positions"))
    elif rope_type == "longrope":
        context = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                           None)
        if context:
            limits.append((int(context), "sample", f"its longrope rotary switches every sample to its long factors "
                                                   f"once one sample passes {context} positions"))
    return limits


def logit_transforms(model: nn.Module) -> dict[str, str]:
    """Output-logit transforms the model's config switches on, by config key, with a line for the
    report: the fused loss must apply each one (its table entry declares which) or stay off."""
    config = text_config(model)
    found = {}
    for key in ("final_logit_softcapping", "logits_scaling", "logit_scale", "output_multiplier_scale",
                "logit_multiplier"):
        value = getattr(config, key, None)
        if key == "final_logit_softcapping":
            if _nonzero(value):
                found[key] = f"final logit softcapping ({key}={value})"
        elif value is not None and value != 1:
            found[key] = f"logit scaling ({key}={value})"
    return found


# Arguments hasten's attention reads, or that carry nothing attention computes with (each named
# with why it may be ignored).
ATTENTION_KWARGS_READ = frozenset({"position_ids", "is_causal", CU_Q, CU_K, MAX_Q, MAX_K, CHUNK_CU, CHUNK_MAX})
ATTENTION_KWARGS_INERT = frozenset({
    "cache_position", "use_cache", "past_key_values", "cache",  # cache bookkeeping, updated before the call
    "num_items_in_batch", "output_hidden_states", "output_router_logits",  # read by the model, not attention
    "labels",  # the loss's: Gemma 4's wrappers pass them to their decoder, which hands its kwargs to attention
    "logits_to_keep",  # the LM head's: LLaVA-OneVision hands generate's value on to its decoder's attention
    "seq_idx",  # read by state-space layers (packing into those is refused)
    "position_embeddings",  # rotary already applied to q and k
    "layer_idx", "target_dtype",  # flash bookkeeping
    "num_samples",  # hasten.PackingCollator's sample count, passed along with the batch
    LINEAR_META,  # the batch's boundaries for the stateful layers (linear attention, short convolutions)
})
# Falsy values of these mean "off"; a true value asks for something hasten does not compute.
ATTENTION_KWARGS_OFF_WHEN_FALSY = frozenset({"output_attentions", "softcap", "s_aux", "sinks", "deterministic",
                                            "position_bias", "indices", "block_indices", "attn_weights"})


def check_attention_kwargs(kwargs: dict, module: nn.Module) -> None:
    """Raise on any argument hasten's attention would otherwise drop."""
    for name, value in kwargs.items():
        if name in ATTENTION_KWARGS_READ or name in ATTENTION_KWARGS_INERT:
            continue
        if name in ATTENTION_KWARGS_OFF_WHEN_FALSY:
            if value is None or value is False or (isinstance(value, (int, float)) and value == 0):
                continue
        elif value is None:
            continue
        shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise NotImplementedError(
            f"hasten's varlen attention does not implement the argument `{name}` ({shown}) that reached "
            f"{type(module).__name__}'s attention call; rather than drop it, hasten stops. If `{name}` is a column "
            "of your batch that is not a model input, remove it from the batch. If it is an attention feature of this "
            "model, accelerate() should have left the model's attention to transformers: please report the model "
            "type, and until then train without hasten's attention (training.packed_sequence: false).")
