"""A pytest plugin that fails the run when a test is skipped for a reason nobody listed.

CI installs every dependency a package declares, so an ``importorskip`` that fires there means a broken environment,
not a missing optional extra; it must not pass as green. Load it with ``-p expected_skips`` (the noxfile's ``tests``
session does); ``--expected-skips=FILE`` names the list (default: ``expected_skips.toml`` beside this file). Each
entry names a test (a node-id prefix, relative to the rootdir), a substring of the skip message and why the skip is
right where the list is used, e.g. GPU-only modules on CPU CI; ``missing`` optionally names a module the skip is
expected only without (so the same skip in an environment that has it still fails).
"""

from __future__ import annotations

import importlib.util
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["ExpectedSkip", "SkipChecker", "load_expected_skips", "unexpected"]

DEFAULT_LIST = Path(__file__).with_name("expected_skips.toml")


@dataclass(frozen=True)
class ExpectedSkip:
    test: str
    reason: str
    why: str
    missing: str | None = None

    def matches(self, nodeid: str, message: str) -> bool:
        if self.missing is not None and _installed(self.missing):
            return False
        return nodeid.startswith(self.test) and self.reason in message


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def load_expected_skips(path: Path) -> list[ExpectedSkip]:
    entries = tomllib.loads(path.read_text()).get("skip", [])
    expected = []
    for index, entry in enumerate(entries):
        missing = {"test", "reason", "why"} - set(entry)
        if missing:
            raise ValueError(f"{path}: [[skip]] entry {index} lacks {sorted(missing)}; every entry names all three.")
        unknown = set(entry) - {"test", "reason", "why", "missing"}
        if unknown:
            raise ValueError(f"{path}: [[skip]] entry {index} has unknown keys {sorted(unknown)}.")
        expected.append(ExpectedSkip(entry["test"], entry["reason"], entry["why"], entry.get("missing")))
    return expected


def unexpected(skipped: list[tuple[str, str]], expected: list[ExpectedSkip]) -> list[tuple[str, str]]:
    """The (node id, message) pairs of ``skipped`` that no entry of ``expected`` allows."""
    return [(nodeid, message) for nodeid, message in skipped if not any(e.matches(nodeid, message) for e in expected)]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--expected-skips",
        default=str(DEFAULT_LIST),
        help="TOML list of the skips this run may have (the expected_skips plugin fails on any other skip)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipChecker(Path(config.getoption("--expected-skips"))), "expected_skips_checker")


class SkipChecker:
    """Records every skip (of a test or of a whole module at collection) and judges them when the session ends."""

    def __init__(self, expected: Path) -> None:
        self.expected = expected
        self.skipped: list[tuple[str, str]] = []

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        longrepr = report.longrepr
        message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        self.skipped.append((report.nodeid, message))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        surprises = unexpected(self.skipped, load_expected_skips(self.expected))
        if not surprises:
            return
        lines = [f"{len(surprises)} skip(s) for a reason {self.expected} does not list (a broken environment?):"]
        lines += [f"  {nodeid}: {message}" for nodeid, message in surprises]
        lines.append(f"Fix the environment, or add a [[skip]] entry (test, reason, why) to {self.expected}.")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
