"""Every ```python block of this package's README runs on the CPU or is marked skipped.

The helpers are shared by every package's tests: tests_support/readme_snippets.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from readme_snippets import Snippet, check_every_block_is_accounted_for, readme_snippets, run_snippet

README = Path(__file__).resolve().parents[1] / "README.md"
# The "Use" section's Qwen3-4B example needs a GPU and the hub; the other blocks build tiny models in code.
EXPECTED_RUN, EXPECTED_SKIPPED = 4, 1
RUNNABLE = [snippet for snippet in readme_snippets(README.read_text()) if snippet.skip_reason is None]


def test_every_block_is_run_or_explicitly_skipped() -> None:
    check_every_block_is_accounted_for(README, expected_run=EXPECTED_RUN, expected_skipped=EXPECTED_SKIPPED)


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[f"line{snippet.line}" for snippet in RUNNABLE])
def test_readme_snippet_runs_on_the_cpu(snippet: Snippet) -> None:
    run_snippet(snippet)
