from pathlib import Path

import pytest

from hasten.config import Config, ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_deployment_guide_yaml_loads_as_written():
    config = Config.from_yaml(ROOT / "configs" / "deployment_guide.yaml")
    assert config.training.packed_sequence is True and config.training.metadata_cache is True
    assert config.training.checkpoint.double_buffer is True
    assert config.training.checkpoint.interval_steps == 100
    assert config.training.moe.fused_grouping is True
    # the guide's double_buffer switch turns on planned, double-buffered activation offload
    assert config.training.checkpoint.offload_mode() == "auto"
    assert config.training.checkpoint.offload_double_buffer()
    assert config.inactive_features() == []


def test_unknown_key_names_key_and_nearest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  packed_sequnce: true\n")
    with pytest.raises(ConfigError, match=r"unknown key `training.packed_sequnce`; did you mean `training.packed_sequence`"):
        Config.from_yaml(path)
    with pytest.raises(ConfigError, match=r"unknown key `trainer`; did you mean `training`"):
        Config.from_dict({"trainer": {}})
    with pytest.raises(ConfigError, match=r"unknown key `training.checkpoint.zzz`; valid keys here"):
        Config.from_dict({"training": {"checkpoint": {"zzz": 1}}})


@pytest.mark.parametrize("raw,message", [
    ({"training": {"packed_sequence": "yes"}}, r"`training.packed_sequence` must be true or false; got 'yes'"),
    ({"training": {"checkpoint": {"interval_steps": 1.5}}}, r"`training.checkpoint.interval_steps` must be an integer"),
    ({"training": {"max_tokens": True}}, r"`training.max_tokens` must be an integer"),
    ({"training": {"overlong": "wrap"}}, r"`training.overlong` must be one of 'truncate', 'drop'; got 'wrap'"),
    ({"training": {"max_tokens": 0}}, r"`training.max_tokens` must be at least 1"),
    ({"training": {"learning_rate": -1}}, r"`training.learning_rate` must be positive"),
    ({"training": {"fsdp2_layers_per_unit": -2}}, r"`training.fsdp2_layers_per_unit` must be 0 \(auto\)"),
    ({"training": 3}, r"`training` must be a mapping"),
    ({"model": {"path": 5}}, r"`model.path` must be a string"),
])
def test_wrong_types_and_ranges(raw, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict(raw)


def test_yaml_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Config.from_yaml(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        Config.from_yaml(top)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert Config.from_yaml(empty) == Config()


def test_round_trip_and_nullable_fields():
    config = Config.from_dict({"model": {"path": None}, "training": {"learning_rate": 1}})
    assert config.training.learning_rate == 1.0
    assert Config.from_dict(config.to_dict()) == config
