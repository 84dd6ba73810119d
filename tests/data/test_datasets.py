import json
import sys
from pathlib import Path

import pytest

from hasten.data import (
    ByteTokenizer,
    DataError,
    embedded_corpus_path,
    load_dataset,
    read_records,
    tokenize_records,
)

BOS, EOS = 257, 258
M = -100  # a label without loss


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def error_message(function, *args, **kwargs) -> str:
    with pytest.raises(DataError) as error:
        function(*args, **kwargs)
    return str(error.value)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


@pytest.fixture
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_hf_tokenizer(chat_template: str = CHAT_TEMPLATE):
    """A one-character-per-token transformers tokenizer, built offline: <s>=128, </s>=129."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"\n": 127, "<s>": 128, "</s>": 129, "<pad>": 130}
    vocab = {chr(code): code for code in range(32, 127)} | specials
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=Regex("."), behavior="isolated")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        add_bos_token=True,
    )
    hf.chat_template = chat_template
    assert hf("ab")["input_ids"] == [128, 97, 98]
    return hf


@pytest.fixture(scope="module")
def hf_tokenizer():
    return build_hf_tokenizer()


# --- embedded corpus ----------------------------------------------------------------------


def test_embedded_corpus_ships_with_its_notice():
    path = embedded_corpus_path()
    assert path.name == "corpus.jsonl" and path.is_file()
    notice = (path.parent / "NOTICE").read_text()
    assert "Python Software Foundation License" in notice and "CPython 3.11.7" in notice


def test_embedded_corpus_records_are_distinct_real_text():
    records = read_records(embedded_corpus_path())
    assert 1500 <= len(records) <= 3000
    assert all(list(record) == ["text"] for record in records)
    texts = [record["text"] for record in records]
    assert len(set(texts)) == len(texts)
    assert min(len(text) for text in texts) >= 80
    assert any("regular expression" in text for text in texts)


def test_embedded_corpus_loads_as_whole_documents_of_varied_length(tokenizer):
    samples = load_dataset(None, tokenizer)
    first_text = read_records(embedded_corpus_path())[0]["text"]
    assert len(samples) > 1000
    assert samples[0]["input_ids"] == [BOS, *byte_ids(first_text), EOS]
    assert all(sample["labels"] == sample["input_ids"] for sample in samples)
    lengths = sorted(len(sample["input_ids"]) for sample in samples)
    assert lengths[0] < 150 and lengths[-1] > 4000
    assert len(set(lengths)) > 500


# --- record shapes ------------------------------------------------------------------------


def test_plain_text_trains_on_every_token(tokenizer):
    [sample] = tokenize_records([{"text": "Hi é"}], tokenizer)
    assert sample["input_ids"] == [BOS, 72, 105, 32, 0xC3, 0xA9, EOS]
    assert sample["labels"] == sample["input_ids"]


def test_text_field_selects_another_key(tokenizer):
    [sample] = tokenize_records([{"body": "ok", "text": 5}], tokenizer, text_field="body")
    assert sample["input_ids"] == [BOS, *byte_ids("ok"), EOS]


def test_explicit_text_field_wins_over_the_prompt_completion_shape(tokenizer):
    [sample] = tokenize_records([{"prompt": "ab", "completion": "c"}], tokenizer, text_field="prompt")
    assert sample == {"input_ids": [BOS, 97, 98, EOS], "labels": [BOS, 97, 98, EOS]}


def test_prompt_completion_masks_the_prompt(tokenizer):
    [sample] = tokenize_records([{"prompt": "Q:", "completion": "A."}], tokenizer)
    assert sample["input_ids"] == [BOS, *byte_ids("Q:"), *byte_ids("A."), EOS]
    assert sample["labels"] == [M, M, M, *byte_ids("A."), EOS]


def test_chat_trains_on_assistant_content_and_final_eos_only(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    [sample] = tokenize_records([{"messages": messages}], tokenizer)
    rendered = "<|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\n4\n<|user|>\n3+3?\n<|assistant|>\n6\n"
    assert sample["input_ids"] == [BOS, *byte_ids(rendered), EOS]
    # token i is byte i-1 of the rendering; the assistant contents "4\n" and "6\n" sit at:
    first_answer = 1 + rendered.index("<|assistant|>\n4") + len("<|assistant|>\n")
    second_answer = 1 + rendered.index("<|assistant|>\n6") + len("<|assistant|>\n")
    trained = [index for index, label in enumerate(sample["labels"]) if label != M]
    assert trained == [first_answer, first_answer + 1, second_answer, second_answer + 1, len(rendered) + 1]
    assert [sample["labels"][index] for index in trained] == [ord("4"), 10, ord("6"), 10, EOS]


def test_chat_ending_with_a_user_turn_leaves_eos_untrained(tokenizer):
    messages = [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    [sample] = tokenize_records([{"messages": messages}], tokenizer)
    header = len("<|assistant|>\n")
    assert sample["labels"] == [M] * (1 + header) + byte_ids("Hello\n") + [M] * len("<|user|>\nBye\n") + [M]


def test_empty_texts_give_empty_samples(tokenizer):
    records = [{"text": ""}, {"prompt": "", "completion": ""}, {"messages": []}, {"text": "x"}]
    samples = tokenize_records(records, tokenizer)
    assert samples[:3] == [{"input_ids": [], "labels": []}] * 3
    assert samples[3]["input_ids"] == [BOS, ord("x"), EOS]


# --- transformers tokenizers --------------------------------------------------------------


def test_hf_plain_text_appends_eos_once(hf_tokenizer):
    samples = tokenize_records([{"text": "ab"}, {"text": "ab</s>"}], hf_tokenizer)
    assert samples[0] == {"input_ids": [128, 97, 98, 129], "labels": [128, 97, 98, 129]}
    assert samples[1]["input_ids"] == [128, 97, 98, 129]


def test_hf_prompt_completion_masks_the_prompt(hf_tokenizer):
    [sample] = tokenize_records([{"prompt": "ab", "completion": "cd"}], hf_tokenizer)
    assert sample == {"input_ids": [128, 97, 98, 99, 100, 129], "labels": [M, M, M, 99, 100, 129]}


def test_hf_chat_uses_the_template_and_trains_on_assistant_turns(hf_tokenizer):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "k"},
    ]
    [sample] = tokenize_records([{"messages": messages}], hf_tokenizer)
    assert sample["input_ids"] == hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<s><|user|>\nhi</s>\n<|assistant|>\nyo</s>\n<|user|>\nok</s>\n<|assistant|>\nk</s>\n"
    # one token per character, "<s>" and "</s>" one each: "yo</s>\n" is tokens 28-31 and
    # "k</s>\n" 59-61; the "<|assistant|>\n" headers before them stay masked
    trained = [index for index, label in enumerate(sample["labels"]) if label != M]
    assert trained == [28, 29, 30, 31, 59, 60, 61]
    assert [sample["labels"][index] for index in trained] == [121, 111, 129, 127, 107, 129, 127]
    assert len(sample["input_ids"]) == 62


def test_hf_chat_template_error_names_the_record():
    failing = build_hf_tokenizer("{{ raise_exception('roles must alternate') }}")
    records = [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    message = error_message(tokenize_records, records, failing, source="chats")
    assert message.startswith("chats, record 1: the tokenizer's chat template failed: roles must alternate")


def test_hf_chat_template_that_rewrites_history_is_rejected():
    # numbers each turn from the end, so a longer chat does not start with a shorter one's text
    rewriting = build_hf_tokenizer(
        "{% for m in messages %}{{ messages|length - loop.index }}{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}A{% endif %}"
    )
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError, match=r"record 1: the chat template does not render 'messages\[1\]'"):
        tokenize_records([{"messages": messages}], rewriting)


# --- chat roles ---------------------------------------------------------------------------

GEMMA_TEMPLATE = (  # Gemma's template, short: assistant turns are rendered as "model"
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = m.role %}{% endif %}<t>{{ role }}\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<t>model\n{% endif %}"
)


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def test_tool_and_system_turns_are_context(tokenizer):
    record = chat(("system", "s"), ("user", "u"), ("assistant", "call"), ("tool", "42"), ("assistant", "a"))
    [sample] = tokenize_records([record], tokenizer)
    rendered = "<|system|>\ns\n<|user|>\nu\n<|assistant|>\ncall\n<|tool|>\n42\n<|assistant|>\na\n"
    assert sample["input_ids"] == [BOS, *byte_ids(rendered), EOS]
    trained = bytes(label for label in sample["labels"] if 0 <= label < 256).decode()
    assert trained == "call\na\n" and sample["labels"][-1] == EOS


@pytest.mark.parametrize("role,hint", [
    ("asistant", "did you mean 'assistant'? correct the role in the data; or, if the 'asistant' turns are the "
                 "replies to train on, add the role to data.assistant_roles (data.assistant_roles: "
                 "[assistant, asistant])"),
    ("User", "did you mean 'user'?"),
    ("model", "gemma-style data names the replies 'model': set data.assistant_roles: [model]"),
    ("narrator", "rename the role to one of system, user, tool, assistant; or, if the 'narrator' turns"),
])
def test_unknown_role_names_the_line_the_role_the_known_roles_and_the_fix(tmp_path, tokenizer, role, hint):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        chat(("user", "q"), ("assistant", "a")),
        chat(("user", "q"), (role, "a")),
        chat(("user", "q"), (role, "b")),
    ])
    message = error_message(load_dataset, path, tokenizer)
    assert message.startswith(
        f"{path}, line 2: 'messages[1]' has the role {role!r}, which is not a known role (known: system, user, "
        "tool (context, not trained on) and assistant (trained on; data.assistant_roles); records in the data "
        "with this role: 2). Fix: ")
    assert hint in message.lower()


def test_gemma_model_role_trains_like_assistant_when_named(tokenizer):
    record = chat(("user", "hi"), ("model", "yo"))
    [sample] = tokenize_records([record], tokenizer, assistant_roles=["model"])
    rendered = "<|user|>\nhi\n<|model|>\nyo\n"
    assert sample["input_ids"] == [BOS, *byte_ids(rendered), EOS]
    answer = 1 + rendered.index("yo")
    assert [i for i, label in enumerate(sample["labels"]) if label != M] == [answer, answer + 1, answer + 2,
                                                                             len(rendered) + 1]
    # with model named, 'assistant' is not known any more: only the roles given are trained
    with pytest.raises(DataError, match=r"has the role 'assistant', which is not a known role \(known: system, "
                                        r"user, tool \(context, not trained on\) and model \(trained on"):
        tokenize_records([chat(("user", "q"), ("assistant", "a"))], tokenizer, assistant_roles=["model"])


def test_several_assistant_roles_and_the_comma_string(tokenizer):
    record = chat(("user", "q"), ("model", "m"), ("user", "q"), ("assistant", "a"))
    [by_list] = tokenize_records([record], tokenizer, assistant_roles=["model", "assistant"])
    [by_string] = tokenize_records([record], tokenizer, assistant_roles="model, assistant")
    assert by_list == by_string
    assert bytes(label for label in by_list["labels"] if 0 <= label < 256) == b"m\na\n"


@pytest.mark.parametrize("roles", [[], "", ["user"], ("assistant", "tool")])
def test_assistant_roles_argument_is_checked(tokenizer, roles):
    with pytest.raises(ValueError, match="assistant_roles names"):
        tokenize_records([{"text": "x"}], tokenizer, assistant_roles=roles)


def test_hf_template_renders_assistant_roles_as_assistant(hf_tokenizer):
    as_assistant = chat(("user", "hi"), ("assistant", "yo"), ("user", "ok"), ("assistant", "k"))
    as_model = chat(("user", "hi"), ("model", "yo"), ("user", "ok"), ("model", "k"))
    [expected] = tokenize_records([as_assistant], hf_tokenizer)
    [sample] = tokenize_records([as_model], hf_tokenizer, assistant_roles=["model"])
    assert sample == expected
    with pytest.raises(DataError, match=r"record 1: 'messages\[1\]' has the role 'model'.*data.assistant_roles: "
                                        r"\[model\]"):
        tokenize_records([as_model], hf_tokenizer)


def test_hf_gemma_template_trains_the_model_turns():
    gemma = build_hf_tokenizer(GEMMA_TEMPLATE)
    record = chat(("user", "hi"), ("model", "yo"))
    [sample] = tokenize_records([record], gemma, assistant_roles=["model"])
    rendered = "<s><t>user\nhi</s>\n<t>model\nyo</s>\n"
    assert gemma.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                     tokenize=False) == rendered
    assert len(sample["input_ids"]) == 26  # one token per character; <s> and </s> one each
    trained = [index for index, label in enumerate(sample["labels"]) if label != M]
    assert trained == [22, 23, 24, 25]  # "yo</s>\n"; the "<t>model\n" header stays masked
    assert [sample["labels"][i] for i in trained] == [121, 111, 129, 127]


@pytest.mark.parametrize("use_hf", [False, True])
def test_conversation_without_an_assistant_turn_is_an_error(tmp_path, tokenizer, hf_tokenizer, use_hf):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        chat(("user", "q"), ("assistant", "a")),
        chat(("system", "s"), ("user", "q")),
        chat(("user", "only a question")),
    ])
    message = error_message(load_dataset, path, hf_tokenizer if use_hf else tokenizer)
    assert message == (
        f"{path}, line 2: the conversation has no turn of the role assistant (data.assistant_roles), so it "
        "would train on nothing (roles found: system, user; records in the data without such a turn: 2). Fix: add "
        "the assistant's reply to the conversation, or remove the record; if the replies have another role, add "
        "that role to data.assistant_roles.")


def test_empty_conversation_stays_an_empty_sample(tokenizer):
    assert tokenize_records([{"messages": []}], tokenizer) == [{"input_ids": [], "labels": []}]


# --- reading files ------------------------------------------------------------------------


def test_jsonl_skips_blank_lines_and_errors_report_the_real_line(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n\n{"text": null}\n', encoding="utf-8")
    assert read_records(path)[:2] == [{"text": "a"}, {"text": "b"}]
    with pytest.raises(DataError) as error:
        load_dataset(str(path), tokenizer)
    assert str(error.value).startswith(f"{path}, line 5: field 'text' must be a string, got null. Fix:")


def test_json_list_and_single_object_and_bom(tmp_path):
    as_list = tmp_path / "list.json"
    as_list.write_text('[\n  {"text": "a"},\n  {"prompt": "p", "completion": "c"}\n]', encoding="utf-8")
    assert read_records(as_list) == [{"text": "a"}, {"prompt": "p", "completion": "c"}]
    single = tmp_path / "single.json"
    single.write_text('{\n  "text": "only"\n}\n', encoding="utf-8")
    assert read_records(single) == [{"text": "only"}]
    lines_with_bom = tmp_path / "lines.json"
    lines_with_bom.write_text('\ufeff{"text": "x"}\n{"text": "y"}\n', encoding="utf-8")
    assert read_records(lines_with_bom) == [{"text": "x"}, {"text": "y"}]


def test_json_list_item_errors_name_the_item(tmp_path, tokenizer):
    path = tmp_path / "list.json"
    path.write_text('[{"text": "a"}, {"prompt": "p"}]', encoding="utf-8")
    with pytest.raises(DataError, match=r"list\.json, item 2: missing field 'completion'\. Fix:"):
        load_dataset(path, tokenizer)
    path.write_text('[{"text": "a"}, "b"]', encoding="utf-8")
    assert error_message(read_records, path) == (
        f"{path}, item 2 of the JSON list: expected an object, got a string. "
        'Fix: make every item an object such as {"text": "..."}.'
    )


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=rf"^{missing}: no such file\. Fix: check the data path"):
        read_records(missing)


def test_directory_and_unknown_suffix_are_rejected(tmp_path):
    with pytest.raises(DataError, match=r": not a file\. Fix:"):
        read_records(tmp_path)
    text_file = tmp_path / "data.txt"
    text_file.write_text("hello")
    assert error_message(read_records, text_file) == (
        f"{text_file}: unsupported file type '.txt'. Fix: use a .jsonl, .json or .parquet file."
    )


@pytest.mark.parametrize(
    ("name", "content"), [("empty.jsonl", ""), ("blank.jsonl", "\n \n"), ("empty.json", "[]")]
)
def test_empty_file_is_an_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=rf"{name}: the file is empty\. Fix: add at least one record"):
        read_records(path)


def test_invalid_json_line_names_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n', encoding="utf-8")
    assert error_message(read_records, path).startswith(
        f"{path}, line 3: not valid JSON (Expecting ',' delimiter at column 13). Fix:"
    )


def test_invalid_json_list_names_the_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n{"text": "a"},\n{"text": }\n]', encoding="utf-8")
    assert error_message(read_records, path).startswith(
        f"{path}, line 3: not valid JSON (Expecting value at column 10). Fix:"
    )


@pytest.mark.parametrize(
    ("line", "kind"), [('["a list"]', "a list"), ('"a string"', "a string"), ("7", "a number")]
)
def test_line_that_is_not_an_object_names_the_line(tmp_path, line, kind):
    path = tmp_path / "data.jsonl"
    path.write_text(f'{{"text": "a"}}\n{line}\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"data\.jsonl, line 2: expected a JSON object, got {kind}\. Fix:"):
        read_records(path)


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    assert error_message(read_records, path) == (
        f"{path}, line 2: not valid UTF-8 (byte 0xff). Fix: save the file as UTF-8."
    )


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    assert error_message(read_records, path) == (
        f"{path}: reading .parquet files needs pyarrow, which is not installed. "
        "Fix: pip install pyarrow (or convert the file to .jsonl)."
    )


def test_parquet_rows_are_read_when_pyarrow_is_installed(tmp_path, tokenizer):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    path = tmp_path / "data.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": ["a", None]}), path)
    assert read_records(path) == [{"text": "a"}, {"text": None}]
    with pytest.raises(DataError, match=r"data\.parquet, row 2: field 'text' must be a string, got null"):
        load_dataset(path, tokenizer)


# --- record errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (
            {"txt": "typo", "id": 3},
            r"no 'text', 'prompt'/'completion' or 'messages' field \(fields found: \['id', 'txt'\]\)",
        ),
        ({"text": 42}, r"field 'text' must be a string, got a number"),
        ({"text": ["a"]}, r"field 'text' must be a string, got a list"),
        ({"prompt": "p"}, r"missing field 'completion'"),
        ({"completion": "c"}, r"missing field 'prompt'"),
        ({"prompt": "p", "completion": {"a": 1}}, r"field 'completion' must be a string, got an object"),
        ({"messages": "hi"}, r"field 'messages' must be a list, got a string"),
        ({"messages": ["hi"]}, r"field 'messages\[0\]' must be an object, got a string"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]},
            r"field 'messages\[1\]\.content' must be a string, got nothing",
        ),
        (
            {"messages": [{"role": None, "content": "a"}]},
            r"field 'messages\[0\]\.role' must be a string, got null",
        ),
    ],
)
def test_record_errors_name_source_record_and_field(tokenizer, record, problem):
    with pytest.raises(DataError, match=rf"^train\.jsonl, record 2: {problem}\. Fix: \S"):
        tokenize_records([{"text": "fine"}, record], tokenizer, source="train.jsonl")


def test_record_error_from_a_file_names_the_file_and_line(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "a"}, {"text": "b"}, {"content": "c"}])
    with pytest.raises(DataError, match=rf"^{path}, line 3: no 'text', .*set text_field to that key\.$"):
        load_dataset(path, tokenizer)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


def test_unreadable_file_names_the_path_and_the_fix(tmp_path, monkeypatch):
    import hasten.data.datasets as datasets

    class Unreadable(type(Path())):
        def read_bytes(self):
            raise PermissionError(13, "Permission denied", str(self))

    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "a"}])
    monkeypatch.setattr(datasets, "Path", Unreadable)
    assert error_message(read_records, path) == (
        f"{path}: cannot be read (Permission denied). Fix: make the file readable by this user, or copy it "
        "to a place that is."
    )
