"""The recipes' data loading: JSONL and Parquet files, a dataset directory through ``datasets``, and the errors that
say how to fix bad input (missing files, bad lines, no chat template, a missing optional dependency)."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest
from recipe_data import RecipeDataError, Task, chat_prompt_ids, load_records, prepare_examples
from recipe_fixtures import chat_tokenizer, expected_prompt_ids

RECORDS = [{"question": "2 + 2?", "answer": "#### 4"}, {"question": "3 * 3?", "answer": "#### 9"}]
ECHO = Task[str](
    "echo", lambda record: [{"role": "user", "content": record["question"]}], lambda r: r["answer"], lambda c, r: 0.0
)


def test_jsonl_errors_name_the_line_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n{not json}\n")
    with pytest.raises(RecipeDataError, match=r"bad.jsonl:2 is not valid JSON"):
        load_records(str(path))
    path.write_text("[1, 2]\n")
    with pytest.raises(RecipeDataError, match=r"bad.jsonl:1 is a JSON list, expected an object"):
        load_records(str(path))
    path.write_text("\n")
    with pytest.raises(RecipeDataError, match="holds no records"):
        load_records(str(path))
    with pytest.raises(RecipeDataError, match="no JSONL file"):
        load_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(RecipeDataError, match="limit must be >= 1"):
        load_records(str(path), limit=0)


def test_a_json_array_file_as_bird_ships_it(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(RECORDS))
    assert load_records(str(path)) == RECORDS
    assert load_records(str(path), limit=1) == RECORDS[:1]
    path.write_text(json.dumps({"data": RECORDS}))
    with pytest.raises(RecipeDataError, match="must hold a JSON array of objects"):
        load_records(str(path))


def test_a_dataset_directory_loads_through_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    pytest.importorskip("datasets")
    directory = tmp_path / "my_dataset"
    directory.mkdir()
    (directory / "train.jsonl").write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    assert load_records(str(directory), split="train") == RECORDS
    assert load_records(str(directory), split="train", limit=1) == RECORDS[:1]


def test_missing_optional_dependencies_name_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def without_recipe_extras(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] in ("datasets", "pyarrow"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_recipe_extras)
    with pytest.raises(RecipeDataError, match=r"arctic-platform\[recipes\]"):
        load_records("openai/gsm8k", subset="main")
    parquet = tmp_path / "train.parquet"
    parquet.write_bytes(b"PAR1")
    with pytest.raises(
        RecipeDataError, match=r"needs pyarrow: install the recipes' extra `arctic-platform\[recipes\]`"
    ):
        load_records(str(parquet))


def test_prompts_need_a_chat_template() -> None:
    tokenizer = chat_tokenizer()
    ids, text = chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])
    assert ids == expected_prompt_ids("hi")
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.chat_template = None
    with pytest.raises(RecipeDataError, match="no chat template"):
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])


def test_length_filter_keeps_prompts_up_to_the_budget() -> None:
    tokenizer = chat_tokenizer()
    budget = len(expected_prompt_ids("2 + 2?"))
    assert budget == len(expected_prompt_ids("3 * 3?"))
    kept = prepare_examples(RECORDS, ECHO, tokenizer, max_prompt_tokens=budget)
    assert (len(kept.examples), kept.dropped_too_long) == (2, 0)
    dropped = prepare_examples(RECORDS, ECHO, tokenizer, max_prompt_tokens=budget - 1)
    assert (len(dropped.examples), dropped.dropped_too_long) == (0, 2)
    with pytest.raises(RecipeDataError, match="max_prompt_tokens must be >= 1"):
        prepare_examples(RECORDS, ECHO, tokenizer, max_prompt_tokens=0)
