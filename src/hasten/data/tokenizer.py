"""A dependency-free byte-level tokenizer for the embedded default model.

Every UTF-8 byte is its own token, so any text round-trips without a vocabulary file and
the default run needs nothing downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable

_BYTE_VALUES = 256
_PAD_TOKEN_ID = _BYTE_VALUES
_BOS_TOKEN_ID = _BYTE_VALUES + 1
_EOS_TOKEN_ID = _BYTE_VALUES + 2
_SPECIAL_TOKEN_TEXT = {_PAD_TOKEN_ID: "<pad>", _BOS_TOKEN_ID: "<bos>", _EOS_TOKEN_ID: "<eos>"}


class ByteTokenizer:
    """Token ids 0..255 are bytes; 256, 257 and 258 are pad, bos and eos."""

    name = "hasten-byte"
    pad_token_id = _PAD_TOKEN_ID
    bos_token_id = _BOS_TOKEN_ID
    eos_token_id = _EOS_TOKEN_ID
    vocab_size = _BYTE_VALUES + len(_SPECIAL_TOKEN_TEXT)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        byte_ids = list(text.encode("utf-8"))
        if add_special_tokens:
            return [self.bos_token_id, *byte_ids, self.eos_token_id]
        return byte_ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Bytes back to text; special tokens are dropped, or shown as ``<bos>`` etc."""
        pieces: list[str] = []
        pending_bytes = bytearray()
        for token_id in ids:
            token_id = int(token_id)  # accepts tensor elements and numpy integers too
            if 0 <= token_id < _BYTE_VALUES:
                pending_bytes.append(token_id)
                continue
            if token_id not in _SPECIAL_TOKEN_TEXT:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary of {self.name} "
                    f"(0..{self.vocab_size - 1})"
                )
            if not skip_special_tokens:
                pieces.append(_decode_bytes(pending_bytes))
                pending_bytes.clear()
                pieces.append(_SPECIAL_TOKEN_TEXT[token_id])
        pieces.append(_decode_bytes(pending_bytes))
        return "".join(pieces)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


def _decode_bytes(byte_ids: bytearray) -> str:
    # a sequence cut mid-character (e.g. by a length limit) still decodes
    return bytes(byte_ids).decode("utf-8", errors="replace")
