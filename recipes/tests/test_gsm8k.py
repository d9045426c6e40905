"""GSM8K: records from JSONL and Parquet, the chat prompt token by token, the reference and the final-answer reward
with number normalisation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gsm8k import (
    GSM8K_TASK,
    INSTRUCTION,
    final_answer,
    gsm8k_recipe,
    gsm8k_reference,
    gsm8k_reward,
    normalize_number,
)
from recipe_data import RecipeDataError, load_records, prepare_examples
from recipe_fixtures import chat_tokenizer, expected_prompt_ids

ITEMS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
        "$<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "A company's revenue was $1,250,000 last year and grew by 8% this year, while its costs stayed "
        "flat at the level of the year before. What is this year's revenue in dollars?",
        "answer": "1,250,000 * 1.08 = 1,350,000\n#### 1,350,000",
    },
]


def write_jsonl(path: Path, records: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("72", "72"),
        ("72.0", "72"),
        ("72.50", "72.5"),
        ("$1,234", "1234"),
        ("1,350,000", "1350000"),
        ("8%", "8"),
        (" -3 ", "-3"),
        ("-0.0", "0"),
        ("10.", "10"),
        ("1e3", "1000"),
        ("seventy", None),
        ("", None),
        ("1/2", None),
        ("nan", None),
    ],
)
def test_numbers_are_normalised(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("48 + 24 = 72, so the answer is \\boxed{72}.", "72"),
        ("She earned \\boxed{\\$10.00}", "10"),
        ("Growth \\boxed{8\\%}", "8"),
        ("First \\boxed{5}, on reflection \\boxed{1,350,000}", "1350000"),
        ("The total is 72 clips.\n#### 72.0\nDone", "72"),
        ("24 in May, 72 in total.", "72"),
        ("\\boxed{seventy-two}", None),
        ("no number here", None),
    ],
)
def test_the_final_answer_is_the_last_boxed_then_hashes_then_last_number(completion: str, expected: str | None) -> None:
    assert final_answer(completion) == expected


def test_reference_is_the_normalised_number_after_the_hashes() -> None:
    assert [gsm8k_reference(item) for item in ITEMS] == ["72", "10", "1350000"]
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_reference({"question": "?", "answer": "#### many"})
    with pytest.raises(RecipeDataError, match=r"lacks \['answer'\]"):
        gsm8k_reference({"question": "?"})


def test_reward_is_exact_match_of_the_final_number() -> None:
    assert gsm8k_reward("so \\boxed{72}", "72") == 1.0
    assert gsm8k_reward("so \\boxed{72.0}", "72") == 1.0
    assert gsm8k_reward("so \\boxed{$1,350,000}", "1350000") == 1.0
    assert gsm8k_reward("so \\boxed{71}", "72") == 0.0
    # The boxed answer wins over a later stray number.
    assert gsm8k_reward("\\boxed{72} (checked with 3 methods)", "72") == 1.0
    assert gsm8k_reward("", "72") == 0.0


@pytest.mark.parametrize("file_format", ["jsonl", "parquet"])
def test_data_path_from_local_files_to_prompts(tmp_path: Path, file_format: str) -> None:
    if file_format == "jsonl":
        path = write_jsonl(tmp_path / "train.jsonl", ITEMS)
    else:
        parquet = pytest.importorskip("pyarrow.parquet")
        pyarrow = pytest.importorskip("pyarrow")
        path = tmp_path / "train.parquet"
        parquet.write_table(pyarrow.Table.from_pylist(ITEMS), path)
    records = load_records(str(path))
    assert records == ITEMS
    assert load_records(str(path), limit=2) == ITEMS[:2]
    tokenizer = chat_tokenizer()
    first = f"{INSTRUCTION}\n\n{ITEMS[0]['question']}"
    budget = len(expected_prompt_ids(first))
    prepared = prepare_examples(records, GSM8K_TASK, tokenizer, max_prompt_tokens=budget)
    # The first prompt fits exactly; the third question is longer, so its prompt is dropped; the second is shorter.
    assert [example.reference for example in prepared.examples] == ["72", "10"]
    assert prepared.dropped_too_long == 1
    assert list(prepared.examples[0].prompt_ids) == expected_prompt_ids(first)
    assert prepared.examples[0].prompt_text.endswith("<|im_start|>assistant\n")


def test_recipe_config_is_complete() -> None:
    recipe = gsm8k_recipe("Qwen/Qwen3-1.7B")
    config = recipe.config
    assert config.model_name == "Qwen/Qwen3-1.7B"
    assert config.zorro_train.enable and config.fca.enable
    assert config.sampling.max_model_len == recipe.loop.max_prompt_tokens + recipe.loop.max_tokens == 512 + 768
    assert config.training.lr == 1e-6
    assert recipe.loop.processing() == {
        "loss_fn": "grpo",
        "config": {
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "clip_ratio_c": None,
            "importance_ratio_level": "token",
            "loss_agg_mode": "token-mean",
            "kl_coef": 0.0,
            "kl_estimator": "k3",
            "entropy_coef": 0.0,
            "tis_cap": None,
        },
    }
