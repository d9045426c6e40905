"""The CI check of skips (tests_support/expected_skips.py): an unlisted skip fails the run, a listed one does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import expected_skips
import pytest

TESTS = """
import pytest

def test_runs():
    pass

def test_needs_a_gpu():
    pytest.skip("needs a CUDA GPU")

def test_broken_environment():
    pytest.importorskip("a_module_nobody_installed")

@pytest.mark.xfail(reason="known bug", strict=True)
def test_known_bug():
    assert False
"""


def run_with_list(tmp_path: Path, listing: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(TESTS)
    (tmp_path / "skips.toml").write_text(listing)
    # No third-party plugins: the inner run needs only pytest and this one.
    env = {
        **os.environ,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(expected_skips.__file__).parent), *sys.path]),
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "expected_skips",
         f"--expected-skips={tmp_path / 'skips.toml'}", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip


GPU = '[[skip]]\ntest = "test_sample.py::test_needs_a_gpu"\nreason = "needs a CUDA GPU"\nwhy = "CPU CI"\n'


def test_an_unlisted_skip_fails_the_run(tmp_path: Path) -> None:
    done = run_with_list(tmp_path, GPU)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "1 skip(s) for a reason" in done.stdout
    assert "test_sample.py::test_broken_environment" in done.stdout and "a_module_nobody_installed" in done.stdout
    assert "test_needs_a_gpu" not in done.stdout.split("for a reason")[1]


def test_listed_skips_and_xfails_pass(tmp_path: Path) -> None:
    listing = GPU + '[[skip]]\ntest = "test_sample.py::test_broken"\nreason = "a_module_nobody_installed"\nwhy = "x"\n'
    done = run_with_list(tmp_path, listing)
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr


def test_a_skip_expected_without_a_module_fails_where_the_module_is_installed(tmp_path: Path) -> None:
    listing = GPU + (
        '[[skip]]\ntest = "test_sample.py::test_broken"\nreason = "a_module_nobody_installed"\nwhy = "x"\n'
        'missing = "pytest"\n'
    )
    assert run_with_list(tmp_path, listing).returncode == pytest.ExitCode.TESTS_FAILED


def test_the_repository_list_is_well_formed(tmp_path: Path) -> None:
    entries = expected_skips.load_expected_skips(expected_skips.DEFAULT_LIST)
    assert entries and all(entry.test and entry.reason and entry.why for entry in entries)
    incomplete = tmp_path / "incomplete.toml"
    incomplete.write_text('[[skip]]\ntest = "a"\nreason = "b"\n')
    with pytest.raises(ValueError, match=r"lacks \['why'\]"):
        expected_skips.load_expected_skips(incomplete)
