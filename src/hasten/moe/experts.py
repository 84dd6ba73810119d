"""The fused experts forward for transformers' MoE experts modules.

Works on the experts module's own weights in place (gate_up_proj (E, 2I, H), down_proj
(E, H, I)), so state dicts and checkpoints are unchanged. Per layer:

  ids (T, k) --moe_group--> grouping (one kernel, no host sync)
  x (T, H) --permute--> (S, H) --grouped GEMM gate_up--> (S, 2I) --swiglu--> (S, I)
           --grouped GEMM down--> (S, H) --combine, router weights--> (T, H)

LoRA on the experts (PEFT's target_parameters, one adapter): PEFT hands the experts module its
weights through a parametrization that folds W + scaling * lhs @ rhs per forward, a merged copy of
the whole expert stack that autograd keeps for backward (for Qwen3-30B-A3B, 1.2 GB a layer).
When that parametrization holds the factors (peft's _LoraFactorsProxy), the projection runs split
instead: x W^T + scaling * (x rhs^T) lhs^T per expert, three grouped GEMMs on the base weight and
the factors (lhs (E, out, r), rhs (E, r, in)); backward keeps x and the (S, r) product only.
"""

from __future__ import annotations

import functools
import os

import torch
from torch.nn.utils import parametrize

from hasten.observability import record_fallback
from hasten.ops import has_cuda_kernel
from hasten.ops import moe as moe_ops

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def _transformers_default_gate():
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a transformers without it has no per-class gate either
        return None
    return _default_apply_gate


def unsupported_reason(experts: torch.nn.Module) -> str | None:
    """Why this experts module cannot take the fused path, or None when it can.

    Follows transformers' experts interface (the flags `use_experts_implementation` sets): weights
    as stored (transposed or not), biases added per row (the row's expert), and the gated
    activation: hasten's fused SwiGLU kernel where it is transformers' default act(gate) * up on a
    concatenated [gate | up] with SiLU, else the class's own `_apply_gate` on the same rows
    (gpt-oss's clamped SwiGLU on interleaved columns), as transformers' grouped_mm path calls it."""
    if not (isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor)):
        return "its weights are not stored as gate_up_proj / down_proj 3-D tensors"
    if not getattr(experts, "has_gate", True):
        return "it has no gated projection (up_proj only)"
    if getattr(experts, "has_bias", False) and not all(
            isinstance(getattr(experts, name, None), torch.Tensor) for name in ("gate_up_proj_bias", "down_proj_bias")):
        return "its biases are not gate_up_proj_bias / down_proj_bias tensors"
    if getattr(experts, "has_post_expert_norm", False):
        return "it normalises each expert's output"
    if getattr(experts, "_is_expert_parallel", False):
        return "its experts are sharded across ranks (expert parallelism)"
    if getattr(type(experts), "_apply_gate", None) is None:
        return f"{type(experts).__name__} has no _apply_gate (not transformers' experts interface)"
    return None


def uses_fused_swiglu(experts: torch.nn.Module) -> bool:
    """True where the gate is transformers' default act(gate) * up on [gate | up] with SiLU: hasten's
    swiglu kernel computes exactly that. Otherwise the class's own _apply_gate runs."""
    if getattr(type(experts), "_apply_gate", None) is not _transformers_default_gate():
        return False
    if not getattr(experts, "is_concatenated", True):
        return False
    act = getattr(getattr(experts, "config", None), "hidden_act", None)
    return act in ("silu", "swish") or isinstance(getattr(experts, "act_fn", None), torch.nn.SiLU)


# float32 on both sides, the same formula in another order (expf against torch's sigmoid): 1e-7
# seen; a different formula (no clamp, no + 1, another layout) is off by far more than this
_CLAMPED_TOLERANCE = 1e-5
# the fused and the separate bias round x + b to the dtype alike; the gradients' GEMMs may order sums
# differently in bf16
_CLAMPED_BIAS_TOLERANCE = 1e-2


def clamped_gate_mismatch(experts: torch.nn.Module) -> str | None:
    """None where the class's own `_apply_gate` computes gpt-oss's clamped SwiGLU exactly, forward
    and backward, with the module's `alpha` and `limit`: interleaved (gate, up) pairs,
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit). Checked in float32
    on the module's device at its gate_up width, with values past both clamps and on the bounds, so
    on a GPU the check runs hasten's CUDA kernel too."""
    name = type(experts).__name__
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, limit)):
        return f"{name} has no numeric alpha and limit (gpt-oss's swiglu_alpha, swiglu_limit)"
    weight = experts.gate_up_proj
    if weight.device.type == "meta":
        return f"{name}'s weights are on the meta device, so its gate cannot be checked"
    width = weight.shape[-1] if getattr(experts, "is_transposed", False) else weight.shape[-2]
    if width % 2:
        return f"{name}'s gate_up width {width} is odd"
    gen = torch.Generator().manual_seed(0)
    try:  # gradients wanted even where accelerate() runs under no_grad or inference_mode
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.randn(3, width, generator=gen) * 2 * max(abs(float(limit)), 1.0)
            x[0, :4] = torch.tensor([float(limit), -float(limit), float(limit), float(limit)])  # on the bounds
            x = x.to(weight.device).requires_grad_()
            grad = torch.randn(3, width // 2, generator=gen).to(weight.device)
            want = type(experts)._apply_gate(experts, x)
            (want_grad,) = torch.autograd.grad(want, x, grad)
            got = moe_ops.clamped_swiglu(x, alpha, limit)
            (got_grad,) = torch.autograd.grad(got, x, grad)
    except Exception as exc:  # a gate that cannot run on a probe cannot be vouched for
        return f"{name}'s gate could not be checked ({type(exc).__name__}: {exc})"
    errors = [float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30))
              if a.shape == b.shape else float("inf") for a, b in ((got, want), (got_grad, want_grad))]
    if not max(errors) <= _CLAMPED_TOLERANCE:
        return (f"{name}._apply_gate computes something other than gpt-oss's clamped SwiGLU on interleaved pairs "
                f"(relative difference {max(errors):.1e} on random inputs, forward and backward)")
    return None


def clamped_bias_mismatch(experts: torch.nn.Module) -> str | None:
    """None where hasten's clamped SwiGLU kernel with the expert biases added inside it (each row's
    expert bias, rounded to the dtype, before the gate) equals the kernel run on gate_up + the
    biases added apart (one_hot @ bias, the unfused path), forward and the gradients of gate_up and
    the bias. Checked on the module's device in float32 and in its weights' dtype, at its gate_up
    width, on rows of three experts (one of them empty, and a row past the valid slots), so on a
    GPU the check runs the CUDA kernel's instantiations that training will."""
    name = type(experts).__name__
    weight = experts.gate_up_proj
    width = weight.shape[-1] if getattr(experts, "is_transposed", False) else weight.shape[-2]
    limit = float(experts.limit)
    gen = torch.Generator().manual_seed(1)
    errors = []
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for dtype in dict.fromkeys((torch.float32, weight.dtype)):
                x = (torch.randn(7, width, generator=gen) * 2 * max(abs(limit), 1.0)).to(weight.device, dtype)
                bias = (torch.randn(3, width, generator=gen) * limit).to(weight.device, dtype)
                ends = torch.tensor([2, 2, 6], dtype=torch.int32, device=weight.device)
                grad = torch.randn(7, width // 2, generator=gen).to(weight.device, dtype)
                leaves = [x.clone().requires_grad_(), bias.clone().requires_grad_()]
                want = moe_ops.clamped_swiglu(torch.addmm(leaves[0], moe_ops.row_experts_one_hot(ends, 7, dtype),
                                                          leaves[1]), experts.alpha, limit)
                want_grads = torch.autograd.grad(want, leaves, grad)
                fused = [x.clone().requires_grad_(), bias.clone().requires_grad_()]
                got = moe_ops.clamped_swiglu(fused[0], experts.alpha, limit, fused[1], ends)
                got_grads = torch.autograd.grad(got, fused, grad)
                for a, b in ((got, want), *zip(got_grads, want_grads)):
                    errors.append(float((a.detach().double() - b.detach().double()).norm()
                                        / b.detach().double().norm().clamp_min(1e-30)) if a.shape == b.shape
                                  else float("inf"))
    except Exception as exc:  # a kernel that cannot run on a probe cannot be vouched for
        return f"{name}'s gate with its expert biases fused could not be checked ({type(exc).__name__}: {exc})"
    if not max(errors) <= _CLAMPED_BIAS_TOLERANCE:
        return (f"hasten's clamped SwiGLU with {name}'s expert biases fused differs from the biases added apart "
                f"(relative difference {max(errors):.1e} on random inputs, forward and backward)")
    return None


def gate_kernel(experts: torch.nn.Module, checked: bool = False) -> str:
    """Which kernel computes the experts' gate: "swiglu" (transformers' default gate), "clamped_swiglu"
    (gpt-oss's, only where `checked`: accelerate() ran clamped_gate_mismatch on this module), or
    "own" (the class's `_apply_gate`, as transformers' grouped_mm path calls it)."""
    if uses_fused_swiglu(experts):
        return "swiglu"
    return "clamped_swiglu" if checked else "own"


def weights_in_gate(experts: torch.nn.Module, gate: str) -> bool:
    """Whether the router's weights multiply the rows inside the fused SwiGLU (moe_weighted_swiglu)
    rather than in the combine: transformers' default gate without biases (a down bias would be
    weighted too), unless training.moe.weights_in_gate turned it off (accelerate() sets the flag)."""
    return gate == "swiglu" and not getattr(experts, "has_bias", False) and getattr(
        experts, "_hasten_weights_in_gate", True)


def describe(experts: torch.nn.Module) -> str:
    """What the fused path runs for this experts class, for the report."""
    parts = ["one-kernel grouping", "grouped GEMM"]
    gate = getattr(experts, "_hasten_gate", None) or gate_kernel(experts)
    parts.append({"swiglu": "fused SwiGLU",
                  "clamped_swiglu": "fused clamped SwiGLU (gpt-oss: interleaved gate and up, alpha, limit)"}.get(
        gate, f"the model's own gated activation ({type(experts).__name__}._apply_gate)"))
    if getattr(experts, "has_bias", False):
        parts.append("expert biases (gate_up's inside the clamped kernel, down's in the combine)"
                     if gate == "clamped_swiglu" and getattr(experts, "_hasten_fused_bias", False)
                     else "expert biases (down's in the combine)")
    if weights_in_gate(experts, gate):
        parts.append("the router's weights in the SwiGLU, a summing combine")
    else:  # named, with the reason: the combine then keeps y for the weights' gradient
        reason = ("its expert biases" if getattr(experts, "has_bias", False) else
                  "training.moe.weights_in_gate is false" if gate == "swiglu" else "a gate other than the fused SwiGLU")
        parts.append(f"the router's weights in the deterministic combine ({reason})")
    return ", ".join(parts)


@functools.lru_cache(maxsize=None)
def _grouped_mm_built() -> bool:
    """Whether hasten._C has the grouped GEMM's CUDA kernel (asked once: the dispatcher query is
    host time on every expert GEMM)."""
    return has_cuda_kernel("moe_grouped_mm")


def _grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor, hastens_op: bool) -> str | None:
    """Why the experts' GEMMs cannot be one grouped GEMM (None: they can); `hastens_op`: through
    hasten::moe_grouped_mm, which this build must have, rather than torch's called directly."""
    if _GROUPED_MM is None:  # hasten's op runs torch's kernel wherever its own do not apply
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.device.type != "cuda":
        return "grouped GEMM needs a CUDA GPU"
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return f"grouped GEMM takes bfloat16 and the experts run in {weight.dtype}"
    if x.shape[1] % 8 or weight.shape[1] % 8 or weight.shape[2] % 8:
        return "grouped GEMM needs row sizes that are multiples of 8 elements"
    if hastens_op and not _grouped_mm_built():
        return "this hasten build has no CUDA kernel for hasten::moe_grouped_mm"
    return None


def _per_expert_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], weight.shape[1])
    bounds = offsets.tolist()  # the host sync of this fallback
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            out[start:end] = x[start:end] @ weight[expert].transpose(0, 1)
    return out


# Compiled, the per-expert loop (its boundaries read on the host) runs as one opaque op, so the
# layer's graph does not break; its backward is the same loop's gradient, written out (autograd
# cannot run inside an op's kernel).
@torch.library.custom_op("hasten_host::per_expert_matmul", mutates_args=())
def _per_expert_matmul_op(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _per_expert_matmul(x, weight, offsets)


@_per_expert_matmul_op.register_fake
def _per_expert_matmul_fake(x, weight, offsets):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("hasten_host::per_expert_matmul_backward", mutates_args=())
def _per_expert_matmul_backward_op(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                   offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_weight = torch.zeros_like(x), torch.zeros_like(weight)
    bounds = offsets.tolist()
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:  # out[s] = x[s] @ weight[e].T
            grad_x[start:end] = grad_out[start:end] @ weight[expert]
            grad_weight[expert] = grad_out[start:end].transpose(0, 1) @ x[start:end]
    return grad_x, grad_weight


@_per_expert_matmul_backward_op.register_fake
def _per_expert_matmul_backward_fake(grad_out, x, weight, offsets):
    return torch.empty_like(x), torch.empty_like(weight)


def _per_expert_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _per_expert_backward(ctx, grad_out):
    x, weight, offsets = ctx.saved_tensors
    grad_x, grad_weight = _per_expert_matmul_backward_op(grad_out.contiguous(), x, weight, offsets)
    return grad_x, grad_weight, None


_per_expert_matmul_op.register_autograd(_per_expert_backward, setup_context=_per_expert_setup)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, g: moe_ops.Grouping, transposed: bool = False) -> torch.Tensor:
    """x (S, in) in expert order, weight (E, out, in), or (E, in, out) when transposed -> (S, out);
    rows past the valid slots are undefined."""
    hastens_op = os.environ.get("HASTEN_GROUPED_GEMM") is not None
    reason = _grouped_mm_usable(x, weight, hastens_op)
    if reason is None and not hastens_op:
        # hasten::moe_grouped_mm's CUTLASS tiles pass their GPU tests (equal to torch's kernel bit
        # for bit in W3's blocks) but ran slower there on an H100 (0.86-0.96x; 5e6de35): the default
        # stays torch's grouped GEMM, called directly; HASTEN_GROUPED_GEMM (auto, torch, a tile)
        # opts into hasten's op
        return _GROUPED_MM(x, weight if transposed else weight.transpose(-2, -1), offs=g.group_ends)
    if reason is None:
        return moe_ops.grouped_mm(x, weight, g.group_ends, transposed)
    record_fallback("moe_grouped_gemm", f"MoE experts run one matmul per expert ({reason}); correct, slower, "
                    "and one host sync per layer")
    if transposed:
        weight = weight.transpose(-2, -1)
    if torch.compiler.is_compiling():
        return _per_expert_matmul_op(x, weight, g.offsets)
    return _per_expert_matmul(x, weight, g.offsets)


class MoeLoadStats:
    """Tokens per expert per layer, read once per logging step.

    Each tracked experts module holds its running total on its device (`_hasten_moe_tokens`,
    int64 (E,)); the forward adds the layer's counts to it in place: one tiny device op, no
    sync, no Python list that grows (under torch.compile a growing list is a guard on its length,
    a recompile per step). A checkpoint's recompute in backward does not add (eager: asked of
    autograd; compiled: the recompute is inside the compiled backward, which replays no Python
    and applies input mutations once)."""

    def __init__(self) -> None:
        self._layers: list[torch.nn.Module] = []
        self._recorded = False  # anything added since the last read

    def track(self, module: torch.nn.Module, num_experts: int, device: torch.device) -> None:
        module._hasten_moe_tokens = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self._layers.append(module)

    def untrack(self) -> None:
        for module in self._layers:
            module.__dict__.pop("_hasten_moe_tokens", None)
        self._layers.clear()

    def add(self, module: torch.nn.Module, counts: torch.Tensor) -> None:
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return  # inside backward: a checkpoint recompute
        total = module._hasten_moe_tokens
        if total.device != counts.device:  # the model moved after accelerate()
            total = module._hasten_moe_tokens = total.to(counts.device)
        total.add_(counts)
        self._recorded = True

    def summary(self, reset: bool = True) -> dict | None:
        if not self._recorded or not self._layers:
            return None
        totals = [m._hasten_moe_tokens for m in self._layers]
        table = torch.stack([t.to(totals[0].device) for t in totals]).float().cpu()  # one sync
        if reset:
            for total in totals:
                total.zero_()
            self._recorded = False
        mean = table.mean(dim=1).clamp_min(1e-9)
        imbalance = table.max(dim=1).values / mean  # 1.0 = perfectly even
        return {"tokens_per_expert_min": int(table.min()), "tokens_per_expert_max": int(table.max()),
                "imbalance_max": float(imbalance.max()), "imbalance_mean": float(imbalance.mean())}


def lora_factors(experts: torch.nn.Module, name: str):
    """(base weight, (lhs, rhs, scaling)) when PEFT's parametrization of `name` holds one adapter's
    low-rank factors (delta = scaling * lhs @ rhs, lhs (E, out, r), rhs (E, r, in)); None otherwise
    (no LoRA, or a merged delta: several adapters, a low-precision base)."""
    if not parametrize.is_parametrized(experts, name):
        return None
    chain = experts.parametrizations[name]
    if len(chain) != 1 or type(chain[0]).__name__ != "_LoraFactorsProxy":
        return None
    proxy = chain[0]
    if not (proxy.lhs.dim() == proxy.rhs.dim() == 3 and proxy.lhs.shape[-1] == proxy.rhs.shape[-2]):
        return None
    return chain.original, (proxy.lhs, proxy.rhs, float(proxy.scaling))


def _row_expert_one_hot(g: moe_ops.Grouping, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """(S, E) in `dtype`: 1 where a sorted row belongs to an expert (moe_ops.row_experts_one_hot)."""
    return moe_ops.row_experts_one_hot(g.group_ends, rows, dtype)


def _add_expert_bias(y: torch.Tensor, bias: torch.Tensor, row_one_hot: torch.Tensor) -> torch.Tensor:
    """y (S, out) + each row's expert bias (E, out), as y + one_hot (S, E) @ bias: the add rides in
    the GEMM's epilogue, and bias's gradient is one_hot^T @ grad, a GEMM with float32 accumulation.
    Gathering bias[row] instead wrote an (S, out) copy, and its backward scattered S x out partial
    sums onto E x out addresses (gpt-oss-20b's block: 65,536 rows onto 32)."""
    return torch.addmm(y, row_one_hot, bias.to(y.dtype))


def _projection(experts: torch.nn.Module, name: str, x: torch.Tensor, g: moe_ops.Grouping,
                row_one_hot: torch.Tensor | None) -> torch.Tensor:
    """x (S, in) through the expert weight `name` (E, out, in), or (E, in, out) where the module
    stores it transposed; split where it carries LoRA factors; plus the row's expert bias."""
    transposed = bool(getattr(experts, "is_transposed", False))
    split = lora_factors(experts, name)
    if split is None:
        y = grouped_linear(x, getattr(experts, name), g, transposed)
    else:
        base, (lhs, rhs, scaling) = split  # delta = scaling * lhs @ rhs, in the stored layout
        # (E, in, out): y = x (lhs rhs) = (x lhs) rhs, lhs (E, in, r) and rhs (E, r, out) in that
        # layout too; (E, out, in): y = x (lhs rhs)^T = (x rhs^T) lhs^T, rhs (E, r, in), lhs (E, out, r)
        first, second = (lhs, rhs) if transposed else (rhs, lhs)
        # PEFT's factors are permuted views of its adapters; the grouped GEMM reads them dense, and
        # the copies are small (E x out x r). The scaling goes on the (S, r) product, not the (S,
        # out) one: a pass over S x r values each way instead of S x out (W5's gate_up: 131,072 x
        # 1,536 per layer, forward and backward)
        low = grouped_linear(x, first.contiguous(), g, transposed) * scaling  # (S, r)
        y = grouped_linear(x, base, g, transposed) + grouped_linear(low, second.contiguous(), g, transposed)
    if row_one_hot is not None:
        y = _add_expert_bias(y, getattr(experts, f"{name}_bias"), row_one_hot)
    return y


def fused_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts forward: hidden (T, H), ids (T, k), weights (T, k) -> (T, H)."""
    g = moe_ops.group(top_k_index, self.num_experts)
    stats: MoeLoadStats | None = getattr(self, "_hasten_moe_stats", None)
    if stats is not None:
        stats.add(self, g.counts)
    x = moe_ops.permute(hidden_states, g)
    has_bias = bool(getattr(self, "has_bias", False))
    gate = getattr(self, "_hasten_gate", None) or gate_kernel(self)  # decided at accelerate(); else here
    # gpt-oss: gate_up's expert biases added inside the clamped kernel where accelerate() checked it
    # (clamped_bias_mismatch), instead of a pass of their own over the (S, 2I) tensor
    fused_bias = has_bias and gate == "clamped_swiglu" and getattr(self, "_hasten_fused_bias", False)
    row_one_hot = _row_expert_one_hot(g, x.shape[0], x.dtype) if has_bias and not fused_bias else None
    gate_up = _projection(self, "gate_up_proj", x, g, row_one_hot)
    if weights_in_gate(self, gate):
        # The router's weights times each row inside the SwiGLU, before the down projection (the same
        # product: the projection is linear in its input, LoRA's too), so the combine is a sum. Its
        # backward then needs no y: the weights' gradient is a row sum in the SwiGLU's backward, and
        # the (S, H) y is neither kept for it nor read again (Qwen3-30B-A3B: 131,072 x 2,048 a layer).
        act = moe_ops.weighted_swiglu(gate_up, top_k_weights.to(gate_up.dtype), g)
        return moe_ops.combine(_projection(self, "down_proj", act, g, None), None, g)
    if gate == "swiglu":
        act = moe_ops.swiglu(gate_up)
    elif gate == "clamped_swiglu" and fused_bias:
        act = moe_ops.clamped_swiglu(gate_up, self.alpha, self.limit, self.gate_up_proj_bias.to(gate_up.dtype),
                                     g.group_ends)
    elif gate == "clamped_swiglu":
        act = moe_ops.clamped_swiglu(gate_up, self.alpha, self.limit)
    else:
        act = type(self)._apply_gate(self, gate_up)
    # down_proj's expert biases: added inside the combine, which reads every row of y anyway (the
    # model's y + bias rounded to y's dtype, then weighted), instead of a pass of their own over the
    # (S, H) tensor (gpt-oss-20b's block: 65,536 x 2,880)
    y = _projection(self, "down_proj", act, g, None)
    down_bias = self.down_proj_bias.to(y.dtype) if has_bias else None
    return moe_ops.combine(y, top_k_weights.to(y.dtype), g, down_bias)
