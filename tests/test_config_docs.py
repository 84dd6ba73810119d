import dataclasses
import re
import typing
from pathlib import Path

import yaml

from hasten.config import Config
from hasten.config_docs import ENVIRONMENT, REGENERATE, field_comments, render_config_reference

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
GUIDE_KEYS = (
    "training.packed_sequence",
    "training.metadata_cache",
    "training.checkpoint.double_buffer",
    "training.checkpoint.interval_steps",
    "training.moe.fused_grouping",
)


def _leaves(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _flatten(raw: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in raw.items():
        out += _flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key]
    return out


def _row(doc: str, key: str) -> str:
    rows = [line for line in doc.splitlines() if line.startswith(f"| `{key}` |")]
    assert len(rows) == 1, f"expected one table row for {key}, found {len(rows)}"
    return rows[0]


def test_configuration_md_is_generated_from_config():
    assert DOC.read_text(encoding="utf-8") == render_config_reference(), (
        f"docs/configuration.md is out of date with src/hasten/config.py; regenerate it: {REGENERATE}")


def test_every_leaf_key_has_a_row_with_type_and_default():
    doc = render_config_reference()
    leaves = _leaves(Config)
    assert len(leaves) >= 20
    for key in leaves:
        _row(doc, key)
    assert "one of `\"truncate\"`, `\"drop\"`" in _row(doc, "training.overlong")
    assert "| `4096` |" in _row(doc, "training.max_tokens")
    assert "str or null" in _row(doc, "model.path")


def test_deployment_guide_keys_are_documented_and_inactive_ones_marked():
    raw = yaml.safe_load((ROOT / "configs" / "deployment_guide.yaml").read_text(encoding="utf-8"))
    assert sorted(_flatten(raw)) == sorted(GUIDE_KEYS)
    doc = render_config_reference()
    inactive = {entry.split(" ", 1)[0] for entry in Config().inactive_features()}
    assert "training.checkpoint.double_buffer" not in inactive  # activation offload is built
    for key in GUIDE_KEYS:
        row = _row(doc, key)
        assert ("accepted, not active yet" in row.lower()) == (key in inactive), row


def test_descriptions_come_from_source_comments():
    comments = field_comments(Config.__dataclass_fields__["training"].default_factory)
    assert comments["packed_sequence"].startswith("Pack short samples into rows")
    assert "re-derives it inside every attention layer" in comments["metadata_cache"]  # two comment lines joined
    assert comments["max_steps"] == "Optimizer steps to train (the LR schedule spans them)."
    assert comments["seed"].startswith("Seeds model init")  # the comment directly above, not an earlier one
    assert "Pack short samples" in _row(render_config_reference(), "training.packed_sequence")


def test_defaults_block_loads_back_to_the_default_config():
    block = re.search(r"```yaml\n(.*?)```", render_config_reference(), re.S).group(1)
    assert Config.from_dict(yaml.safe_load(block)) == Config()


def test_every_environment_variable_the_code_reads_is_documented():
    """Each HASTEN_* name read through os.environ or getenv in src/, csrc/ or setup.py has a row in
    ENVIRONMENT (and so in docs/configuration.md), and each row names a variable the code reads."""
    read = set()
    sources = [ROOT / "setup.py", *(ROOT / "src").rglob("*.py"),
               *(p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".h", ".cu", ".cuh"))]
    pattern = re.compile(r"(?:getenv|environ(?:\.get)?)\s*[(\[]\s*\"(HASTEN_[A-Z0-9_]+)\"")
    for path in sources:
        read |= set(pattern.findall(path.read_text(encoding="utf-8")))
    documented = {name for name, _when, _what in ENVIRONMENT}
    assert read, "the pattern found no variable: it no longer matches how the code reads them"
    assert read <= documented, f"read but not documented in hasten.config_docs.ENVIRONMENT: {sorted(read - documented)}"
    assert documented <= read, f"documented but not read anywhere: {sorted(documented - read)}"
