"""Long-context multi-document QA: real multi-document items (HotpotQA's layout and a plain document list), the
prompt token by token, SQuAD-style normalisation, exact match and token F1 of the boxed answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from long_context_qa import (
    documents_of,
    exact_match,
    long_context_qa_recipe,
    long_context_qa_task,
    normalize_answer,
    token_f1,
)
from recipe_answers import last_boxed
from recipe_data import RecipeDataError, load_records, prepare_examples
from recipe_fixtures import chat_tokenizer, expected_prompt_ids

HOTPOT_ITEM = {
    "question": "Which magazine was started first, Arthur's Magazine or First for Women?",
    "answer": "Arthur's Magazine",
    "context": {
        "title": ["Arthur's Magazine", "First for Women"],
        "sentences": [
            [
                "Arthur's Magazine (1844-1846) was an American literary periodical published in Philadelphia in the "
                "19th century.",
                " Edited by T.S. Arthur, it featured work by Edgar A. Poe, J.H. Ingraham, Sarah Josepha Hale, "
                "Thomas G. Spear, and others.",
            ],
            [
                "First for Women is a woman's magazine published by Bauer Media Group in the USA.",
                " The magazine was started in 1989.",
            ],
        ],
    },
}
DOCUMENTS_ITEM = {
    "question": "In which city was the architect of the Sydney Opera House born?",
    "answers": ["Copenhagen", "Copenhagen, Denmark"],
    "documents": [
        {"title": "Sydney Opera House", "text": "The Sydney Opera House was designed by Danish architect Jorn Utzon."},
        {"title": "Jorn Utzon", "text": "Jorn Utzon was born in Copenhagen, the son of a naval architect."},
        "Copenhagen is the capital and most populous city of Denmark.",
    ],
}


def test_normalisation_is_squad_style() -> None:
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("An apple, a pear") == "apple pear"
    assert normalize_answer("Arthur's Magazine") == "arthurs magazine"
    assert normalize_answer("theatre") == "theatre"


def test_exact_match_and_token_f1_by_hand() -> None:
    assert exact_match("the Copenhagen", ["Copenhagen, Denmark", "Copenhagen"]) == 1.0
    assert exact_match("Copenhagen Denmark", ["Copenhagen"]) == 0.0
    # "eiffel tower in paris" vs "eiffel tower": 2 common tokens, precision 2/4, recall 2/2, F1 = 2/3.
    assert token_f1("The Eiffel Tower in Paris", ["Eiffel Tower"]) == pytest.approx(2 / 3)
    # Best over the answers: "copenhagen" vs "copenhagen denmark" gives P 1, R 1/2, F1 2/3; vs "copenhagen" 1.
    assert token_f1("Copenhagen", ["Copenhagen, Denmark"]) == pytest.approx(2 / 3)
    assert token_f1("Copenhagen", ["Copenhagen, Denmark", "Copenhagen"]) == 1.0
    assert token_f1("Aarhus", ["Copenhagen"]) == 0.0
    # A repeated token is common only as often as both sides have it: "x y y" vs "y z" share one "y", so precision
    # 1/3, recall 1/2, F1 = 2 (1/6) / (5/6) = 2/5.
    assert token_f1("x y y", ["y z"]) == pytest.approx(2 / 5)
    # Only articles: both normalise to nothing, which matches only nothing.
    assert token_f1("the", ["a"]) == 1.0
    assert token_f1("the", ["Copenhagen"]) == 0.0


def test_last_boxed_handles_nesting_and_truncation() -> None:
    assert last_boxed("\\boxed{a} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{Copenhagen} and a cut-off \\boxed{Aar") == "Copenhagen"
    assert last_boxed("no box") is None


def test_reward_scores_the_boxed_answer() -> None:
    f1 = long_context_qa_task("f1")
    exact = long_context_qa_task("exact_match")
    answers = f1.reference(DOCUMENTS_ITEM)
    assert answers == ("Copenhagen", "Copenhagen, Denmark")
    assert f1.reward("Utzon was born there: \\boxed{Copenhagen}", answers) == 1.0
    assert f1.reward("\\boxed{in Copenhagen}", answers) == pytest.approx(2 / 3)
    assert exact.reward("\\boxed{in Copenhagen}", answers) == 0.0
    assert exact.reward("\\boxed{copenhagen, denmark.}", answers) == 1.0
    # An answer outside the box is not scored.
    assert f1.reward("Copenhagen", answers) == 0.0
    assert f1.reference(HOTPOT_ITEM) == ("Arthur's Magazine",)
    assert f1.reference({"answers": {"text": ["1989"], "answer_start": [5]}}) == ("1989",)


def test_documents_from_hotpot_context_and_from_a_list() -> None:
    assert documents_of(HOTPOT_ITEM)[1] == (
        "First for Women",
        "First for Women is a woman's magazine published by Bauer Media Group in the USA. The magazine was started "
        "in 1989.",
    )
    assert [title for title, _ in documents_of(DOCUMENTS_ITEM)] == ["Sydney Opera House", "Jorn Utzon", ""]
    with pytest.raises(RecipeDataError, match="'documents' or 'context'"):
        documents_of({"question": "?"})


def test_data_path_prompt_and_length_filter(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps(HOTPOT_ITEM) + "\n\n" + json.dumps(DOCUMENTS_ITEM) + "\n")
    records = load_records(str(path))
    assert records == [HOTPOT_ITEM, DOCUMENTS_ITEM]
    task = long_context_qa_task()
    content = (
        "Document 1: Sydney Opera House\nThe Sydney Opera House was designed by Danish architect Jorn Utzon.\n\n"
        "Document 2: Jorn Utzon\nJorn Utzon was born in Copenhagen, the son of a naval architect.\n\n"
        "Document 3\nCopenhagen is the capital and most populous city of Denmark.\n\n"
        "Question: In which city was the architect of the Sydney Opera House born?\n\n"
        "Answer from the documents with a short phrase, and put it in \\boxed{} at the end."
    )
    expected = expected_prompt_ids(content)
    # The HotpotQA item's prompt is longer; a budget of exactly the second prompt's length keeps only it.
    prepared = prepare_examples(records, task, chat_tokenizer(), max_prompt_tokens=len(expected))
    assert prepared.dropped_too_long == 1
    assert [list(example.prompt_ids) for example in prepared.examples] == [expected]
    assert prepared.examples[0].reference == ("Copenhagen", "Copenhagen, Denmark")


def test_recipe_config_fits_long_prompts() -> None:
    recipe = long_context_qa_recipe("Qwen/Qwen3-4B")
    assert recipe.config.sampling.max_model_len == 8192 + 512
    assert recipe.config.zorro_train.enable and recipe.config.fca.enable
