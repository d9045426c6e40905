"""Every ```python block of this package's README runs as written, on the CPU, each in a fresh interpreter.

A block that cannot run on a CPU (needs a GPU or a hub model) is marked on the line right before its fence with
``<!-- snippet: skip (why) -->``. The numbers of run and skipped blocks are pinned, so a block is never skipped
silently and a new block is never left untested.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# The "Use" section's Qwen3-4B example needs a GPU and the hub; the other blocks build tiny models in code.
EXPECTED_RUN, EXPECTED_SKIPPED = 4, 1
SKIP_MARKER = re.compile(r"<!-- snippet: skip \((?P<reason>.+?)\) -->")
SNIPPET_TIMEOUT_S = 300


@dataclass(frozen=True)
class Snippet:
    line: int  # 1-based line of the opening fence
    code: str
    skip_reason: str | None


def readme_snippets(text: str) -> list[Snippet]:
    """The ```python blocks of a markdown text, each with the skip reason of the marker right before it (if any)."""
    lines = text.splitlines()
    snippets = []
    index = 0
    while index < len(lines):
        if lines[index].strip() != "```python":
            index += 1
            continue
        end = next((row for row in range(index + 1, len(lines)) if lines[row].strip() == "```"), None)
        assert end is not None, f"README line {index + 1}: the ```python block is never closed"
        marker = SKIP_MARKER.fullmatch(lines[index - 1].strip()) if index > 0 else None
        code = "\n".join(lines[index + 1 : end]) + "\n"
        snippets.append(Snippet(index + 1, code, None if marker is None else marker["reason"]))
        index = end + 1
    return snippets


SNIPPETS = readme_snippets(README.read_text())
RUNNABLE = [snippet for snippet in SNIPPETS if snippet.skip_reason is None]


def test_the_parser_reads_markers_only_right_before_a_block() -> None:
    text = "\n".join(
        [
            "<!-- snippet: skip (needs a GPU) -->",
            "```python",
            "print(1)",
            "```",
            "<!-- snippet: skip (too far) -->",
            "",
            "```python",
            "print(2)",
            "```",
            "```bash",
            "echo 3",
            "```",
        ]
    )
    snippets = readme_snippets(text)
    assert [(s.line, s.code, s.skip_reason) for s in snippets] == [
        (2, "print(1)\n", "needs a GPU"),
        (7, "print(2)\n", None),
    ]


def test_every_block_is_run_or_explicitly_skipped() -> None:
    text = README.read_text()
    skipped = [snippet for snippet in SNIPPETS if snippet.skip_reason is not None]
    # A marker that is not right before a ```python fence would skip nothing while looking as if it did.
    assert len(SKIP_MARKER.findall(text)) == len(skipped), (
        "a `<!-- snippet: skip (...) -->` marker is not right before a block"
    )
    assert (len(RUNNABLE), len(skipped)) == (EXPECTED_RUN, EXPECTED_SKIPPED), (
        f"README holds {len(RUNNABLE)} runnable and {len(skipped)} skipped ```python blocks (skipped at lines "
        f"{[snippet.line for snippet in skipped]}); expected {EXPECTED_RUN} and {EXPECTED_SKIPPED}: update "
        "EXPECTED_RUN / EXPECTED_SKIPPED when you add a block on purpose"
    )


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[f"line{snippet.line}" for snippet in RUNNABLE])
def test_readme_snippet_runs_on_the_cpu(snippet: Snippet) -> None:
    # What a newcomer's CPU machine has: no GPU and no Triton interpreter switched on.
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-c", snippet.code], capture_output=True, text=True, env=env, timeout=SNIPPET_TIMEOUT_S
    )
    assert done.returncode == 0, f"README line {snippet.line} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
