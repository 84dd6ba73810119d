"""A module class's forward, rewritten at the statement level and compiled where it was written.

hasten fuses runs of statements that cross module boundaries (a residual add and the norm after it;
a head norm and the rotary embedding after it) without re-implementing any family's forward: the
class's own source is parsed, a transform replaces the matched statements with calls to hasten's
helpers, and the rest compiles unchanged in the namespace the forward was written in (its
decorators included), so every other call stays the model's own, argument for argument. The
helpers are closure variables of the compiled function: the modeling module is not touched.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Callable

from torch import nn

from hasten.instance_forward import replace_forward, restore_forward, without_hooked


def rewritten_forward(cls: type, transform: Callable[[list[ast.stmt]], tuple[list[ast.stmt], object]],
                      helpers: dict[str, object]) -> tuple[types.FunctionType | None, object, str | None]:
    """(cls.forward with `transform` applied to its body, what transform reported, None), or
    (None, None, why not). `transform(body)` returns (new body, report) or (None, why not); the new
    body calls the helpers by their names in `helpers`."""
    function = cls.forward
    try:
        source_lines, first_line = inspect.getsourcelines(function)
        filename = inspect.getsourcefile(function) or f"<{cls.__module__}>"
    except (OSError, TypeError) as exc:
        return None, None, f"{cls.__name__}.forward's source cannot be read ({exc})"
    if "__class__" in inspect.unwrap(function).__code__.co_freevars:
        return None, None, f"{cls.__name__}.forward uses super() (a closure the rewrite cannot carry)"
    tree = ast.parse(textwrap.dedent("".join(source_lines)))
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None, None, f"{cls.__name__}.forward is not a plain function definition"
    definition = tree.body[0]
    body, report = transform(definition.body)
    if body is None:
        return None, None, report
    definition.body = body
    # def _hasten_factory(<helpers>): <the forward, decorators and all>; return forward
    module = ast.parse(f"def _hasten_factory({', '.join(helpers)}):\n    pass\n")
    module.body[0].body = [definition, ast.Return(value=ast.Name(id=definition.name, ctx=ast.Load()))]
    ast.fix_missing_locations(module)
    ast.increment_lineno(module, first_line - 1)  # tracebacks point at the modeling file's lines
    namespace: dict = {}
    # the namespace the forward was written in (an inherited forward: its parent's module)
    exec(compile(module, filename, "exec"), inspect.unwrap(function).__globals__, namespace)  # noqa: S102
    return namespace["_hasten_factory"](*helpers.values()), report, None


def install_rewritten_forwards(modules: list[nn.Module], key_of: Callable[[nn.Module], object],
                               build: Callable[[nn.Module], tuple]) -> tuple[Callable[[], None], list, list[str]]:
    """Give each of `modules` that accelerate's hooks do not wrap the forward `build(module)` returns
    for its key (one build per `key_of(module)`: (forward or None, report, why not), forward a
    function of self). Returns (undo, the reports of the modules given one, the sorted reasons
    modules were left alone)."""
    built: dict = {}
    modules, hooked = without_hooked(modules)
    reasons: set[str] = set(hooked)
    patched, reports = [], []
    for module in modules:
        key = key_of(module)
        if key not in built:
            built[key] = build(module)
        forward, report, why = built[key]
        if forward is None:
            if why is not None:
                reasons.add(why)
            continue
        replace_forward(module, types.MethodType(forward, module))
        patched.append(module)
        reports.append(report)

    def undo() -> None:
        for module in patched:
            restore_forward(module)

    return undo, reports, sorted(reasons)


def name_of(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def single_target(statement: ast.stmt) -> str | None:
    """The name `statement` assigns when it is `name = ...`."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        return name_of(statement.targets[0])
    return None


def self_call(node: ast.AST, attributes: frozenset[str]) -> str | None:
    """The attribute when `node` is `self.<attribute>(one positional argument)`, attribute one of
    `attributes`."""
    if (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], ast.Starred) and isinstance(node.func, ast.Attribute)
            and name_of(node.func.value) == "self" and node.func.attr in attributes):
        return node.func.attr
    return None
