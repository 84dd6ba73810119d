"""A head norm and the rotary embedding after it in one kernel each way (hasten::rms_norm_rope).

Qwen3's attention (Qwen3-MoE's, Gemma 3's and the many written like them) computes

    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    ...
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

(Gemma 3: `query_states = self.q_norm(query_states)` on the projection already transposed). With
hasten's RMSNorm and rotary kernels that is two kernels per tensor each way, each reading and
writing all of q or k; the fused op reads x once and writes the rotated output once (backward: reads
the output's gradient and x, writes x's gradient). The attention class's own forward is rewritten
(dense/rewrite.py): each norm statement loses its norm call,

    query_states = self.q_proj(hidden_states).view(hidden_shape)

and the rotary statement becomes

    query_states, key_states = _hasten_norm_rope(apply_rotary_pos_emb, self.q_norm, query_states, True,
                                                 self.k_norm, key_states, True, cos, sin)

(True: the norm statement's `.transpose(1, 2)` moved into the helper, after the norm, where it
was). Only where nothing between the two statements reads or writes those names, so that the norm's
output is the rotary's input and nothing else's. At each call the helper takes the fused op only
where it computes what the statements compute: both norms hasten's patched RMSNorm on x's dtype
without hooks, with a weight over head_dim; `apply_rotary_pos_emb` hasten's replacement, rotating
q and k (B, heads, L, D) as that replacement would; cos and sin of x's dtype; a shape the kernel
takes. Otherwise it runs the statements as written (norm, transpose, the rotary function), counted
once per reason as `fused_qk_norm_rope`.
"""

from __future__ import annotations

import ast
import inspect

import torch
from torch import nn

from hasten.dense.patch import KERNEL_ANGLES_ATTRIBUTE
from hasten.dense.residual import _patched_rms
from hasten.dense.rewrite import install_rewritten_forwards, name_of, rewritten_forward, self_call, single_target
from hasten.observability import record_fallback
from hasten.ops.dense import rms_norm_rope, rms_norm_rope_covers

_HELPER = "_hasten_norm_rope"
_ROTARY = "apply_rotary_pos_emb"  # the modeling module's global that hasten's rotary patch replaces


def _fused(rotary, pairs: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """(q', k') through hasten::rms_norm_rope where it computes what norm, transpose and `rotary`
    compute (the module docstring), else None (the reason counted)."""
    kernel_angles = getattr(rotary, KERNEL_ANGLES_ATTRIBUTE, None)
    if kernel_angles is None or len(args) < 2:
        record_fallback("fused_qk_norm_rope", "apply_rotary_pos_emb is not hasten's rotary kernel at this call; "
                        "the head norms and the model's rotary function run as written")
        return None
    cos, sin, rest = args[0], args[1], args[2:]
    tensors = [x.transpose(1, 2) if transposed else x for _norm, x, transposed in pairs]
    angles = kernel_angles(tensors, cos, sin, rest, kwargs)  # cos and sin converted once for q and k
    specs = [_patched_rms(norm, x) for (norm, _x, _transposed), x in zip(pairs, tensors)]
    why = None
    if angles is None:
        why = "a rotary call hasten::rope would not take as (batch, heads, length, head_dim)"
    elif any(spec is None or norm.weight.shape != x.shape[-1:]
             for spec, (norm, _x, _transposed), x in zip(specs, pairs, tensors)):
        why = "a head norm that is not hasten's RMSNorm over head_dim on this input (hooks, another dtype)"
    elif any(angles[0].dtype != x.dtype for x in tensors):
        why = f"cos and sin in {angles[0].dtype}, q and k in {tensors[0].dtype}"
    elif not all(rms_norm_rope_covers(x, angles[0].shape[-1], angles[2]) for x in tensors):
        why = (f"head_dim {tensors[0].shape[-1]} with rotary dim {angles[0].shape[-1]}, a shape the fused kernel "
               "does not take")
    if why is not None:
        record_fallback("fused_qk_norm_rope", f"{why}; the head norms and the rotary kernel run one after the other")
        return None
    kernel_cos, kernel_sin, interleaved = angles
    return tuple(rms_norm_rope(x, norm.weight, kernel_cos, kernel_sin, getattr(norm, spec.eps_attribute),
                               spec.weight_offset, interleaved)
                 for spec, (norm, _x, _transposed), x in zip(specs, pairs, tensors))


def norm_rope(rotary, q_norm: nn.Module, q: torch.Tensor, q_transposed: bool, k_norm: nn.Module, k: torch.Tensor,
              k_transposed: bool, *args, **kwargs):
    """`rotary(q_norm(q)[.transpose(1, 2)], k_norm(k)[.transpose(1, 2)], *args, **kwargs)`: fused
    where that is the same computation."""
    fused = _fused(rotary, ((q_norm, q, q_transposed), (k_norm, k, k_transposed)), args, kwargs)
    if fused is not None:
        return fused
    q, k = q_norm(q), k_norm(k)
    return rotary(q.transpose(1, 2) if q_transposed else q, k.transpose(1, 2) if k_transposed else k, *args, **kwargs)


def _rotary_pair(statement: ast.stmt) -> tuple[str, str] | None:
    """(q, k) when `statement` is `q, k = apply_rotary_pos_emb(q, k, ...)`."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Tuple) and len(statement.targets[0].elts) == 2):
        return None
    q, k = (name_of(target) for target in statement.targets[0].elts)
    call = statement.value
    if (q is None or k is None or q == k or not isinstance(call, ast.Call) or name_of(call.func) != _ROTARY
            or len(call.args) < 2 or [name_of(a) for a in call.args[:2]] != [q, k]):
        return None
    return q, k


def _is_transpose_1_2(node: ast.AST) -> ast.AST | None:
    """X when `node` is `X.transpose(1, 2)`."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "transpose"
            and not node.keywords and len(node.args) == 2
            and all(isinstance(a, ast.Constant) and type(a.value) is int for a in node.args)
            and [a.value for a in node.args] == [1, 2]):
        return node.func.value
    return None


def _mentions(statement: ast.stmt, name: str) -> bool:
    return any(isinstance(node, ast.Name) and node.id == name for node in ast.walk(statement))


def _norm_statement(body: list[ast.stmt], rotary_at: int, name: str, norms: frozenset[str]):
    """(index, norm attribute, the norm's argument, transposed) for the last statement before
    body[rotary_at] that assigns `name`, when it is `name = self.<norm>(X)` or
    `name = self.<norm>(X).transpose(1, 2)` and no statement between mentions `name`; else None."""
    for index in range(rotary_at - 1, -1, -1):
        if single_target(body[index]) == name:
            break
        if _mentions(body[index], name):
            return None
    else:
        return None
    value = body[index].value
    inner = _is_transpose_1_2(value)
    norm = self_call(inner if inner is not None else value, norms)
    if norm is None:
        return None
    call = inner if inner is not None else value
    return index, norm, call.args[0], inner is not None


def _rewrite(body: list[ast.stmt], norms: frozenset[str], class_name: str):
    """(body with its first `q, k = apply_rotary_pos_emb(q, k, ...)` and the head norms before it
    fused, the two norm attributes), (None, None) where the body has no such rotary call, or
    (None, why) where its head norms are not written as this file fuses them."""
    for at, statement in enumerate(body):
        pair = _rotary_pair(statement)
        if pair is None:
            continue
        found = [_norm_statement(body, at, name, norms) for name in pair]
        if None in found:
            return None, (f"{class_name}.forward does not apply its head norms ({', '.join(sorted(norms))}) to q and k "
                          "in the statements right before apply_rotary_pos_emb")
        out = list(body)
        helper_args = [ast.Name(id=_ROTARY, ctx=ast.Load())]
        for name, (index, norm, argument, transposed) in zip(pair, found):
            if name_of(argument) == name:  # `q = self.q_norm(q)`: nothing left to assign
                out[index] = ast.copy_location(ast.Pass(), body[index])
            else:
                out[index] = ast.copy_location(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=argument),
                                               body[index])
            helper_args += [ast.Attribute(value=ast.Name(id="self", ctx=ast.Load()), attr=norm, ctx=ast.Load()),
                            ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=transposed)]
        call = statement.value
        fused_call = ast.Call(func=ast.Name(id=_HELPER, ctx=ast.Load()), args=helper_args + call.args[2:],
                              keywords=call.keywords)
        out[at] = ast.copy_location(ast.Assign(targets=statement.targets, value=fused_call), statement)
        return out, [found[0][1], found[1][1]]
    return None, None


def _calls_rotary(cls: type) -> bool:
    """Whether cls.forward (under its decorators) names the rotary function."""
    code = getattr(inspect.unwrap(cls.forward), "__code__", None)
    return code is not None and _ROTARY in code.co_names


def install_fused_qk_norm_rope(model: nn.Module, fused_norms: set[int]):
    """Give each module of `model` whose forward applies two of its own patched norms (ids in
    `fused_norms`) to q and k right before `apply_rotary_pos_emb` its class's forward rewritten on
    them. Returns (undo, number of modules, reasons classes with such a rotary call were left alone)."""
    # modules whose forward calls the rotary function and holds two norms hasten patched
    candidates = [m for m in model.modules() if _calls_rotary(type(m))
                  and sum(id(child) in fused_norms for child in m.children()) >= 2]

    def norms_of(module: nn.Module) -> frozenset[str]:
        return frozenset(name for name, child in module.named_children() if id(child) in fused_norms)

    def build(module: nn.Module):
        norms = norms_of(module)
        return rewritten_forward(type(module), lambda body, n=norms, c=type(module).__name__: _rewrite(body, n, c),
                                 {_HELPER: norm_rope})

    undo, patched, reasons = install_rewritten_forwards(candidates, lambda m: (type(m), norms_of(m)), build)
    return undo, len(patched), reasons
