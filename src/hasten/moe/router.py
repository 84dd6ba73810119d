"""Float32 router logits on tensor cores (`kernels.router_logits`).

DeepSeek-V2/V3's router (and GLM-4.5's, dots.llm1's, Kimi's, about two dozen in transformers) writes

    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))

cuBLAS runs it on FFMA, and the casts copy the tokens' hidden states to float32 (and their gradient
back). The router class's own forward is rewritten (dense/rewrite.py) on that one statement:

    router_logits = _hasten_router_logits(F.linear, hidden_states, self.weight)

and the helper computes the same float32 logits from bfloat16 tensor-core products
(hasten.ops.moe.router_logits: exact products, float32 sums in another order) where
`router_logits_applies` says it can: bfloat16 hidden states on CUDA, a float32 or bfloat16 weight.
Anywhere else it runs the statement as written, the reason counted once as `router_logits`. The
softmax or sigmoid, the top-k, the correction bias and the scaling after it stay the class's own.
"""

from __future__ import annotations

import ast
import inspect

import torch
from torch import nn

from hasten.dense.rewrite import install_rewritten_forwards, name_of, rewritten_forward, single_target
from hasten.observability import record_fallback
from hasten.ops.moe import router_logits, router_logits_applies

_HELPER = "_hasten_router_logits"
FALLBACK = "router_logits"


def float32_router_logits(linear, hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear(hidden_states.type(torch.float32), weight.type(torch.float32))`, on tensor cores where
    that is the same computation (the module docstring)."""
    why = router_logits_applies(hidden_states, weight)
    if why is None and linear is not torch.nn.functional.linear:
        why = "the statement's F.linear is not torch's"
    if why is None:
        return router_logits(hidden_states, weight)
    record_fallback(FALLBACK, f"{why}; the router's float32 F.linear runs as written")
    return linear(hidden_states.type(torch.float32), weight.type(torch.float32))


def _float32_cast(node: ast.AST) -> ast.AST | None:
    """X when `node` is `X.type(torch.float32)`."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "type"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Attribute)
            and node.args[0].attr == "float32" and name_of(node.args[0].value) == "torch"):
        return node.func.value
    return None


def _router_statement(statement: ast.stmt) -> ast.AST | None:
    """The hidden states' expression when `statement` is
    `name = F.linear(X.type(torch.float32), self.weight.type(torch.float32))`."""
    if single_target(statement) is None:
        return None
    call = statement.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "linear"
            and name_of(call.func.value) == "F" and len(call.args) == 2 and not call.keywords):
        return None
    hidden, weight = (_float32_cast(a) for a in call.args)
    if (hidden is None or name_of(hidden) is None or not isinstance(weight, ast.Attribute)
            or weight.attr != "weight" or name_of(weight.value) != "self"):
        return None
    return hidden


def _rewrite(body: list[ast.stmt]):
    """(body with its router statements through the helper, how many), or (None, None) where the
    forward's top level has none."""
    out, count = list(body), 0
    for at, statement in enumerate(body):
        hidden = _router_statement(statement)
        if hidden is None:
            continue
        linear = statement.value.func  # F.linear, passed so the fallback calls what the statement named
        call = ast.Call(func=ast.Name(id=_HELPER, ctx=ast.Load()),
                        args=[linear, hidden, ast.Attribute(value=ast.Name(id="self", ctx=ast.Load()), attr="weight",
                                                            ctx=ast.Load())], keywords=[])
        out[at] = ast.copy_location(ast.Assign(targets=statement.targets, value=call), statement)
        count += 1
    return (out, count) if count else (None, None)


def _may_have_the_statement(cls: type) -> bool:
    """Whether cls.forward (under its decorators) calls something named linear and `type`."""
    code = getattr(inspect.unwrap(cls.forward), "__code__", None)
    return code is not None and "linear" in code.co_names and "type" in code.co_names


def install_float32_router_logits(model: nn.Module):
    """Give each module of `model` whose class's forward computes its router logits as the module
    docstring shows, and that holds a 2-D `weight`, its class's forward rewritten on that statement.
    Returns (undo, number of modules, reasons modules were left alone)."""
    candidates = [m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
                  and m.weight.dim() == 2 and _may_have_the_statement(type(m))]
    undo, patched, reasons = install_rewritten_forwards(
        candidates, type, lambda m: rewritten_forward(type(m), _rewrite, {_HELPER: float32_router_logits}))
    return undo, len(patched), reasons
