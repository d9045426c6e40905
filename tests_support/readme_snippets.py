"""Every ```python block of a package's README runs as written, on the CPU, each in a fresh interpreter.

Shared by the packages' ``test_readme_snippets.py`` (the repository's pytest configuration puts this folder on
``sys.path``). A block that cannot run on a CPU (needs a GPU, a hub model or an engine) is marked on the line right
before its fence with ``<!-- snippet: skip (why) -->``. Each package pins its numbers of run and skipped blocks, so a
block is never skipped silently and a new block is never left untested.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cpu_user import cpu_user_environment

__all__ = ["SKIP_MARKER", "Snippet", "check_every_block_is_accounted_for", "readme_snippets", "run_snippet"]

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


def check_every_block_is_accounted_for(readme: Path, *, expected_run: int, expected_skipped: int) -> None:
    """Every block of ``readme`` is run or skipped by a marker right before it, in the pinned numbers."""
    text = readme.read_text()
    snippets = readme_snippets(text)
    skipped = [snippet for snippet in snippets if snippet.skip_reason is not None]
    runnable = len(snippets) - len(skipped)
    # A marker that is not right before a ```python fence would skip nothing while looking as if it did.
    assert len(SKIP_MARKER.findall(text)) == len(skipped), (
        f"{readme}: a `<!-- snippet: skip (...) -->` marker is not right before a block"
    )
    assert (runnable, len(skipped)) == (expected_run, expected_skipped), (
        f"{readme} holds {runnable} runnable and {len(skipped)} skipped ```python blocks (skipped at lines "
        f"{[snippet.line for snippet in skipped]}); expected {expected_run} and {expected_skipped}: update the "
        "expected numbers in the package's test_readme_snippets.py when you add a block on purpose"
    )


def run_snippet(snippet: Snippet) -> None:
    """Run one block in a fresh interpreter as a newcomer's CPU machine would: no GPU, no Triton interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", snippet.code],
        capture_output=True,
        text=True,
        env=cpu_user_environment(),
        timeout=SNIPPET_TIMEOUT_S,
    )
    assert done.returncode == 0, f"README line {snippet.line} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
