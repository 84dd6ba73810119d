import pytest
import torch

from hasten.data import ByteTokenizer


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
