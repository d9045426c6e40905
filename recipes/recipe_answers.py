"""Answers inside completions: the last ``\\boxed{...}`` (braces may nest), shared by the GSM8K and QA rewards."""

from __future__ import annotations

__all__ = ["last_boxed"]

_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` whose braces close, else None.

    ``r"so \\boxed{\\frac{1}{2}}"`` gives ``r"\\frac{1}{2}"``; an unclosed ``\\boxed{`` (a truncated completion) is
    skipped in favour of an earlier closed one.
    """
    start = text.rfind(_BOXED)
    while start != -1:
        depth = 0
        for index in range(start + len(_BOXED) - 1, len(text)):
            if text[index] == "{":
                depth += 1
            elif text[index] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED) : index]
        start = text.rfind(_BOXED, 0, start)
    return None
