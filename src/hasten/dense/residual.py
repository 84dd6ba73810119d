"""The residual add of a pre-norm decoder layer fused with the RMSNorm after it (hasten::add_rms_norm).

A decoder layer's forward (Llama's and the many written like it) contains

    hidden_states = residual + hidden_states        # the attention's output joins the stream
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)

(Gemma 2/3: the same three statements before `pre_feedforward_layernorm`). One kernel each way can
do all three: the sum and the norm in one pass, and in backward the norm's gradient and the
gradient the sum gets from the residual stream summed in the same pass (otherwise autograd adds
them with one more kernel). The layer class's own source is rewritten, not re-implemented: its
forward is parsed, each run of exactly those three statements becomes

    hidden_states, residual = <add_norm>(self.post_attention_layernorm, hidden_states, residual)

(the branch joining the stream may have its own name: Llama 4's `residual + attention_states`),
and the rest is compiled unchanged in the modeling module's namespace (its decorators included),
so the attention's and MLP's calls stay the model's own, argument for argument.

The stream's other join is in the backward: after

    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)

the layer's input gets two gradients (through `residual` and through the norm) that autograd adds
with a kernel of its own. Each such pair (not followed by an in-place change of `residual`) becomes

    hidden_states, residual = <norm_passing>(self.input_layernorm, hidden_states)

where `residual` is a view of the input whose gradient the norm's backward kernel adds (grad_add,
hasten.ops.dense.rms_norm_passing_input). A class whose forward has neither pattern, or whose
source cannot be read, keeps its forward, with the reason. At each call the helpers take the fused
path only where it computes what the statements compute (the norm is hasten's patched RMSNorm, no
hooks on it, one shape and dtype; <norm_passing> also only for an input that needs a gradient and
outside torch.compile); otherwise they run the statements as written.
"""

from __future__ import annotations

import ast
import types

import torch
from torch import nn

from hasten.dense.rewrite import name_of as _name
from hasten.dense.rewrite import install_rewritten_forwards, rewritten_forward, self_call
from hasten.dense.rewrite import single_target as _single_target
from hasten.dense.spec import NormSpec
from hasten.instance_forward import has_call_hooks
from hasten.ops.dense import add_rms_norm, rms_norm_passing_input

# The names the rewritten forward calls <add_norm> and <norm_passing> by (closure variables: the
# modeling module's namespace is not touched).
_HELPER = "_hasten_add_norm"
_PASSING_HELPER = "_hasten_norm_passing"
# Set by install_fused_norms on each norm it patched: the NormSpec the patched forward computes.
NORM_SPEC_ATTRIBUTE = "_hasten_norm_spec"


def _patched_rms(norm: nn.Module, x: torch.Tensor) -> NormSpec | None:
    """The norm's spec where hasten's patched RMSNorm computes it on x: no hooks, x's dtype."""
    spec: NormSpec | None = getattr(norm, NORM_SPEC_ATTRIBUTE, None)
    weight = getattr(norm, "weight", None)
    if (spec is not None and spec.kind == "rms" and "forward" in norm.__dict__ and isinstance(weight, torch.Tensor)
            and x.dtype == weight.dtype and not has_call_hooks(norm)):
        return spec
    return None


def add_norm(norm: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor):
    """(norm(residual + hidden_states), residual + hidden_states): fused where it is the same."""
    spec = _patched_rms(norm, hidden_states)
    if (spec is not None and hidden_states.shape == residual.shape and hidden_states.dtype == residual.dtype
            and hidden_states.device == residual.device):
        return add_rms_norm(hidden_states, residual, norm.weight, getattr(norm, spec.eps_attribute), spec.weight_offset)
    total = residual + hidden_states
    return norm(total), total


def norm_passing(norm: nn.Module, hidden_states: torch.Tensor):
    """(norm(hidden_states), hidden_states): where fused, the second is a view whose gradient the
    norm's backward kernel adds to the norm's own (no separate add in the backward)."""
    spec = _patched_rms(norm, hidden_states)
    if (spec is not None and hidden_states.requires_grad and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):
        return rms_norm_passing_input(hidden_states, norm.weight, getattr(norm, spec.eps_attribute),
                                      spec.weight_offset)
    return norm(hidden_states), hidden_states


def _match(body: list[ast.stmt], i: int, norms: frozenset[str]) -> tuple[str, str, str, str] | None:
    """(hidden, branch, residual, norm attribute) when body[i:i+3] is `h = r + a; r = h;
    h = self.norm(h)` (a: the branch joining the stream, often h itself; Llama 4 names it
    attention_states) with `norm` one of `norms` (a post-norm layer's `h = self.mlp(h)` in that
    place is no match)."""
    if i + 3 > len(body):
        return None
    first, second, third = body[i:i + 3]
    hidden = _single_target(first)
    if hidden is None or not (isinstance(first.value, ast.BinOp) and isinstance(first.value.op, ast.Add)):
        return None
    left, right = _name(first.value.left), _name(first.value.right)
    residual = _single_target(second)
    if None in (left, right, residual) or _name(second.value) != hidden or residual == hidden:
        return None
    if residual not in (left, right) or left == right:
        return None
    branch = right if left == residual else left
    norm = _norm_call(third, hidden, norms)
    return None if norm is None else (hidden, branch, residual, norm)


def _norm_call(statement: ast.stmt, hidden: str, norms: frozenset[str]) -> str | None:
    """The norm attribute when `statement` is `hidden = self.<norm>(hidden)`, `norm` one of `norms`."""
    if _single_target(statement) != hidden:
        return None
    norm = self_call(statement.value, norms)
    return norm if norm is not None and _name(statement.value.args[0]) == hidden else None


def _changed_in_place(name: str, statements: list[ast.stmt]) -> bool:
    """Whether `statements` may change `name`'s tensor in place: `name += ...`, `name[...] = ...`
    or a method call ending in `_` on it (a custom Function's view output refuses those)."""
    for node in (n for statement in statements for n in ast.walk(statement)):
        if isinstance(node, ast.AugAssign) and _name(node.target) == name:
            return True
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Subscript) and _name(t.value) == name for t in targets):
                return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _name(node.func.value) == name
                and node.func.attr.endswith("_") and not node.func.attr.startswith("_")):
            return True
    return False


def _match_passing(body: list[ast.stmt], i: int, norms: frozenset[str]) -> tuple[str, str, str] | None:
    """(hidden, residual, norm attribute) when body[i:i+2] is `r = h; h = self.norm(h)` with `norm`
    one of `norms` and nothing after it changes r in place."""
    if i + 2 > len(body):
        return None
    first, second = body[i:i + 2]
    residual, hidden = _single_target(first), _name(first.value) if isinstance(first, ast.Assign) else None
    if residual is None or hidden is None or residual == hidden:
        return None
    norm = _norm_call(second, hidden, norms)
    if norm is None or _changed_in_place(residual, body[i + 2:]):
        return None
    return hidden, residual, norm


def _rewrite(body: list[ast.stmt], candidates: frozenset[str],
             passing: bool) -> tuple[list[ast.stmt], list[str], list[str]]:
    """The statements with every match on one of the `candidates` norms fused, those norms in the
    order they come (with the add before them, or passing their input through), and the latter."""
    out, norms, passed, i = [], [], [], 0
    while i < len(body):
        found = _match(body, i, candidates)
        if found is not None:
            hidden, branch, residual, norm = found
            fused = ast.parse(f"{hidden}, {residual} = {_HELPER}(self.{norm}, {branch}, {residual})").body[0]
            out.append(ast.copy_location(fused, body[i]))
            norms.append(norm)
            i += 3
            continue
        found_passing = _match_passing(body, i, candidates) if passing else None
        if found_passing is not None:
            hidden, residual, norm = found_passing
            fused = ast.parse(f"{hidden}, {residual} = {_PASSING_HELPER}(self.{norm}, {hidden})").body[0]
            out.append(ast.copy_location(fused, body[i]))
            norms.append(norm)
            passed.append(norm)
            i += 2
            continue
        out.append(body[i])
        i += 1
    return out, norms, passed


def fused_forward(cls: type, candidates: frozenset[str], passing: bool = True
                  ) -> tuple[types.FunctionType | None, list[str], list[str], str | None]:
    """(the rewritten forward of decoder-layer class `cls`, the norms it fuses, those of them that
    pass their input through, None) or (None, [], [], why not); `candidates`: the attribute names
    of the layer's norms hasten patched; `passing`: whether `residual = h; h = self.<norm>(h)`
    pairs are rewritten too."""
    def transform(body: list[ast.stmt]):
        body, norms, passed = _rewrite(body, candidates, passing)
        if not norms:
            return None, (f"{cls.__name__}.forward has no `h = residual + h; residual = h; h = self.<norm>(h)` "
                          "and no `residual = h; h = self.<norm>(h)` to fuse (its residual stream is written "
                          "otherwise)")
        return body, (norms, passed)

    forward, report, why = rewritten_forward(cls, transform, {_HELPER: add_norm, _PASSING_HELPER: norm_passing})
    if forward is None:
        return None, [], [], why
    norms, passed = report
    return forward, norms, passed, None


def install_fused_residual(layers: list[nn.Module], fused_norms: set[int], passing: bool = True):
    """Give each decoder layer in `layers` its class's forward rewritten on the norms among its
    children that are `fused_norms` (ids of the norms hasten patched), the input norms' pairs too
    where `passing`. Returns (undo, number of layers, how many of them pass an input norm's input
    through, reasons classes were left alone)."""
    def norms_of(layer: nn.Module) -> frozenset[str]:
        # the layer's own norms hasten patched, by attribute name (one rewrite per class and set)
        return frozenset(name for name, child in layer.named_children() if id(child) in fused_norms)

    def build(layer: nn.Module):
        forward, _norms, passed, why = fused_forward(type(layer), norms_of(layer), passing)
        return forward, passed, why

    undo, passed, reasons = install_rewritten_forwards(layers, lambda m: (type(m), norms_of(m)), build)
    return undo, len(passed), sum(bool(p) for p in passed), reasons
