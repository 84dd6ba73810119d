"""Read training records from disk and turn them into token ids and labels.

Supported files: ``.jsonl`` (one JSON object per line), ``.json`` (a JSON list of objects, or
JSONL) and ``.parquet`` (needs pyarrow). Supported record shapes:

- plain text: ``{"text": "..."}`` (the key is ``text_field``); loss on every token;
- prompt/completion: ``{"prompt": "...", "completion": "..."}``; loss on the completion only;
- chat: ``{"messages": [{"role": "...", "content": "..."}, ...]}``; loss on the assistant turns
  only: those whose role is one of ``assistant_roles`` (default ``["assistant"]``; Gemma-style data
  names them ``model``). ``system``, ``user`` and ``tool`` turns are context (masked). A role that
  is neither, or a conversation without an assistant turn (it would train on nothing), is an error.

Labels are aligned with ``input_ids`` (not shifted); ``-100`` marks tokens without loss.
Every problem in the data raises :class:`DataError` naming the file, the position and the fix.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hasten.config import CONTEXT_ROLES
from hasten.data.tokenizer import ByteTokenizer

IGNORE_INDEX = -100  # label value that torch's cross-entropy (and transformers) skip

_SUPPORTED_SUFFIXES = ".jsonl, .json or .parquet"
DEFAULT_ASSISTANT_ROLES = ("assistant",)

Sample = dict[str, list[int]]


class DataError(ValueError):
    """A data file or record that cannot be used; the message says where and how to fix it."""


@dataclass(frozen=True)
class _LoadedRecords:
    records: list[dict[str, Any]]
    describe_position: Callable[[int], str]  # 0-based record index -> "line 7", "row 7", ...


def embedded_corpus_path() -> Path:
    """The real-text corpus shipped inside the package (CPython docstrings, see its NOTICE)."""
    return Path(__file__).resolve().parent / "embedded" / "corpus.jsonl"


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a ``.jsonl``, ``.json`` or ``.parquet`` file into a list of dicts."""
    return _read(Path(path)).records


def tokenize_records(
    records: Sequence[dict[str, Any]],
    tokenizer: Any,
    *,
    text_field: str = "text",
    source: str = "<records>",
    assistant_roles: Iterable[str] = DEFAULT_ASSISTANT_ROLES,
) -> list[Sample]:
    """Tokenize each record into ``{"input_ids": [...], "labels": [...]}``.

    ``tokenizer`` is a :class:`ByteTokenizer` or a transformers tokenizer. Chat turns whose
    role is in ``assistant_roles`` are trained on. Errors name ``source`` and the 1-based
    record number.
    """
    return _tokenize(records, tokenizer, text_field, source, lambda index: f"record {index + 1}",
                     _assistant_roles(assistant_roles))


def load_dataset(
    path: str | os.PathLike[str] | None,
    tokenizer: Any,
    *,
    text_field: str = "text",
    assistant_roles: Iterable[str] = DEFAULT_ASSISTANT_ROLES,
) -> list[Sample]:
    """Read and tokenize a data file; ``path=None`` means the embedded corpus."""
    file_path = embedded_corpus_path() if path is None else Path(path)
    loaded = _read(file_path)
    return _tokenize(
        loaded.records, tokenizer, text_field, str(file_path), loaded.describe_position,
        _assistant_roles(assistant_roles),
    )


def _assistant_roles(roles: Iterable[str]) -> tuple[str, ...]:
    if isinstance(roles, str):
        roles = roles.split(",")
    names = tuple(dict.fromkeys(role.strip() for role in roles if role.strip()))
    if not names:
        raise ValueError("assistant_roles names no role; give at least one (default: assistant)")
    context = sorted(set(names) & set(CONTEXT_ROLES))
    if context:
        raise ValueError(
            f"assistant_roles names {', '.join(map(repr, context))}, a context role that is "
            "never trained on; list only the roles of the replies to train on"
        )
    return names


# --- reading ------------------------------------------------------------------------------


def _read(path: Path) -> _LoadedRecords:
    if not path.exists():
        raise DataError(
            f"{path}: no such file. Fix: check the data path, or leave it unset to train on "
            "the embedded corpus."
        )
    if not path.is_file():
        raise DataError(
            f"{path}: not a file. Fix: point the data path at a {_SUPPORTED_SUFFIXES} file."
        )
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        loaded = _parse_json_lines(path, _read_utf8(path))
    elif suffix == ".json":
        text = _read_utf8(path)
        loaded = _parse_json_document(path, text) or _parse_json_lines(path, text)
    elif suffix == ".parquet":
        loaded = _read_parquet(path)
    else:
        raise DataError(
            f"{path}: unsupported file type {path.suffix or '(no extension)'!r}. "
            f"Fix: use a {_SUPPORTED_SUFFIXES} file."
        )
    if not loaded.records:
        raise DataError(
            f'{path}: the file is empty. Fix: add at least one record, e.g. {{"text": "..."}}.'
        )
    return loaded


def _read_utf8(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DataError(
            f"{path}: cannot be read ({error.strerror or error}). Fix: make the file readable by "
            "this user, or copy it to a place that is."
        ) from None
    try:
        return raw.decode("utf-8-sig")  # tolerate the BOM some editors write
    except UnicodeDecodeError as error:
        line_number = raw[: error.start].count(b"\n") + 1
        raise DataError(
            f"{path}, line {line_number}: not valid UTF-8 (byte 0x{raw[error.start]:02x}). "
            "Fix: save the file as UTF-8."
        ) from None


def _parse_json_document(path: Path, text: str) -> _LoadedRecords | None:
    """A whole-file JSON list (or a single object); None when the text is JSONL instead."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        if not text.lstrip().startswith("["):
            return None  # several objects, one per line
        raise DataError(
            f"{path}, line {error.lineno}: not valid JSON ({error.msg} at column {error.colno}). "
            "Fix: the file must hold one JSON list of objects, or one JSON object per line."
        ) from None
    if isinstance(document, dict):
        return _LoadedRecords([document], lambda index: "line 1")
    if not isinstance(document, list):
        raise DataError(
            f"{path}, line 1: expected a JSON list of objects, got {_json_type(document)}. "
            'Fix: write [{"text": "..."}, ...] or one JSON object per line.'
        )
    for index, item in enumerate(document):
        if not isinstance(item, dict):
            raise DataError(
                f"{path}, item {index + 1} of the JSON list: expected an object, got "
                f'{_json_type(item)}. Fix: make every item an object such as {{"text": "..."}}.'
            )
    return _LoadedRecords(document, lambda index: f"item {index + 1}")


def _parse_json_lines(path: Path, text: str) -> _LoadedRecords:
    records: list[dict[str, Any]] = []
    line_numbers: list[int] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines (often a trailing one) hold no record
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{path}, line {line_number}: not valid JSON ({error.msg} at column "
                f"{error.colno}). Fix: put one complete JSON object per line, "
                'e.g. {"text": "..."}.'
            ) from None
        if not isinstance(record, dict):
            raise DataError(
                f"{path}, line {line_number}: expected a JSON object, got {_json_type(record)}. "
                'Fix: put one JSON object per line, e.g. {"text": "..."}.'
            )
        records.append(record)
        line_numbers.append(line_number)
    return _LoadedRecords(records, lambda index: f"line {line_numbers[index]}")


def _read_parquet(path: Path) -> _LoadedRecords:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            f"{path}: reading .parquet files needs pyarrow, which is not installed. "
            "Fix: pip install pyarrow (or convert the file to .jsonl)."
        ) from None
    try:
        records = pyarrow.parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as error:
        raise DataError(
            f"{path}: not a readable parquet file ({error}). Fix: re-export it, or convert it "
            "to .jsonl."
        ) from None
    return _LoadedRecords(records, lambda index: f"row {index + 1}")


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# --- tokenizing ---------------------------------------------------------------------------


def _tokenize(
    records: Sequence[dict[str, Any]],
    tokenizer: Any,
    text_field: str,
    source: str,
    describe_position: Callable[[int], str],
    assistant_roles: tuple[str, ...],
) -> list[Sample]:
    shapes_help = (
        f'use {{"{text_field}": "..."}}, {{"prompt": "...", "completion": "..."}} or '
        '{"messages": [{"role": "...", "content": "..."}, ...]}'
    )
    samples = []
    for index, record in enumerate(records):
        where = f"{source}, {describe_position(index)}"
        if not isinstance(record, dict):
            problem = f"expected an object, got {_json_type(record)}"
            raise _record_error(where, problem, shapes_help)
        # the explicit text field wins, so text_field="prompt" reads prompts as plain text
        if text_field in record:
            samples.append(_tokenize_text(tokenizer, _string_field(record, text_field, where)))
        elif "messages" in record:
            messages = _messages_field(record, where)
            _check_roles(messages, where, assistant_roles, records, text_field)
            samples.append(_tokenize_chat(tokenizer, messages, where, assistant_roles))
        elif "prompt" in record or "completion" in record:
            prompt = _string_field(record, "prompt", where)
            completion = _string_field(record, "completion", where)
            samples.append(_tokenize_prompt_completion(tokenizer, prompt, completion))
        else:
            raise _record_error(
                where,
                f"no {text_field!r}, 'prompt'/'completion' or 'messages' field "
                f"(fields found: {sorted(record)})",
                f"{shapes_help}; if the text is under another key, set text_field to that key",
            )
    return samples


def _record_error(where: str, problem: str, fix: str) -> DataError:
    return DataError(f"{where}: {problem}. Fix: {fix}.")


def _string_field(record: dict[str, Any], field: str, where: str) -> str:
    if field not in record:
        raise _record_error(
            where, f"missing field {field!r}", f"give the record a string {field!r}"
        )
    value = record[field]
    if not isinstance(value, str):
        raise _record_error(
            where, f"field {field!r} must be a string, got {_json_type(value)}",
            f"make {field!r} a string",
        )
    return value


def _messages_field(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    messages = record["messages"]
    example = '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'
    if not isinstance(messages, list):
        raise _record_error(
            where, f"field 'messages' must be a list, got {_json_type(messages)}",
            f'write "messages": {example}',
        )
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _record_error(
                where, f"field 'messages[{position}]' must be an object, got {_json_type(message)}",
                f'write "messages": {example}',
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                found = "nothing" if key not in message else _json_type(message[key])
                raise _record_error(
                    where, f"field 'messages[{position}].{key}' must be a string, got {found}",
                    f"give every message a string {key!r}",
                )
    return messages


def _check_roles(
    messages: list[dict[str, str]],
    where: str,
    assistant_roles: tuple[str, ...],
    records: Sequence[Any],
    text_field: str,
) -> None:
    """Every role is a context role or an assistant role, and some turn is an assistant turn."""
    if not messages:
        return  # an empty conversation is an empty sample, which the packing collator counts
    known = (*CONTEXT_ROLES, *assistant_roles)
    known_text = (f"{', '.join(CONTEXT_ROLES)} (context, not trained on) and "
                  f"{', '.join(assistant_roles)} (trained on; data.assistant_roles)")
    for position, message in enumerate(messages):
        role = message["role"]
        if role in known:
            continue
        users = _count_chats(records, text_field, lambda roles: role in roles)
        if role == "model":
            fix = ("Gemma-style data names the replies 'model': set data.assistant_roles: [model] "
                   "(or rename the role to 'assistant' in the data)")
        else:
            near = difflib.get_close_matches(role, known, n=1, cutoff=0.6)
            fix = (f"did you mean {near[0]!r}? Correct the role in the data" if near
                   else f"rename the role to one of {', '.join(known)}")
            wanted = ", ".join((*assistant_roles, role))
            fix += (f"; or, if the {role!r} turns are the replies to train on, add the role to "
                    f"data.assistant_roles (data.assistant_roles: [{wanted}])")
        raise _record_error(
            where,
            f"'messages[{position}]' has the role {role!r}, which is not a known role (known: "
            f"{known_text}; records in the data with this role: {users})",
            fix,
        )
    if not any(message["role"] in assistant_roles for message in messages):
        without = _count_chats(
            records, text_field, lambda roles: not set(roles) & set(assistant_roles)
        )
        found = ", ".join(dict.fromkeys(message["role"] for message in messages))
        raise _record_error(
            where,
            f"the conversation has no turn of the role{'s' if len(assistant_roles) > 1 else ''} "
            f"{', '.join(assistant_roles)} (data.assistant_roles), so it would train on nothing "
            f"(roles found: {found}; records in the data without such a turn: {without})",
            "add the assistant's reply to the conversation, or remove the record; if the replies "
            "have another role, add that role to data.assistant_roles",
        )


def _count_chats(
    records: Sequence[Any], text_field: str, matches: Callable[[list[str]], bool]
) -> int:
    """Chat records whose list of roles `matches` (other and malformed records are skipped)."""
    count = 0
    for record in records:
        if not isinstance(record, dict) or text_field in record:
            continue
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            continue
        roles = [m.get("role") for m in messages if isinstance(m, dict)]
        roles = [role for role in roles if isinstance(role, str)]
        count += bool(matches(roles))
    return count


def _tokenize_text(tokenizer: Any, text: str) -> Sample:
    if not text:
        return _empty_sample()  # the packing collator drops and counts empty samples
    input_ids = _with_eos(tokenizer, _encode_start(tokenizer, text))
    return {"input_ids": input_ids, "labels": list(input_ids)}


def _tokenize_prompt_completion(tokenizer: Any, prompt: str, completion: str) -> Sample:
    if not prompt and not completion:
        return _empty_sample()
    # tokenized apart so the boundary between masked and trained tokens is exact
    prompt_ids = _encode_start(tokenizer, prompt)
    completion_ids = _with_eos(tokenizer, _encode_inner(tokenizer, completion))
    return {
        "input_ids": prompt_ids + completion_ids,
        "labels": [IGNORE_INDEX] * len(prompt_ids) + completion_ids,
    }


def _tokenize_chat(
    tokenizer: Any, messages: list[dict[str, str]], where: str, assistant_roles: tuple[str, ...]
) -> Sample:
    if not messages:
        return _empty_sample()
    if hasattr(tokenizer, "apply_chat_template"):
        return _tokenize_chat_with_template(tokenizer, messages, where, assistant_roles)
    return _tokenize_chat_by_role_tags(tokenizer, messages, assistant_roles)


def _tokenize_chat_by_role_tags(
    tokenizer: ByteTokenizer, messages: list[dict[str, str]], assistant_roles: tuple[str, ...]
) -> Sample:
    """bos, then ``<|role|>\\n{content}\\n`` per message, then eos; loss on assistant content.

    The role tag (the role as written in the data) stays masked because at inference time it is
    given, not generated. The eos is trained only after a final assistant message, so the model
    learns to stop there.
    """
    input_ids = [tokenizer.bos_token_id]
    labels = [IGNORE_INDEX]
    for message in messages:
        tag_ids = _encode_inner(tokenizer, f"<|{message['role']}|>\n")
        content_ids = _encode_inner(tokenizer, f"{message['content']}\n")
        is_trained = message["role"] in assistant_roles
        input_ids += tag_ids + content_ids
        labels += [IGNORE_INDEX] * len(tag_ids)
        labels += content_ids if is_trained else [IGNORE_INDEX] * len(content_ids)
    input_ids.append(tokenizer.eos_token_id)
    ends_with_assistant = messages[-1]["role"] in assistant_roles
    labels.append(tokenizer.eos_token_id if ends_with_assistant else IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels}


def _tokenize_chat_with_template(
    tokenizer: Any, messages: list[dict[str, str]], where: str, assistant_roles: tuple[str, ...]
) -> Sample:
    """Apply the tokenizer's chat template; loss on the assistant turns only.

    Turns of the assistant roles reach the template with the role ``assistant``: the name chat
    templates (and their generation prompts) use for the model's replies; a template that calls
    them otherwise (Gemma's ``model``) maps ``assistant`` itself.

    An assistant turn spans from the end of the conversation before it, rendered with the
    generation prompt (so the assistant header is masked), to the end of the conversation
    through it (so its end-of-turn tokens are trained). The rendered text is cut at those
    points and each piece tokenized apart, so the label boundaries are exact.
    """
    from jinja2 import TemplateError  # a transformers dependency whenever templates are used

    def render(conversation: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        if not conversation:
            return ""
        try:
            return tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except (TemplateError, ValueError) as error:  # a template's raise_exception, no template
            raise _record_error(
                where, f"the tokenizer's chat template failed: {error}",
                "fix the conversation, or use a tokenizer that has a chat template",
            ) from None

    trained = [message["role"] in assistant_roles for message in messages]
    messages = [{**message, "role": "assistant"} if is_trained else message
                for message, is_trained in zip(messages, trained)]
    full_text = render(messages)
    trained_spans = []  # (start, end) character offsets in full_text
    for position, is_trained in enumerate(trained):
        if not is_trained:
            continue
        before = render(messages[:position], add_generation_prompt=True)
        through = render(messages[: position + 1])
        if not (through.startswith(before) and full_text.startswith(through)):
            raise _record_error(
                where,
                f"the chat template does not render 'messages[{position}]' as an extension of "
                "the turns before it, so its tokens cannot be located",
                "use a chat template whose output for a conversation starts with its output "
                "for each shorter prefix of it",
            )
        trained_spans.append((len(before), len(through)))

    input_ids: list[int] = []
    labels: list[int] = []
    cursor = 0
    for start, end in [*trained_spans, (len(full_text), len(full_text))]:
        context_ids = _encode_inner(tokenizer, full_text[cursor:start])
        trained_ids = _encode_inner(tokenizer, full_text[start:end])
        input_ids += context_ids + trained_ids
        labels += [IGNORE_INDEX] * len(context_ids) + trained_ids
        cursor = end
    return {"input_ids": input_ids, "labels": labels}


def _encode_start(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text that begins a sequence, with the tokenizer's leading special tokens."""
    if isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _encode_inner(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text inside a sequence, without special tokens."""
    if not text:
        return []
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text, add_special_tokens=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _with_eos(tokenizer: Any, input_ids: list[int]) -> list[int]:
    eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if eos_token_id is None or (input_ids and input_ids[-1] == eos_token_id):
        return input_ids
    return [*input_ids, eos_token_id]


def _empty_sample() -> Sample:
    return {"input_ids": [], "labels": []}
