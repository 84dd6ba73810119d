"""hasten for Hugging Face transformers models: `accelerate(model)` patches in place.

What the patch does:
  * registers hasten's varlen attention under the name "hasten_varlen" with
    transformers' AttentionInterface, and a mask function that builds no mask for
    packed or plain causal batches, and switches the model to it;
  * adds a forward pre-hook on the model that, once per forward, makes the
    batch's packing metadata when only `position_ids` arrived (one device op, one
    read-back) and passes it down through the standard FlashAttention keyword
    arguments, so every layer reads the same object.
The returned handle undoes all of it.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel, masking_utils
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hasten.attention.varlen import varlen_attention
from hasten.config import Config
from hasten.memory import apply_activation_checkpointing
from hasten.dense import install_fused_mlp, install_fused_rms_norm, install_fused_rope
from hasten.loss import FusedLossUnsupported, install_fused_cross_entropy
from hasten.memory.offload import OffloadError, OffloadManager
from hasten.moe import MoeLoadStats, fused_experts_forward, unsupported_reason
from hasten.observability import logger, record_fallback
from hasten.packing.meta import CU_K, CU_Q, MAX_K, MAX_Q, PackedMeta, verify_against_position_ids, verify_enabled

ATTN_NAME = "hasten_varlen"
EXPERTS_NAME = "hasten_fused"


@dataclass(frozen=True)
class ArchSpec:
    """What hasten knows about one transformers architecture (by `config.model_type`)."""

    family: str  # "dense" | "moe"
    notes: str = ""


# Architectures tested against transformers' own attention (tests/integrations,
# tests/gpu). Others that use the standard attention interface are patched too,
# with a one-time notice.
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("dense"),
    "qwen2": ArchSpec("dense", "sliding window honoured where the config enables it"),
    "qwen3": ArchSpec("dense"),
    "mistral": ArchSpec("dense", "sliding window honoured"),
    "qwen3_moe": ArchSpec("moe"),
    "qwen2_moe": ArchSpec("moe", "the shared expert stays transformers' own MLP"),
    "mixtral": ArchSpec("moe"),
    "olmoe": ArchSpec("moe"),
}


@dataclass
class _AttentionSettings:
    metadata_cache: bool
    backend: str
    gqa: str
    verify: bool


# Settings per patched model, found from an attention module through `module.config`
# (transformers' configs are unhashable, hence the id).
_SETTINGS: dict[int, _AttentionSettings] = {}
_DEFAULT_SETTINGS = _AttentionSettings(True, "auto", "auto", False)


def _settings_for(module: torch.nn.Module) -> _AttentionSettings:
    return _SETTINGS.get(id(getattr(module, "config", None)), _DEFAULT_SETTINGS)


def hasten_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             sliding_window: int | None = None, **kwargs: Any):
    """transformers attention function. query (B, Hq, L, D), key/value (B, Hkv, S, D) -> (B, L, Hq, D)."""
    settings = _settings_for(module)
    cu_seqlens, max_seqlen = kwargs.get(CU_Q), kwargs.get(MAX_Q)
    position_ids = kwargs.get("position_ids")
    batch, _, q_len, _ = query.shape

    if q_len != key.shape[2]:  # decoding against a KV cache: not a training path, never packed
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **_without_packing(kwargs))
    if cu_seqlens is None:
        if attention_mask is not None:
            record_fallback("attention_padded_batch", "a batch came with a padding attention_mask, so attention ran "
                            "through transformers' sdpa with a dense mask; pack the batch with "
                            "hasten.PackingCollator (or pass position_ids without attention_mask) for the varlen path")
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                          sliding_window=sliding_window, **kwargs)
        if position_ids is not None:
            # metadata_cache off (or a caller that bypassed the model hook): derive in this layer.
            meta = PackedMeta.from_position_ids(position_ids)
            cu_seqlens, max_seqlen = meta.cu_seqlens, meta.max_seqlen
        else:  # one sequence per row
            cu_seqlens = torch.arange(0, (batch + 1) * q_len, q_len, device=query.device, dtype=torch.int32)
            max_seqlen = q_len
    elif settings.verify or verify_enabled():
        if position_ids is None:
            raise RuntimeError("HASTEN_VERIFY needs position_ids in the attention call to re-derive the metadata")
        verify_against_position_ids(cu_seqlens, max_seqlen, position_ids, f"layer {getattr(module, 'layer_idx', '?')}")

    # (B, H, L, D) -> (B * L, H, D): the packed token layout of the varlen kernels.
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (query, key, value))
    out = varlen_attention(q, k, v, cu_seqlens.to(device=q.device, dtype=torch.int32), int(max_seqlen),
                           scale=scaling, causal=getattr(module, "is_causal", True), sliding_window=sliding_window,
                           dropout=dropout, backend=settings.backend, gqa=settings.gqa)
    return out.view(batch, q_len, out.shape[1], out.shape[2]), None


def _without_packing(kwargs: dict) -> dict:
    return {name: value for name, value in kwargs.items() if name not in (CU_Q, CU_K, MAX_Q, MAX_K)}


def hasten_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """No mask for packed or plain causal batches (attention reads cu_seqlens). A real
    padding mask is honoured by building transformers' sdpa mask, and the attention
    function reports that fallback."""
    if attention_mask is None:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(ATTN_NAME, hasten_attention_forward)
AttentionMaskInterface.register(ATTN_NAME, hasten_mask)

# transformers' mask preparation looks for packed rows in position_ids and ends with a Python-level
# `.all()` on a device tensor: a host sync in every forward, for a result hasten_mask throws away
# (packed batches carry no attention_mask; attention reads cu_seqlens). Inside a forward that
# hasten prepared as packed, that search is skipped. One entry per hooked forward, innermost last.
_packed_forwards = threading.local()
_find_packed_sequence_indices = masking_utils.find_packed_sequence_indices


def _packed_forward_stack() -> list[bool]:
    if not hasattr(_packed_forwards, "stack"):
        _packed_forwards.stack = []
    return _packed_forwards.stack


def _find_packed_sequence_indices_unless_hasten(position_ids: torch.Tensor) -> torch.Tensor | None:
    stack = _packed_forward_stack()
    if stack and stack[-1]:
        return None
    return _find_packed_sequence_indices(position_ids)


masking_utils.find_packed_sequence_indices = _find_packed_sequence_indices_unless_hasten


def _leave_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    stack = _packed_forward_stack()
    if stack:
        stack.pop()
ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, fused_experts_forward)


class _PackingPreHook:
    """Once per forward: packing metadata from position_ids, shared by all layers."""

    def __init__(self, model: PreTrainedModel, settings: _AttentionSettings) -> None:
        self.settings = settings
        self.signature = inspect.signature(model.forward)
        self.var_keyword = next((p.name for p in self.signature.parameters.values()
                                 if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        bound = dict(self.signature.bind_partial(*args, **kwargs).arguments)
        bound.update(bound.pop(self.var_keyword, None) or {})
        return bound

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        prepared = self._prepare(args, kwargs)
        _packed_forward_stack().append(prepared is not None)  # popped by _leave_forward
        return prepared

    def _prepare(self, args: tuple, kwargs: dict):
        bound = self._arguments(args, kwargs)
        # generation with a cache: leave it alone (transformers >= 5.24 names it `cache`)
        if bound.get("past_key_values") is not None or bound.get("cache") is not None:
            return None
        cu_seqlens = bound.get(CU_Q)
        position_ids = bound.get("position_ids")
        mask = bound.get("attention_mask")
        # position_ids alone describe a packed (or plain) batch; with a padding mask the batch is a
        # padded one, which the attention function serves through its (reported) fallback.
        if cu_seqlens is None and position_ids is not None and mask is None and self.settings.metadata_cache:
            kwargs.update(PackedMeta.from_position_ids(position_ids).attention_kwargs())
            cu_seqlens = kwargs[CU_Q]
        if cu_seqlens is None:
            return None
        if position_ids is None:  # transformers would number the whole row 0..L-1: wrong rotary phases
            raise ValueError("hasten: this batch has packing metadata (cu_seq_lens) but no position_ids; packed "
                             "batches need per-sample position_ids (hasten.PackingCollator emits them)")
        if mask is not None:
            if not bool(mask.all()):
                raise ValueError("hasten: this batch has packing metadata (cu_seq_lens) and an attention_mask with "
                                 "padding; packed batches carry their boundaries in cu_seq_lens. Drop attention_mask "
                                 "from the batch (hasten.PackingCollator emits none).")
            args, kwargs = _without(args, kwargs, "attention_mask", self.signature)
        # A packed batch never generates: no KV cache (transformers builds one by default, which
        # would also hold every layer's K/V for the whole forward).
        if bound.get("use_cache") is not False:
            args, kwargs = _without(args, kwargs, "use_cache", self.signature)
            kwargs["use_cache"] = False
        return args, kwargs


def _without(args: tuple, kwargs: dict, name: str, signature: inspect.Signature) -> tuple[tuple, dict]:
    kwargs.pop(name, None)
    names = list(signature.parameters)
    if name in names and names.index(name) < len(args):
        args = list(args)
        args[names.index(name)] = None
        args = tuple(args)
    return args, kwargs


@dataclass
class AccelerationHandle:
    """What `accelerate` changed on one model; `undo()` restores it."""

    model: PreTrainedModel
    config: Config
    active: list[str] = field(default_factory=list)
    inactive: list[str] = field(default_factory=list)
    moe_stats: MoeLoadStats | None = None
    offload: OffloadManager | None = None
    _undo_steps: list = field(default_factory=list)

    def undo(self) -> None:
        while self._undo_steps:
            self._undo_steps.pop()()

    def report(self) -> str:
        lines = ["hasten active: " + (", ".join(self.active) or "nothing")]
        lines += [f"hasten not active: {item}" for item in self.inactive]
        return "\n".join(lines)


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    # transformers' use_experts_implementation decorator marks experts modules with these flags
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_concatenated")]


def _patch_attention(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    training = config.training
    if not training.packed_sequence:
        handle.inactive.append("training.packed_sequence is false: attention left as transformers configured it")
        return
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in ARCHITECTURES:
        if not getattr(model, "_supports_attention_backend", False):
            record_fallback("unsupported_architecture", f"model type '{model_type}' does not use transformers' "
                            "attention interface, so hasten cannot route its attention; attention is unchanged")
            handle.inactive.append(f"varlen attention (model type '{model_type}' not supported)")
            return
        logger.warning("hasten: model type '%s' is not in hasten's tested table (%s); patching it through "
                       "transformers' standard attention interface", model_type, ", ".join(sorted(ARCHITECTURES)))
    settings = _AttentionSettings(training.metadata_cache, config.attention.backend, config.attention.gqa,
                                  config.attention.verify)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    _SETTINGS[id(model.config)] = settings
    hook = model.register_forward_pre_hook(_PackingPreHook(model, settings), with_kwargs=True)
    leave = model.register_forward_hook(_leave_forward, with_kwargs=True, always_call=True)

    def undo() -> None:
        hook.remove()
        leave.remove()
        _SETTINGS.pop(id(model.config), None)
        model.set_attn_implementation(previous or "sdpa")

    handle._undo_steps.append(undo)
    handle.active.append("varlen attention (packed sequences, no mask)")
    handle.active.append("metadata cache (once per batch)" if training.metadata_cache
                         else "metadata derived per layer (training.metadata_cache is false)")


def _patch_moe(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    experts = _experts_modules(model)
    if not experts:
        if config.training.moe.fused_grouping:
            handle.inactive.append("training.moe.fused_grouping (this model has no MoE experts)")
        return
    if not config.training.moe.fused_grouping:
        handle.inactive.append("training.moe.fused_grouping is false: experts left as transformers configured them")
        return
    reasons = {reason for m in experts if (reason := unsupported_reason(m)) is not None}
    if reasons:
        record_fallback("moe_unsupported_experts", "the fused MoE path cannot run these experts ("
                        + "; ".join(sorted(reasons)) + "); transformers' experts implementation is used")
        handle.inactive.append("fused MoE experts (" + "; ".join(sorted(reasons)) + ")")
        return
    model_type = getattr(model.config, "model_type", "?")
    if ARCHITECTURES.get(model_type, ArchSpec("")).family != "moe":
        logger.warning("hasten: MoE model type '%s' is not in hasten's tested table; its experts match the fused "
                       "path's layout, so they are patched", model_type)
    previous = model.config._experts_implementation
    model.set_experts_implementation(EXPERTS_NAME)
    stats = MoeLoadStats()
    for m in experts:
        m._hasten_moe_stats = stats

    def undo() -> None:
        for m in experts:
            m.__dict__.pop("_hasten_moe_stats", None)
        model.set_experts_implementation(previous or "eager")

    handle._undo_steps.append(undo)
    handle.moe_stats = stats
    handle.active.append(f"fused MoE experts ({len(experts)} layers: one-kernel grouping, grouped GEMM, "
                         "fused SwiGLU, deterministic combine)")


def _patch_memory(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    checkpoint = config.training.checkpoint
    if checkpoint.offload_mode() != "none":
        _patch_offload(model, config, handle)
    policy = checkpoint.activations
    if policy == "none":
        return
    try:
        handle._undo_steps.append(apply_activation_checkpointing(model, policy))
    except ValueError as exc:
        record_fallback("activation_checkpointing", f"training.checkpoint.activations={policy} cannot be applied "
                        f"({exc}); activations are kept")
        handle.inactive.append(f"activation checkpointing ({exc})")
        return
    handle.active.append(f"activation checkpointing ({policy}, per decoder layer)")


def _patch_offload(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    checkpoint = config.training.checkpoint
    mode, double_buffer = checkpoint.offload_mode(), checkpoint.offload_double_buffer()
    device = next(model.parameters()).device
    if device.type != "cuda":
        reason = (f"training.checkpoint offload ({mode}) runs on a GPU; this model is on {device.type}, where "
                  "activations already live in host memory")
        record_fallback("activation_offload", reason)
        handle.inactive.append(f"activation offload ({reason})")
        return
    try:
        manager = OffloadManager(model, mode, double_buffer=double_buffer, max_memory_gib=checkpoint.max_memory_gib)
    except OffloadError as exc:
        record_fallback("activation_offload", f"training.checkpoint offload ({mode}) cannot be applied ({exc}); "
                        "activations stay on the device")
        handle.inactive.append(f"activation offload ({exc})")
        return
    handle.offload = manager
    handle._undo_steps.append(manager.detach)
    buffers = "double-buffered" if double_buffer else "one buffer"
    what = "planned per layer after the first step" if mode == "auto" else "every decoder layer but the last"
    handle.active.append(f"activation offload ({mode}: {what}; {buffers}, copy streams)")


def _patch_loss(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    if not config.kernels.fused_cross_entropy:
        handle.inactive.append("fused cross-entropy (kernels.fused_cross_entropy is false)")
        return
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in ARCHITECTURES:
        record_fallback("fused_cross_entropy", f"model type '{model_type}' is not in hasten's architecture table; "
                        "transformers' own loss path runs (logits materialised)")
        handle.inactive.append(f"fused cross-entropy (model type '{model_type}' not supported)")
        return
    try:
        handle._undo_steps.append(install_fused_cross_entropy(model))
    except FusedLossUnsupported as exc:
        record_fallback("fused_cross_entropy", f"{exc}; transformers' own loss path runs (logits materialised)")
        handle.inactive.append(f"fused cross-entropy ({exc})")
        return
    handle.active.append("fused cross-entropy (LM head + loss in chunks, no full logits; training forwards return "
                         "logits=None)")


def _patch_dense_kernels(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    kernels = config.kernels
    if not (kernels.rms_norm or kernels.swiglu or kernels.rope):
        return
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in ARCHITECTURES:
        reason = f"model type '{model_type}' is not in hasten's architecture table"
        record_fallback("fused_dense_kernels", f"{reason}; transformers' RMSNorm, MLP and rotary code run")
        handle.inactive.append(f"fused RMSNorm / SwiGLU / RoPE ({reason})")
        return
    done = []
    if kernels.rms_norm:
        undo, count = install_fused_rms_norm(model)
        handle._undo_steps.append(undo)
        if count:
            done.append(f"RMSNorm x{count}")
        else:
            handle.inactive.append("fused RMSNorm (no Llama/Qwen-style RMSNorm modules, with `variance_epsilon`, "
                                   "in this model)")
    if kernels.swiglu:
        undo, count = install_fused_mlp(model)
        handle._undo_steps.append(undo)
        if count:
            done.append(f"SwiGLU MLP x{count}")
        else:
            handle.inactive.append("fused SwiGLU (no SiLU-gated MLP modules in this model)")
    if kernels.rope:
        undo, found = install_fused_rope(model)
        handle._undo_steps.append(undo)
        if found:
            done.append("RoPE")
        else:
            record_fallback("fused_rope", f"{type(model).__module__} has no apply_rotary_pos_emb to replace")
            handle.inactive.append("fused RoPE (the modeling module has no apply_rotary_pos_emb)")
    if done:
        handle.active.append("fused kernels (" + ", ".join(done) + ")")


def accelerate(model: PreTrainedModel, config: Config | None = None) -> AccelerationHandle:
    """Patch a loaded transformers model in place; returns a handle whose `undo()` reverts it."""
    config = config or Config()
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hasten.accelerate expects a transformers PreTrainedModel, got {type(model).__name__}; "
                        "for a PEFT model pass model.get_base_model() or call accelerate before wrapping")
    handle = AccelerationHandle(model, config, inactive=config.inactive_features())
    _patch_attention(model, config, handle)
    _patch_moe(model, config, handle)
    _patch_memory(model, config, handle)
    _patch_loss(model, config, handle)
    _patch_dense_kernels(model, config, handle)
    return handle
