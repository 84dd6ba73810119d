"""Bad config values, data files and model folders given to `hasten train`: each is refused with exit 2
and a message naming the problem and the fix, and loses nothing; the inputs that YAML or the data
write in another form than meant (1e-4, tensorboard: true, Gemma's model role) are accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cli.bad_inputs.harness import TINY, run_train

try:
    import pyarrow.parquet  # noqa: F401

    PYARROW = True
except ImportError:
    PYARROW = False


def tiny_with(**sections: str) -> str:
    """TINY with `key: value` lines set in its sections (a key already there is replaced)."""
    lines = TINY.splitlines()
    for section, body in sections.items():
        if f"{section}:" not in lines:
            lines.append(f"{section}:")
        start = lines.index(f"{section}:") + 1
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith(" ")), len(lines))
        for line in body.strip("\n").splitlines():
            key = line.split(":", 1)[0] if not line.startswith(" ") else None
            existing = [i for i in range(start, end) if key and lines[i].startswith(f"  {key}:")]
            if existing:
                lines[existing[0]] = f"  {line}"
            else:
                lines.insert(end, f"  {line}")
                end += 1
    return "\n".join(lines) + "\n"


def write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def jsonl(*records) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


# --- config values --------------------------------------------------------------------------

BAD_VALUES = {
    # id: (section, lines, fragment of the problem, fragment of the fix / allowed range)
    "lr-nan": ("training", "learning_rate: .nan", "`training.learning_rate`", "must be a finite number"),
    "lr-inf": ("training", "learning_rate: .inf", "`training.learning_rate`", "must be a finite number"),
    "lr-minus-inf": ("training", "learning_rate: -.inf", "`training.learning_rate`", "finite number"),
    "lr-overflow": ("training", "learning_rate: 1e999", "`training.learning_rate`", "finite number; got '1e999'"),
    "lr-negative": ("training", "learning_rate: -0.001", "`training.learning_rate` must be positive",
                    "greater than 0, e.g. 3e-4); got -0.001"),
    "lr-zero": ("training", "learning_rate: 0", "`training.learning_rate` must be positive", "got 0.0"),
    "lr-word": ("training", "learning_rate: fast", "`training.learning_rate` must be a number",
                "e.g. 0.5 or 1e-4); got 'fast'"),
    "lr-empty": ("training", "learning_rate:", "`training.learning_rate` must be a number", "got nothing"),
    "weight-decay-negative": ("training", "weight_decay: -0.01", "`training.weight_decay`",
                              "must be zero (none) or positive; got -0.01"),
    "weight-decay-nan": ("training", "weight_decay: .nan", "`training.weight_decay`", "finite number"),
    "seed-negative": ("training", "seed: -1", "`training.seed`", "must be from 0 to 4294967295; got -1"),
    "seed-huge": ("training", "seed: 99999999999999999999", "`training.seed`", "from 0 to 4294967295"),
    "max-tokens-zero": ("training", "max_tokens: 0", "`training.max_tokens`", "must be at least 1; got 0"),
    "max-tokens-word": ("training", "max_tokens: lots", "`training.max_tokens`", "must be an integer; got 'lots'"),
    "max-tokens-float": ("training", "max_tokens: 512.5", "`training.max_tokens`", "must be an integer"),
    "max-steps-zero": ("training", "max_steps: 0", "`training.max_steps`", "at least 1; got 0"),
    "accumulation-zero": ("training", "gradient_accumulation_steps: 0", "`training.gradient_accumulation_steps`",
                          "at least 1"),
    "logging-steps-zero": ("training", "logging_steps: 0", "`training.logging_steps`", "at least 1"),
    "warmup-negative": ("training", "warmup_steps: -1", "`training.warmup_steps`", "zero or more; got -1"),
    "layers-per-unit-negative": ("training", "fsdp2_layers_per_unit: -1", "`training.fsdp2_layers_per_unit`",
                                 "must be 0 (auto) or a number of layers"),
    "interval-zero": ("training", "checkpoint:\n  interval_steps: 0", "`training.checkpoint.interval_steps`",
                      "at least 1"),
    "keep-last-zero": ("training", "checkpoint:\n  keep_last: 0", "`training.checkpoint.keep_last`", "at least 1"),
    "max-memory-negative": ("training", "checkpoint:\n  offload: auto\n  max_memory_gib: -4",
                            "`training.checkpoint.max_memory_gib`", "must be a positive number of gib"),
    "max-memory-inf": ("training", "checkpoint:\n  max_memory_gib: .inf", "`training.checkpoint.max_memory_gib`",
                       "finite number"),
    "packed-not-bool": ("training", "packed_sequence: maybe", "`training.packed_sequence`",
                        "must be true or false; got 'maybe'"),
    "device-unknown": ("training", "device: gpu", "`training.device`", "must be one of 'auto', 'cuda', 'cpu'"),
    "overlong-unknown": ("training", "overlong: wrap", "`training.overlong`", "one of 'truncate', 'drop'"),
    "lora-dropout-above-1": ("lora", "dropout: 1.5", "`lora.dropout`", "from 0 up to, not including, 1"),
    "lora-dropout-1": ("lora", "dropout: 1", "`lora.dropout`", "not including, 1"),
    "lora-dropout-negative": ("lora", "dropout: -0.1", "`lora.dropout`", "from 0 up to"),
    "lora-alpha-zero": ("lora", "alpha: 0", "`lora.alpha` must be positive", "got 0"),
    "lora-alpha-negative": ("lora", "alpha: -16", "`lora.alpha` must be positive", "got -16"),
    "lora-alpha-word": ("lora", "alpha: big", "`lora.alpha`", "must be an integer"),
    "lora-r-zero": ("lora", "enabled: true\nr: 0", "`lora.r`", "at least 1; got 0"),
    "lora-r-zero-disabled": ("lora", "r: 0", "`lora.r`", "at least 1; got 0"),
    "lora-targets-empty-list": ("lora", "target_modules: []", "`lora.target_modules` names nothing",
                                "give at least one name"),
    "lora-targets-empty-string": ("lora", "target_modules: ' , '", "`lora.target_modules` names nothing",
                                  "at least one name"),
    "lora-targets-mapping": ("lora", "target_modules: {q_proj: 1}", "`lora.target_modules` must be a list of names",
                             "or a comma-separated string"),
    "tensorboard-unknown": ("logging", "tensorboard: sometimes", "`logging.tensorboard`",
                            "one of 'auto', 'true', 'false'"),
    "profile-step-negative": ("logging", "profile_step: -1", "`logging.profile_step`", "zero (off) or a step number"),
    "profile-step-past-the-end": ("logging", "profile_step: 99", "`logging.profile_step` 99 comes after the last step",
                                  "choose a step from 1 to 2, or 0 for none"),
    "assistant-roles-empty": ("data", "assistant_roles: []", "`data.assistant_roles` names nothing",
                              "at least one name"),
    "assistant-roles-user": ("data", "assistant_roles: [user]", "names 'user', whose turns are context",
                             "gemma-style data: [model]"),
    "assistant-roles-numbers": ("data", "assistant_roles: [1, 2]", "`data.assistant_roles` must be a list of names",
                                "comma-separated string"),
    "text-field-empty": ("data", "text_field: ''", "`data.text_field` must name a field", "default: text"),
    "unknown-key": ("training", "learning_rat: 0.1", "unknown key `training.learning_rat`",
                    "did you mean `training.learning_rate`"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_config_value_is_refused_naming_key_value_and_range(capsys, tmp_path, case):
    section, lines, problem, fix = BAD_VALUES[case]
    outcome = run_train(capsys, tmp_path, config=tiny_with(**{section: lines}))
    outcome.assert_refused(problem, fix)
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("text,problem,fix", [
    ("training: [unclosed\n", "job.yaml is not valid yaml", "fix: correct the file at that place"),
    ("- training\n- model\n", "the top level must be a mapping of sections", "training:, model:"),
    ("training: 3\n", "`training` must be a mapping", "got 3"),
])
def test_malformed_config_file_is_refused(capsys, tmp_path, text, problem, fix):
    run_train(capsys, tmp_path, config=text).assert_refused(problem, fix)


def test_missing_config_file_is_refused(capsys, tmp_path):
    outcome = run_train(capsys, tmp_path, "--config", str(tmp_path / "nope.yaml"), config=None)
    outcome.assert_refused("nope.yaml does not exist", "pass an existing yaml file to --config")


def test_bad_command_line_override_is_refused(capsys, tmp_path):
    run_train(capsys, tmp_path, "--max_steps", "0").assert_refused("`training.max_steps` must be at least 1", "got 0")


# --- values written in another form than meant: accepted ----------------------------------


def test_learning_rate_written_1e_4_trains_at_1e_4(capsys, tmp_path):
    outcome = run_train(capsys, tmp_path, config=tiny_with(training="learning_rate: 1e-4\nweight_decay: 1e-2"))
    assert outcome.rc == 0, outcome.err
    outcome.assert_nothing_lost()
    recorded = json.loads((tmp_path / "out" / "logs" / "config.json").read_text())["training"]
    assert recorded["learning_rate"] == 1e-4 and recorded["weight_decay"] == 0.01


@pytest.mark.parametrize("value", ["true", "false", "yes"])
def test_tensorboard_written_as_a_yaml_boolean_is_accepted(capsys, tmp_path, value):
    outcome = run_train(capsys, tmp_path, config=tiny_with(logging=f"tensorboard: {value}"))
    assert outcome.rc == 0, outcome.err
    outcome.assert_nothing_lost()
    recorded = json.loads((tmp_path / "out" / "logs" / "config.json").read_text())["logging"]
    assert recorded["tensorboard"] == ("false" if value == "false" else "true")


def test_lora_target_modules_as_a_yaml_list_is_accepted(capsys, tmp_path):
    pytest.importorskip("peft")
    outcome = run_train(capsys, tmp_path, config=tiny_with(lora="enabled: true\nr: 4\ntarget_modules: [q_proj, "
                                                                "v_proj]"))
    assert outcome.rc == 0, outcome.err
    recorded = json.loads((tmp_path / "out" / "logs" / "config.json").read_text())["lora"]
    assert recorded["target_modules"] == "q_proj,v_proj"
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").is_file()


# --- chat roles -----------------------------------------------------------------------------

GEMMA = jsonl(chat(("user", "What is 2+2?"), ("model", "4")), chat(("user", "Say hi."), ("model", "Hi!")))


@pytest.mark.parametrize("records,problem,fix", [
    ((chat(("user", "q"), ("assistant", "a")), chat(("user", "q"), ("asistant", "a"))),
     "line 2: 'messages[1]' has the role 'asistant', which is not a known role (known: system, user, tool",
     "did you mean 'assistant'?"),
    ((chat(("system", "s"), ("Human", "q"), ("assistant", "a")),),
     "line 1: 'messages[1]' has the role 'human'", "rename the role to one of system, user, tool, assistant"),
    ((chat(("user", "q"), ("assistant", "a")), chat(("user", "q")), chat(("system", "s"), ("user", "q"))),
     "line 2: the conversation has no turn of the role assistant (data.assistant_roles), so it would train on "
     "nothing (roles found: user; records in the data without such a turn: 2)", "add the assistant's reply"),
])
def test_unknown_role_or_no_assistant_turn_is_refused(capsys, tmp_path, records, problem, fix):
    data = write(tmp_path / "chat.jsonl", jsonl(*records))
    outcome = run_train(capsys, tmp_path, config=tiny_with(data=f"path: {data}"))
    outcome.assert_refused(str(data), problem, fix)


def test_gemma_model_role_without_assistant_roles_is_refused(capsys, tmp_path):
    data = write(tmp_path / "gemma.jsonl", GEMMA)
    outcome = run_train(capsys, tmp_path, config=tiny_with(data=f"path: {data}"))
    outcome.assert_refused(f"{data}, line 1: 'messages[1]' has the role 'model'", "records in the data with this "
                           "role: 2", "set data.assistant_roles: [model]")


@pytest.mark.parametrize("roles", ["[model]", "model", "'model, assistant'"])
def test_gemma_model_role_with_assistant_roles_trains(capsys, tmp_path, roles):
    mixed = jsonl(chat(("user", "q"), ("assistant", "a"))) if "assistant" in roles else ""
    data = write(tmp_path / "gemma.jsonl", GEMMA + mixed)
    outcome = run_train(capsys, tmp_path, config=tiny_with(data=f"path: {data}\nassistant_roles: {roles}"))
    assert outcome.rc == 0, outcome.err
    outcome.assert_nothing_lost()
    rows = [json.loads(line) for line in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["loss"] == row["loss"] and row["loss"] > 0 for row in rows)  # not NaN: the model turns train


def test_assistant_roles_model_refuses_assistant_turns(capsys, tmp_path):
    data = write(tmp_path / "chat.jsonl", jsonl(chat(("user", "q"), ("assistant", "a"))))
    outcome = run_train(capsys, tmp_path, config=tiny_with(data=f"path: {data}\nassistant_roles: [model]"))
    outcome.assert_refused("has the role 'assistant', which is not a known role", "and model (trained on",
                           "data.assistant_roles: [model, assistant]")


# --- data files -----------------------------------------------------------------------------

BAD_DATA = {
    # id: (file name, content, fragment of the problem, fragment of the fix)
    "invalid-json-line": ("data.jsonl", '{"text": "a"}\n{"text": "b"\n', "line 2: not valid json",
                          "put one complete json object per line"),
    "plain-text-lines": ("data.jsonl", "just some text\nmore text\n", "line 1: not valid json",
                         "one complete json object per line"),
    "array-line": ("data.jsonl", '{"text": "a"}\n["b"]\n', "line 2: expected a json object, got a list",
                   "put one json object per line"),
    "empty-file": ("data.jsonl", "", "the file is empty", "add at least one record"),
    "blank-lines-only": ("data.jsonl", "\n  \n\n", "the file is empty", "add at least one record"),
    "empty-json-list": ("data.json", "[]", "the file is empty", "add at least one record"),
    "json-list-item-not-object": ("data.json", '[{"text": "a"}, 7]', "item 2 of the json list: expected an object",
                                  "make every item an object"),
    "json-broken-list": ("data.json", '[\n{"text": "a"},\n{"text": }\n]', "line 3: not valid json",
                         "one json list of objects, or one json object per line"),
    "json-scalar": ("data.json", '"just a string"', "line 1: expected a json list of objects, got a string",
                    'write [{"text": "..."}, ...]'),
    "csv-file": ("data.csv", "text\nhello\n", "unsupported file type '.csv'", "use a .jsonl, .json or .parquet file"),
    "no-extension": ("data", '{"text": "a"}\n', "unsupported file type '(no extension)'", "use a .jsonl"),
    "text-field-missing": ("data.jsonl", '{"body": "hello"}\n', "line 1: no 'text', 'prompt'/'completion' or "
                           "'messages' field (fields found: ['body'])", "set text_field to that key"),
    "text-not-a-string": ("data.jsonl", '{"text": 42}\n', "line 1: field 'text' must be a string, got a number",
                          "make 'text' a string"),
    "text-null": ("data.jsonl", '{"text": "a"}\n{"text": null}\n', "line 2: field 'text' must be a string, got null",
                  "make 'text' a string"),
    "completion-missing": ("data.jsonl", '{"prompt": "p"}\n', "line 1: missing field 'completion'",
                           "give the record a string 'completion'"),
    "messages-not-a-list": ("data.jsonl", '{"messages": "hi"}\n', "field 'messages' must be a list, got a string",
                            '"messages": [{"role": "user"'),
    "message-without-content": ("data.jsonl", '{"messages": [{"role": "user"}]}\n',
                                "field 'messages[0].content' must be a string, got nothing",
                                "give every message a string 'content'"),
    "non-utf8": ("data.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', "line 2: not valid utf-8 (byte 0xe9)",
                 "save the file as utf-8"),
    "only-empty-texts": ("data.jsonl", '{"text": ""}\n{"text": ""}\n', "no sample can be trained on (all are empty",
                         "check the data file"),
    "corrupt-parquet": ("data.parquet", b"PAR1 not really",
                        *(("not a readable parquet file", "re-export it, or convert it to .jsonl") if PYARROW
                          else ("reading .parquet files needs pyarrow", "pip install pyarrow"))),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_file_is_refused_naming_file_place_and_fix(capsys, tmp_path, case):
    name, content, problem, fix = BAD_DATA[case]
    data = write(tmp_path / name, content)
    outcome = run_train(capsys, tmp_path, config=tiny_with(data=f"path: {data}"))
    outcome.assert_refused(str(data), problem, fix)


def test_text_field_naming_an_absent_field_is_refused(capsys, tmp_path):
    data = write(tmp_path / "data.jsonl", jsonl({"text": "hello"}))
    outcome = run_train(capsys, tmp_path, config=tiny_with(data=f"path: {data}\ntext_field: body"))
    outcome.assert_refused("line 1: no 'body', 'prompt'/'completion' or 'messages' field", "set text_field")


def test_data_path_that_is_a_folder_is_refused(capsys, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder / "part-0.jsonl", jsonl({"text": "a"}))
    outcome = run_train(capsys, tmp_path, config=tiny_with(data=f"path: {folder}"))
    outcome.assert_refused(f"{folder}: not a file", "point the data path at a .jsonl, .json or .parquet file")


def test_missing_data_file_is_refused(capsys, tmp_path):
    outcome = run_train(capsys, tmp_path, config=tiny_with(data=f"path: {tmp_path / 'nope.jsonl'}"))
    outcome.assert_refused("nope.jsonl: no such file", "check the data path")


def test_unreadable_data_file_is_refused(capsys, tmp_path, monkeypatch):
    import hasten.data.datasets as datasets

    class Unreadable(type(Path())):  # what a file without read permission gives (also when tests run as root)
        def read_bytes(self):
            raise PermissionError(13, "Permission denied", str(self))

    data = write(tmp_path / "data.jsonl", jsonl({"text": "a"}))
    monkeypatch.setattr(datasets, "Path", Unreadable)
    outcome = run_train(capsys, tmp_path, config=tiny_with(data=f"path: {data}"))
    outcome.assert_refused(f"{data}: cannot be read (permission denied)", "make the file readable")


# --- model folders and their tokenizers ------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny Qwen3 model folder (config.json and weights, no tokenizer files)."""
    import transformers

    from hasten.training.defaults import embedded_model_config

    folder = tmp_path_factory.mktemp("model") / "tiny"
    transformers.Qwen3ForCausalLM(embedded_model_config("tiny")).save_pretrained(folder)
    return folder


def model_folder(saved_model: Path, folder: Path, *, weights: bool = True, tokenizer: str | None = None) -> Path:
    folder.mkdir(parents=True)
    for name in ("config.json", *(["model.safetensors"] if weights else [])):
        shutil.copy(saved_model / name, folder / name)
    if tokenizer == "byte":
        from hasten.data import ByteTokenizer

        ByteTokenizer().save_pretrained(folder)
    elif tokenizer == "transformers":
        from hasten.data.tokenizer import as_transformers_tokenizer

        as_transformers_tokenizer().save_pretrained(str(folder))
    return folder


def with_model(path: Path) -> str:
    return tiny_with(model=f"path: {path}")


def test_model_folder_without_tokenizer_files_is_refused(capsys, tmp_path, saved_model):
    folder = model_folder(saved_model, tmp_path / "model")
    outcome = run_train(capsys, tmp_path, config=with_model(folder))
    outcome.assert_refused(f"model.path {folder} has no tokenizer files: hasten looked for tokenizer.json",
                           "tokenizer.model", "vocab.json", "found none",
                           "fix: copy the tokenizer files of the model this folder came from")


def test_model_folder_with_only_a_tokenizer_config_is_refused(capsys, tmp_path, saved_model):
    folder = model_folder(saved_model, tmp_path / "model")
    write(folder / "tokenizer_config.json", '{"tokenizer_class": "LlamaTokenizer"}')
    write(folder / "special_tokens_map.json", "{}")
    outcome = run_train(capsys, tmp_path, config=with_model(folder))
    outcome.assert_refused("has no tokenizer files", "found only special_tokens_map.json, tokenizer_config.json",
                           "copy the tokenizer files")


def test_model_folder_with_a_broken_tokenizer_json_is_refused(capsys, tmp_path, saved_model):
    folder = model_folder(saved_model, tmp_path / "model")
    write(folder / "tokenizer.json", '{"version": "1.0", "model": ')
    outcome = run_train(capsys, tmp_path, config=with_model(folder))
    outcome.assert_refused(f"model.path {folder}: its tokenizer does not load", "copy the tokenizer files")


def test_output_dir_given_as_model_path_is_refused(capsys, tmp_path, saved_model):
    run = tmp_path / "earlier"
    model_folder(saved_model, run / "final", tokenizer="byte")
    outcome = run_train(capsys, tmp_path, config=with_model(run))
    outcome.assert_refused(f"model.path {run} is not a transformers model folder: it has no config.json",
                           f"did you mean {run / 'final'}?")


def test_lora_adapter_folder_without_its_base_is_refused(capsys, tmp_path):
    from hasten.data import ByteTokenizer

    folder = tmp_path / "lora_run" / "final"  # what a lora.enabled run on the embedded default saves
    folder.mkdir(parents=True)
    write(folder / "adapter_config.json", '{"base_model_name_or_path": null, "peft_type": "LORA"}')
    write(folder / "adapter_model.safetensors", b"")
    ByteTokenizer().save_pretrained(folder)
    outcome = run_train(capsys, tmp_path, config=with_model(folder))
    outcome.assert_refused("it holds lora adapters only and names no base model", "merge_and_unload()")


def test_model_folder_without_weights_is_refused(capsys, tmp_path, saved_model):
    folder = model_folder(saved_model, tmp_path / "model", weights=False, tokenizer="byte")
    outcome = run_train(capsys, tmp_path, config=with_model(folder))
    outcome.assert_refused("has config.json but no weights", "copy the model's weight files")


@pytest.mark.parametrize("make", ["missing", "file"])
def test_model_path_that_is_no_folder_is_refused(capsys, tmp_path, make):
    path = tmp_path / "model"
    if make == "file":
        write(path, "not a model")
    run_train(capsys, tmp_path, config=with_model(path)).assert_refused(f"model.path {path} is not a folder",
                                                                        "give a local transformers model folder")


def test_tokenizer_larger_than_the_embedding_is_refused(capsys, tmp_path):
    import transformers

    from hasten.data import ByteTokenizer
    from hasten.training.defaults import embedded_model_config

    config = embedded_model_config("tiny")
    config.vocab_size, config.pad_token_id = 200, None
    folder = tmp_path / "small_vocab"
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    outcome = run_train(capsys, tmp_path, config=with_model(folder))
    outcome.assert_refused("the tokenizer has 259 tokens (ids 0 to 258) but the model's embedding has 200 rows",
                           "use the tokenizer this model was trained with", "resize_token_embeddings")


def test_model_path_that_the_run_would_overwrite_is_refused(capsys, tmp_path, saved_model):
    final = model_folder(saved_model, tmp_path / "out" / "final", tokenizer="byte")
    outcome = run_train(capsys, tmp_path, config=with_model(final))  # --output_dir is tmp_path/out
    outcome.assert_refused(f"model.path {final} is the folder this run saves its model into",
                           "so the model it starts from would be overwritten", "pass another --output_dir")


def test_the_final_folder_holds_the_tokenizer_and_trains_again(capsys, tmp_path):
    first = run_train(capsys, tmp_path, "--output_dir", str(tmp_path / "first"))
    assert first.rc == 0, first.err
    final = tmp_path / "first" / "final"
    assert {"config.json", "model.safetensors", "hasten_tokenizer.json", "tokenizer.json"} <= {
        p.name for p in final.iterdir()}
    write(tmp_path / "again.yaml", with_model(final))
    again = run_train(capsys, tmp_path, "--config", str(tmp_path / "again.yaml"), "--output_dir",
                      str(tmp_path / "second"), config=None)
    assert again.rc == 0, again.err
    again.assert_nothing_lost()  # the first run's model is unchanged
    assert (tmp_path / "second" / "final" / "hasten_tokenizer.json").is_file()


def test_final_folder_loads_in_transformers_with_the_same_ids(capsys, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hasten.data import ByteTokenizer

    assert run_train(capsys, tmp_path).rc == 0
    final = tmp_path / "out" / "final"
    tokenizer = AutoTokenizer.from_pretrained(str(final), local_files_only=True)
    text = "def f(x): return x  # é"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(
        text, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)


def test_model_folder_with_a_transformers_tokenizer_trains_and_saves_it(capsys, tmp_path, saved_model):
    folder = model_folder(saved_model, tmp_path / "model", tokenizer="transformers")
    outcome = run_train(capsys, tmp_path, config=with_model(folder))
    assert outcome.rc == 0, outcome.err
    outcome.assert_nothing_lost()
    assert (tmp_path / "out" / "final" / "tokenizer.json").is_file()
    assert not (tmp_path / "out" / "final" / "hasten_tokenizer.json").exists()
