"""Data for the recipes: records from a hub dataset or local JSONL / Parquet files, chat prompts, length filtering.

A record is one row of the data as a plain dict; each recipe's ``Task`` turns a record into chat messages and a
reference answer. ``prepare_examples`` renders the messages with the tokenizer's chat template, tokenizes them and
drops the prompts longer than the token budget.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "Example",
    "PreparedData",
    "RecipeDataError",
    "Task",
    "chat_prompt_ids",
    "load_records",
    "prepare_examples",
    "require_fields",
]

Reference = TypeVar("Reference")
Record = Mapping[str, Any]
Messages = list[dict[str, str]]

_EXTRA = (
    "install the recipes' extra `arctic-platform[recipes]` (datasets, pyarrow): from the repository root, "
    "`uv sync --all-packages --extra recipes` or `pip install '.[recipes]'`"
)


class RecipeDataError(ValueError):
    """The data cannot be loaded or turned into prompts; the message says how to fix it."""


class ChatTokenizer(Protocol):
    """What the recipes need of a transformers tokenizer."""

    chat_template: str | None
    pad_token_id: int | None
    eos_token_id: int | None

    def apply_chat_template(self, conversation: Messages, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Task(Generic[Reference]):
    """One recipe's task: how a record becomes a chat prompt and a reference, and how a completion is scored.

    ``reward(completion_text, reference)`` returns a float in [0, 1].
    """

    name: str
    messages: Callable[[Record], Messages]
    reference: Callable[[Record], Reference]
    reward: Callable[[str, Reference], float]


@dataclass(frozen=True)
class Example(Generic[Reference]):
    """One prompt ready for the sampler: its token ids, the rendered text and the reference the reward needs."""

    prompt_ids: tuple[int, ...]
    prompt_text: str
    reference: Reference


@dataclass(frozen=True)
class PreparedData(Generic[Reference]):
    """The examples that fit the token budget, and how many records were dropped for their length."""

    examples: tuple[Example[Reference], ...]
    dropped_too_long: int


def load_records(
    source: str, *, split: str = "train", subset: str | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Rows of ``source`` as dicts, in file order, at most ``limit`` of them.

    ``source`` is a ``.jsonl`` file (one JSON object a line), a ``.json`` file (an array of objects, as BIRD ships
    its splits), a ``.parquet`` file, or else a dataset the ``datasets``
    library loads: a hub id (``openai/gsm8k`` with ``subset="main"``) or a local dataset directory, of which the
    ``split`` is read.
    """
    if limit is not None and limit < 1:
        raise RecipeDataError(f"limit must be >= 1 or None, got {limit}.")
    path = Path(source)
    if path.suffix == ".jsonl":
        records = _read_jsonl(path, limit)
    elif path.suffix == ".json":
        records = _read_json_list(path, limit)
    elif path.suffix == ".parquet":
        records = _read_parquet(path, limit)
    else:
        records = _read_datasets(source, split=split, subset=subset, limit=limit)
    if not records:
        raise RecipeDataError(f"{source} holds no records (split {split!r}); point --data at a non-empty dataset.")
    return records


def _read_jsonl(path: Path, limit: int | None) -> list[dict[str, Any]]:
    if not path.is_file():
        raise RecipeDataError(f"no JSONL file at {path}; check the --data path.")
    records: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise RecipeDataError(
                    f"{path}:{number} is not valid JSON ({error.msg}); fix or remove the line."
                ) from None
            if not isinstance(record, dict):
                raise RecipeDataError(f"{path}:{number} is a JSON {type(record).__name__}, expected an object.")
            records.append(record)
            if limit is not None and len(records) == limit:
                break
    return records


def _read_json_list(path: Path, limit: int | None) -> list[dict[str, Any]]:
    # BIRD and Spider ship their splits as one JSON array of objects.
    if not path.is_file():
        raise RecipeDataError(f"no JSON file at {path}; check the --data path.")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise RecipeDataError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}).") from None
    if not isinstance(document, list) or not all(isinstance(record, dict) for record in document):
        raise RecipeDataError(f"{path} must hold a JSON array of objects (one per record); use .jsonl for lines.")
    return document[:limit] if limit is not None else document


def _read_parquet(path: Path, limit: int | None) -> list[dict[str, Any]]:
    if not path.is_file():
        raise RecipeDataError(f"no Parquet file at {path}; check the --data path.")
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise RecipeDataError(f"reading {path} needs pyarrow: {_EXTRA}.") from None
    table = parquet.read_table(path)
    if limit is not None:
        table = table.slice(0, limit)
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def _read_datasets(source: str, *, split: str, subset: str | None, limit: int | None) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise RecipeDataError(
            f"{source!r} is not a .jsonl, .json or .parquet file, so it is read as a hub dataset id or a local "
            f"dataset directory, which needs the `datasets` library: {_EXTRA}."
        ) from None
    dataset = datasets.load_dataset(source, subset, split=split)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return [dict(row) for row in dataset]


def chat_prompt_ids(tokenizer: ChatTokenizer, messages: Messages) -> tuple[list[int], str]:
    """The prompt's token ids and text: ``messages`` rendered by the tokenizer's chat template, ready for the
    assistant's turn (the template's own special tokens, none added on top)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeDataError(
            "the tokenizer has no chat template, so the recipe cannot build its prompts; use an instruct/chat model's "
            "tokenizer (--tokenizer), or set `tokenizer.chat_template` to a Jinja template before preparing the data."
        )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise RecipeDataError(f"the chat template rendered a {type(text).__name__}, expected a string.")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids, text


def prepare_examples(
    records: Iterable[Record],
    task: Task[Reference],
    tokenizer: ChatTokenizer,
    *,
    max_prompt_tokens: int,
) -> PreparedData[Reference]:
    """Every record as an ``Example``, except those whose prompt is longer than ``max_prompt_tokens`` tokens."""
    if max_prompt_tokens < 1:
        raise RecipeDataError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}.")
    examples: list[Example[Reference]] = []
    dropped = 0
    for record in records:
        ids, text = chat_prompt_ids(tokenizer, task.messages(record))
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        examples.append(Example(tuple(ids), text, task.reference(record)))
    return PreparedData(tuple(examples), dropped)


def require_fields(record: Record, fields: Sequence[str], task: str) -> None:
    """Refuse a record that lacks one of ``fields``, naming the ones it has."""
    missing = [field for field in fields if field not in record]
    if missing:
        raise RecipeDataError(
            f"a {task} record needs the fields {list(fields)}, but this one lacks {missing} (it has "
            f"{sorted(record)}); rename the columns of your data or pick the dataset's matching subset."
        )
