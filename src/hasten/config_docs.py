"""Generates docs/configuration.md from the dataclasses in hasten.config.

Each key's type and default come from the dataclass fields; its description is the `# ...`
comment block directly above the field in config.py. Keys that `Config().inactive_features()`
lists are marked "accepted, not active yet".

    python -m hasten.config_docs > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from typing import Any, Literal

from hasten.config import Config

REGENERATE = "python -m hasten.config_docs > docs/configuration.md"
NO_DESCRIPTION = "(no comment in config.py)"
_FIELD_LINE = re.compile(r"^\s*([A-Za-z_]\w*)\s*:")


@dataclasses.dataclass(frozen=True)
class Key:
    """One YAML key of the schema: a leaf value or a section (nested dataclass)."""

    path: str
    hint: Any
    default: Any
    description: str
    is_section: bool


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the `#` comment lines directly above it in the class source, joined."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    lines = inspect.getsource(cls).splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("class "))  # after decorators
    body = [line for line in lines[start + 1:] if line.strip()]
    indent = len(body[0]) - len(body[0].lstrip()) if body else 0
    for line in body:
        stripped = line.strip()
        if len(line) - len(line.lstrip()) != indent:  # method bodies and continuation lines
            pending = []
            continue
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD_LINE.match(line)
        if match:
            comments.setdefault(match.group(1), " ".join(pending))
        pending = []
    return comments


def walk(cls: type = Config, prefix: str = "") -> list[Key]:
    """Every key of the schema in source order, sections before their keys."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    keys: list[Key] = []
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys.append(Key(path, hint, None, comments.get(f.name, ""), True))
            keys.extend(walk(hint, path + "."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        keys.append(Key(path, hint, default, comments.get(f.name, ""), False))
    return keys


def leaf_keys() -> list[str]:
    return [key.path for key in walk() if not key.is_section]


def inactive_keys() -> dict[str, str]:
    """Key path -> why it is not active, from Config().inactive_features()."""
    result = {}
    for entry in Config().inactive_features():
        path, _, rest = entry.partition(" ")
        result[path] = rest.strip().removeprefix("(").removesuffix(")")
    return result


def yaml_value(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(item) for item in value) + "]"
    return repr(value)


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(f"`{yaml_value(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is list:
        return "list of " + " or ".join(type_name(a) for a in args)
    if dataclasses.is_dataclass(hint):
        return "section"
    return getattr(hint, "__name__", str(hint))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _defaults_yaml(keys: list[Key]) -> list[str]:
    lines = []
    for key in keys:
        depth = key.path.count(".")
        name = key.path.rsplit(".", 1)[-1]
        lines.append("  " * depth + (f"{name}:" if key.is_section else f"{name}: {yaml_value(key.default)}"))
    return lines


# Environment variables hasten reads, beside the config file: (name, when it is read, what it does).
# tests/test_config_docs.py checks that every HASTEN_* variable the code reads is listed here.
ENVIRONMENT = (
    ("HASTEN_CPU_ONLY", "install", "`1`: build the CPU implementations only, even where a CUDA torch and nvcc "
     "are present."),
    ("HASTEN_CUDNN_ATTENTION", "install", "`0`: leave out the cuDNN varlen attention op (a build about two "
     "minutes shorter); packed attention then runs flash-attn or torch's varlen kernel, said at run time."),
    ("HASTEN_CUDNN_FRONTEND_INCLUDE", "install", "the folder holding `cudnn_frontend.h`, where the "
     "nvidia-cudnn-frontend pip package is not installed."),
    ("HASTEN_CUTLASS_DIR", "install", "a CUTLASS checkout (or its include folder) for the MoE experts' grouped "
     "GEMM kernels, where the nvidia-cutlass pip package is not installed; with either, 9.0 in the architecture "
     "list is built as 9.0a."),
    ("HASTEN_CUTLASS", "install", "`0`: leave out the CUTLASS grouped GEMM kernels; MoE experts then run torch's "
     "grouped GEMM throughout (`hasten doctor` says which a build has)."),
    ("HASTEN_GROUPED_GEMM", "run", "MoE experts' grouped GEMM through hasten's op: `auto` (hasten's CUTLASS tiles "
     "on sm90 where an H200 probe measured them faster, torch's kernel elsewhere), `torch`, `cutlass_64x256` or "
     "`cutlass_128x128` (for A/B runs); read on every call. Unset (the default): torch's grouped GEMM called "
     "directly; `auto` measured 0.86-0.96x of it in W3's blocks on an H100 (docs/benchmarks.md)."),
    ("HASTEN_VERIFY", "run", "`1`: every attention call re-derives the packing metadata from position_ids and "
     "raises on a mismatch (as `attention.verify: true`); under torch.compile it is read when a layer is traced."),
    ("HASTEN_ATTENTION_BACKWARD_PER_HEAD_ABOVE_BYTES", "run", "the float32 workspace, in bytes, above which the "
     "varlen attention backward runs once per K/V head (default 1 GiB; `0`: every call)."),
    ("HASTEN_LORA_GRADS_KERNEL", "run", "`0`: the fused LoRA backward's two thin products from two GEMMs instead "
     "of the kernel that reads the output gradient once (a comparison; same results to rounding)."),
    ("HASTEN_LORA_GRADS_CONFIG", "run", "`0`: that kernel's plain variant instead of the lean default (a "
     "comparison)."),
    ("HASTEN_LORA_GATED", "run", "`1` (experimental): a gated MLP's gate/up LoRA pair and its activation as one op "
     "whose CUDA backward is one pass; slower than the default on the H200 so far (docs/design.md, LoRA)."),
    ("HASTEN_LORA_GATED_KERNEL", "run", "`0`: that op's backward as the activation's kernel, then the thin "
     "products (a comparison)."),
    ("HASTEN_CE_CLUSTER", "run", "`1` (experimental, sm_90): the fused loss's row kernel holds each row of logits "
     "in a thread-block cluster's shared memory, so the gradient pass does not read it from memory again; no "
     "faster on an H100 so far (docs/design.md, loss). Read on every call."),
)


def _environment_section() -> list[str]:
    out = ["## Environment variables", "",
           "Read at install (`pip install -e .`, `make install`) or at run time; none is needed for a normal run.",
           "", "| variable | read at | what it does |", "| --- | --- | --- |"]
    out += [f"| `{name}` | {when} | {_cell(what)} |" for name, when, what in ENVIRONMENT]
    return out + [""]


def render_config_reference() -> str:
    keys = walk()
    inactive = inactive_keys()
    out = [
        "# Configuration reference",
        "",
        f"Generated from `src/hasten/config.py` by `{REGENERATE}`; do not edit by hand.",
        "",
        "A config file is YAML with one mapping per section below (`hasten train --config FILE`). Every key is "
        "optional; a missing key takes its default. An unknown key is an error naming the nearest valid key, "
        "a value of the wrong type is an error naming the key and the expected type, and a value out of range "
        "(NaN and infinity included) is an error naming the key, the value and the allowed range. A float key "
        "also takes a number that YAML 1.1 reads as a string (`1e-4`, written without a dot), a key whose choices "
        "include `\"true\"` and `\"false\"` also takes YAML `true` and `false`, and a list key takes a YAML "
        "list or a comma-separated string. Keys marked "
        "**accepted, not active yet** load without error, but their feature is not built in this version; "
        "`hasten train` lists them as not active at start-up and in `summary.json` (`hasten_inactive`).",
        "",
    ]
    sections = [Key("", Config, None, "", True)] + [k for k in keys if k.is_section]
    for section in sections:
        leaves = [k for k in keys if not k.is_section and k.path.rsplit(".", 1)[0] == section.path]
        if not leaves:
            continue
        out += [f"## `{section.path}`", ""]
        if section.description:
            out += [section.description, ""]
        out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for key in leaves:
            description = key.description or NO_DESCRIPTION
            if key.path in inactive:
                description = f"**Accepted, not active yet** ({inactive[key.path]}). {description}"
            out.append(f"| `{key.path}` | {_cell(type_name(key.hint))} | `{yaml_value(key.default)}` | "
                       f"{_cell(description)} |")
        out.append("")
    out += _environment_section()
    out += ["## All keys with their defaults", "", "```yaml", *_defaults_yaml(keys), "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render_config_reference(), end="")
