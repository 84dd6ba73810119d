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


# --- range checks: every numeric key names the key, the value and the range -----------------


@pytest.mark.parametrize("raw,message", [
    ({"training": {"learning_rate": 0}}, r"`training.learning_rate` must be positive \(greater than 0.*got 0.0"),
    ({"training": {"learning_rate": float("nan")}}, r"`training.learning_rate` must be a finite number; got nan"),
    ({"training": {"learning_rate": float("inf")}}, r"`training.learning_rate` must be a finite number; got inf"),
    ({"training": {"learning_rate": "-inf"}}, r"`training.learning_rate` must be a finite number; got '-inf'"),
    ({"training": {"learning_rate": "1e999"}}, r"`training.learning_rate` must be a finite number; got '1e999'"),
    ({"training": {"learning_rate": 10**400}}, r"`training.learning_rate` must be a finite number"),
    ({"training": {"learning_rate": "fast"}}, r"`training.learning_rate` must be a number \(e.g. 0.5 or 1e-4\); "
                                              r"got 'fast'"),
    ({"training": {"learning_rate": None}}, r"`training.learning_rate` must be a number .*got nothing"),
    ({"training": {"learning_rate": True}}, r"`training.learning_rate` must be a number"),
    ({"training": {"weight_decay": -0.1}}, r"`training.weight_decay` must be zero \(none\) or positive; got -0.1"),
    ({"training": {"weight_decay": float("nan")}}, r"`training.weight_decay` must be a finite number; got nan"),
    ({"training": {"seed": -1}}, r"`training.seed` must be from 0 to 4294967295; got -1"),
    ({"training": {"seed": 2**40}}, r"`training.seed` must be from 0 to 4294967295"),
    ({"training": {"warmup_steps": -1}}, r"`training.warmup_steps` must be zero or more; got -1"),
    ({"training": {"max_steps": 0}}, r"`training.max_steps` must be at least 1; got 0"),
    ({"training": {"gradient_accumulation_steps": 0}}, r"`training.gradient_accumulation_steps` must be at least 1"),
    ({"training": {"logging_steps": -3}}, r"`training.logging_steps` must be at least 1; got -3"),
    ({"training": {"checkpoint": {"interval_steps": 0}}}, r"`training.checkpoint.interval_steps` must be at least 1"),
    ({"training": {"checkpoint": {"keep_last": 0}}}, r"`training.checkpoint.keep_last` must be at least 1"),
    ({"training": {"checkpoint": {"max_memory_gib": 0}}}, r"`training.checkpoint.max_memory_gib` must be a positive"),
    ({"training": {"checkpoint": {"max_memory_gib": -2}}}, r"max_memory_gib` must be a positive number of GiB"),
    ({"training": {"checkpoint": {"max_memory_gib": ".nan"}}}, r"max_memory_gib` must be a number|finite"),
    ({"training": {"checkpoint": {"max_memory_gib": float("inf")}}}, r"max_memory_gib` must be a finite number"),
    ({"lora": {"r": 0}}, r"`lora.r` must be at least 1; got 0"),  # checked whether or not lora is enabled
    ({"lora": {"alpha": 0}}, r"`lora.alpha` must be positive .*got 0"),
    ({"lora": {"alpha": -8}}, r"`lora.alpha` must be positive"),
    ({"lora": {"dropout": 1.5}}, r"`lora.dropout` must be from 0 up to, not including, 1 .*got 1.5"),
    ({"lora": {"dropout": 1}}, r"`lora.dropout` must be from 0 up to, not including, 1"),
    ({"lora": {"dropout": -0.1}}, r"`lora.dropout` must be from 0"),
    ({"lora": {"dropout": float("nan")}}, r"`lora.dropout` must be a finite number"),
    ({"logging": {"profile_step": -1}}, r"`logging.profile_step` must be zero \(off\) or a step number; got -1"),
    ({"logging": {"profile_step": 21}}, r"`logging.profile_step` 21 comes after the last step \(training.max_steps "
                                        r"20\).*choose a step from 1 to 20, or 0"),
])
def test_out_of_range_values_name_key_value_and_range(raw, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict(raw)


@pytest.mark.parametrize("written,value", [("1e-4", 1e-4), ("3E-5", 3e-5), ("1.0e4", 1e4), (" 2e-3 ", 2e-3),
                                           ("0.01", 0.01), (5, 5.0)])
def test_float_keys_take_numbers_that_yaml_reads_as_strings(tmp_path, written, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"training:\n  learning_rate: {written}\n  weight_decay: {written}\n"
                    f"  checkpoint:\n    max_memory_gib: {written}\nlora:\n  dropout: 0.1\n")
    config = Config.from_yaml(path)
    assert config.training.learning_rate == value and isinstance(config.training.learning_rate, float)
    assert config.training.weight_decay == value and config.training.checkpoint.max_memory_gib == value


def test_yaml_float_nan_and_inf_are_rejected(tmp_path):
    path = tmp_path / "c.yaml"
    for written in (".nan", ".inf", "-.inf"):
        path.write_text(f"training:\n  learning_rate: {written}\n")
        with pytest.raises(ConfigError, match=r"`training.learning_rate` must be a finite number"):
            Config.from_yaml(path)


@pytest.mark.parametrize("written,value", [("true", "true"), ("false", "false"), ("'true'", "true"),
                                           ("auto", "auto"), ("yes", "true"), ("off", "false")])
def test_tensorboard_takes_yaml_booleans_as_the_strings(tmp_path, written, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"logging:\n  tensorboard: {written}\n")
    assert Config.from_yaml(path).logging.tensorboard == value


def test_literal_keys_still_refuse_booleans_they_have_no_choice_for():
    with pytest.raises(ConfigError, match=r"`training.device` must be one of 'auto', 'cuda', 'cpu'; got False"):
        Config.from_dict({"training": {"device": False}})


@pytest.mark.parametrize("written,value", [
    ("[q_proj, v_proj]", "q_proj,v_proj"),
    ("q_proj, v_proj", "q_proj,v_proj"),
    ("'q_proj,v_proj,'", "q_proj,v_proj"),
    ("[q_proj, q_proj, o_proj]", "q_proj,o_proj"),
])
def test_target_modules_take_a_list_or_a_comma_string(tmp_path, written, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"lora:\n  target_modules: {written}\n")
    config = Config.from_yaml(path)
    assert config.lora.target_modules == value
    assert Config.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("value,message", [
    ("", r"`lora.target_modules` names nothing"),
    ([], r"`lora.target_modules` names nothing"),
    (" , ", r"`lora.target_modules` names nothing"),
    ([1, 2], r"`lora.target_modules` must be a list of names \(e.g. \[a, b\]\) or a comma-separated string"),
    (None, r"`lora.target_modules` must be a list of names .*got nothing"),
])
def test_empty_or_malformed_target_modules_are_errors(value, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"lora": {"target_modules": value}})


def test_assistant_roles_default_list_and_comma_string():
    assert Config().data.assistant_roles == ["assistant"]
    assert Config.from_dict({"data": {"assistant_roles": "model"}}).data.assistant_roles == ["model"]
    assert Config.from_dict({"data": {"assistant_roles": "model, assistant"}}).data.assistant_roles == [
        "model", "assistant"]
    config = Config.from_dict({"data": {"assistant_roles": ["model", " gpt "]}})
    assert config.data.assistant_roles == ["model", "gpt"]
    assert Config.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("value,message", [
    ([], r"`data.assistant_roles` names nothing \(got \[\]\); give at least one name"),
    ("", r"`data.assistant_roles` names nothing"),
    ({"a": 1}, r"`data.assistant_roles` must be a list of names"),
    (["model", None], r"`data.assistant_roles` must be a list of names"),
    (["user"], r"`data.assistant_roles` names 'user', whose turns are context .*Gemma-style data: \[model\]"),
    (["assistant", "system", "tool"], r"names 'system', 'tool', whose turns are context"),
])
def test_bad_assistant_roles(value, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"data": {"assistant_roles": value}})


def test_empty_paths_mean_the_embedded_defaults():
    config = Config.from_dict({"model": {"path": ""}, "data": {"path": "  "}})
    assert config.model.path is None and config.data.path is None


def test_empty_text_field_is_an_error():
    with pytest.raises(ConfigError, match=r"`data.text_field` must name a field of the records"):
        Config.from_dict({"data": {"text_field": " "}})
