import json
import random
from pathlib import Path

import pytest
import torch

from hasten.config import ConfigError
from hasten.data import ByteTokenizer, tokenize_records
from hasten.data.tokenizer import (
    BYTE_TOKENIZER_FILE,
    as_transformers_tokenizer,
    check_tokenizer_fits,
    load_model_tokenizer,
)


@pytest.fixture
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


def test_special_token_ids_follow_the_256_byte_ids(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257, 258)
    assert tokenizer.vocab_size == 259
    assert tokenizer.name == "hasten-byte"


def test_encode_wraps_utf8_bytes_in_bos_and_eos(tokenizer):
    assert tokenizer.encode("Hi!") == [257, 72, 105, 33, 258]
    assert tokenizer.encode("Hi!", add_special_tokens=False) == [72, 105, 33]
    assert tokenizer.encode("") == [257, 258]


def test_non_ascii_is_encoded_as_its_utf8_bytes(tokenizer):
    assert tokenizer.encode("é€", add_special_tokens=False) == [0xC3, 0xA9, 0xE2, 0x82, 0xAC]


@pytest.mark.parametrize(
    "text", ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🚀🐍", "tab\tnew\nline", ""]
)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert tokenizer.decode(ids) == text


def test_decode_can_show_special_tokens(tokenizer):
    ids = [256, *tokenizer.encode("añ"), 256]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<pad><bos>añ<eos><pad>"
    assert tokenizer.decode(ids) == "añ"


def test_decode_replaces_a_character_cut_in_half(tokenizer):
    euro_sign = tokenizer.encode("€", add_special_tokens=False)
    assert tokenizer.decode([ord("a"), *euro_sign[:2], ord("b")]) == "a\ufffdb"


def test_decode_accepts_a_tensor(tokenizer):
    assert tokenizer.decode(torch.tensor(tokenizer.encode("tensor"))) == "tensor"


@pytest.mark.parametrize("bad_id", [259, -1])
def test_decode_rejects_ids_outside_the_vocabulary(tokenizer, bad_id):
    expected = rf"token id {bad_id} is outside the vocabulary of hasten-byte \(0\.\.258\)"
    with pytest.raises(ValueError, match=expected):
        tokenizer.decode([104, bad_id])


# --- saving beside a model, loading a model folder's tokenizer -------------------------------

TEXTS = ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🚀🐍", "tab\tnew\nline\r\n", "", "  two spaces",
         "<bos> <eos><pad> written as text", "<|assistant|>\nhi\n", "\x00\x01\x7f", "Ġ Ċ ĉ (byte-level letters)"]


def random_texts(count=200, seed=0):
    rng = random.Random(seed)
    alphabet = [chr(c) for c in [*range(0, 0x250), *range(0x3040, 0x30ff), 0x1F680, 0x1F40D, 0xFFFD]]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def auto_byte_tokenizer(tmp_path_factory):
    """The ByteTokenizer saved, then loaded back by transformers' AutoTokenizer."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("byte")
    ByteTokenizer().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_save_pretrained_writes_hastens_file_and_a_transformers_tokenizer(tmp_path, tokenizer):
    written = tokenizer.save_pretrained(tmp_path / "final")
    names = sorted(p.name for p in (tmp_path / "final").iterdir())
    assert names == [BYTE_TOKENIZER_FILE, "tokenizer.json", "tokenizer_config.json"]
    assert sorted(Path(p).name for p in written) == names
    record = json.loads((tmp_path / "final" / BYTE_TOKENIZER_FILE).read_text())
    assert record == {"tokenizer": "hasten-byte", "vocab_size": 259, "pad_token_id": 256, "bos_token_id": 257,
                      "eos_token_id": 258}
    assert isinstance(ByteTokenizer.from_pretrained(tmp_path / "final"), ByteTokenizer)
    assert len(tokenizer) == 259


@pytest.mark.parametrize("text", TEXTS + random_texts())
def test_the_transformers_equivalent_gives_the_same_ids(auto_byte_tokenizer, tokenizer, text):
    auto = auto_byte_tokenizer
    assert auto(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert auto(text)["input_ids"] == [257, *tokenizer.encode(text, add_special_tokens=False)]  # bos, as HF does
    ids = tokenizer.encode(text)
    assert auto.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids) == text
    assert auto.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)


def test_the_transformers_equivalent_has_the_same_specials_and_size(auto_byte_tokenizer):
    auto = auto_byte_tokenizer
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (256, 257, 258)
    assert len(auto) == 259
    assert auto.convert_ids_to_tokens([256, 257, 258]) == ["<pad>", "<bos>", "<eos>"]
    # a cut character decodes with a replacement character in both
    assert auto.decode([ord("a"), 0xE2, 0x82, ord("b")]) == ByteTokenizer().decode([ord("a"), 0xE2, 0x82, ord("b")])


def test_the_transformers_equivalent_tokenizes_records_as_hasten_does(auto_byte_tokenizer, tokenizer):
    records = [{"text": "a <eos> b"}, {"prompt": "Q: 2+2?", "completion": " 4"}, {"text": "日本"}]
    assert tokenize_records(records, auto_byte_tokenizer) == tokenize_records(records, tokenizer)
    assert as_transformers_tokenizer()("x")["input_ids"] == [257, ord("x")]


def save_tiny_model(folder: Path, vocab_size: int | None = None) -> Path:
    import transformers

    from hasten.training.defaults import embedded_model_config

    config = embedded_model_config("tiny")
    if vocab_size is not None:
        config.vocab_size = vocab_size
        config.pad_token_id = None  # 256 would be past a smaller embedding
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def copy_model(tiny_model: Path, folder: Path, *, weights: bool = True) -> Path:
    folder.mkdir()
    for name in ("config.json", *(["model.safetensors"] if weights else [])):
        (folder / name).write_bytes((tiny_model / name).read_bytes())
    return folder


def test_a_folder_hasten_saved_loads_the_byte_tokenizer(tmp_path, tiny_model, tokenizer):
    folder = copy_model(tiny_model, tmp_path / "final")
    tokenizer.save_pretrained(folder)
    assert isinstance(load_model_tokenizer(folder), ByteTokenizer)


def test_a_transformers_tokenizer_folder_loads_through_autotokenizer(tmp_path, tiny_model):
    folder = copy_model(tiny_model, tmp_path / "m")
    as_transformers_tokenizer().save_pretrained(str(folder))
    loaded = load_model_tokenizer(folder)
    assert not isinstance(loaded, ByteTokenizer) and len(loaded) == 259


def test_no_tokenizer_files_is_an_error_naming_folder_files_and_fix(tmp_path, tiny_model):
    folder = copy_model(tiny_model, tmp_path / "m")
    with pytest.raises(ConfigError) as error:
        load_model_tokenizer(folder)
    message = str(error.value)
    assert message.startswith(f"model.path {folder} has no tokenizer files: hasten looked for tokenizer.json; "
                              "tokenizer.model or another SentencePiece *.model; vocab.json with merges.txt; "
                              "vocab.txt; *.tiktoken")
    assert "and found none" in message
    assert f"Fix: copy the tokenizer files of the model this folder came from (tokenizer.json, " in message
    # a tokenizer_config.json alone holds no vocabulary (transformers would build 3 tokens from it)
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    with pytest.raises(ConfigError, match=r"has no tokenizer files: .* found only tokenizer_config.json"):
        load_model_tokenizer(folder)


def test_a_tokenizer_that_does_not_load_is_an_error(tmp_path, tiny_model):
    folder = copy_model(tiny_model, tmp_path / "m")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=rf"model.path {folder}: its tokenizer does not load \(.*\); the tokenizer "
                                          r"files there are tokenizer.json\. Fix: copy the tokenizer files"):
        load_model_tokenizer(folder)


def test_a_stub_tokenizer_of_a_few_tokens_is_an_error(tmp_path, tiny_model):
    folder = copy_model(tiny_model, tmp_path / "m")
    (folder / "vocab.json").write_text('{"a": 0, "b": 1}')
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    with pytest.raises(ConfigError, match=r"the tokenizer loaded from it has only \d tokens, so its vocabulary "
                                          r"files are missing or empty"):
        load_model_tokenizer(folder)


def test_a_folder_without_config_json_is_no_model_folder(tmp_path, tiny_model, tokenizer):
    run = tmp_path / "run"  # an OUTPUT_DIR, given instead of its final folder
    run.mkdir()
    tokenizer.save_pretrained(run)
    with pytest.raises(ConfigError, match=rf"model.path {run} is not a transformers model folder: it has no "
                                          r"config.json\. Fix: point model.path at a model folder"):
        load_model_tokenizer(run)
    copy_model(tiny_model, run / "final")
    with pytest.raises(ConfigError, match=rf"no config.json \(did you mean {run / 'final'}\? hasten train saves"):
        load_model_tokenizer(run)


def test_a_folder_without_weights_is_an_error(tmp_path, tiny_model, tokenizer):
    folder = copy_model(tiny_model, tmp_path / "m", weights=False)
    tokenizer.save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"has config.json but no weights \(looked for \*.safetensors.*Fix: copy "
                                          r"the model's weight files"):
        load_model_tokenizer(folder)


def test_a_damaged_hasten_tokenizer_file_is_an_error(tmp_path, tiny_model, tokenizer):
    folder = copy_model(tiny_model, tmp_path / "m")
    tokenizer.save_pretrained(folder)
    (folder / BYTE_TOKENIZER_FILE).write_text('{"tokenizer": "hasten-byte", "vocab_size": 300}')
    with pytest.raises(ConfigError, match=r"hasten_tokenizer.json describes .* not this hasten's byte tokenizer"):
        load_model_tokenizer(folder)
    (folder / BYTE_TOKENIZER_FILE).write_text("{")
    with pytest.raises(ConfigError, match=r"hasten_tokenizer.json cannot be read .*Fix: write it again"):
        load_model_tokenizer(folder)


def test_a_tokenizer_larger_than_the_embedding_is_an_error(tmp_path, tokenizer):
    import transformers

    folder = save_tiny_model(tmp_path / "small_vocab", vocab_size=200)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ConfigError, match=rf"model.path {folder}: the tokenizer has 259 tokens \(ids 0 to 258\) but "
                                          r"the model's embedding has 200 rows.*resize_token_embeddings"):
        check_tokenizer_fits(tokenizer, model, folder)
    larger = save_tiny_model(tmp_path / "large_vocab", vocab_size=300)
    check_tokenizer_fits(tokenizer, transformers.AutoModelForCausalLM.from_pretrained(larger), larger)  # fits


def test_a_lora_adapter_folder_without_a_base_model_says_it_holds_adapters_only(tmp_path, tokenizer):
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"base_model_name_or_path": null}')
    (folder / "adapter_model.safetensors").write_bytes(b"")
    tokenizer.save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"has no config.json \(it holds LoRA adapters only and names no base "
                                          r"model.*merge_and_unload"):
        load_model_tokenizer(folder)
    # one that names its base model loads as transformers loads it (through the base)
    (folder / "adapter_config.json").write_text('{"base_model_name_or_path": "/models/base"}')
    assert isinstance(load_model_tokenizer(folder), ByteTokenizer)
