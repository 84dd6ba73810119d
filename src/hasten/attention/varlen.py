"""Variable-length causal attention over packed tokens, with no padding and no mask.

Layout: q (T, Hq, D), k and v (T, Hkv, D) with Hq a multiple of Hkv; `cu_seqlens`
(N + 1,) int32 marks the N sequences inside the T tokens. Dispatch, best first:

  cudnn          hasten::varlen_attention: cuDNN's fused SDPA with ragged offsets (hasten's op,
                 built where the cudnn-frontend headers are, see docs/design.md; cuDNN >= 9.6,
                 bf16/fp16, no sliding window, no dropout).
  flash_attn     flash-attn's varlen kernel, when the package is installed
  torch_varlen   torch.nn.attention.varlen.varlen_attn (torch >= 2.10, CUDA, fp16/bf16)
  per_sequence   scaled_dot_product_attention once per sequence: correct anywhere,
                 slow, and reported through hasten.observability when used because
                 a faster path was not available.

Under torch.compile: the host facts the choice reads (the build's kernels, cuDNN's version,
which libraries import) are read once (`BackendFacts`, at accelerate()), so the choice itself is
Python on a tensor's device, dtype and shape, which dynamo evaluates at trace time and guards.
The per-sequence path needs its boundaries on the host; compiled, it runs as one opaque op
(`hasten_host::per_sequence_attention`, the same loop) so the graph does not break.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from hasten.observability import record_fallback

Backend = Literal["cudnn", "flash_attn", "torch_varlen", "per_sequence"]
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


# ragged attention with fewer K/V heads in the backward and (T, H) softmax statistics
_MIN_CUDNN = 90600


# How to get the cuDNN attention op into a build (doctor gives the same fix).
BUILD_CUDNN_OP = ("pip install --no-deps nvidia-cudnn-frontend, then rebuild: make install "
                  "(or pip install --no-build-isolation -e .)")


@dataclass(frozen=True)
class BackendFacts:
    """What this process can run, read once: each is a host query (the dispatcher's kernel table,
    cuDNN's version, an import) that does not change while the process runs and that torch.compile
    cannot trace. accelerate() reads them into each patched model's attention settings."""

    cudnn_op: bool  # hasten::varlen_attention has its CUDA (cuDNN) kernel in this build
    cudnn_version: int  # 0: no cuDNN
    flash_attn: Callable | None  # flash-attn's varlen function, when it imports
    flash_attn_softcap: bool  # it takes `softcap` (flash-attn >= 2.6)
    torch_varlen: Callable | None  # torch.nn.attention.varlen.varlen_attn, when this torch has it
    torch_varlen_gqa_flag: bool  # varlen_attn takes enable_gqa


@torch.compiler.disable  # host queries: a trace that gets here before any eager call breaks here once
def _read_backend_facts() -> BackendFacts:
    from hasten.ops import has_cuda_kernel

    flash = _flash_attn_fn()
    return BackendFacts(cudnn_op=has_cuda_kernel("varlen_attention"),
                        cudnn_version=torch.backends.cudnn.version() or 0, flash_attn=flash,
                        flash_attn_softcap=flash is not None and "softcap" in inspect.signature(flash).parameters,
                        torch_varlen=_torch_varlen_fn(), torch_varlen_gqa_flag=_torch_varlen_takes_gqa_flag())


_FACTS: BackendFacts | None = None


def backend_facts() -> BackendFacts:
    """The facts, read on the first call (in eager: accelerate() makes that call) and kept for the
    process: a build's kernels, cuDNN's version and the importable libraries do not change."""
    global _FACTS
    if _FACTS is None:
        _FACTS = _read_backend_facts()
    return _FACTS


def prepare_device(facts: BackendFacts, device: torch.device, gqa: str = "auto") -> None:
    """The checks a backend runs once per device (torch varlen's native GQA), run now, before any
    trace: a compiled layer cannot run them (a traced check would become part of the graph)."""
    if device.type == "cuda" and gqa == "auto" and facts.torch_varlen is not None:
        _torch_varlen_native_gqa_ok(device, facts)


def _cudnn_unavailable(q: torch.Tensor, facts: BackendFacts | None = None) -> str | None:
    """Why hasten's cuDNN attention op cannot run these inputs (None: it can)."""
    if facts is None:
        facts = backend_facts()
    if not facts.cudnn_op:
        return ("hasten was built without its cuDNN attention op (no cudnn-frontend headers at install): "
                + BUILD_CUDNN_OP)
    version = facts.cudnn_version
    if version < _MIN_CUDNN:
        return f"cuDNN {version} is older than {_MIN_CUDNN} (ragged attention with grouped K/V heads)"
    if q.shape[-1] % 8 != 0:
        return f"head_dim {q.shape[-1]} is not a multiple of 8"
    if q.numel() >= 2**31:
        return f"{q.shape[0]} tokens x {q.shape[1]} heads x {q.shape[2]} overflow cuDNN's int32 ragged offsets"
    return None


_CHAIN: tuple[Backend, ...] = ("cudnn", "flash_attn", "torch_varlen")


def select_backend(q: torch.Tensor, requested: str = "auto", *, report: bool = True,
                   facts: BackendFacts | None = None) -> Backend:
    """The first backend of cudnn -> flash_attn -> torch_varlen, starting at `requested` (auto:
    at cudnn), that can run these inputs; per_sequence when none can. A forced slower backend is
    honoured silently; a requested one that cannot run is reported once with the reason (unless
    `report` is false: hasten's own redirects past cudnn), and the next one of the chain runs.
    `facts`: what the process can run (read now when not given)."""
    if facts is None:
        facts = backend_facts()
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
        first = "cudnn" if requested == "auto" else requested
        for backend in _CHAIN[_CHAIN.index(first):]:
            why_not = _unavailable(backend, q, facts)
            if why_not is None:
                return backend
            if backend == first and report:
                record_fallback(f"{backend}_attention" if backend == "cudnn" else f"{backend}_unavailable",
                                f"{backend} packed attention cannot run: {why_not}; the next backend of "
                                "cudnn -> flash_attn -> torch_varlen runs instead"
                                + (" (about 8% slower training on W1)" if backend == "cudnn" else ""))
        reason = (f"torch {torch.__version__} has no torch.nn.attention.varlen and flash-attn is not installed "
                  "(upgrade to torch >= 2.10 or install flash-attn)")
    record_fallback("attention_per_sequence", f"packed attention runs one sequence at a time: {reason}. Results "
                    "are correct; speed is not.")
    return "per_sequence"


def _unavailable(backend: Backend, q: torch.Tensor, facts: BackendFacts) -> str | None:
    if backend == "cudnn":
        return _cudnn_unavailable(q, facts)
    if backend == "flash_attn":
        return None if facts.flash_attn is not None else "flash-attn is not installed"
    return None if facts.torch_varlen is not None else f"torch {torch.__version__} has no torch.nn.attention.varlen"


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # (T, Hkv, D) -> (T, Hkv * groups, D), each K/V head repeated for its query heads.
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


@functools.lru_cache(maxsize=None)
def _torch_varlen_takes_gqa_flag() -> bool:
    fn = _torch_varlen_fn()
    return fn is not None and "enable_gqa" in inspect.signature(fn).parameters


_native_gqa_checked: dict[torch.device, bool] = {}


def _torch_varlen_native_gqa_ok(device: torch.device, facts: BackendFacts) -> bool:
    """Once per device: does torch's varlen kernel read fewer K/V heads than Q heads correctly?

    torch 2.11 accepts such K/V without a flag; newer releases take `enable_gqa`. The
    answer is checked against repeated K/V on a small problem, not assumed. accelerate() checks
    the model's device before any trace; a device first seen inside a torch.compile trace cannot
    run the check there and repeats K/V heads (correct, more memory traffic), said once.
    """
    known = _native_gqa_checked.get(device)
    if known is not None:
        return known
    if torch.compiler.is_compiling():
        record_fallback("gqa_repeat_kv", "torch's varlen attention with fewer K/V heads than Q heads was not checked "
                        "on this device before torch.compile traced the layer; repeating K/V heads instead (more "
                        "memory traffic). hasten.accelerate() on the model once it is on this device checks it")
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(40, 4, 64, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(40, 2, 64, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(40, 2, 64, device=device, dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, 17, 40], device=device, dtype=torch.int32)
    try:
        native = _call_torch_varlen(q, k, v, cu, 23, None, True, (-1, 0), facts)
        repeated = _call_torch_varlen(q, _repeat_kv(k, 2), _repeat_kv(v, 2), cu, 23, None, False, (-1, 0), facts)
        ok = torch.allclose(native.float(), repeated.float(), atol=1e-2, rtol=1e-2)
        detail = "gave a different result from repeated K/V"
    except (RuntimeError, ValueError) as exc:
        ok, detail = False, f"raised {type(exc).__name__}: {exc}"
    if not ok:
        record_fallback("gqa_repeat_kv", f"torch's varlen attention with fewer K/V heads than Q heads {detail}; "
                        "repeating K/V heads instead (more memory traffic)")
    _native_gqa_checked[device] = ok
    return ok


def _call_torch_varlen(q, k, v, cu, max_seqlen, scale, gqa: bool, window, facts: BackendFacts):
    extra = {"enable_gqa": True} if gqa and facts.torch_varlen_gqa_flag else {}
    return facts.torch_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=window, **extra)


def _allowed_keys(length: int, causal: bool, left_window: int, device) -> torch.Tensor | None:
    """(L, L) bool: the keys each query of one sequence sees (None: all of them)."""
    if not causal:
        return None
    idx = torch.arange(length, device=device)
    dist = idx[:, None] - idx[None, :]
    return (dist >= 0) & (dist <= left_window) if left_window >= 0 else dist >= 0


def _capped_scores(qs, ks, scale: float, softcap: float) -> torch.Tensor:
    # (H, L, L) scores, scaled then softcapped (Gemma 2's eager attention: c * tanh(s / c))
    scores = qs @ ks.transpose(1, 2) * scale
    return torch.tanh(scores / softcap) * softcap


def _per_sequence(q, k, v, cu_seqlens, scale, causal: bool, left_window: int, dropout: float,
                  softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()  # host sync per call: this path is the fallback
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, _repeat_kv(k, groups), _repeat_kv(v, groups)))
        if softcap > 0.0 or sinks is not None:  # sdpa has neither: the scores written out, as the model's eager
            scale_used = q.shape[-1] ** -0.5 if scale is None else scale  # attention does
            scores = (_capped_scores(qs, ks, scale_used, softcap) if softcap > 0.0
                      else qs @ ks.transpose(1, 2) * scale_used)
            allowed = _allowed_keys(end - start, causal, left_window, q.device)
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            compute = torch.promote_types(q.dtype, torch.float32)
            if sinks is not None:  # (H, L, L + 1): each head's sink logit in the denominator, dropped after
                sink = sinks.to(compute).view(-1, 1, 1).expand(-1, end - start, 1)
                probs = torch.softmax(torch.cat([scores.to(compute), sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1, dtype=compute)
            probs = F.dropout(probs.to(q.dtype), p=dropout)
            out[start:end] = (probs @ vs).transpose(0, 1)
            continue
        mask = _allowed_keys(end - start, causal, left_window, q.device) if left_window >= 0 else None
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout,
                                           is_causal=causal and mask is None, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


# The per-sequence loop reads its boundaries on the host, which a traced graph cannot. Compiled, it
# runs as this op: dynamo and inductor see one call with the output's shape (q's), and the loop
# runs inside it as in eager. Its backward is the attention gradient written out per sequence in
# float32 or wider (what the C++ reference hasten::varlen_attention_backward computes, with the window);
# autograd cannot run inside an op's kernel. No dropout (its mask would have to be replayed in
# backward): attention dropout on this path stays eager.
@torch.library.custom_op("hasten_host::per_sequence_attention", mutates_args=())
def _per_sequence_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float | None, causal: bool, left_window: int, softcap: float) -> torch.Tensor:
    return _per_sequence(q, k, v, cu_seqlens, scale, causal, left_window, 0.0, softcap)


@_per_sequence_op.register_fake
def _per_sequence_fake(q, k, v, cu_seqlens, scale, causal, left_window, softcap):
    return torch.empty_like(q)


@torch.library.custom_op("hasten_host::per_sequence_attention_backward", mutates_args=())
def _per_sequence_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens: torch.Tensor, scale: float | None, causal: bool,
                              left_window: int, softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, kv_heads = q.shape[1] // k.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    compute = torch.promote_types(q.dtype, torch.float32)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # (heads, L, D) in float32 at least, K/V heads repeated for their query heads
        qs, ks, vs, dout = (x[start:end].to(compute).transpose(0, 1) for x in
                            (q, _repeat_kv(k, groups), _repeat_kv(v, groups), grad_out))
        scores = qs @ ks.transpose(1, 2) * scale
        cap_slope = None
        if softcap > 0.0:  # c * tanh(s / c): its derivative 1 - tanh^2 scales the scores' gradient
            capped = torch.tanh(scores / softcap)
            cap_slope, scores = 1 - capped * capped, capped * softcap
        allowed = _allowed_keys(end - start, causal, left_window, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        d_probs = dout @ vs.transpose(1, 2)
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
        if cap_slope is not None:
            d_scores = d_scores * cap_slope

        def per_kv_head(x):  # (Hq, L, D) summed over each K/V head's query heads -> (L, Hkv, D)
            return x.reshape(kv_heads, groups, *x.shape[1:]).sum(1).transpose(0, 1)

        grad_q[start:end] = (d_scores @ ks * scale).transpose(0, 1).to(q.dtype)
        grad_k[start:end] = per_kv_head(d_scores.transpose(1, 2) @ qs * scale).to(k.dtype)
        grad_v[start:end] = per_kv_head(probs.transpose(1, 2) @ dout).to(v.dtype)
    return grad_q, grad_k, grad_v


@_per_sequence_backward_op.register_fake
def _per_sequence_backward_fake(grad_out, q, k, v, cu_seqlens, scale, causal, left_window, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _per_sequence_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, scale, causal, left_window, softcap = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens)
    ctx.args = (scale, causal, left_window, softcap)


def _per_sequence_backward(ctx, grad_out):
    q, k, v, cu_seqlens = ctx.saved_tensors
    grad_q, grad_k, grad_v = _per_sequence_backward_op(grad_out.contiguous(), q, k, v, cu_seqlens, *ctx.args)
    return grad_q, grad_k, grad_v, None, None, None, None, None


_per_sequence_op.register_autograd(_per_sequence_backward, setup_context=_per_sequence_setup)

# Attention dropout on the per-sequence path under torch.compile: a graph break (the loop and its
# random masks run eagerly), so a fullgraph compile of such a layer is refused by torch.compile.
_per_sequence_eager = torch.compiler.disable(_per_sequence)


def _cudnn_max_seqlen(max_seqlen: int) -> int:
    """max_seqlen for hasten's cuDNN op under torch.compile: the power of two (at least 64) that the
    op keys its cuDNN graphs on (`bucket(max_seqlen, 64)` in varlen_attention_cuda.cpp), so the op
    computes exactly what it computes for the exact value. The op's schema takes `int max_seqlen`,
    not SymInt, so a symbolic longest sequence would be specialised to its value (one recompile per
    new longest sequence); the comparisons below leave dynamo a range guard instead, one graph per
    power of two."""
    bucket = 64
    while bucket < max_seqlen:
        bucket *= 2
    return bucket


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     *, scale: float | None = None, causal: bool = True, sliding_window: int | None = None,
                     softcap: float | None = None, dropout: float = 0.0, backend: str = "auto",
                     gqa: GqaMode = "auto", facts: BackendFacts | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every packed sequence to itself only. Returns (T, Hq, D). `softcap` c: the
    scaled scores s become c * tanh(s / c) before the mask (Gemma 2's attn_logit_softcapping;
    cuDNN and flash-attn compute it, torch's varlen kernel does not, so without those it runs one
    sequence at a time). `sinks` (Hq,): a logit per query head in every softmax's denominator
    (gpt-oss): hasten's own op (cuDNN, or its CPU reference) computes it packed, anything else one
    sequence at a time. `facts`: what the process can run (accelerate() reads them once; read per
    call when not given, which torch.compile cannot trace)."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if sliding_window is not None and not causal:  # no backend below takes a two-sided window
        raise NotImplementedError(f"hasten's varlen attention has no bidirectional sliding window "
                                  f"(sliding_window={sliding_window}, causal=False)")
    if softcap is not None and not softcap >= 0.0:
        raise ValueError(f"softcap must be positive (or None/0: off), got {softcap}")
    softcap = float(softcap or 0.0)
    if facts is None:
        facts = backend_facts()
    # sliding_window W (transformers' meaning): a query sees itself and the W - 1 tokens before it.
    left = sliding_window - 1 if sliding_window is not None else -1
    if sinks is not None:
        return _attention_with_sinks(q, k, v, cu_seqlens, max_seqlen, scale, causal, sliding_window, softcap,
                                     dropout, sinks, backend, facts, left)
    chosen = select_backend(q, backend, facts=facts)
    if chosen == "cudnn" and dropout > 0.0:
        record_fallback("cudnn_attention_features", "cuDNN packed attention is not used for layers with dropout; "
                        "FlashAttention-2 (flash-attn, else torch's varlen) runs them")
        chosen = select_backend(q, "flash_attn", report=False, facts=facts)
    if chosen == "cudnn":
        from hasten.ops.attention import varlen_attention as cudnn_attention

        if torch.compiler.is_compiling():
            # a refusal is raised by the op when the graph runs, past any Python a trace could leave
            # here: compiled, a batch cuDNN refuses raises its error instead of falling back
            return cudnn_attention(q, k, v, cu_seqlens, _cudnn_max_seqlen(max_seqlen), scale, causal,
                                   sliding_window or 0, softcap)
        try:
            return cudnn_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal, sliding_window or 0, softcap)
        except RuntimeError as exc:  # a shape cuDNN refuses (the op caches the refusal per bucket)
            record_fallback("cudnn_attention", f"cuDNN refused this batch ({exc}); FlashAttention-2 runs it")
            chosen = select_backend(q, "flash_attn", report=False, facts=facts)
    if softcap > 0.0 and chosen == "flash_attn" and not facts.flash_attn_softcap:
        chosen = select_backend(q, "torch_varlen", report=False, facts=facts)
    if softcap > 0.0 and chosen == "torch_varlen":
        record_fallback("attention_softcap", f"attention softcapping ({softcap:g}) runs one sequence at a time: "
                        "torch's varlen attention has no softcap (hasten's cuDNN op or flash-attn >= 2.6 computes it "
                        "packed)")
        chosen = "per_sequence"
    if dropout > 0.0 and chosen == "torch_varlen":
        record_fallback("attention_dropout", "torch's varlen attention has no dropout; attention dropout "
                        f"{dropout} runs one sequence at a time (install flash-attn for the fast path)")
        chosen = "per_sequence"
    if chosen == "per_sequence":
        left_window = left if causal else -1
        if not torch.compiler.is_compiling():
            return _per_sequence(q, k, v, cu_seqlens, scale, causal, left_window, dropout, softcap)
        if dropout > 0.0:
            return _per_sequence_eager(q, k, v, cu_seqlens, scale, causal, left_window, dropout, softcap)
        return _per_sequence_op(q, k, v, cu_seqlens, scale, causal, left_window, softcap)

    groups = q.shape[1] // k.shape[1]
    if chosen == "flash_attn":  # reads shared K/V heads natively
        capped = {"softcap": softcap} if softcap > 0.0 else {}
        return facts.flash_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout,
                                softmax_scale=scale, causal=causal, window_size=(left, 0 if causal else -1), **capped)
    window = (left, 0) if causal else (-1, -1)
    native = groups > 1 and gqa != "repeat" and (gqa == "native" or _torch_varlen_native_gqa_ok(q.device, facts))
    if groups > 1 and not native:
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    return _call_torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale, native, window, facts)


def _attention_with_sinks(q, k, v, cu_seqlens, max_seqlen: int, scale, causal: bool, sliding_window, softcap: float,
                          dropout: float, sinks: torch.Tensor, backend: str, facts: BackendFacts,
                          left: int) -> torch.Tensor:
    """varlen_attention with sinks: hasten's op where it runs (cuDNN on a GPU, its float32 reference
    on the CPU: the log-sum-exp it returns is what a sink adds to), else one sequence at a time.
    flash-attn 2 and torch's varlen kernel take no sink."""
    reason = None
    if dropout > 0.0:
        reason = f"attention dropout ({dropout:g}): hasten's op has none"
    elif q.device.type == "cuda":
        chosen = select_backend(q, backend, facts=facts)
        if chosen != "cudnn":
            reason = f"the {chosen} backend has no attention sinks (hasten's cuDNN op computes them packed)"
    elif q.device.type != "cpu":
        reason = f"hasten's op has no kernel for {q.device.type} tensors"
    if reason is None:
        from hasten.ops.attention import varlen_attention_sinks

        bucketed = _cudnn_max_seqlen(max_seqlen) if torch.compiler.is_compiling() and q.is_cuda else max_seqlen
        try:
            return varlen_attention_sinks(q, k, v, cu_seqlens, bucketed, sinks, scale, causal, sliding_window or 0,
                                          softcap)
        except RuntimeError as exc:  # a shape cuDNN refuses
            if torch.compiler.is_compiling():
                raise
            reason = f"cuDNN refused this batch ({exc})"
    if torch.compiler.is_compiling():
        raise NotImplementedError(f"hasten's attention with sinks cannot run compiled here: {reason}")
    record_fallback("attention_sinks", f"attention sinks run one sequence at a time: {reason}")
    return _per_sequence(q, k, v, cu_seqlens, scale, causal, left if causal else -1, dropout, softcap, sinks)
