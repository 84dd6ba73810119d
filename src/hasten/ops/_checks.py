"""The fakes' input checks: csrc's checks (csrc/include/hasten/checks.h and each family's
*_checks.h) in Python, with the same messages, so that a traced program (torch.compile,
FakeTensor, meta) refuses what the kernels refuse, at trace time.

Every check goes through torch._check: on symbolic sizes it becomes a guard or a runtime
assertion instead of a data-dependent branch. tests/ops/test_op_pattern.py runs each bad input
through the CPU kernel and through the fake and asserts one message, so the two cannot drift.
"""

from __future__ import annotations

import math

from collections.abc import Sequence

import torch

# c10's names for dtypes (what TORCH_CHECK prints for a ScalarType)
_C10_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
              torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
              torch.uint8: "Byte", torch.bool: "Bool"}
_TORCH_NAMES = {torch.int64: "torch.int64", torch.int32: "torch.int32", torch.float32: "torch.float32",
                torch.float16: "torch.float16", torch.bfloat16: "torch.bfloat16"}
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype))


def shape(sizes: Sequence) -> str:
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def check(condition, op: str, message) -> None:
    """torch._check with hasten's message format; `message` may be a callable (built on failure)."""
    torch._check(condition, lambda: f"hasten::{op}: {message() if callable(message) else message}")


def check_dtype(t: torch.Tensor, op: str, arg: str, allowed: Sequence[torch.dtype]) -> None:
    check(t.dtype in allowed, op, lambda: f"`{arg}` must be {' or '.join(dtype_name(a) for a in allowed)}, got "
          f"{dtype_name(t.dtype)}. Convert it with .to({_TORCH_NAMES.get(allowed[0], 'a supported dtype')}) before "
          "the call.")


def check_same_device(a: torch.Tensor, b: torch.Tensor, op: str, arg_a: str, arg_b: str) -> None:
    check(a.device == b.device, op, lambda: f"`{arg_a}` is on {a.device} but `{arg_b}` is on {b.device}; move them "
          "to one device")


def check_same_dtype(a: torch.Tensor, b: torch.Tensor, op: str, arg_a: str, arg_b: str) -> None:
    check(a.dtype == b.dtype, op, lambda: f"`{arg_b}` must have the dtype of `{arg_a}` ({dtype_name(a.dtype)}), got "
          f"{dtype_name(b.dtype)}")


def check_dim(t: torch.Tensor, dim: int, op: str, arg: str, expected_shape: str) -> None:
    check(t.dim() == dim, op, lambda: f"`{arg}` must be {expected_shape}, got shape {shape(t.shape)}")


def check_size(t: torch.Tensor, dim: int, expected, op: str, arg: str, meaning: str) -> None:
    check(t.shape[dim] == expected, op, lambda: f"`{arg}` dimension {dim} must be {meaning} ({expected}), got shape "
          f"{shape(t.shape)}")


def check_fits_int32(n, op: str, what: str) -> None:
    check(n < 2**31 - 1, op, lambda: f"{what} ({n}) does not fit the int32 offsets that varlen attention kernels "
          "take; split the batch into smaller ones.")


# --- dense (csrc/norm, csrc/activation, csrc/rope) ------------------------------------------------

def check_rms_norm_args(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    check(x.dim() >= 1, op, "`x` must have a hidden dimension")
    check(weight.dim() == 1 and weight.shape[0] == x.shape[-1], op, lambda: f"`weight` must be ({x.shape[-1]},) to "
          f"match the last dimension of `x`, got shape {shape(weight.shape)}")
    check_dtype(x, op, "x", FLOATS)
    check_same_dtype(x, weight, op, "x", "weight")
    check_same_device(x, weight, op, "x", "weight")


def check_rms_norm_backward_args(grad_y, x, weight, rstd) -> None:
    op = "rms_norm_backward"
    check_rms_norm_args(op, x, weight)
    check(grad_y.shape == x.shape, op, lambda: f"`grad_y` must have the shape of `x` {shape(x.shape)}, got "
          f"{shape(grad_y.shape)}")
    check_same_dtype(x, grad_y, op, "x", "grad_y")
    check_dtype(rstd, op, "rstd", (torch.float32,))
    check(rstd.numel() * x.shape[-1] == x.numel(), op, "`rstd` must hold one value per row of `x`")
    check_same_device(x, grad_y, op, "x", "grad_y")
    check_same_device(x, rstd, op, "x", "rstd")


def check_add_rms_norm_args(x, residual, weight) -> None:
    op = "add_rms_norm"
    check_rms_norm_args(op, x, weight)
    check(residual.shape == x.shape, op, lambda: f"`residual` must have the shape of `x` {shape(x.shape)}, got "
          f"{shape(residual.shape)}")
    check_same_dtype(x, residual, op, "x", "residual")
    check_same_device(x, residual, op, "x", "residual")


def check_grad_add(grad_add, x) -> None:
    op = "rms_norm_backward"
    check(grad_add.shape == x.shape, op, lambda: f"`grad_add` must have the shape of `x` {shape(x.shape)}, got "
          f"{shape(grad_add.shape)}")
    check_same_dtype(x, grad_add, op, "x", "grad_add")
    check_same_device(x, grad_add, op, "x", "grad_add")


def check_swiglu_args(op: str, gate_up: torch.Tensor) -> None:
    check_dim(gate_up, 2, op, "gate_up", "2-D (rows, 2 * inner)")
    check(gate_up.shape[1] % 2 == 0, op, lambda: f"`gate_up` must hold [gate | up] halves, got an odd width "
          f"{gate_up.shape[1]}")


def check_swiglu_backward_args(grad_act, gate_up) -> None:
    op = "swiglu_backward"
    check_swiglu_args(op, gate_up)
    check_same_dtype(gate_up, grad_act, op, "gate_up", "grad_act")
    check(grad_act.dim() == 2 and grad_act.shape[0] == gate_up.shape[0] and grad_act.shape[1] * 2 == gate_up.shape[1],
          op, lambda: f"`grad_act` must be (rows, inner) of `gate_up` (rows, 2 * inner), got {shape(grad_act.shape)} "
          f"and {shape(gate_up.shape)}")
    check_same_device(gate_up, grad_act, op, "gate_up", "grad_act")


def check_weighted_swiglu_args(op: str, gate_up, weights, permutation, offsets) -> None:
    check_swiglu_args(op, gate_up)
    check_dtype(permutation, op, "permutation", (torch.int32,))
    check_dtype(offsets, op, "offsets", (torch.int32,))
    check_dim(permutation, 1, op, "permutation", "1-D (slots,)")
    check_dim(offsets, 1, op, "offsets", "1-D (experts + 1,)")
    check(offsets.numel() >= 2, op, "`offsets` needs experts + 1 >= 2 entries")
    check_size(gate_up, 0, permutation.numel(), op, "gate_up", "slots of `permutation`")
    check(weights.numel() == permutation.numel(), op, lambda: f"`weights` must hold one value per slot "
          f"({permutation.numel()}), got shape {shape(weights.shape)}")
    check_same_dtype(gate_up, weights, op, "gate_up", "weights")
    check_same_device(gate_up, weights, op, "gate_up", "weights")
    check_same_device(gate_up, permutation, op, "gate_up", "permutation")
    check_same_device(gate_up, offsets, op, "gate_up", "offsets")


def check_weighted_swiglu_backward_args(grad_act, gate_up, weights, permutation, offsets) -> None:
    op = "moe_weighted_swiglu_backward"
    check_weighted_swiglu_args(op, gate_up, weights, permutation, offsets)
    check_same_dtype(gate_up, grad_act, op, "gate_up", "grad_act")
    check(grad_act.dim() == 2 and grad_act.shape[0] == gate_up.shape[0] and grad_act.shape[1] * 2 == gate_up.shape[1],
          op, lambda: f"`grad_act` must be (rows, inner) of `gate_up` (rows, 2 * inner), got {shape(grad_act.shape)} "
          f"and {shape(gate_up.shape)}")
    check_same_device(gate_up, grad_act, op, "gate_up", "grad_act")


def check_clamped_swiglu_args(op: str, gate_up: torch.Tensor, alpha: float, limit: float) -> None:
    """gpt-oss's clamped SwiGLU: swiglu's (rows, 2 * inner) shape, interleaved; alpha and limit finite,
    limit positive."""
    check_swiglu_args(op, gate_up)
    check(math.isfinite(alpha) and math.isfinite(limit) and limit > 0, op,
          lambda: f"`alpha` must be finite and `limit` finite and positive, got alpha={alpha:g}, limit={limit:g}")


def check_clamped_swiglu_bias(op: str, gate_up: torch.Tensor, bias, group_ends) -> None:
    """The optional expert biases: bias (E, 2 * inner) in gate_up's dtype and device with group_ends
    (E,) int32 beside it, or neither."""
    check((bias is None) == (group_ends is None), op, lambda: "`bias` and `group_ends` go together (each row's "
          f"expert comes from group_ends), got only {'`bias`' if bias is not None else '`group_ends`'}")
    if bias is None:
        return
    check(bias.dim() == 2 and bias.shape[0] >= 1 and bias.shape[1] == gate_up.shape[1], op,
          lambda: f"`bias` must be (experts, 2 * inner) with gate_up's width {gate_up.shape[1]}, got {shape(bias.shape)}")
    check_same_dtype(gate_up, bias, op, "gate_up", "bias")
    check_same_device(gate_up, bias, op, "gate_up", "bias")
    check(group_ends.dim() == 1 and group_ends.shape[0] == bias.shape[0], op,
          lambda: f"`group_ends` must be (experts,) with one end per row of `bias` ({bias.shape[0]}), got "
          f"{shape(group_ends.shape)}")
    check_dtype(group_ends, op, "group_ends", (torch.int32,))
    check_same_device(gate_up, group_ends, op, "gate_up", "group_ends")


def check_clamped_swiglu_backward_args(grad_act, gate_up, alpha: float, limit: float) -> None:
    op = "clamped_swiglu_backward"
    check_clamped_swiglu_args(op, gate_up, alpha, limit)
    check_same_dtype(gate_up, grad_act, op, "gate_up", "grad_act")
    check(grad_act.dim() == 2 and grad_act.shape[0] == gate_up.shape[0] and grad_act.shape[1] * 2 == gate_up.shape[1],
          op, lambda: f"`grad_act` must be (rows, inner) of `gate_up` (rows, 2 * inner), got {shape(grad_act.shape)} "
          f"and {shape(gate_up.shape)}")
    check_same_device(gate_up, grad_act, op, "gate_up", "grad_act")


def check_gated_mul_args(op: str, gate, up) -> None:
    """silu_mul and gelu_tanh_mul: gate and up (..., inner) of one shape."""
    check(gate.shape == up.shape, op, lambda: f"`gate` and `up` must have one shape, got {shape(gate.shape)} and "
          f"{shape(up.shape)}")
    check(gate.dim() >= 1, op, "`gate` must have at least one dimension")
    check_same_dtype(gate, up, op, "gate", "up")
    check_same_device(gate, up, op, "gate", "up")


def check_gated_mul_backward_args(op: str, grad_act, gate, up) -> None:
    check_gated_mul_args(op, gate, up)
    check(grad_act.shape == gate.shape, op, lambda: f"`grad_act` must have the shape of `gate` {shape(gate.shape)}, "
          f"got {shape(grad_act.shape)}")
    check_same_dtype(gate, grad_act, op, "gate", "grad_act")
    check_same_device(gate, grad_act, op, "gate", "grad_act")


def check_rope_args(x, cos, sin, op: str = "rope") -> None:
    check(x.dim() == 4, op, lambda: f"`x` must be (batch, heads, length, head_dim), got shape {shape(x.shape)}")
    check(x.stride(3) == 1 or x.shape[3] <= 1, op, "`x` must be contiguous along head_dim")
    check(cos.shape == sin.shape, op, lambda: f"`cos` and `sin` must have one shape, got {shape(cos.shape)} and "
          f"{shape(sin.shape)}")
    for t in (cos, sin):
        check(t.dim() == 3 and t.shape[1] == x.shape[2] and (t.shape[0] == x.shape[0] or t.shape[0] == 1), op,
              lambda t=t: f"`cos` and `sin` must be (batch or 1, length={x.shape[2]}, rotary_dim), got shape "
              f"{shape(t.shape)}")
        check(t.shape[2] % 2 == 0 and t.shape[2] > 0 and t.shape[2] <= x.shape[3], op,
              lambda t=t: f"the rotary dim (last dimension of `cos` and `sin`) must be even and in "
              f"[2, head_dim={x.shape[3]}], got {t.shape[2]}")
        check(t.stride(2) == 1 or t.shape[2] <= 1, op, "`cos` and `sin` must be contiguous along their last dimension")
        check_same_device(x, t, op, "x", "cos/sin")
    # float64 on the CPU too: the reference computes in double; the kernel takes 16/32-bit
    allowed = FLOATS + (torch.float64,) if x.device.type == "cpu" else FLOATS
    check_dtype(x, op, "x", allowed)
    check_dtype(cos, op, "cos", allowed)
    check_same_dtype(cos, sin, op, "cos", "sin")


def check_rms_norm_rope_args(op: str, x, weight, cos, sin) -> None:
    """csrc/norm/norm_checks.h check_rms_norm_rope_args: rope's x, cos and sin, rms_norm's weight over
    head_dim, cos and sin of x's dtype."""
    check_rope_args(x, cos, sin, op)
    check_rms_norm_args(op, x, weight)
    check_same_dtype(x, cos, op, "x", "cos")


def check_rms_norm_rope_backward_args(grad_out, x, weight, rstd, cos, sin) -> None:
    op = "rms_norm_rope_backward"
    check_rms_norm_rope_args(op, x, weight, cos, sin)
    check(grad_out.shape == x.shape, op, lambda: f"`grad_out` must have the shape of `x` {shape(x.shape)}, got "
          f"{shape(grad_out.shape)}")
    check(grad_out.stride(3) == 1 or grad_out.shape[3] <= 1, op, "`grad_out` must be contiguous along head_dim")
    check_same_dtype(x, grad_out, op, "x", "grad_out")
    check_same_device(x, grad_out, op, "x", "grad_out")
    check_dtype(rstd, op, "rstd", (torch.float32,))
    check(rstd.dim() == 3 and tuple(rstd.shape) == tuple(x.shape[:3]), op,
          lambda: f"`rstd` must be (batch, heads, length) = {shape(x.shape[:3])}, got {shape(rstd.shape)}")
    check_same_device(x, rstd, op, "x", "rstd")


# --- attention (csrc/attention) -------------------------------------------------------------------

def check_varlen_attention_args(op: str, q, k, v, cu_seqlens, max_seqlen) -> None:
    check_dim(q, 3, op, "q", "(tokens, q_heads, head_dim)")
    check_dim(k, 3, op, "k", "(tokens, kv_heads, head_dim)")
    check(v.shape == k.shape, op, lambda: f"`v` must have k's shape {shape(k.shape)}, got {shape(v.shape)}")
    check(k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2], op, lambda: f"`k` {shape(k.shape)} must have q's "
          f"token count and head_dim (q is {shape(q.shape)})")
    check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0, op, lambda: f"q_heads ({q.shape[1]}) must be a multiple "
          f"of kv_heads ({k.shape[1]})")
    check(k.dtype == q.dtype and v.dtype == q.dtype, op, lambda: f"q, k and v must share one dtype; got "
          f"{dtype_name(q.dtype)}, {dtype_name(k.dtype)}, {dtype_name(v.dtype)}")
    check_dim(cu_seqlens, 1, op, "cu_seqlens", "(num_seqs + 1,)")
    check_dtype(cu_seqlens, op, "cu_seqlens", (torch.int32,))
    check(cu_seqlens.numel() >= 1, op, "`cu_seqlens` needs at least one entry (0)")
    check(max_seqlen >= 0, op, lambda: f"`max_seqlen` must be >= 0, got {max_seqlen}")
    for t in (k, v, cu_seqlens):
        check_same_device(q, t, op, "q", "k, v or cu_seqlens")


def check_attention_window(op: str, causal, window) -> None:
    check(window >= 0, op, lambda: f"`window` must be >= 0 (0: no window), got {window}")
    check(window == 0 or causal, op, lambda: f"a sliding window ({window}) needs causal attention; a two-sided "
          "window is not implemented")


def check_attention_softcap(op: str, softcap) -> None:
    check(softcap >= 0.0 and math.isfinite(softcap), op,
          lambda: f"`softcap` must be 0 (off) or a positive finite number, got {softcap:g}")


def check_attention_sinks(op: str, q, sinks) -> None:
    check_dim(sinks, 1, op, "sinks", "(q_heads,)")
    check(sinks.shape[0] == q.shape[1], op, lambda: f"`sinks` needs one logit per query head ({q.shape[1]}), got "
          f"{shape(sinks.shape)}")
    check(sinks.device == q.device, op, lambda: f"`sinks` must be on q's device {q.device}, got {sinks.device}")
    check(sinks.is_floating_point(), op, lambda: f"`sinks` must be floating point, got {dtype_name(sinks.dtype)}")


def check_varlen_attention_backward_args(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen) -> None:
    op = "varlen_attention_backward"
    check_varlen_attention_args(op, q, k, v, cu_seqlens, max_seqlen)
    check(grad_out.shape == q.shape and out.shape == q.shape, op, lambda: f"`grad_out` and `out` must have q's shape "
          f"{shape(q.shape)}, got {shape(grad_out.shape)} and {shape(out.shape)}")
    check(lse.dim() == 2 and lse.shape[0] == q.shape[0] and lse.shape[1] == q.shape[1], op,
          lambda: f"`lse` must be (tokens, q_heads) = {shape(q.shape[:2])}, got {shape(lse.shape)}")
    check_dtype(lse, op, "lse", (torch.float32,))


# --- packing (csrc/packing) -----------------------------------------------------------------------

def check_varlen_meta_args(position_ids) -> None:
    op = "varlen_meta"
    check_dtype(position_ids, op, "position_ids", (torch.int64, torch.int32))
    check(position_ids.dim() >= 1, op, "`position_ids` must have at least one dimension (rows, tokens), got a scalar")
    check_fits_int32(position_ids.numel(), op, "the number of tokens")


# --- loss (csrc/loss) -----------------------------------------------------------------------------

def check_cross_entropy_rows_args(logits, targets, grad_scale, label_smoothing, softcap) -> None:
    op = "cross_entropy_rows_"
    check(logits.dim() == 2, op, lambda: f"`logits` must be (rows, vocab), got shape {shape(logits.shape)}")
    check(logits.stride(1) == 1, op, "`logits` rows must be contiguous (stride 1 along vocab)")
    check_dtype(logits, op, "logits", FLOATS)
    check_dtype(targets, op, "targets", (torch.int64,))
    check(targets.dim() == 1 and targets.shape[0] == logits.shape[0], op, lambda: f"`targets` must be "
          f"({logits.shape[0]},) to match the logits rows, got shape {shape(targets.shape)}")
    check_same_device(logits, targets, op, "logits", "targets")
    if grad_scale is not None:
        check(grad_scale.numel() == 1 and grad_scale.dtype == torch.float32, op,
              "`grad_scale` must be one float32 value (1 / the loss denominator)")
        check_same_device(logits, grad_scale, op, "logits", "grad_scale")
    check_smoothing_and_softcap(label_smoothing, softcap)


def check_smoothing_and_softcap(label_smoothing, softcap) -> None:
    """cross_entropy_rows_'s scalar checks, which linear_cross_entropy reaches through it."""
    op = "cross_entropy_rows_"
    check(0.0 <= label_smoothing <= 1.0, op, lambda: f"`label_smoothing` must be in [0, 1], got {label_smoothing:f}")
    check(softcap >= 0.0, op, lambda: f"`softcap` must be 0 (off) or positive, got {softcap:f}")


def check_linear_cross_entropy_args(hidden, weight, bias, targets, denominator) -> None:
    op = "linear_cross_entropy"
    check(hidden.dim() == 2, op, lambda: f"`hidden` must be (tokens, hidden_size), got shape {shape(hidden.shape)}; "
          "flatten the batch dimensions first")
    check(weight.dim() == 2 and weight.shape[1] == hidden.shape[1], op, lambda: f"`weight` must be (vocab, "
          f"hidden_size={hidden.shape[1]}), got shape {shape(weight.shape)}")
    check(weight.dtype == hidden.dtype, op, lambda: f"`weight` is {dtype_name(weight.dtype)} but `hidden` is "
          f"{dtype_name(hidden.dtype)}; the LM head and its input must share a dtype")
    check_dtype(hidden, op, "hidden", FLOATS)
    check_same_device(hidden, weight, op, "hidden", "weight")
    if bias is not None:
        check(bias.dim() == 1 and bias.shape[0] == weight.shape[0] and bias.dtype == weight.dtype, op,
              lambda: f"`bias` must be (vocab,) in the weight's dtype, got shape {shape(bias.shape)}")
    check_dtype(targets, op, "targets", (torch.int64,))
    check(targets.dim() == 1 and targets.shape[0] == hidden.shape[0], op, lambda: f"`targets` must be "
          f"({hidden.shape[0]},), one per token, got shape {shape(targets.shape)}")
    check_same_device(hidden, targets, op, "hidden", "targets")
    check(denominator.numel() == 1, op,
          "`denominator` must hold one value (the number of target tokens the loss is averaged over)")
    check_same_device(hidden, denominator, op, "hidden", "denominator")


# --- MoE (csrc/moe) -------------------------------------------------------------------------------

def check_moe_group_args(expert_ids, num_experts) -> None:
    op = "moe_group"
    check_dtype(expert_ids, op, "expert_ids", (torch.int64, torch.int32))
    check_dim(expert_ids, 2, op, "expert_ids", "(tokens, top_k)")
    check(num_experts >= 1, op, lambda: f"num_experts must be at least 1, got {num_experts}")
    check_fits_int32(expert_ids.numel(), op, "tokens * top_k")


def _check_routing_args(op: str, rows, index, offsets, top_k) -> None:
    check_dim(rows, 2, op, "rows", "2-D (rows, hidden)")
    check_dtype(index, op, "permutation/inverse", (torch.int32,))
    check_dtype(offsets, op, "offsets", (torch.int32,))
    check_dim(index, 1, op, "permutation/inverse", "1-D (slots,)")
    check_dim(offsets, 1, op, "offsets", "1-D (experts + 1,)")
    check(offsets.numel() >= 2, op, "`offsets` needs experts + 1 >= 2 entries")
    check(top_k >= 1, op, lambda: f"top_k must be at least 1, got {top_k}")
    check(index.numel() % top_k == 0, op, lambda: f"slots ({index.numel()}) must be tokens * top_k ({top_k})")
    check(rows.dtype in FLOATS or (rows.dtype == torch.float64 and rows.device.type == "cpu"), op,
          lambda: f"rows must be float32, float16 or bfloat16 (float64 on the CPU), got {dtype_name(rows.dtype)}")
    check_same_device(rows, index, op, "rows", "permutation/inverse")
    check_same_device(rows, offsets, op, "rows", "offsets")


def check_permute_args(x, permutation, offsets, top_k, slot_scale) -> None:
    op = "moe_permute"
    _check_routing_args(op, x, permutation, offsets, top_k)
    check_size(x, 0, permutation.numel() // top_k, op, "x", "tokens = slots / top_k")
    if slot_scale is not None:
        check_same_dtype(x, slot_scale, op, "x", "slot_scale")
        check(slot_scale.numel() == permutation.numel(), op, lambda: f"`slot_scale` needs one value per slot "
              f"({permutation.numel()}), got shape {shape(slot_scale.shape)}")
        check_same_device(x, slot_scale, op, "x", "slot_scale")


def _check_expert_bias(op: str, y, offsets, bias) -> None:
    """bias (E, H) of the combine ops: one row per expert of offsets, y's width, dtype and device."""
    if bias is None:
        return
    check_dim(bias, 2, op, "bias", "2-D (experts, hidden)")
    check_same_dtype(y, bias, op, "y", "bias")
    check_size(bias, 0, offsets.numel() - 1, op, "bias", "experts = offsets - 1")
    check_size(bias, 1, y.shape[1], op, "bias", "hidden of y")
    check_same_device(y, bias, op, "y", "bias")


def check_combine_args(y, inverse, offsets, top_k, weights, bias=None) -> None:
    op = "moe_combine"
    _check_routing_args(op, y, inverse, offsets, top_k)
    _check_expert_bias(op, y, offsets, bias)
    check_size(y, 0, inverse.numel(), op, "y", "slots = tokens * top_k")
    if weights is not None:
        check_same_dtype(y, weights, op, "y", "weights")
        check(weights.numel() == inverse.numel(), op, lambda: f"`weights` must be (tokens, top_k) = "
              f"({inverse.numel() // top_k}, {top_k}), got {shape(weights.shape)}")
        check_same_device(y, weights, op, "y", "weights")


def check_weight_grad_args(grad_out, y, inverse, offsets, top_k, bias=None) -> None:
    op = "moe_combine_weight_grad"
    _check_routing_args(op, y, inverse, offsets, top_k)
    _check_expert_bias(op, y, offsets, bias)
    check_same_dtype(y, grad_out, op, "y", "grad_out")
    check_dim(grad_out, 2, op, "grad_out", "2-D (tokens, hidden)")
    check_size(grad_out, 0, inverse.numel() // top_k, op, "grad_out", "tokens")
    check_size(grad_out, 1, y.shape[1], op, "grad_out", "hidden of y")
    check_size(y, 0, inverse.numel(), op, "y", "slots = tokens * top_k")


ROUTE_MAX_EXPERTS, ROUTE_MAX_TOP_K, ROUTE_MAX_GROUPS = 512, 32, 32


def check_route_args(op: str, logits, top_k, scoring, num_groups, top_groups, group_score, selection_bias) -> None:
    """The router's choice (moe_route): logits (T, E), selection_bias (E,) or None, and the spec."""
    check_dim(logits, 2, op, "logits", "2-D (tokens, experts)")
    check(logits.dtype in FLOATS or (logits.dtype == torch.float64 and logits.device.type == "cpu"), op,
          lambda: f"`logits` must be float32, float16 or bfloat16 (float64 on the CPU), got {dtype_name(logits.dtype)}")
    experts = logits.shape[1]
    check(1 <= experts <= ROUTE_MAX_EXPERTS, op,
          lambda: f"the router's experts must be 1 to {ROUTE_MAX_EXPERTS}, got {experts}")
    check(1 <= top_k <= ROUTE_MAX_TOP_K and top_k <= experts, op,
          lambda: f"top_k must be 1 to {ROUTE_MAX_TOP_K} and at most the experts ({experts}), got {top_k}")
    check(scoring in ("softmax", "sigmoid", "topk_softmax"), op,
          lambda: f'scoring must be "softmax", "sigmoid" or "topk_softmax", got "{scoring}"')
    check(group_score in ("max", "top2_sum"), op, lambda: f'group_score must be "max" or "top2_sum", got "{group_score}"')
    check(1 <= num_groups <= ROUTE_MAX_GROUPS and experts % num_groups == 0, op,
          lambda: f"num_groups must be 1 to {ROUTE_MAX_GROUPS} and divide the experts ({experts}), got {num_groups}")
    if num_groups > 1:
        group_size = experts // num_groups
        check(1 <= top_groups <= num_groups and top_groups * group_size >= top_k, op,
              lambda: f"top_groups must be 1 to num_groups ({num_groups}) and its groups must hold top_k ({top_k}) "
              f"experts, got {top_groups}")
        check(group_score != "top2_sum" or group_size >= 2, op,
              lambda: f'group_score "top2_sum" needs groups of at least 2 experts, got {group_size}')
    check(scoring != "topk_softmax" or (num_groups == 1 and selection_bias is None), op,
          'scoring "topk_softmax" takes no groups and no selection_bias')
    if selection_bias is not None:
        check_dim(selection_bias, 1, op, "selection_bias", "1-D (experts,)")
        check_size(selection_bias, 0, experts, op, "selection_bias", "the experts of logits")
        check(selection_bias.dtype in FLOATS or (selection_bias.dtype == torch.float64
                                                 and selection_bias.device.type == "cpu"), op,
              lambda: f"`selection_bias` must be float32, float16 or bfloat16, got {dtype_name(selection_bias.dtype)}")
        check_same_device(logits, selection_bias, op, "logits", "selection_bias")


def check_route_backward_args(grad_weights, logits, ids, top_k) -> None:
    op = "moe_route_backward"
    # the forward's weights: float32, float64 for float64 logits (CPU)
    check_dtype(grad_weights, op, "grad_weights", (torch.float64,) if logits.dtype == torch.float64 else (torch.float32,))
    check_dtype(ids, op, "ids", (torch.int64,))
    for t in (grad_weights, ids):
        check(t.dim() == 2 and t.shape[0] == logits.shape[0] and t.shape[1] == top_k, op,
              lambda t=t: f"`grad_weights` and `ids` must be (tokens, top_k) = ({logits.shape[0]}, {top_k}), got "
              f"{shape(t.shape)}")
        check_same_device(logits, t, op, "logits", "grad_weights/ids")


def _check_group_ends(op: str, rows_arg: str, rows, group_ends) -> None:
    check_dtype(group_ends, op, "group_ends", (torch.int32,))
    check_dim(group_ends, 1, op, "group_ends", "1-D (experts,)")
    check(group_ends.numel() >= 1, op, "`group_ends` needs one entry per expert, got none")
    check_same_device(rows, group_ends, op, rows_arg, "group_ends")


def _check_grouped_float(op: str, arg: str, t) -> None:
    check(t.dtype in FLOATS or (t.dtype == torch.float64 and t.device.type == "cpu"), op,
          lambda: f"`{arg}` must be float32, float16 or bfloat16 (float64 on the CPU), got {dtype_name(t.dtype)}")


def check_grouped_mm_args(x, weight, group_ends, transposed) -> None:
    op = "moe_grouped_mm"
    check_dim(x, 2, op, "x", "2-D (rows, in)")
    check_dim(weight, 3, op, "weight", "3-D (experts, in, out)" if transposed else "3-D (experts, out, in)")
    _check_grouped_float(op, "x", x)
    check_same_dtype(x, weight, op, "x", "weight")
    check_size(weight, 1 if transposed else 2, x.shape[1], op, "weight", "the columns of x (in)")
    _check_group_ends(op, "x", x, group_ends)
    check_size(group_ends, 0, weight.shape[0], op, "group_ends", "the experts of weight")
    check_same_device(x, weight, op, "x", "weight")


def check_grouped_mm_weight_grad_args(a, b, group_ends) -> None:
    op = "moe_grouped_mm_weight_grad"
    check_dim(a, 2, op, "a", "2-D (rows, M)")
    check_dim(b, 2, op, "b", "2-D (rows, N)")
    _check_grouped_float(op, "a", a)
    check_same_dtype(a, b, op, "a", "b")
    check_size(b, 0, a.shape[0], op, "b", "the rows of a")
    _check_group_ends(op, "a", a, group_ends)
    check_same_device(a, b, op, "a", "b")


# --- LoRA (csrc/lora) -----------------------------------------------------------------------------

def check_lora_linear_args(op: str, x, x_lora, weight, bias, lora_a, lora_b) -> None:
    check(x.dim() >= 1, op, "`x` must be (..., in_features), got a scalar")
    check_dim(weight, 2, op, "weight", "(out_features, in_features)")
    check_dim(lora_a, 2, op, "lora_a", "(rank, in_features)")
    check_dim(lora_b, 2, op, "lora_b", "(out_features, rank)")
    n_in, n_out, rank = x.shape[-1], weight.shape[0], lora_a.shape[0]
    check(weight.shape[1] == n_in, op, lambda: f"`weight` {shape(weight.shape)} must have x's last size {n_in} as its "
          "second size")
    check(lora_a.shape[1] == n_in, op, lambda: f"`lora_a` {shape(lora_a.shape)} must be (rank, {n_in})")
    check(lora_b.shape[0] == n_out and lora_b.shape[1] == rank, op,
          lambda: f"`lora_b` {shape(lora_b.shape)} must be ({n_out}, {rank}): (out_features, rank)")
    check(weight.dtype == x.dtype, op, lambda: f"the base `weight` ({dtype_name(weight.dtype)}) must have x's dtype "
          f"({dtype_name(x.dtype)})")
    for t in (x, lora_a, lora_b):
        check(t.dtype.is_floating_point, op, lambda t=t: f"x, lora_a and lora_b must be floating, got "
              f"{dtype_name(t.dtype)}")
    if x_lora is not None:
        check(x_lora.shape == x.shape and x_lora.dtype == x.dtype, op,
              "`x_lora` (the LoRA path's input after dropout) must have x's shape and dtype")
        check_same_device(x, x_lora, op, "x", "x_lora")
    if bias is not None:
        check(bias.dim() == 1 and bias.shape[0] == n_out and bias.dtype == x.dtype, op,
              lambda: f"`bias` must be ({n_out},) in x's dtype")
        check_same_device(x, bias, op, "x", "bias")
    for t in (weight, lora_a, lora_b):
        check_same_device(x, t, op, "x", "weight, lora_a or lora_b")


def check_lora_adapters(op, adapters, lora_a, lora_b, dtype) -> None:
    """`adapters` of a LoRA backward op: None or empty (the backward casts the adapters itself), or
    the forward's flat copy of lora_a and lora_b in x's dtype (csrc/lora/lora_backward.h,
    adapters_in, words the same error)."""
    if adapters is None or adapters.numel() == 0:
        return
    total = sum(t.numel() for t in (*lora_a, *lora_b))
    device = lora_a[0].device
    check(adapters.dim() == 1 and adapters.numel() == total and adapters.dtype == dtype and adapters.device == device
          and adapters.is_contiguous(), op,
          lambda: f"`adapters` must be the forward's flat copy of lora_a and lora_b ({total} contiguous elements in "
          f"x's dtype {dtype_name(dtype)} on {device}), got {shape(adapters.shape)} {dtype_name(adapters.dtype)}")


def check_lora_linear_backward_args(grad_y, x_lora, weight, lora_a, lora_b, xa) -> None:
    op = "lora_linear_backward"
    check_lora_linear_args(op, x_lora, None, weight, None, lora_a, lora_b)
    rows = x_lora.numel() // x_lora.shape[-1] if x_lora.shape[-1] else 0
    n_out, rank = weight.shape[0], lora_a.shape[0]
    check(grad_y.shape[-1] == n_out and grad_y.numel() // n_out == rows, op,
          lambda: f"`grad_y` {shape(grad_y.shape)} must be (..., {n_out}) over x's rows")
    check(xa.shape[-1] == rank and (xa.numel() // rank if rank else 0) == rows, op,
          lambda: f"`xa` {shape(xa.shape)} must be (..., {rank}) over x's rows")
