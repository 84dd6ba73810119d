"""Tokenizers of `hasten train`: the byte-level one of the embedded default model, and the
checked loading of a model folder's tokenizer.

ByteTokenizer: every UTF-8 byte is its own token, so any text round-trips without a vocabulary
file and the default run needs nothing downloaded. `save_pretrained` writes it beside a model
(the file hasten reads back, and a transformers `tokenizer.json` with the same ids).

`load_model_tokenizer(folder)` loads the tokenizer of a transformers model folder, or says, as a
ConfigError naming the folder and the fix, why it cannot: no model there, no tokenizer files
(where transformers would quietly build a tokenizer of one token), files that do not load.
`check_tokenizer_fits` compares the tokenizer with the model's embedding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hasten.config import ConfigError

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

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"

    def save_pretrained(self, folder: str | os.PathLike[str]) -> tuple[str, ...]:
        """Write the tokenizer into `folder` (beside a saved model).

        `hasten_tokenizer.json` is what hasten loads back (`load_model_tokenizer`): this exact
        tokenizer. `tokenizer.json` and `tokenizer_config.json` are the same tokenizer for
        transformers' AutoTokenizer (other tools, inference): the same ids for every text and
        the same special tokens; like most transformers tokenizers it adds bos (not eos) when
        asked for special tokens, and it has no chat template.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / BYTE_TOKENIZER_FILE
        marker.write_text(json.dumps(_byte_tokenizer_record(), indent=2) + "\n", encoding="utf-8")
        written = as_transformers_tokenizer().save_pretrained(str(folder))
        return (str(marker), *(str(path) for path in written))

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> "ByteTokenizer":
        """The tokenizer that `save_pretrained` wrote into `folder`."""
        path = Path(folder) / BYTE_TOKENIZER_FILE
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConfigError(f"{path} cannot be read ({error}); it is hasten's byte-tokenizer file. Fix: write "
                              "it again with hasten.data.ByteTokenizer().save_pretrained(folder), or remove it "
                              "if the folder has another tokenizer") from None
        if record != _byte_tokenizer_record():
            raise ConfigError(f"{path} describes {record!r}, not this hasten's byte tokenizer "
                              f"({_byte_tokenizer_record()!r}). Fix: write it again with "
                              "hasten.data.ByteTokenizer().save_pretrained(folder)")
        return cls()


def _decode_bytes(byte_ids: bytearray) -> str:
    # a sequence cut mid-character (e.g. by a length limit) still decodes
    return bytes(byte_ids).decode("utf-8", errors="replace")


# --- saving and loading beside a model ------------------------------------------------------

BYTE_TOKENIZER_FILE = "hasten_tokenizer.json"
# A real tokenizer has hundreds of tokens at least; transformers builds one of a few tokens from a
# folder without vocabulary files.
MIN_VOCAB_SIZE = 16
# Files that hold a vocabulary (tokenizer_config.json alone does not).
_TOKENIZER_FILES_TEXT = ("tokenizer.json; tokenizer.model or another SentencePiece *.model; vocab.json with "
                         "merges.txt; vocab.txt; *.tiktoken (each with tokenizer_config.json beside it); or "
                         f"{BYTE_TOKENIZER_FILE} (hasten's byte tokenizer)")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def _byte_tokenizer_record() -> dict[str, Any]:
    return {"tokenizer": ByteTokenizer.name, "vocab_size": ByteTokenizer.vocab_size,
            "pad_token_id": _PAD_TOKEN_ID, "bos_token_id": _BOS_TOKEN_ID, "eos_token_id": _EOS_TOKEN_ID}


def as_transformers_tokenizer():
    """ByteTokenizer as a transformers PreTrainedTokenizerFast: byte b is token b and pad, bos and
    eos are 256, 257 and 258, exactly as ByteTokenizer. Special tokens written in the text stay
    bytes (split_special_tokens), as they do in ByteTokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # the byte-level alphabet: byte b is written as the character bytes_to_unicode gives it
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(_BYTE_VALUES) if b not in printable]
    char_of = {b: chr(b) for b in printable} | {b: chr(_BYTE_VALUES + i) for i, b in enumerate(others)}
    backend = Tokenizer(models.BPE(vocab={char_of[b]: b for b in range(_BYTE_VALUES)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(_SPECIAL_TOKEN_TEXT[token_id], special=True)
                                for token_id in sorted(_SPECIAL_TOKEN_TEXT)])
    bos = _SPECIAL_TOKEN_TEXT[_BOS_TOKEN_ID]
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, _BOS_TOKEN_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos,
                                   eos_token=_SPECIAL_TOKEN_TEXT[_EOS_TOKEN_ID],
                                   pad_token=_SPECIAL_TOKEN_TEXT[_PAD_TOKEN_ID], split_special_tokens=True)


def _has_vocabulary(name: str) -> bool:
    return (name == "tokenizer.json" or name.startswith("vocab") or name.endswith((".model", ".tiktoken"))
            or name == BYTE_TOKENIZER_FILE)


def _adapter_base(folder: Path, names: list[str]) -> str | None:
    """The base model a PEFT adapter folder names (transformers loads such a folder through it)."""
    if "adapter_config.json" not in names:
        return None
    try:
        base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return base if isinstance(base, str) and base.strip() else None


def load_model_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer of the transformers model folder `path` (`model.path`), checked.

    A folder that hasten train saved with the byte tokenizer gives that ByteTokenizer; any other
    loads through transformers' AutoTokenizer. Raises ConfigError naming the folder and the fix when
    the folder is no model folder, has no tokenizer files, or its tokenizer does not load or is a
    stub of a few tokens.
    """
    folder = Path(path)
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
    except OSError as error:
        raise ConfigError(f"model.path {folder} cannot be read ({error.strerror}). Fix: make the folder readable "
                          "by this user, or copy the model to a folder that is") from None
    if "config.json" not in names and not _adapter_base(folder, names):
        saved = folder / "final"
        hint = (f" (did you mean {saved}? hasten train saves its model in OUTPUT_DIR/final)"
                if (saved / "config.json").is_file() else "")
        if "adapter_config.json" in names:
            hint += (" (it holds LoRA adapters only and names no base model, as a lora.enabled run on the embedded "
                     "default saves them: merge them into their base model and save that, e.g. with PEFT's "
                     "merge_and_unload(), to train on)")
        raise ConfigError(f"model.path {folder} is not a transformers model folder: it has no config.json{hint}. "
                          "Fix: point model.path at a model folder (config.json, weights and tokenizer files), "
                          "e.g. the OUTPUT_DIR/final folder of an earlier hasten train, or leave it empty for the "
                          "embedded default model")
    if not any(name.endswith(_WEIGHT_SUFFIXES) or name == "adapter_config.json" for name in names):
        raise ConfigError(f"model.path {folder} has config.json but no weights (looked for *.safetensors, "
                          "*.bin, *.pt, *.pth, *.ckpt, *.h5, *.msgpack, *.gguf or a PEFT adapter_config.json). "
                          "Fix: copy the model's weight files into the folder as well")
    if BYTE_TOKENIZER_FILE in names:
        return ByteTokenizer.from_pretrained(folder)
    tokenizer_files = [name for name in names if "token" in name or _has_vocabulary(name) or name == "merges.txt"]
    found = f"found only {', '.join(tokenizer_files)}" if tokenizer_files else "found none"
    fix = (f"Fix: copy the tokenizer files of the model this folder came from (tokenizer.json, "
           f"tokenizer_config.json, special_tokens_map.json and any tokenizer.model or vocab files) into {folder}, "
           "or save them there with tokenizer.save_pretrained(folder)")
    if not any(_has_vocabulary(name) for name in names):
        raise ConfigError(f"model.path {folder} has no tokenizer files: hasten looked for {_TOKENIZER_FILES_TEXT} "
                          f"and {found} (without them transformers would build a tokenizer that knows a "
                          f"handful of tokens). {fix}")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # transformers, tokenizers and sentencepiece raise many kinds
        raise ConfigError(f"model.path {folder}: its tokenizer does not load ({type(error).__name__}: "
                          f"{str(error).strip() or 'no message'}); the tokenizer files there are "
                          f"{', '.join(tokenizer_files)}. {fix}") from error
    if len(tokenizer) < MIN_VOCAB_SIZE:
        raise ConfigError(f"model.path {folder}: the tokenizer loaded from it has only {len(tokenizer)} tokens, so "
                          f"its vocabulary files are missing or empty (tokenizer files there: "
                          f"{', '.join(tokenizer_files)}). {fix}")
    return tokenizer


def check_tokenizer_fits(tokenizer: Any, model: Any, path: str | os.PathLike[str]) -> None:
    """ConfigError when the tokenizer has ids past the model's embedding rows."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    if rows is None:
        return
    size = len(tokenizer)
    if size > rows:
        raise ConfigError(f"model.path {path}: the tokenizer has {size} tokens (ids 0 to {size - 1}) but the model's "
                          f"embedding has {rows} rows, so ids from {rows} up have no embedding. Fix: use the "
                          "tokenizer this model was trained with (copy its tokenizer files into the folder), or "
                          "grow the embedding to the tokenizer (model.resize_token_embeddings(len(tokenizer))) and "
                          "save the model again")
