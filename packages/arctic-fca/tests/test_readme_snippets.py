"""Every ```python block of this package's README runs on the CPU or is marked skipped.

The helpers are shared by every package's tests: tests_support/readme_snippets.py.
"""

from __future__ import annotations

from pathlib import Path

from readme_snippets import check_every_block_is_accounted_for

README = Path(__file__).resolve().parents[1] / "README.md"
# The stats example needs a vLLM engine and a model; a runnable block added here needs a run test (run_snippet).
EXPECTED_RUN, EXPECTED_SKIPPED = 0, 1


def test_every_block_is_run_or_explicitly_skipped() -> None:
    check_every_block_is_accounted_for(README, expected_run=EXPECTED_RUN, expected_skipped=EXPECTED_SKIPPED)
