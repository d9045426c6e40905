"""Tokenizers for the recipes' tests: the byte-level tokenizer of ``arctic_rl.testing`` (one token per byte) with a
minimal chat template, so prompt token ids can be computed by hand."""

from __future__ import annotations

from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IM_START, IM_END = 257, 258


def chat_tokenizer() -> Any:
    from arctic_rl.testing import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def expected_prompt_ids(user_content: str) -> list[int]:
    """The byte tokenizer's ids of one user turn rendered by ``CHAT_TEMPLATE``, computed without the tokenizer."""
    return [
        IM_START,
        *b"user\n",
        *user_content.encode(),
        IM_END,
        *b"\n",
        IM_START,
        *b"assistant\n",
    ]
