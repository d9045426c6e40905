"""GSM8K with GRPO: grade-school math word problems, rewarded by exact match of the final number.

Records have ``question`` and ``answer`` (the worked solution ending in ``#### <number>``, as in ``openai/gsm8k``).
The model is asked to end with ``\\boxed{<number>}``; the reward is 1 when the completion's final answer equals the
reference after number normalisation, else 0.

    python recipes/gsm8k.py --model Qwen/Qwen3-1.7B --data openai/gsm8k --data-subset main \\
        --eval-data openai/gsm8k --eval-split test
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from recipe_answers import last_boxed
from recipe_data import Messages, Record, Task, require_fields
from recipe_loop import EngineOptions, LoopSettings, Recipe, RunSummary, client_config, recipe_main

__all__ = [
    "GSM8K_LOOP",
    "GSM8K_TASK",
    "final_answer",
    "gsm8k_messages",
    "gsm8k_recipe",
    "gsm8k_reference",
    "gsm8k_reward",
    "main",
    "normalize_number",
]

INSTRUCTION = "Solve the math problem step by step. Put the final answer, a single number, in \\boxed{} at the end."

GSM8K_LOOP = LoopSettings(
    steps=200,
    prompts_per_step=32,
    group_size=8,
    max_prompt_tokens=512,
    max_tokens=768,
    temperature=1.0,
    eval_every=20,
    eval_prompts=256,
)

# A number as people write it: sign, currency, thousands separators, decimals, percent.
_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?%?|-?\$?\s*\.\d+%?")


def gsm8k_recipe(
    model_name: str, *, engines: EngineOptions | None = None, lr: float = 1e-6, loop: LoopSettings = GSM8K_LOOP
) -> Recipe:
    """The GSM8K run: the engines (ZoRRO and FCA on) and the loop settings."""
    engines = engines or EngineOptions()
    return Recipe(client_config(model_name, engines, loop, lr=lr), loop)


def gsm8k_messages(record: Record) -> Messages:
    require_fields(record, ["question"], "GSM8K")
    return [{"role": "user", "content": f"{INSTRUCTION}\n\n{record['question']}"}]


def gsm8k_reference(record: Record) -> str:
    """The normalised reference number: the text after ``####`` in ``answer`` (or all of ``answer``)."""
    require_fields(record, ["answer"], "GSM8K")
    answer = str(record["answer"])
    final = answer.rsplit("####", 1)[-1]
    number = normalize_number(final)
    if number is None:
        raise ValueError(f"the GSM8K reference {final.strip()!r} is not a number; expected '... #### <number>'.")
    return number


def normalize_number(text: str) -> str | None:
    """``text`` as a canonical number string, or None if it is not one number.

    Drops spaces, ``$``, ``%``, thousands commas and a trailing period, and writes the value without trailing zeros
    or exponent: ``"$1,234.50"`` -> ``"1234.5"``, ``"72.0"`` -> ``"72"``, ``"-0"`` -> ``"0"``.
    """
    cleaned = text.strip().rstrip(".").replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
    if not cleaned:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    canonical = format(value.normalize(), "f")
    return "0" if canonical in ("-0", "0") else canonical


def final_answer(completion: str) -> str | None:
    """The completion's final answer, normalised: the last ``\\boxed{}``, else the text after the last ``####``,
    else the last number in the completion."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return normalize_number(boxed.replace("\\$", "$").replace("\\%", "%"))
    if "####" in completion:
        return normalize_number(completion.rsplit("####", 1)[-1].strip().split("\n")[0])
    numbers = _NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None


def gsm8k_reward(completion: str, reference: str) -> float:
    """1.0 when the completion's final answer equals the reference number, else 0.0."""
    return 1.0 if final_answer(completion) == reference else 0.0


GSM8K_TASK: Task[str] = Task("gsm8k", gsm8k_messages, gsm8k_reference, gsm8k_reward)


def main(argv: Sequence[str] | None = None) -> RunSummary:
    def task(arguments: argparse.Namespace) -> Task[Any]:
        return GSM8K_TASK

    return recipe_main(argv, description=__doc__ or "", build=gsm8k_recipe, default_loop=GSM8K_LOOP, task=task)


if __name__ == "__main__":
    main()
