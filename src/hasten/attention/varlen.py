"""Variable-length causal attention over packed tokens, with no padding and no mask.

Layout: q (T, Hq, D), k and v (T, Hkv, D) with Hq a multiple of Hkv; `cu_seqlens`
(N + 1,) int32 marks the N sequences inside the T tokens. Dispatch, best first:

  flash_attn     flash-attn's varlen kernel, when the package is installed
  cudnn          cuDNN's fused attention over ragged sequences (aten._cudnn_attention_forward
                 with cumulative sequence lengths), once a check on this device, dtype, head
                 size and head grouping has matched torch's varlen kernel; no sliding window,
                 no dropout
  torch_varlen   torch.nn.attention.varlen.varlen_attn (torch >= 2.10, CUDA, fp16/bf16;
                 FlashAttention-2)
  per_sequence   scaled_dot_product_attention once per sequence: correct anywhere,
                 slow, and reported through hasten.observability when used because
                 a faster path was not available.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Literal

import torch
import torch.nn.functional as F

from hasten.observability import record_fallback

Backend = Literal["flash_attn", "cudnn", "torch_varlen", "per_sequence"]
GqaMode = Literal["auto", "native", "repeat"]

_FAST_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=None)
def _torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def _flash_attn_fn():
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:
        record_fallback("flash_attn_import", f"flash-attn is installed but failed to import ({exc}); using torch's "
                        "varlen attention instead")
        return None
    return flash_attn_varlen_func


def select_backend(q: torch.Tensor, requested: str = "auto") -> Backend:
    """The fastest backend that can run these inputs; a forced slower one is honoured silently,
    an unavailable fast one is reported once with the reason."""
    if requested == "per_sequence":
        return "per_sequence"
    reason = None
    if q.device.type != "cuda":
        reason = f"varlen attention kernels need a CUDA GPU and the tensors are on {q.device.type}"
    elif q.dtype not in _FAST_DTYPES:
        reason = f"varlen attention kernels take float16/bfloat16 and the model runs in {q.dtype}"
    elif q.shape[-1] > _MAX_HEAD_DIM:
        reason = f"head_dim {q.shape[-1]} is above the kernels' limit of {_MAX_HEAD_DIM}"
    if reason is None:
        if requested in ("auto", "flash_attn") and _flash_attn_fn() is not None:
            return "flash_attn"
        if requested in ("auto", "cudnn") and _cudnn_ragged_available():
            return "cudnn"
        if requested in ("auto", "torch_varlen") and _torch_varlen_fn() is not None:
            return "torch_varlen"
        reason = (f"torch {torch.__version__} has no torch.nn.attention.varlen and flash-attn is not installed "
                  "(upgrade to torch >= 2.10 or install flash-attn)")
    record_fallback("attention_per_sequence", f"packed attention runs one sequence at a time: {reason}. Results "
                    "are correct; speed is not.")
    return "per_sequence"


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # (T, Hkv, D) -> (T, Hkv * groups, D), each K/V head repeated for its query heads.
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


@functools.lru_cache(maxsize=None)
def _torch_varlen_takes_gqa_flag() -> bool:
    fn = _torch_varlen_fn()
    return fn is not None and "enable_gqa" in inspect.signature(fn).parameters


_native_gqa_checked: dict[torch.device, bool] = {}


def _torch_varlen_native_gqa_ok(device: torch.device) -> bool:
    """Once per device: does torch's varlen kernel read fewer K/V heads than Q heads correctly?

    torch 2.11 accepts such K/V without a flag; newer releases take `enable_gqa`. The
    answer is checked against repeated K/V on a small problem, not assumed.
    """
    if device not in _native_gqa_checked:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(40, 4, 64, device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(40, 2, 64, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(40, 2, 64, device=device, dtype=torch.bfloat16, generator=gen)
        cu = torch.tensor([0, 17, 40], device=device, dtype=torch.int32)
        try:
            native = _call_torch_varlen(q, k, v, cu, 23, None, True, (-1, 0))
            repeated = _call_torch_varlen(q, _repeat_kv(k, 2), _repeat_kv(v, 2), cu, 23, None, False, (-1, 0))
            ok = torch.allclose(native.float(), repeated.float(), atol=1e-2, rtol=1e-2)
            detail = "gave a different result from repeated K/V"
        except (RuntimeError, ValueError) as exc:
            ok, detail = False, f"raised {type(exc).__name__}: {exc}"
        if not ok:
            record_fallback("gqa_repeat_kv", f"torch's varlen attention with fewer K/V heads than Q heads {detail}; "
                            "repeating K/V heads instead (more memory traffic)")
        _native_gqa_checked[device] = ok
    return _native_gqa_checked[device]


def _call_torch_varlen(q, k, v, cu, max_seqlen, scale, gqa: bool, window):
    fn = _torch_varlen_fn()
    extra = {"enable_gqa": True} if gqa and _torch_varlen_takes_gqa_flag() else {}
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=window, **extra)


def _per_sequence(q, k, v, cu_seqlens, scale, causal: bool, left_window: int, dropout: float) -> torch.Tensor:
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()  # host sync per call: this path is the fallback
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, _repeat_kv(k, groups), _repeat_kv(v, groups)))
        mask = None
        if causal and left_window >= 0:
            n = end - start
            idx = torch.arange(n, device=q.device)
            dist = idx[:, None] - idx[None, :]
            mask = (dist >= 0) & (dist <= left_window)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout,
                                           is_causal=causal and mask is None, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


@functools.lru_cache(maxsize=None)
def _cudnn_ragged_available() -> bool:
    return (hasattr(torch.ops.aten, "_cudnn_attention_forward") and torch.backends.cudnn.is_available()
            and torch.backends.cuda.cudnn_sdp_enabled())


class _CudnnRaggedAttention(torch.autograd.Function):
    """cuDNN's fused attention over packed sequences. q (T, Hq, D), k and v (T, Hkv, D) with Hkv
    dividing Hq, cu_seqlens (N + 1,) int32. The forward keeps the log-sum-exp (Hq per token) for
    the backward instead of the probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, scale: float | None, causal: bool):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True, 0.0, causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed, offset)
        ctx.max_seqlen, ctx.scale, ctx.causal = max_seqlen, scale, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens, seed, offset = ctx.saved_tensors
        # attn_bias None (an undefined tensor): a defined empty one would be read as a bias
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, seed, offset, None, cu_seqlens, cu_seqlens,
            ctx.max_seqlen, ctx.max_seqlen, 0.0, ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


# (device, dtype, head_dim, grouped K/V) -> cuDNN agreed with torch's varlen kernel there
_cudnn_checked: dict[tuple, bool] = {}


def _cudnn_agrees(q: torch.Tensor, grouped: bool) -> bool:
    """Once per device, dtype, head size and head grouping: do cuDNN's ragged forward and
    backward match torch's varlen kernel on a small packed problem (a one-token sequence
    included)? Checked, not assumed: the ragged path is new in torch and cuDNN versions vary."""
    key = (q.device, q.dtype, q.shape[-1], grouped)
    if key not in _cudnn_checked:
        gen = torch.Generator(device=q.device).manual_seed(0)
        hkv, d = (2 if grouped else 4), q.shape[-1]
        shapes = ((57, 4, d), (57, hkv, d), (57, hkv, d), (57, 4, d))
        q0, k0, v0, grad = (torch.randn(s, device=q.device, dtype=q.dtype, generator=gen) for s in shapes)
        cu = torch.tensor([0, 17, 18, 57], device=q.device, dtype=torch.int32)
        try:
            got = _attention_and_grads(lambda a, b, c: _CudnnRaggedAttention.apply(a, b, c, cu, 39, None, True),
                                       q0, k0, v0, grad)
            want = _attention_and_grads(lambda a, b, c: _call_torch_varlen(
                a, _repeat_kv(b, 4 // hkv), _repeat_kv(c, 4 // hkv), cu, 39, None, False, (-1, 0)),
                q0, k0, v0, grad)
            ok = all(torch.allclose(g.float(), w.float(), atol=2e-2, rtol=2e-2) for g, w in zip(got, want))
            detail = "gave results different from torch's varlen kernel"
        except Exception as exc:  # noqa: BLE001 - any failure of the check means: do not use cuDNN here
            ok, detail = False, f"raised {type(exc).__name__}: {str(exc)[:200]}"
        if not ok:
            what = " with fewer K/V heads than query heads" if grouped else ""
            then = ("K/V heads are repeated for it (more memory traffic)" if grouped
                    else "using torch's varlen kernel (FlashAttention-2) instead")
            record_fallback("attention_cudnn_gqa" if grouped else "attention_cudnn",
                            f"cuDNN's ragged attention{what} {detail} (head_dim {d}, {q.dtype}); {then}")
        _cudnn_checked[key] = ok
    return _cudnn_checked[key]


def _cudnn_plan(q: torch.Tensor, groups: int, gqa: str) -> str | None:
    """How cuDNN runs these heads: "native" (K/V heads as given), "repeat" (K/V repeated to the
    query heads) or None (cuDNN disagreed with the reference on this device)."""
    if groups > 1 and gqa != "repeat" and _cudnn_agrees(q, grouped=True):
        return "native"
    if _cudnn_agrees(q, grouped=False):
        return "repeat" if groups > 1 else "native"
    return None


def _attention_and_grads(fn, q, k, v, grad):
    with torch.enable_grad():  # the check may first run inside no_grad (an evaluation forward)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     *, scale: float | None = None, causal: bool = True, sliding_window: int | None = None,
                     dropout: float = 0.0, backend: str = "auto", gqa: GqaMode = "auto") -> torch.Tensor:
    """Attention of every packed sequence to itself only. Returns (T, Hq, D)."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    # sliding_window W (transformers' meaning): a query sees itself and the W - 1 tokens before it.
    left = sliding_window - 1 if sliding_window is not None else -1
    chosen = select_backend(q, backend)
    groups = q.shape[1] // k.shape[1]
    cudnn_plan = None
    if chosen == "cudnn":
        # cuDNN's ragged path has no sliding window and no dropout; torch's kernel does the window
        cudnn_plan = _cudnn_plan(q, groups, gqa) if left < 0 and dropout == 0.0 else None
        if cudnn_plan is None:
            if backend == "cudnn" and (left >= 0 or dropout > 0.0):
                record_fallback("attention_cudnn_window", "attention.backend cudnn has no sliding window or dropout; "
                                "those layers use torch's varlen kernel")
            chosen = "torch_varlen"
    if dropout > 0.0 and chosen == "torch_varlen":
        record_fallback("attention_dropout", "torch's varlen attention has no dropout; attention dropout "
                        f"{dropout} runs one sequence at a time (install flash-attn for the fast path)")
        chosen = "per_sequence"
    if chosen == "per_sequence":
        return _per_sequence(q, k, v, cu_seqlens, scale, causal, left if causal else -1, dropout)
    if chosen == "cudnn":
        if cudnn_plan == "repeat":
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        return _CudnnRaggedAttention.apply(q, k, v, cu_seqlens, max_seqlen, scale, causal)
    if chosen == "flash_attn":  # reads shared K/V heads natively
        return _flash_attn_fn()(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout,
                                softmax_scale=scale, causal=causal, window_size=(left, 0 if causal else -1))
    window = (left, 0) if causal else (-1, -1)
    native = groups > 1 and gqa != "repeat" and (gqa == "native" or _torch_varlen_native_gqa_ok(q.device))
    if groups > 1 and not native:
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    return _call_torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale, native, window)
