"""hasten for Hugging Face transformers models: `accelerate(model)` patches in place.

What the patch does:
  * registers hasten's varlen attention under the name "hasten_varlen" with
    transformers' AttentionInterface, and a mask function that builds no mask for
    packed or plain causal batches, and switches the model to it (the registrations
    are process-wide: made by the first accelerate(), restored when the last handle
    is undone; importing this module registers nothing);
  * adds a forward pre-hook on the model that, once per forward, makes the
    batch's packing metadata when only `position_ids` arrived (one device op, one
    read-back) and passes it down through the standard FlashAttention keyword
    arguments, so every layer reads the same object.
The returned handle undoes all of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface, PreTrainedModel, masking_utils
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from hasten.attention.varlen import BackendFacts, backend_facts, prepare_device, varlen_attention
from hasten.integrations.architectures import ARCHITECTURES, model_type_of, spec_for
from hasten.integrations.contract import (attention_chunk_size, check_attention_kwargs, logit_transforms,
                                         merges_topk_selection, packed_row_limits, positions_from_tokens,
                                         stateful_layers, text_config, uses_attention_interface)
from hasten.integrations.masks import BandMask, MaskNotSupported, read_band
from hasten.integrations.support import attention_features_missing, stateful_refusal
from hasten.config import Config
from hasten.instance_forward import keep_over_kernelize, replace_forward, restore_forward
from hasten.observability import record_fallback
from hasten.packing.collator import PackingError
from hasten.packing.meta import CHUNK_CU, CHUNK_MAX, CU_K, CU_Q, LINEAR_META, MAX_K, MAX_Q, PackedMeta, chunk_boundaries, verify_against_position_ids, verify_enabled
from hasten.stateful import patch as stateful_patch
from hasten.stateful.varlen import LinearMeta

# The features that run hasten's ops (dense kernels, loss, MoE, memory) are imported by the
# accelerate() steps that apply them: importing this module loads no op library.
if TYPE_CHECKING:
    from hasten.memory.offload import OffloadManager
    from hasten.moe import MoeLoadStats

ATTN_NAME = "hasten_varlen"
# the model's own eager / sdpa attention, packed rows kept apart by a mask hasten builds on that
# implementation's own mask (a float mask for eager, a boolean one for sdpa)
DENSE_NAMES = {"eager": "hasten_dense_eager", "sdpa": "hasten_dense_sdpa"}
EXPERTS_NAME = "hasten_fused"


@dataclass
class _AttentionSettings:
    """hasten's attention settings for one patched model, set on each of its attention modules."""

    metadata_cache: bool
    backend: str
    gqa: str
    verify: bool
    # what the process can run (the build's kernels, cuDNN, flash-attn, torch varlen), read once at
    # accelerate(): host queries that a torch.compile trace of the attention call could not make
    facts: BackendFacts


# The attribute accelerate() sets on every attention module it inspected (removed by undo()).
_TAG = "_hasten_attention"


def _effective_window(window: int | None, length: int) -> int | None:
    # a window at least as long as the row changes nothing
    return None if window is None or window >= length else int(window)


def hasten_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | BandMask | None, scaling: float | None = None,
                             dropout: float = 0.0, sliding_window: int | None = None, **kwargs: Any):
    """transformers attention function. query (B, Hq, L, D), key/value (B, Hkv, S, D) -> (B, L, Hq, D).

    `attention_mask` is what hasten_mask returned: a BandMask (the mask's causality and window,
    no padding), a dense mask (padding, or a decoding step), or None (the model built no mask)."""
    settings: _AttentionSettings | None = getattr(module, _TAG, None)
    if settings is None:
        raise RuntimeError(f"hasten's attention was called from {type(module).__name__}, a module accelerate() did "
                           "not inspect (its model's config was switched to hasten's attention elsewhere); call "
                           "hasten.accelerate() on the model that owns this module")
    is_causal = kwargs.pop("is_causal", None)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    caller_causal = {} if is_causal is None else {"is_causal": is_causal}  # for the dense fallbacks, as given
    softcap = kwargs.pop("softcap", None) or None  # Gemma 2's attn_logit_softcapping: every path applies it
    sinks = _attention_sinks(module, kwargs.pop("s_aux", None))  # gpt-oss: every path applies them
    check_attention_kwargs(kwargs, module)
    if key.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"{type(module).__name__} has query and key head sizes {query.shape[-1]} and "
                                  f"{key.shape[-1]}; attention scores need one: leave this model's attention to "
                                  "transformers (training.packed_sequence: false)")
    batch, _, q_len, _ = query.shape
    chunk = None

    if isinstance(attention_mask, BandMask):
        if attention_mask.causal != causal:
            raise NotImplementedError(f"{type(module).__name__}: the model's mask is "
                                      f"{'causal' if attention_mask.causal else 'bidirectional'} but the attention "
                                      f"call is {'causal' if causal else 'bidirectional'}; hasten cannot tell which "
                                      "the model computes")
        chunk = attention_mask.chunk
        declared = getattr(getattr(module, "config", None), "attention_chunk_size", None)
        if chunk is not None and chunk != declared:
            raise NotImplementedError(f"{type(module).__name__}'s mask reads as causal chunks of {chunk} positions but "
                                      f"its config declares attention_chunk_size={declared}; hasten cannot tell a "
                                      "chunked mask from another pattern of equal blocks, and stops. Leave this model's "
                                      "attention to transformers (training.packed_sequence: false)")
        mask_window = _effective_window(attention_mask.window, q_len)
        if sliding_window is not None and _effective_window(sliding_window, q_len) != mask_window:
            raise NotImplementedError(f"{type(module).__name__} passes sliding_window={sliding_window} but its mask "
                                      f"has {'no window' if mask_window is None else f'a window of {mask_window}'}; "
                                      "transformers' own attention would apply one or the other depending on its "
                                      "backend, so hasten refuses to pick")
        sliding_window, attention_mask = mask_window, None

    cu_seqlens, max_seqlen = kwargs.get(CU_Q), kwargs.get(MAX_Q)
    position_ids = kwargs.get("position_ids")
    if q_len != key.shape[2]:  # decoding against a KV cache: not a training path, never packed
        return _dense_attention(module, softcap, sinks)(module, query, key, value, attention_mask, scaling=scaling,
                                                        dropout=dropout, **_without_packing(kwargs), **caller_causal,
                                                        **_softcap_kwarg(softcap), **_sinks_kwarg(sinks))
    if cu_seqlens is None:
        if attention_mask is not None:
            record_fallback("attention_padded_batch", "a batch came with a padding attention_mask, so attention ran "
                            "through transformers' sdpa (eager with a softcap) with a dense mask; pack the batch "
                            "with hasten.PackingCollator (or pass position_ids without attention_mask) for the "
                            "varlen path")
            return _dense_attention(module, softcap, sinks)(module, query, key, value, attention_mask,
                                                            scaling=scaling, dropout=dropout, **kwargs, **caller_causal,
                                                            **_softcap_kwarg(softcap), **_sinks_kwarg(sinks))
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

    if chunk is not None:  # Llama 4: each sample cut into chunks of `chunk` positions, causal within each
        if kwargs.get(CHUNK_CU) is not None:  # built once per batch with the metadata (the packing hook)
            cu_seqlens, max_seqlen = kwargs[CHUNK_CU], kwargs[CHUNK_MAX]
        else:  # metadata derived in this layer (training.metadata_cache false)
            cu_seqlens, max_seqlen = chunk_boundaries(cu_seqlens.to(device=query.device, dtype=torch.int32),
                                                      int(max_seqlen), batch * q_len, chunk)
    # (B, H, L, D) -> (B * L, H, D): the packed token layout of the varlen kernels.
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (query, key, value))
    v, value_dim = _value_heads_at_query_size(v, q.shape[-1])
    out = varlen_attention(q, k, v, cu_seqlens.to(device=q.device, dtype=torch.int32), int(max_seqlen),
                           scale=scaling, causal=causal, sliding_window=sliding_window, softcap=softcap,
                           dropout=dropout, backend=settings.backend, gqa=settings.gqa, facts=settings.facts,
                           sinks=sinks)
    if value_dim != out.shape[-1]:
        out = out[..., :value_dim]
    return out.reshape(batch, q_len, out.shape[1], value_dim), None


def _value_heads_at_query_size(v: torch.Tensor, qk_dim: int) -> tuple[torch.Tensor, int]:
    """(tokens, kv_heads, Dv) values -> (tokens, kv_heads, Dqk) and Dv, for multi-head latent
    attention (DeepSeek-V2/V3: Dqk 192 = 128 without rotary + 64 with it, Dv 128), since the
    varlen kernels take one head size. The values are zero-padded to the query/key size: scores
    and softmax read q and k alone, so the output's first Dv columns are softmax(qk^T)v exactly
    and the rest are zero (sliced off by the caller); the padding's backward drops the zero
    columns' gradient. The price is a copy of v and a wider output (1.5x for DeepSeek's sizes).
    A value head wider than the query's would need q and k padded instead (none in the table)."""
    value_dim = v.shape[-1]
    if value_dim == qk_dim:
        return v, value_dim
    if value_dim > qk_dim:
        raise NotImplementedError(f"value heads ({value_dim}) wider than query/key heads ({qk_dim}): hasten's varlen "
                                  "attention does not pad queries and keys; leave this model's attention to "
                                  "transformers (training.packed_sequence: false)")
    return torch.nn.functional.pad(v, (0, qk_dim - value_dim)), value_dim


def _softcap_kwarg(softcap: float | None) -> dict:
    return {"softcap": softcap} if softcap else {}


def _sinks_kwarg(sinks: torch.Tensor | None) -> dict:
    return {"s_aux": sinks} if sinks is not None else {}


def _attention_sinks(module: torch.nn.Module, s_aux) -> torch.Tensor | None:
    """The sink logits (Hq,) this attention call computes with: gpt-oss passes its module's
    `sinks` as `s_aux` (and its eager attention reads `module.sinks`). A module with sinks whose
    call passes none, or passes other ones, is refused: hasten cannot tell which the model means."""
    own = getattr(module, "sinks", None)
    if s_aux is None:
        if isinstance(own, torch.Tensor):
            raise NotImplementedError(f"{type(module).__name__} has attention sinks (`sinks`) but its attention call "
                                      "passes none (`s_aux`); rather than drop them, hasten stops: leave this model's "
                                      "attention to transformers (training.packed_sequence: false)")
        return None
    if not isinstance(s_aux, torch.Tensor) or s_aux is not own:
        raise NotImplementedError(f"{type(module).__name__}'s attention call passes `s_aux` that is not its module's "
                                  "`sinks` parameter; hasten computes sinks as gpt-oss defines them and stops here")
    return s_aux


@functools.lru_cache(maxsize=None)
def _reads_sinks(eager_attention) -> bool:
    """Whether a modeling file's eager attention applies the module's sinks (read from its source
    once per function: this runs on every decoding step)."""
    return "sinks" in inspect.getsource(eager_attention)


def _dense_attention(module: torch.nn.Module, softcap: float | None, sinks: torch.Tensor | None = None):
    """The dense attention for a padded batch or a decoding step: transformers' sdpa, or with a
    softcap or sinks (which sdpa ignores) the modeling file's own eager attention, which applies
    them (gpt-oss's reads `module.sinks`)."""
    if not softcap and sinks is None:
        return sdpa_attention_forward
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if softcap and (own is None or "softcap" not in inspect.signature(own).parameters):
        raise NotImplementedError(f"{type(module).__name__} passes softcap={softcap} on a padded batch (or a decoding "
                                  "step) and its modeling file has no eager attention taking a softcap; transformers' "
                                  "sdpa would drop it. Pack the batch (hasten.PackingCollator)")
    if sinks is not None and (own is None or not _reads_sinks(own)):
        raise NotImplementedError(f"{type(module).__name__} has attention sinks on a padded batch (or a decoding step) "
                                  "and its modeling file has no eager attention that applies them; transformers' sdpa "
                                  "would drop them. Pack the batch (hasten.PackingCollator)")

    def eager_with_additive_mask(module, query, key, value, attention_mask, **kwargs):
        # hasten's mask interface builds sdpa's boolean mask (True: attend); eager attention adds its
        # mask to the scores, so it gets 0 where allowed and the dtype's lowest value elsewhere
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~attention_mask, torch.finfo(query.dtype).min)
        return own(module, query, key, value, attention_mask, **kwargs)

    return eager_with_additive_mask


def _without_packing(kwargs: dict) -> dict:
    return {name: value for name, value in kwargs.items() if name not in (CU_Q, CU_K, MAX_Q, MAX_K)}


def hasten_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """transformers mask interface. Without padding: a BandMask, the mask function's causality and
    window read back (attention reads cu_seqlens for the boundaries; no dense mask). With padding,
    or for a decoding step against a cache: transformers' own sdpa mask, which the attention
    function serves through its (reported) dense fallback."""
    plain = (attention_mask is None and q_length == kv_length and isinstance(q_offset, int) and q_offset == 0
             and isinstance(kv_offset, int) and kv_offset == 0)
    if not plain:
        # always a dense boolean mask, never sdpa's "None: plain causal" shortcut: the fallback may be a
        # model's own eager attention (a softcap), which takes no is_causal and reads None as "no mask"
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    try:
        band = read_band(mask_function, q_length, kwargs.get("device"))
    except MaskNotSupported as exc:
        raise MaskNotSupported(f"hasten: {exc}; hasten's varlen attention cannot compute it, and accelerate() should "
                               "have left this model's attention to transformers: please report the model type. "
                               "Until then, train without hasten's attention (training.packed_sequence: false)") from exc
    stack = _forward_stack()
    if stack and stack[-1].hasten_packed:
        return band

    def dense() -> torch.Tensor:  # this forward's row is one sequence: transformers' own mask of it
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=None,
                         **{**kwargs, "allow_is_causal_skip": False})

    return dataclasses.replace(band, dense=dense)


@dataclass
class _ForwardState:
    """What the packing hook decided for one forward of a hooked model (innermost last)."""

    hasten_packed: bool = False  # hasten's varlen attention keeps the samples apart
    # dense mode, packed batch: the sample index of every token, (rows, L); None otherwise
    sample_ids: torch.Tensor | None = None
    masks: list = field(default_factory=list)  # dense mode: the masks hasten built in this forward
    mask_functions: list = field(default_factory=list)  # dense mode: the model's mask function of each mask
    # a hybrid model's packed batch: its LinearMeta and how many stateful calls the forward must make
    linear: tuple[LinearMeta, int] | None = None
    # dense mode, packed batch: its longest sample where the batch says (the collator's max_length_q)
    longest: int | None = None


_forwards = threading.local()


def _forward_stack() -> list[_ForwardState]:
    if not hasattr(_forwards, "stack"):
        _forwards.stack = []
    return _forwards.stack


def _current_forward() -> _ForwardState | None:
    stack = _forward_stack()
    return stack[-1] if stack else None


# --- dense mode: the model's own attention, packed rows kept apart by a mask hasten builds -------

_DENSE_TAG = "_hasten_dense_attention"  # on each attention module: the model's own attention function


def hasten_dense_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attention_mask, **kwargs: Any):
    """The model's own attention function (eager or sdpa, unchanged), after checking that a packed
    batch's attention gets the mask hasten built to keep its samples apart."""
    original = getattr(module, _DENSE_TAG, None)
    if original is None:
        raise RuntimeError(f"hasten's packed-mask attention was called from {type(module).__name__}, a module "
                           "accelerate() did not inspect; call hasten.accelerate() on the model that owns it")
    if original is sdpa_attention_forward:
        dropped = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
        if dropped:  # transformers < 5.24 picks sdpa for Gemma-2 and its sdpa ignores the softcap
            raise NotImplementedError(f"{type(module).__name__} passes {', '.join(dropped)} to transformers' sdpa "
                                      "attention, which does not apply it; load the model with "
                                      "attn_implementation='eager' (or upgrade transformers)")
    # DeepSeek-V3.2's sparse attention (and A.X-K2, GLM-MoE-DSA, MiniMax-M3...) merges its indexer's
    # top-k into the mask only under the implementation names "eager" and "sdpa"; under any other
    # name (this path's) it hands the selection to the attention function, which eager and sdpa
    # ignore. A top-k key selection whose merge the class writes as DeepSeek-V3.2 does is merged
    # here the same way (packed rows: no sample past index_topk, packed_row_limits); any other is refused.
    merge = kwargs.get("indices") is not None and attention_mask is not None and merges_topk_selection(module)
    sparse = [name for name in ("indices", "block_indices") if kwargs.get(name) is not None and
              not (merge and name == "indices")]
    if sparse:
        raise PackedBatchRefused(f"hasten: {type(module).__name__} passes a sparse attention selection "
                                 f"({', '.join(sparse)}) to its attention function, which its model merges into the "
                                 "mask only under transformers' own 'eager' and 'sdpa' names; the model's attention "
                                 "under hasten's packed mask would drop it. Train this model with padded batches "
                                 "(training.packed_sequence: false), where its attention stays transformers'.")
    state = _current_forward()
    built = None if state is None or state.sample_ids is None else next(
        (i for i, m in enumerate(state.masks) if attention_mask is m), -1)  # None: not a packed batch
    if built == -1:
        raise PackedBatchRefused(f"hasten: {type(module).__name__} of a packed batch received an attention mask that "
                                 "hasten did not build for the batch, so nothing would keep its samples apart. Train "
                                 "this model with padded batches (training.packed_sequence: false) and please report "
                                 "the model type.")
    if (built is not None and getattr(module, "is_causal", True) is False and kwargs.get("is_causal") is not True
            and _hides_later_keys(state.mask_functions[built])):  # judged only for modules built non-causal
        # PaliGemma (use_bidirectional_attention on its Gemma text model): modules built non-causal, a
        # causal mask from the text model; alone, sdpa drops that mask and attends both ways, eager
        # keeps it: the model's own result depends on its attention implementation
        raise PackedBatchRefused(f"hasten: {type(module).__name__} is built non-causal (is_causal False) but its "
                                 "model's mask is causal, so what the model computes alone depends on its attention "
                                 "implementation (sdpa without a mask attends both ways, eager keeps the mask); "
                                 "hasten cannot tell which a packed batch must reproduce. Train this model with "
                                 "padded batches (training.packed_sequence: false) and please report the model "
                                 "type.")
    if merge:  # after the check above, which knows the mask hasten built by its identity
        if not getattr(kwargs["indices"], EVERY_KEY, False):  # (see _every_key_indexer: nothing to hide)
            attention_mask = merge_topk_selection(attention_mask, kwargs["indices"], key.shape[-2], query.dtype)
        kwargs["indices"] = None
    return original(module, query, key, value, attention_mask, **kwargs)


# Set on the selection _every_key_indexer returns in place of the indexer's: every key is kept.
EVERY_KEY = "_hasten_every_key"
# Set by _dense_mask on each mask it builds for a packed batch: the batch's longest sample (or None).
_LONGEST = "_hasten_longest_sample"


def _storage_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was taken of (every view's `_base` is the root), or t itself."""
    return t if t._base is None else t._base


def _every_key_indexer(indexer: torch.nn.Module, topk: int):
    """A forward for a sparse-attention indexer (DeepSeek-V3.2's and kin) that skips it on a packed
    batch whose longest sample has at most `topk` tokens: there its top-k keeps every key a query
    sees (packed_row_limits), so the merge would hide nothing, and the indexer's own scores, float32
    (rows, L, index heads, L), 64 GiB a layer at 16,384 tokens on DeepSeek-V3.2, are not computed.
    Its parameters get no gradient either way (top-k indices carry none). It returns an empty
    selection marked EVERY_KEY, which hasten's packed-mask attention reads as "merge nothing";
    elsewhere (padded batches, a longer sample alone in its row) the indexer runs."""
    original = indexer.forward

    def forward(*args, **kwargs):
        # the packed mask the indexer is handed (a slice of it), marked by _dense_mask with the batch's
        # longest sample: an argument, so a checkpointed layer's recompute decides as its forward did
        marked = next(((t, _storage_root(t).__dict__[_LONGEST]) for t in (*args, *kwargs.values())
                       if isinstance(t, torch.Tensor) and _LONGEST in _storage_root(t).__dict__), None)
        mask, longest = marked if marked is not None else (None, None)
        if longest is None or longest > topk:
            return original(*args, **kwargs)
        rows, length = mask.shape[0], mask.shape[-2]
        selection = torch.empty((rows, length, 0), dtype=torch.int32, device=mask.device)
        setattr(selection, EVERY_KEY, True)
        return selection

    return forward


def merge_topk_selection(attention_mask: torch.Tensor, indices: torch.Tensor, keys: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """The mask DeepSeek-V3.2's attention gives transformers' eager and sdpa functions, statement for
    statement: indices (B, S, topk) are each query's chosen keys; the keys not chosen, (B, 1, S,
    keys), are hidden (a boolean mask) or set to dtype's lowest (an additive one, dtype the hidden
    states')."""
    not_chosen = indices.new_ones((indices.shape[0], indices.shape[1], keys), dtype=torch.bool)
    not_chosen = not_chosen.scatter(-1, indices.long(), False).unsqueeze(1)
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~not_chosen
    return attention_mask.masked_fill(not_chosen, torch.finfo(dtype).min)


def _hides_later_keys(mask_function) -> bool:
    """Whether the model's mask function keeps a query from the key after it (a causal mask; a
    bidirectional one lets it see it). False when it cannot be evaluated alone."""
    if mask_function is None:
        return False
    zero, one = torch.tensor(0), torch.tensor(1)
    try:
        return not bool(mask_function(zero, zero, zero, one))
    except Exception:  # noqa: BLE001 - a mask function that needs more than indices (padding): not judged
        return False


def _dense_mask(base):
    """transformers' mask interface `base` (the model's own eager or sdpa mask), with the packed
    batch's sample boundaries added: a query sees keys of its own sample only."""

    def hasten_dense_mask(*args, mask_function=None, **kwargs: Any):
        state = _current_forward()
        if state is None or state.sample_ids is None:
            return base(*args, mask_function=mask_function, **kwargs)
        q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
        rows, length = state.sample_ids.shape
        if q_length != length or kv_length != length:
            raise PackedBatchRefused(f"hasten: a mask of {q_length} x {kv_length} for a packed batch of rows of "
                                     f"{length} tokens; train this model with padded batches "
                                     "(training.packed_sequence: false)")
        sample_ids = state.sample_ids

        def same_sample(batch_idx, head_idx, q_idx, kv_idx):
            return sample_ids[batch_idx, q_idx] == sample_ids[batch_idx, kv_idx]

        kwargs["allow_is_causal_skip"] = False  # sdpa would otherwise return None for "plain causal"
        mask = base(*args, mask_function=masking_utils.and_masks(mask_function, same_sample), **kwargs)
        if isinstance(mask, torch.Tensor):  # read by _every_key_indexer, on the mask's root (its slices reach it)
            setattr(_storage_root(mask), _LONGEST, state.longest)
        state.masks.append(mask)
        state.mask_functions.append(mask_function)
        return mask

    return hasten_dense_mask


def _skipping_packed_search(find_packed_sequence_indices: Callable) -> Callable:
    """transformers' mask preparation looks for packed rows in position_ids and ends with a
    Python-level `.all()` on a device tensor: a host sync in every forward, for a result hasten_mask
    throws away (packed batches carry no attention_mask; attention reads cu_seqlens). The wrapper
    skips that search inside a forward that hasten prepared as packed and runs
    `find_packed_sequence_indices` (transformers' own, or whatever was there) everywhere else."""

    def _find_packed_sequence_indices_unless_hasten(position_ids: torch.Tensor) -> torch.Tensor | None:
        state = _current_forward()
        if state is not None and state.hasten_packed:
            return None
        return find_packed_sequence_indices(position_ids)

    return _find_packed_sequence_indices_unless_hasten


def _leave_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    stack = _forward_stack()
    state = stack.pop() if stack else None
    if state is not None and state.linear is not None and output is not None:
        meta, expected = state.linear
        if meta.calls < expected:  # a stateful layer ran without the batch's boundaries: its samples mixed
            raise PackedBatchRefused(
                f"hasten: in this packed batch only {meta.calls} of the {expected} convolution and linear-attention "
                f"calls of {type(module).__name__}'s stateful layers received the batch's sample boundaries (this "
                "transformers version's layers do not pass them along), so the others carried state from one packed "
                "sample into the next. The step's loss is wrong and no gradient was computed: train with padded "
                "batches (hasten train: training.packed_sequence: false) or a transformers version whose layers "
                "pass their keyword arguments to these functions.")


_ABSENT = object()  # a registry key that did not exist before hasten registered it


class _Registrations:
    """hasten's names in transformers' process-wide registries (AttentionInterface,
    AttentionMaskInterface, ExpertsInterface) and its wrapper of
    masking_utils.find_packed_sequence_indices.

    Models find their attention, mask and experts functions by name in these registries at every
    forward, so the names must stay while any accelerated model is live. Installed when the first
    user arrives (an accelerate() handle, a `registered()` block), counted, and restored when the
    last one leaves: each key to the value it had before (or removed, if it had none), the masking
    function to the very object that was there. A key or function that someone else replaced
    after hasten is left to them."""

    def __init__(self) -> None:
        # reentrant: a model's finalizer (hold_for) can run inside a garbage collection that an
        # allocation in acquire() or release() started
        self._lock = threading.RLock()
        self._users = 0
        self._restore: list[Callable[[], None]] = []

    @property
    def users(self) -> int:
        return self._users

    def hold_for(self, model: torch.nn.Module) -> Callable[[], None]:
        """Acquire for one accelerated model. The returned function releases, once: the handle's
        undo() calls it, and so does the model's garbage collection if it comes first (a model
        whose handle was dropped without undo() still names hasten's functions while it lives,
        and nothing needs them after it)."""
        self.acquire()
        finalizer = weakref.finalize(model, self.release)
        finalizer.atexit = False  # nothing to restore in a process that is ending
        return finalizer

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1

    def release(self) -> None:
        with self._lock:
            if self._users == 0:
                raise RuntimeError("hasten: transformers registrations released more often than acquired")
            self._users -= 1
            if self._users == 0:
                while self._restore:
                    self._restore.pop()()

    def _install(self) -> None:
        from hasten.moe import fused_experts_forward  # runs hasten's MoE ops: imported when registered

        try:
            self._register(AttentionInterface, ATTN_NAME, hasten_attention_forward)
            self._register(AttentionMaskInterface, ATTN_NAME, hasten_mask)
            for implementation, name in DENSE_NAMES.items():
                own_mask = ALL_MASK_ATTENTION_FUNCTIONS[implementation]
                self._register(AttentionInterface, name, hasten_dense_attention_forward)
                self._register(AttentionMaskInterface, name, _dense_mask(own_mask))
            self._register(type(ALL_EXPERTS_FUNCTIONS), EXPERTS_NAME, fused_experts_forward)
            self._wrap_packed_search()
        except BaseException:
            while self._restore:
                self._restore.pop()()
            raise

    def _register(self, interface: type, key: str, value: Callable) -> None:
        # transformers' GeneralInterface keeps registrations in a class-level dict and has no
        # unregister: restoring writes that dict back.
        mapping = interface._global_mapping
        previous = mapping.get(key, _ABSENT)
        interface.register(key, value)

        def restore() -> None:
            if mapping.get(key) is not value:  # someone registered over hasten since: theirs stays
                return
            if previous is _ABSENT:
                del mapping[key]
            else:
                mapping[key] = previous

        self._restore.append(restore)

    def _wrap_packed_search(self) -> None:
        original = masking_utils.find_packed_sequence_indices
        wrapper = _skipping_packed_search(original)
        masking_utils.find_packed_sequence_indices = wrapper

        def restore() -> None:
            # replaced again since (another library's wrapper calling hasten's): leave it; outside a
            # hasten forward hasten's wrapper only calls the original
            if masking_utils.find_packed_sequence_indices is wrapper:
                masking_utils.find_packed_sequence_indices = original

        self._restore.append(restore)


_REGISTRATIONS = _Registrations()


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """hasten's names registered with transformers for the block, for code that selects them
    itself without accelerate(), e.g. `config._experts_implementation = "hasten_fused"` on a bare
    MoE block (benchmarks/moe_block.py). accelerate() holds them until its handle is undone (or
    its model is garbage-collected)."""
    _REGISTRATIONS.acquire()
    try:
        yield
    finally:
        _REGISTRATIONS.release()


class PackedBatchRefused(PackingError):
    """A packed batch reached a model whose layers cannot keep packed samples apart."""


def _refuse_images_in_a_packed_batch(bound: dict, what: str) -> None:
    """A packed batch of a multimodal model must be text only: image tokens attend to each other
    both ways, which hasten's causal varlen attention does not compute."""
    # pixel_values*: images and videos; Gemma 4 also takes encoder outputs and audio features, and
    # marks its media tokens in mm_token_type_ids
    media = any(value is not None for name, value in bound.items()
                if name.startswith("pixel_values") or name in ("mm_encoder_outputs", "input_features"))
    marked = any(isinstance(bound.get(name), torch.Tensor) and bool((bound[name] != 0).any())  # once per forward
                 for name in ("token_type_ids", "mm_token_type_ids"))
    images = media or marked
    if images:
        raise PackedBatchRefused(f"hasten: a packed batch with images or other media (pixel_values*, media tokens "
                                 f"marked in token_type_ids or mm_token_type_ids, encoder outputs, audio features); "
                                 f"{what}")


def _refuse_a_marked_prefix(bound: dict) -> None:
    """A prefix-LM model (the config's `prefix_lm`: HRM-Text) lets the tokens its token_type_ids mark
    attend to each other both ways: a mask overlay that depends on the tokens, which hasten's varlen
    attention does not compute (its reading of the mask samples rows of the first batch row only)."""
    marked = bound.get("token_type_ids")
    if isinstance(marked, torch.Tensor) and bool((marked != 0).any()):  # once per forward, only when given
        raise MaskNotSupported("hasten: token_type_ids mark a bidirectional prefix (the model's prefix_lm), which "
                               "hasten's varlen attention does not compute, packed or not. Train prefix-LM batches "
                               "with training.packed_sequence: false (transformers' attention), or leave "
                               "token_type_ids out (causal throughout, as the model computes without them)")


class _PackingPreHook:
    """Once per forward, before the model runs: what a packed batch needs, by who runs attention.

    mode "hasten": hasten's varlen attention. Packing metadata from position_ids (once, shared by
        every layer) when the batch has none; transformers' own packed-row search is skipped.
    mode "dense": the model's own attention (a feature hasten's kernels do not compute), with a
        mask hasten builds from the batch's sample boundaries (`hasten_dense_mask`), checked at
        every attention call. Correct for any model whose masks go through transformers'
        masking_utils; a dense mask per row, so slower than the varlen path.
    mode "refuse": a layer would carry state from one packed sample into the next (or nothing
        keeps samples apart); a packed batch raises PackedBatchRefused naming `refusal`.
    A packed batch never builds a KV cache (transformers would, and hold every layer's K/V)."""

    def __init__(self, model: PreTrainedModel, settings: _AttentionSettings | None, mode: str,
                 refusal: str | None = None, images: str = "", stateful_calls: int = 0) -> None:
        self.settings, self.mode, self.refusal = settings, mode, refusal
        self.stateful_calls = stateful_calls  # a hybrid model: its stateful layers' calls per forward
        self.images = images  # a multimodal table entry's `vision`: packed batches with images are refused
        self.row_limits = packed_row_limits(model)  # lengths past which the model's own code mixes samples
        self.prefix_lm = bool(getattr(text_config(model), "prefix_lm", False))  # token_type_ids: a two-way prefix
        self.chunk = attention_chunk_size(model)  # Llama 4: its chunks built with the batch's metadata
        self.signature = inspect.signature(model.forward)
        self.var_keyword = next((p.name for p in self.signature.parameters.values()
                                 if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        bound = dict(self.signature.bind_partial(*args, **kwargs).arguments)
        bound.update(bound.pop(self.var_keyword, None) or {})
        return bound

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        state = _ForwardState()
        _forward_stack().append(state)  # popped by _leave_forward
        return self._prepare(args, kwargs, state)

    def _prepare(self, args: tuple, kwargs: dict, state: _ForwardState):
        bound = self._arguments(args, kwargs)
        # generation with a cache: leave it alone (transformers >= 5.24 names it `cache`)
        if bound.get("past_key_values") is not None or bound.get("cache") is not None:
            return None
        if self.prefix_lm and self.mode == "hasten":
            _refuse_a_marked_prefix(bound)
        cu_seqlens = bound.get(CU_Q)
        position_ids = bound.get("position_ids")
        mask = bound.get("attention_mask")
        # position_ids alone describe a packed (or plain) batch; with a padding mask the batch is a
        # padded one, which the attention function serves through its (reported) fallback.
        packed_by_position = cu_seqlens is None and position_ids is not None and mask is None
        if self.mode == "refuse":
            self._refuse_if_packed(bound, cu_seqlens, position_ids if packed_by_position else None)
            return None
        if cu_seqlens is None and not packed_by_position:
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
        if self.mode == "hasten":
            if self.images:
                _refuse_images_in_a_packed_batch(bound, self.images)
            state.hasten_packed = True
            if cu_seqlens is None and self.settings.metadata_cache:
                kwargs.update(PackedMeta.from_position_ids(position_ids).attention_kwargs())
            if self.chunk and kwargs.get(CU_Q) is not None:  # once per batch, for every layer and its recompute
                kwargs[CHUNK_CU], kwargs[CHUNK_MAX] = chunk_boundaries(kwargs[CU_Q], int(kwargs[MAX_Q]),
                                                                       position_ids.numel(), self.chunk)
            if self.stateful_calls:  # once per batch, for every stateful layer and its recompute
                cu = kwargs.get(CU_Q)
                cu = cu if cu is not None else PackedMeta.from_position_ids(position_ids).cu_seqlens
                kwargs[LINEAR_META] = LinearMeta.build(cu, position_ids.numel())
                state.linear = (kwargs[LINEAR_META], self.stateful_calls)
        else:  # dense: every token's sample, row by row (a sample never spans rows)
            state.sample_ids = _sample_ids(bound.get("seq_idx"), position_ids)
            longest = kwargs.get(MAX_Q, bound.get(MAX_Q))
            state.longest = longest if isinstance(longest, int) else None
        for limit, bounds, why in self.row_limits:
            self._refuse_past(limit, bounds, why, kwargs, cu_seqlens, position_ids)
        if bound.get("use_cache") is not False:
            args, kwargs = _without(args, kwargs, "use_cache", self.signature)
            kwargs["use_cache"] = False
        return args, kwargs

    @staticmethod
    def _refuse_past(limit: int, bounds: str, why: str, kwargs: dict, cu_seqlens, position_ids) -> None:
        """Refuse a packed row of several samples whose length ("row") or longest sample ("sample")
        is past `limit`."""
        if bounds == "row":
            length = position_ids.shape[-1]  # a host-side shape: no sync for rows within the limit
        else:
            longest = kwargs.get(MAX_Q)
            length = int(longest) if isinstance(longest, int) else PackedMeta.from_position_ids(position_ids).max_seqlen
        if length <= limit:
            return
        cu_seqlens = kwargs.get(CU_Q, cu_seqlens)
        rows = position_ids.shape[0] if position_ids.dim() > 1 else 1
        samples = cu_seqlens.numel() - 1 if cu_seqlens is not None else PackedMeta.from_position_ids(position_ids).num_seqs
        if samples > rows:
            what = f"a packed row of {position_ids.shape[-1]} tokens" if bounds == "row" else \
                f"a packed batch whose longest sample has {length} tokens"
            fix = (f"Pack rows of at most {limit} tokens (hasten train: training.max_tokens; "
                   f"hasten.PackingCollator(max_tokens=...))" if bounds == "row" else
                   f"Keep every sample to at most {limit} tokens (hasten train cuts samples to training.max_tokens)")
            raise PackedBatchRefused(f"hasten: {what} ({samples} samples in {rows} row(s)): {why}, so its samples would "
                                     f"compute otherwise than alone. {fix}, or pack one sample per row.")

    def _refuse_if_packed(self, bound: dict, cu_seqlens, position_ids) -> None:
        rows = next((x.shape[0] for x in (bound.get("input_ids"), bound.get("inputs_embeds"))
                     if isinstance(x, torch.Tensor)), 1)
        if cu_seqlens is not None:
            samples = cu_seqlens.numel() - 1  # host-side shape, no sync
        elif position_ids is not None:
            samples = PackedMeta.from_position_ids(position_ids).num_seqs  # one read-back; this model is not fast-pathed
        else:
            return
        if samples > rows:
            raise PackedBatchRefused(
                f"hasten: a packed batch ({samples} samples in {rows} row(s)) reached a model that cannot keep packed "
                f"samples apart: {self.refusal}. Train it with padded batches (hasten train: training.packed_sequence: "
                "false; in your own script: one sample per row with an attention_mask), or pack one sample per row.")


def _sample_ids(seq_idx: torch.Tensor | None, position_ids: torch.Tensor) -> torch.Tensor:
    """(rows, L) index of each token's sample: the collator's `seq_idx`, else derived from
    position_ids (PackedMeta, one read-back)."""
    rows, length = position_ids.shape[0], position_ids.shape[-1]
    if seq_idx is None:
        seq_idx = PackedMeta.from_position_ids(position_ids).seq_idx
    return seq_idx.to(position_ids.device).view(rows, length).long()


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
    """What `accelerate` changed on one model; `undo()` restores it.

    active / inactive: one line per piece (attention, packing, norm, MLP, rotary, loss, experts,
    memory), the inactive ones with the feature or setting that stopped them. packing_refusal:
    why packed batches are refused for this model (None: they are kept apart correctly)."""

    model: PreTrainedModel
    config: Config
    active: list[str] = field(default_factory=list)
    inactive: list[str] = field(default_factory=list)
    moe_stats: MoeLoadStats | None = None
    offload: OffloadManager | None = None
    packing_refusal: str | None = None
    _undo_steps: list = field(default_factory=list)

    def undo(self) -> None:
        """Reverse every patch, last applied first; a second call does nothing. The last live
        handle's undo also restores transformers' registries (`_Registrations`)."""
        while self._undo_steps:
            self._undo_steps.pop()()

    def report(self) -> str:
        lines = ["hasten active: " + (", ".join(self.active) or "nothing")]
        lines += [f"hasten not active: {item}" for item in self.inactive]
        return "\n".join(lines)


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    # transformers' use_experts_implementation decorator marks experts modules with these flags
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_concatenated")]


def _text_config_key(model: PreTrainedModel) -> str:
    """The sub-config name of a multimodal model's text config (Gemma 3: "text_config")."""
    text = text_config(model)
    for key in getattr(model.config, "sub_configs", {}) or {}:
        if getattr(model.config, key, None) is text:
            return key
    raise NotImplementedError(f"{type(model).__name__}: no sub-config holds its text config")


def _language_model(model: PreTrainedModel) -> torch.nn.Module:
    """The text model inside a multimodal model: the submodule built from its text config."""
    text = text_config(model)
    for module in model.modules():
        if module is not model and isinstance(module, PreTrainedModel) and module.config is text:
            return module
    raise NotImplementedError(f"{type(model).__name__}: no submodule is built from its text config")


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    # transformers' attention modules carry their layer index or causality; tagging a module that
    # never calls attention is harmless, and a call from an untagged one raises
    return [m for m in model.modules() if hasattr(m, "is_causal") or hasattr(m, "layer_idx")]


def _install_packing_hook(model: PreTrainedModel, handle: AccelerationHandle, hook: _PackingPreHook) -> None:
    pre = model.register_forward_pre_hook(hook, with_kwargs=True)
    leave = model.register_forward_hook(_leave_forward, with_kwargs=True, always_call=True)

    def undo() -> None:
        pre.remove()
        leave.remove()

    handle._undo_steps.append(undo)


def _refuse_packing(model: PreTrainedModel, handle: AccelerationHandle, refusal: str, key: str) -> None:
    handle.packing_refusal = refusal
    _install_packing_hook(model, handle, _PackingPreHook(model, None, "refuse", refusal))
    record_fallback(key, f"packed batches are refused for this model: {refusal}; padded batches run as transformers "
                    "wrote the model")
    handle.inactive.append(f"varlen attention and packed batches ({refusal}; padded batches are correct)")


def _patch_stateful(model: PreTrainedModel, handle: AccelerationHandle) -> int:
    """Install the varlen stateful functions; returns the calls one forward makes to them (every
    stateful layer calls each of its functions once)."""
    layers = stateful_patch.stateful_modules(model, spec_for(model.config).stateful)
    handle._undo_steps.append(stateful_patch.install(model, layers))
    kinds = sorted({type(module).__name__ for module, _ in layers})
    on_cuda = any(p.is_cuda for p in model.parameters())
    handle.active.append(f"varlen stateful layers ({len(layers)} {', '.join(kinds)}: each packed sample from a zero "
                         "state; " + ("flash-linear-attention's varlen kernels)" if on_cuda else
                                      "the model's own functions once per sample off CUDA)"))
    return sum(len(functions) for _, functions in layers)


def _patch_attention(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    training = config.training
    model_type = getattr(model.config, "model_type", "?")
    stateful = stateful_layers(model)
    if stateful:  # whatever the config says: a packed batch from the user's own script is refused too
        refusal = stateful_refusal(model, stateful)
        if refusal is not None or not training.packed_sequence:
            _refuse_packing(model, handle, refusal or f"its {', '.join(stateful)} carry state along the sequence "
                            "and training.packed_sequence is false", "packing_refused_stateful_layers")
            return
    if not training.packed_sequence:
        handle.inactive.append("training.packed_sequence is false: attention left as transformers configured it")
        return
    positions = positions_from_tokens(model)
    if positions is not None:
        _refuse_packing(model, handle, positions, "packing_refused_token_positions")
        return
    if not uses_attention_interface(model, spec_for(model.config)):
        _refuse_packing(model, handle, f"model type '{model_type}' does not use transformers' attention interface, "
                        "so neither hasten nor transformers keeps packed samples apart", "unsupported_architecture")
        return
    missing = attention_features_missing(model)  # a multimodal entry packs text only (its `vision`)
    spec = spec_for(model.config)
    vision = spec.vision if spec is not None else ""
    if missing:
        _patch_dense_packing(model, handle, missing)
        return
    settings = _AttentionSettings(training.metadata_cache, config.attention.backend, config.attention.gqa,
                                  config.attention.verify, backend_facts())
    for device in {p.device for p in model.parameters()}:
        prepare_device(settings.facts, device, config.attention.gqa)
    text_key = _text_config_key(model) if vision else None
    # a multimodal model: hasten's attention in its text model only; the vision tower keeps its own
    tagged = _attention_modules(_language_model(model) if vision else model)
    for module in tagged:
        setattr(module, _TAG, settings)
    previous = model.config._attn_implementation
    previous_text = text_config(model)._attn_implementation
    model.set_attn_implementation({text_key: ATTN_NAME} if text_key else ATTN_NAME)
    stateful_calls = _patch_stateful(model, handle) if stateful else 0
    _install_packing_hook(model, handle, _PackingPreHook(model, settings, "hasten", images=vision,
                                                         stateful_calls=stateful_calls))

    def undo() -> None:
        for module in tagged:
            module.__dict__.pop(_TAG, None)
        model.set_attn_implementation({text_key: previous_text or "sdpa"} if text_key else previous or "sdpa")

    handle._undo_steps.append(undo)
    handle.active.append("varlen attention (packed sequences, no mask)")
    if spec is not None and spec.attention_interface and not spec.attention_kwargs_reach:  # metadata does not reach
        handle.active.append("metadata derived per layer (the model's decoder layers pass its attention "
                             "position_ids only)")
    else:
        handle.active.append("metadata cache (once per batch)" if training.metadata_cache
                             else "metadata derived per layer (training.metadata_cache is false)")


def _patch_dense_packing(model: PreTrainedModel, handle: AccelerationHandle, missing: dict[str, str]) -> None:
    """Attention stays the model's own (it has the `missing` features); packed rows get hasten's mask."""
    model_type = getattr(model.config, "model_type", "?")
    implementation = model.config._attn_implementation
    features = "; ".join(missing.values())
    chunk = attention_chunk_size(model)
    if chunk or implementation not in DENSE_NAMES:
        why = (f"its chunked attention (attention_chunk_size={chunk}) would count its chunks along the packed row"
               if chunk
               else f"its attention implementation '{implementation}' does not take hasten's packed mask")
        _refuse_packing(model, handle, f"its attention has {features}, which hasten's kernels do not compute, and "
                        f"{why}", "attention_feature_not_implemented")
        return
    originals = {}
    for module in _attention_modules(model):
        if implementation == "sdpa":
            originals[module] = sdpa_attention_forward
        elif (own := getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)) is not None:
            originals[module] = own  # the modeling file's own eager attention (sinks, softcap...)
    if not originals:
        _refuse_packing(model, handle, f"its attention has {features}, which hasten's kernels do not compute, and "
                        "hasten found no eager attention function to run it with", "attention_feature_not_implemented")
        return
    for module, original in originals.items():
        setattr(module, _DENSE_TAG, original)
    topk = getattr(text_config(model), "index_topk", None)
    indexers = [module.indexer for module in originals if isinstance(getattr(module, "indexer", None), torch.nn.Module)
                and merges_topk_selection(module)] if isinstance(topk, int) and topk > 0 else []
    for indexer in indexers:
        replace_forward(indexer, _every_key_indexer(indexer, topk))
    model.set_attn_implementation(DENSE_NAMES[implementation])
    _install_packing_hook(model, handle, _PackingPreHook(model, None, "dense"))

    def undo() -> None:
        for module in originals:
            module.__dict__.pop(_DENSE_TAG, None)
        for indexer in indexers:
            restore_forward(indexer)
        model.set_attn_implementation(implementation)

    handle._undo_steps.append(undo)
    record_fallback("attention_feature_not_implemented", f"model type '{model_type}': its attention has {features}, "
                    f"which hasten's varlen attention does not compute; the model's own '{implementation}' attention "
                    "runs, and hasten keeps packed samples apart with a block-diagonal mask per row (correct; slower "
                    "than varlen)")
    handle.inactive.append(f"varlen attention ({features}: the model's own '{implementation}' attention runs; packed "
                           "rows kept apart by hasten's block-diagonal mask)")


def _experts_implementations(model: torch.nn.Module) -> list[tuple[object, str, object]]:
    """(config, attribute, value) of the experts implementation each distinct config of `model`
    holds (transformers keeps it in `_experts_implementation_internal` behind a property; earlier
    releases in `_experts_implementation` itself)."""
    found, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "_experts_implementation"):
            continue
        seen.add(id(config))
        attribute = ("_experts_implementation_internal" if "_experts_implementation_internal" in vars(config)
                     else "_experts_implementation")
        found.append((config, attribute, vars(config).get(attribute)))
    return found


def _patch_moe(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    experts = _experts_modules(model)
    spec = spec_for(model.config)
    if not experts and spec is not None and spec.moe_block:
        if config.training.moe.fused_grouping:
            _patch_moe_blocks(model, spec.moe_block, handle)
        else:
            handle.inactive.append("training.moe.fused_grouping is false: the MoE blocks run as transformers wrote them")
        return
    if not experts:
        if spec is not None and spec.family == "moe" and spec.experts:
            # experts outside transformers' experts interface, named by the table entry (JetMoE, DBRX)
            handle.inactive.append(f"fused MoE experts (the model's own: {spec.experts})")
        elif config.training.moe.fused_grouping:
            handle.inactive.append("training.moe.fused_grouping (this model has no MoE experts)")
        return
    if not config.training.moe.fused_grouping:
        handle.inactive.append("training.moe.fused_grouping is false: experts left as transformers configured them")
        return
    from hasten.moe import MoeLoadStats, unsupported_reason
    from hasten.moe.experts import (clamped_bias_mismatch, clamped_gate_mismatch, describe, gate_kernel,
                                     uses_fused_swiglu)

    reasons = {reason for m in experts if (reason := unsupported_reason(m)) is not None}
    kernels = ("moe_group", "moe_permute", "moe_combine", "swiglu") + (
        ("moe_weighted_swiglu",) if config.training.moe.weights_in_gate else ())
    if (no_kernels := _cuda_kernels_missing(model, *kernels)) is not None:
        reasons.add(no_kernels)
    if reasons:
        record_fallback("moe_unsupported_experts", "the fused MoE path cannot run these experts ("
                        + "; ".join(sorted(reasons)) + "); transformers' experts implementation is used")
        handle.inactive.append("fused MoE experts (" + "; ".join(sorted(reasons)) + ")")
        return
    previous = model.config._experts_implementation
    # each config's own choice, to restore as it was: set_experts_implementation writes one value into
    # all of them, and a wrapper's and its text model's can differ (Kimi-K2.5's: eager and grouped_mm)
    previous_by_config = _experts_implementations(model)
    model.set_experts_implementation(EXPERTS_NAME)
    stats = MoeLoadStats()
    gate_checks: dict[tuple, str | None] = {}  # one check per class, alpha, limit, device and width

    def clamped_ok(m) -> bool:
        key = (type(m), getattr(m, "alpha", None), getattr(m, "limit", None), m.gate_up_proj.device,
               tuple(m.gate_up_proj.shape[-2:]))
        if key not in gate_checks:
            gate_checks[key] = clamped_gate_mismatch(m)
            if gate_checks[key] is not None and hasattr(m, "alpha") and hasattr(m, "limit"):
                # a gpt-oss-like gate that hasten's kernel does not reproduce here: loud and counted
                record_fallback("moe_clamped_gate", f"{gate_checks[key]}; the model's own gate runs")
                handle.inactive.append(f"fused clamped SwiGLU ({gate_checks[key]}; the model's own gate runs)")
        return gate_checks[key] is None

    bias_checks: dict[tuple, str | None] = {}

    def fused_bias_ok(m) -> bool:
        key = (type(m), getattr(m, "alpha", None), getattr(m, "limit", None), m.gate_up_proj.device,
               m.gate_up_proj.dtype, tuple(m.gate_up_proj.shape[-2:]))
        if key not in bias_checks:
            bias_checks[key] = clamped_bias_mismatch(m)
            if bias_checks[key] is not None:  # the biases are then added apart, as before: correct, slower
                record_fallback("moe_clamped_gate_bias", f"{bias_checks[key]}; the biases are added apart")
        return bias_checks[key] is None

    for m in experts:
        m._hasten_moe_stats = stats
        # read per forward: a string, not a check to trace. gpt-oss's clamped gate takes hasten's kernel
        # only where the class's own _apply_gate computes it exactly (checked once per class here)
        m._hasten_gate = gate_kernel(m, checked=not uses_fused_swiglu(m) and clamped_ok(m))
        if m._hasten_gate == "clamped_swiglu" and getattr(m, "has_bias", False):
            m._hasten_fused_bias = fused_bias_ok(m)
        m._hasten_weights_in_gate = config.training.moe.weights_in_gate
        stats.track(m, m.num_experts, m.gate_up_proj.device)

    def undo() -> None:
        stats.untrack()
        for m in experts:
            m.__dict__.pop("_hasten_moe_stats", None)
            m.__dict__.pop("_hasten_gate", None)
            m.__dict__.pop("_hasten_fused_bias", None)
            m.__dict__.pop("_hasten_weights_in_gate", None)
        model.set_experts_implementation(previous or "eager")
        for config, attribute, value in previous_by_config:
            setattr(config, attribute, value)

    handle._undo_steps.append(undo)
    handle.moe_stats = stats
    handle.active.append(f"fused MoE experts ({len(experts)} layers: {describe(experts[0])})")


def _patch_routers(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    """training.moe.fused_router: the routers of the table's recipe on hasten::moe_route, each
    router class checked against its own forward first (hasten.moe.router)."""
    from hasten.moe.router import find_routers, install_fused_routers

    routers = find_routers(model)
    if not routers:
        return
    spec = spec_for(model.config)
    if not config.training.moe.fused_router:
        handle.inactive.append("training.moe.fused_router is false: the MoE routers run as the model wrote them")
        return
    if spec is None or spec.router is None:
        handle.inactive.append("fused MoE routers (the model table has no router recipe for this model type: the "
                               "routers run as the model wrote them)")
        return
    if (no_kernels := _cuda_kernels_missing(model, "moe_route")) is not None:
        reasons = [no_kernels]
        undo, count = (lambda: None), 0
    else:
        undo, count, reasons = install_fused_routers(routers, spec.router)
    if reasons:
        record_fallback("moe_router", "MoE routers left to the model (" + "; ".join(reasons) + ")")
        handle.inactive.append(f"fused MoE routers for {len(routers) - count} of {len(routers)} layers ("
                               + "; ".join(reasons) + ")")
    if count:
        handle._undo_steps.append(undo)
        handle.active.append(f"fused MoE routers ({count} layers: the model's logits, then {spec.router.describe()} "
                             "in hasten::moe_route)")


def _patch_moe_blocks(model: PreTrainedModel, kind: str, handle: AccelerationHandle) -> None:
    """The table's MoE block adapter (`ArchSpec.moe_block`), for experts outside transformers'
    experts interface: each block's forward on hasten's grouping path, checked first."""
    from hasten.moe.blocks import install_llama4_blocks

    installers = {"llama4": (install_llama4_blocks, "one-kernel grouping on the router's top-k, the inputs scaled by "
                                                    "its scores, grouped GEMM, fused SwiGLU, unweighted combine")}
    install, what = installers[kind]
    reason = _cuda_kernels_missing(model, "moe_group", "moe_permute", "moe_combine", "swiglu")
    undo, count, refused = (lambda: None), 0, ([reason] if reason else [])
    if reason is None:
        undo, count, refused, stats = install(model)
    if refused or not count:
        why = "; ".join(refused) or "no such MoE blocks in this model"
        record_fallback("moe_unsupported_experts", f"the fused MoE block path cannot run these blocks ({why}); the "
                        "model's own MoE blocks run")
        handle.inactive.append(f"fused MoE experts ({why})")
        return
    handle._undo_steps.append(undo)
    handle.moe_stats = stats
    handle.active.append(f"fused MoE experts ({count} layers: {what})")


def _model_device(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _cuda_kernels_missing(model: PreTrainedModel, *ops: str) -> str | None:
    """Why hasten's ops cannot run this (CUDA) model: a build without CUDA kernels (no nvcc at
    install time) has CPU implementations only. None when they can run."""
    from hasten.ops import has_cuda_kernel

    if _model_device(model).type != "cuda":
        return None
    missing = [op for op in ops if not has_cuda_kernel(op)]
    if not missing:
        return None
    return (f"hasten was built without CUDA kernels for {', '.join(missing)} (no nvcc when it was installed); "
            "rebuild with the CUDA toolkit on PATH: make install")


def _patch_memory(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    """Checkpointing first, then offload: with activations full the offload wraps each layer's
    checkpoint to send its input to the host (config validation refuses offload with selective)."""
    checkpoint = config.training.checkpoint
    policy = checkpoint.activations
    checkpointed = False
    if policy != "none":
        from hasten.memory import apply_activation_checkpointing

        try:
            handle._undo_steps.append(apply_activation_checkpointing(model, policy))
            checkpointed = policy == "full"
            handle.active.append(f"activation checkpointing ({policy}, per decoder layer)")
        except ValueError as exc:
            record_fallback("activation_checkpointing", f"training.checkpoint.activations={policy} cannot be "
                            f"applied ({exc}); activations are kept")
            handle.inactive.append(f"activation checkpointing ({exc})")
    if checkpoint.offload_mode() != "none":
        _patch_offload(model, config, handle, checkpointed=checkpointed)


def _patch_mlp_tiling(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    tile_tokens = config.training.checkpoint.mlp_tile_tokens
    if not tile_tokens:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        reason = ("training.checkpoint.mlp_tile_tokens is single-process only for now (the tiled MLP's "
                  "gradients under DDP and FSDP2 are not verified); the MLPs run untiled")
        record_fallback("mlp_tiling", reason)
        handle.inactive.append(f"MLP sequence tiling ({reason})")
        return
    from hasten.memory.tiling import install_mlp_tiling

    undo, count, refused = install_mlp_tiling(model, tile_tokens)
    handle._undo_steps.append(undo)
    if count:
        handle.active.append(f"MLP sequence tiling ({tile_tokens} tokens per tile, {count} MLPs)")
    for reason in refused:
        record_fallback("mlp_tiling", f"{reason}; that MLP runs untiled")
        handle.inactive.append(f"MLP sequence tiling ({reason})")


def _patch_offload(model: PreTrainedModel, config: Config, handle: AccelerationHandle, *,
                   checkpointed: bool = False) -> None:
    from hasten.memory.offload import OffloadError, OffloadManager

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
        manager = OffloadManager(model, mode, double_buffer=double_buffer, max_memory_gib=checkpoint.max_memory_gib,
                                 checkpointed=checkpointed)
    except OffloadError as exc:
        record_fallback("activation_offload", f"training.checkpoint offload ({mode}) cannot be applied ({exc}); "
                        "activations stay on the device")
        handle.inactive.append(f"activation offload ({exc})")
        return
    handle.offload = manager
    handle._undo_steps.append(manager.detach)
    buffers = "double-buffered" if double_buffer else "one buffer"
    what = "planned per layer after the first step" if mode == "auto" else "every decoder layer but the last"
    if checkpointed:
        what = f"the checkpointed inputs, {what}"
    handle.active.append(f"activation offload ({mode}: {what}; {buffers}, copy streams)")


def _patch_loss(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    if not config.kernels.fused_cross_entropy:
        handle.inactive.append("fused cross-entropy (kernels.fused_cross_entropy is false)")
        return
    model_type, spec = model_type_of(model.config), spec_for(model.config)
    if spec is None:
        record_fallback("fused_cross_entropy", f"model type '{model_type}' is not in hasten's architecture table; "
                        "transformers' own loss path runs (logits materialised)")
        handle.inactive.append(f"fused cross-entropy (model type '{model_type}' not supported)")
        return
    if (no_kernels := _cuda_kernels_missing(model, "linear_cross_entropy")) is not None:
        record_fallback("fused_cross_entropy", f"{no_kernels}; transformers' own loss path runs")
        handle.inactive.append(f"fused cross-entropy ({no_kernels})")
        return
    text = text_config(model)
    # a logit transform the model's config sets that its table entry does not declare
    declared = spec.logits.accounted_keys()
    missing = [line for key, line in logit_transforms(model).items() if key not in declared]
    if missing:
        reason = "; ".join(missing) + f" (not in the '{model_type}' table entry)"
        record_fallback("fused_cross_entropy", f"{reason}; transformers' own loss path runs (logits materialised)")
        handle.inactive.append(f"fused cross-entropy ({reason})")
        return
    from hasten.loss import FusedLossUnsupported, install_fused_cross_entropy

    try:
        forward_source = inspect.getsource(type(model).forward)
    except (OSError, TypeError) as exc:
        forward_source = None
        if spec.logits.scale_where_forward_names:  # only this release's code says whether the head scales
            reason = (f"{type(model).__name__}.forward's source cannot be read ({exc}), and only it says whether "
                      f"its logits are scaled by {spec.logits.scale_key}")
            record_fallback("fused_cross_entropy", f"{reason}; transformers' own loss path runs (logits materialised)")
            handle.inactive.append(f"fused cross-entropy ({reason})")
            return
    softcap, scale = spec.logits.softcap(text), spec.logits.scale(text, forward_source)
    if forward_source is not None and (reason := _head_code_disagrees(model, spec, softcap, scale, forward_source)):
        record_fallback("fused_cross_entropy", f"{reason}; transformers' own loss path runs (logits materialised)")
        handle.inactive.append(f"fused cross-entropy ({reason})")
        return
    try:
        handle._undo_steps.append(install_fused_cross_entropy(model, softcap=softcap, logit_scale=scale))
    except FusedLossUnsupported as exc:
        record_fallback("fused_cross_entropy", f"{exc}; transformers' own loss path runs (logits materialised)")
        handle.inactive.append(f"fused cross-entropy ({exc})")
        return
    applied = [f"softcap {softcap:g}"] if softcap else []
    applied += [f"logit scale {scale:g}"] if scale != 1.0 else []
    handle.active.append("fused cross-entropy (LM head + loss in chunks, no full logits"
                         + ("".join(f", {item}" for item in applied)) + "; training forwards return logits=None)")


def _head_code_disagrees(model: PreTrainedModel, spec, softcap: float | None, scale: float,
                         forward_source: str) -> str | None:
    """Why the table entry's logit transforms are not what the model's head applies, or None. No
    probe runs the LM head, and releases change what it applies (transformers 5.25's Aya Vision head
    multiplies by logit_scale, 5.24's did not), so the entry is held to the head's own code: each
    transform the config switches on must be applied by the fused loss exactly when the source of
    the model class's forward names its config key."""
    applied = {key for key, on in ((spec.logits.softcap_key, softcap is not None),
                                   (spec.logits.scale_key, scale != 1.0)) if key and on}
    named = {key for key in logit_transforms(model) if key in forward_source}
    if applied == named:
        return None
    import transformers

    head = f"{type(model).__name__}.forward"
    parts = [f"{head} applies {key}, which the table entry does not" for key in sorted(named - applied)]
    parts += [f"the table entry applies {key}, which {head} does not name" for key in sorted(applied - named)]
    return "; ".join(parts) + f" (model type '{model_type_of(model.config)}', transformers {transformers.__version__})"


def patch_lora_layers(model: torch.nn.Module, config: Config, handle: AccelerationHandle) -> None:
    """PEFT's LoRA Linear layers of `model` on hasten::lora_linear (kernels.fused_lora). accelerate()
    runs it; so does hasten train after PEFT adds its adapters (to the accelerated model)."""
    from hasten.lora import install_fused_lora, lora_layers

    if not lora_layers(model):
        return
    if not config.kernels.fused_lora:
        handle.inactive.append("fused LoRA projections (kernels.fused_lora is false: PEFT's layers run)")
        return
    undo, count, grouped, refused = install_fused_lora(model, groups=config.kernels.fused_lora_groups)
    handle._undo_steps.append(undo)
    if count:
        handle.active.append(f"fused LoRA projections ({count} layers: base GEMM and low-rank update in one op, "
                             "no float32 copy of the input)")
    if grouped:
        handle.active.append(f"grouped LoRA projections ({grouped} layers: q/k/v and gate/up each read their "
                             "input once)")
    for reason in refused:
        handle.inactive.append(f"fused LoRA projections ({reason}: PEFT's own forward runs them)")


def _patch_dense_kernels(model: PreTrainedModel, config: Config, handle: AccelerationHandle) -> None:
    kernels = config.kernels
    if not (kernels.rms_norm or kernels.swiglu or kernels.rope):
        return
    model_type, spec = model_type_of(model.config), spec_for(model.config)
    if spec is None:
        reason = f"model type '{model_type}' is not in hasten's architecture table"
        record_fallback("fused_dense_kernels", f"{reason}; transformers' norm, MLP and rotary code run")
        handle.inactive.append(f"fused norm / MLP / RoPE ({reason})")
        return
    gated_op = "swiglu" if spec.mlp.fused_gate_up else {"swiglu": "silu_mul", "geglu_tanh": "gelu_tanh_mul"}.get(
        spec.mlp.kind)
    ops = (("rms_norm",) if spec.norm.kind == "rms" else ()) + ((gated_op,) if gated_op else ()) + ("rope",)
    if (no_kernels := _cuda_kernels_missing(model, *ops)) is not None:
        record_fallback("fused_dense_kernels", f"{no_kernels}; transformers' norm, MLP and rotary code run")
        handle.inactive.append(f"fused norm / MLP / RoPE ({no_kernels})")
        return
    from hasten.dense import install_fused_mlp, install_fused_norms, install_fused_rope

    text = text_config(model)
    # a multimodal wrapper: the text model's pieces (its vision tower keeps its own, as its attention
    # does), and the rotary of the text model's modeling module (Mistral 3's is modeling_mistral's)
    target = _language_model(model) if spec.vision else model
    done = []
    norm_name = {"rms": "RMSNorm", "layer": "LayerNorm"}.get(spec.norm.kind)
    if kernels.rms_norm and norm_name is None:
        handle.inactive.append(f"fused norm (the model's {spec.norm.class_suffix} " + (
            "is torch's own kernel already)" if spec.norm.kind == "torch" else
            "runs its own code: a form hasten's kernels do not take)"))
    elif kernels.rms_norm:
        undo, count, refused = install_fused_norms(target, spec.norm)
        handle._undo_steps.append(undo)
        if count:
            offset = " (weight + 1)" if spec.norm.weight_offset == 1.0 else ""
            done.append(f"{norm_name}{offset} x{count}")
        for reason in refused:
            handle.inactive.append(f"fused {norm_name} ({reason})")
        if not count and not refused:
            handle.inactive.append(f"fused {norm_name} (no {spec.norm.class_suffix} modules with a 1-D weight and "
                                   f"`{spec.norm.eps_attribute}` in this model)")
        if kernels.fused_residual and count and spec.norm.kind == "rms":
            _install_fused_residual(handle, target, done, kernels.fused_residual_grad)
    mlp_name = {"swiglu": "SwiGLU", "geglu_tanh": "GeGLU"}.get(spec.mlp.kind)
    if kernels.swiglu and mlp_name is None:
        handle.inactive.append("fused MLP (an ungated MLP: the model's own activation runs between its projections)"
                               if spec.mlp.kind == "ungated" else
                               "fused MLP (the model's own MLP code runs: a form hasten's kernels do not take)")
    elif kernels.swiglu:
        undo, count, refused = install_fused_mlp(target, spec.mlp, text)
        handle._undo_steps.append(undo)
        if count:
            done.append(f"{mlp_name} MLP{' (fused gate/up)' if spec.mlp.fused_gate_up else ''} x{count}")
        for reason in refused:
            handle.inactive.append(f"fused {mlp_name} ({reason})")
        if not count and not refused:
            handle.inactive.append(f"fused {mlp_name} (no gated MLP modules of the table's layout in this model)")
    if kernels.rope and spec.rotary.own:  # declared in the table: not a fallback
        handle.inactive.append(f"fused RoPE (the model's own rotary code runs: {spec.rotary.note})")
    elif kernels.rope:
        undo, refused = install_fused_rope(target, spec.rotary, text)
        handle._undo_steps.append(undo)
        if refused is None:
            layout = ", ".join(x for x in ("interleaved" if spec.rotary.interleaved else "",
                                           "partial" if spec.rotary.partial else "") if x)
            done.append(f"RoPE ({layout})" if layout else "RoPE")
            if kernels.fused_qk_norm_rope and kernels.rms_norm and spec.norm.kind == "rms":
                _install_fused_qk_norm_rope(handle, target, done)
        else:
            record_fallback("fused_rope", f"{type(model).__module__}: {refused}; transformers' rotary code runs")
            handle.inactive.append(f"fused RoPE ({refused})")
    if done:
        handle.active.append("fused kernels (" + ", ".join(done) + ")")


def _install_fused_qk_norm_rope(handle: AccelerationHandle, model: torch.nn.Module, done: list[str]) -> None:
    """kernels.fused_qk_norm_rope: each attention's head norms with the rotary embedding after them
    (hasten/dense/qk_norm_rope.py), where the norms are ones hasten patched."""
    from hasten.dense.qk_norm_rope import install_fused_qk_norm_rope
    from hasten.dense.residual import NORM_SPEC_ATTRIBUTE

    fused_norms = {id(m) for m in model.modules() if NORM_SPEC_ATTRIBUTE in m.__dict__}
    undo, count, refused = install_fused_qk_norm_rope(model, fused_norms)
    handle._undo_steps.append(undo)
    if count:
        done.append(f"head RMSNorm + RoPE x{count}")
    for reason in refused:
        handle.inactive.append(f"fused head norm + RoPE ({reason})")


def _patch_linear_groups(model: torch.nn.Module, config: Config, handle: AccelerationHandle) -> None:
    """kernels.fused_linear_groups: q/k/v and gate/up of full fine-tuning with one input gradient
    (hasten/dense/linear_group.py)."""
    if not config.kernels.fused_linear_groups:
        return
    from hasten.dense.linear_group import install_linear_groups

    undo, count, refused = install_linear_groups(model)
    handle._undo_steps.append(undo)
    if count:
        handle.active.append(f"shared-input projections with one input gradient (q/k/v, gate/up) x{count}")
    for reason in refused:
        handle.inactive.append(f"shared-input projections ({reason})")


def _install_fused_residual(handle: AccelerationHandle, model: torch.nn.Module, done: list[str],
                            norms_pass_input: bool) -> None:
    """kernels.fused_residual: each decoder layer's residual add with the RMSNorm after it
    (hasten/dense/residual.py), where the norm is one hasten patched; kernels.fused_residual_grad:
    the input norms passing their input through too."""
    from hasten.dense.residual import NORM_SPEC_ATTRIBUTE, install_fused_residual
    from hasten.memory.offload import decoder_layers

    fused_norms = {id(m) for m in model.modules() if NORM_SPEC_ATTRIBUTE in m.__dict__}
    undo, count, passing, refused = install_fused_residual(decoder_layers(model), fused_norms, norms_pass_input)
    handle._undo_steps.append(undo)
    if count:
        done.append(f"residual add + RMSNorm x{count}")
    if passing:
        done.append(f"input RMSNorm passing its input x{passing}")
    for reason in refused:
        handle.inactive.append(f"fused residual add ({reason})")


def accelerate(model: PreTrainedModel, config: Config | None = None) -> AccelerationHandle:
    """Patch a loaded transformers model in place; returns a handle whose `undo()` reverts it."""
    config = config or Config()
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hasten.accelerate expects a transformers PreTrainedModel, got {type(model).__name__}; "
                        "for a PEFT model pass model.get_base_model() or call accelerate before wrapping")
    from hasten.ops._lib import load

    load()  # hasten._C, or an error that names the rebuild, before anything changes
    handle = AccelerationHandle(model, config, inactive=config.inactive_features())
    handle._undo_steps.append(_REGISTRATIONS.hold_for(model))  # first in, so the last undo step
    try:
        _patch_attention(model, config, handle)
        _patch_moe(model, config, handle)
        _patch_routers(model, config, handle)
        _patch_memory(model, config, handle)
        _patch_loss(model, config, handle)
        _patch_dense_kernels(model, config, handle)
        _patch_linear_groups(model, config, handle)
        patch_lora_layers(model, config, handle)
        _patch_mlp_tiling(model, config, handle)  # wraps the MLP forwards the kernel patches set
        handle._undo_steps.append(keep_over_kernelize(model))  # train()/eval() re-kernelize on 5.25
    except BaseException:
        handle.undo()  # a failed accelerate() leaves the model, and the process, as they were
        raise
    model_type = model_type_of(model.config)
    if model_type not in ARCHITECTURES:
        # said once per type: what runs on hasten's kernels and what stays transformers', piece by piece
        record_fallback(f"model_type_not_in_table:{model_type}", f"model type '{model_type}' is not in hasten's "
                        f"tested table ({', '.join(sorted(ARCHITECTURES))}); each piece was checked against what "
                        "hasten's kernels compute.\n  accelerated: " + ("; ".join(handle.active) or "nothing")
                        + "\n  left to transformers: " + ("; ".join(handle.inactive) or "nothing"))
    return handle
