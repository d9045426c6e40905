"""Long-context multi-document QA with GRPO: answer a question from several documents, rewarded by token F1 (or
exact match) of the ``\\boxed{...}`` answer against the reference answers, SQuAD-style normalised.

Records have ``question``, the answers (``answers``: a list, or ``answer``: one string) and the documents, either
``documents`` (a list of strings or of ``{"title", "text"}``) or HotpotQA's ``context``
(``{"title": [...], "sentences": [[...], ...]}``). Prompts longer than ``--max-prompt-tokens`` are dropped.

    python recipes/long_context_qa.py --model Qwen/Qwen3-4B --data hotpotqa/hotpot_qa --data-subset distractor \\
        --eval-data hotpotqa/hotpot_qa --eval-split validation --max-prompt-tokens 8192
"""

from __future__ import annotations

import argparse
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

from recipe_answers import last_boxed
from recipe_data import Messages, RecipeDataError, Record, Task, require_fields
from recipe_loop import EngineOptions, LoopSettings, Recipe, RunSummary, client_config, recipe_main

__all__ = [
    "QA_LOOP",
    "documents_of",
    "exact_match",
    "long_context_qa_recipe",
    "long_context_qa_task",
    "main",
    "normalize_answer",
    "token_f1",
]

QA_LOOP = LoopSettings(
    steps=200,
    prompts_per_step=16,
    group_size=8,
    max_prompt_tokens=8192,
    max_tokens=512,
    temperature=1.0,
    eval_every=20,
    eval_prompts=128,
)

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def long_context_qa_recipe(
    model_name: str, *, engines: EngineOptions | None = None, lr: float = 1e-6, loop: LoopSettings = QA_LOOP
) -> Recipe:
    """The long-context QA run: the engines (ZoRRO and FCA on) and the loop settings."""
    engines = engines or EngineOptions()
    return Recipe(client_config(model_name, engines, loop, lr=lr), loop)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles (a, an, the), single spaces."""
    without_punctuation = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", without_punctuation).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised answer, else 0.0."""
    predicted = normalize_answer(prediction)
    return 1.0 if any(predicted == normalize_answer(answer) for answer in answers) else 0.0


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """The best token-level F1 of the normalised prediction against any answer (SQuAD's F1)."""
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        expected = normalize_answer(answer).split()
        if not predicted or not expected:
            best = max(best, float(predicted == expected))
            continue
        common = sum((Counter(predicted) & Counter(expected)).values())
        if common:
            precision, recall = common / len(predicted), common / len(expected)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def documents_of(record: Record) -> list[tuple[str, str]]:
    """The record's documents as (title, text) pairs (title may be empty)."""
    if "documents" in record:
        documents = []
        for document in record["documents"]:
            if isinstance(document, str):
                documents.append(("", document))
            else:
                documents.append((str(document.get("title", "")), str(document["text"])))
        return documents
    if "context" in record:
        context = record["context"]
        if isinstance(context, str):
            return [("", context)]
        return [
            (str(title), "".join(sentences))
            for title, sentences in zip(context["title"], context["sentences"], strict=True)
        ]
    raise RecipeDataError(
        f"a long-context QA record needs its documents in 'documents' or 'context'; this one has {sorted(record)}."
    )


def _messages(record: Record) -> Messages:
    require_fields(record, ["question"], "long-context QA")
    sections = []
    for number, (title, text) in enumerate(documents_of(record), start=1):
        heading = f"Document {number}: {title}" if title else f"Document {number}"
        sections.append(f"{heading}\n{text}")
    content = (
        "\n\n".join(sections) + f"\n\nQuestion: {record['question']}\n\n"
        "Answer from the documents with a short phrase, and put it in \\boxed{} at the end."
    )
    return [{"role": "user", "content": content}]


def _answers(record: Record) -> tuple[str, ...]:
    if "answers" in record:
        answers = record["answers"]
        # SQuAD's layout: {"text": [...], "answer_start": [...]}.
        texts = answers["text"] if isinstance(answers, dict) else answers
        return tuple(str(answer) for answer in texts)
    if "answer" in record:
        return (str(record["answer"]),)
    raise RecipeDataError(f"a long-context QA record needs 'answers' or 'answer'; this one has {sorted(record)}.")


def long_context_qa_task(metric: Literal["f1", "exact_match"] = "f1") -> Task[tuple[str, ...]]:
    """The QA task, rewarding the boxed answer by ``metric`` (0 when the completion has no closed ``\\boxed{}``)."""
    score = token_f1 if metric == "f1" else exact_match

    def reward(completion: str, answers: tuple[str, ...]) -> float:
        boxed = last_boxed(completion)
        return 0.0 if boxed is None else score(boxed, answers)

    return Task("long_context_qa", _messages, _answers, reward)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metric", choices=["f1", "exact_match"], default="f1", help="reward (default: f1)")


def main(argv: Sequence[str] | None = None) -> RunSummary:
    def task(arguments: argparse.Namespace) -> Task[Any]:
        return long_context_qa_task(arguments.metric)

    return recipe_main(
        argv,
        description=__doc__ or "",
        build=long_context_qa_recipe,
        default_loop=QA_LOOP,
        task=task,
        add_arguments=_add_arguments,
    )


if __name__ == "__main__":
    main()
