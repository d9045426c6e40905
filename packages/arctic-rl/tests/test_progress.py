"""Progress lines: one line per wait on stderr, and a heartbeat while the wait lasts."""

from __future__ import annotations

import pytest

from arctic_rl.progress import report, wait_with_heartbeat


def test_report_prints_one_prefixed_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    report("starting a local Ray instance")
    assert capsys.readouterr() == ("", "arctic-rl: starting a local Ray instance\n")


def test_a_wait_reports_after_each_heartbeat_until_done(capsys: pytest.CaptureFixture[str]) -> None:
    now = [0.0]
    timeouts: list[float] = []

    def done(timeout_s: float) -> bool:
        timeouts.append(timeout_s)
        now[0] += timeout_s if len(timeouts) < 3 else 4.0  # two full heartbeats, then done 4 s into the third
        return len(timeouts) == 3

    seconds = wait_with_heartbeat(done, "starting the engines", heartbeat_s=20.0, clock=lambda: now[0])
    assert seconds == 44.0
    assert timeouts == [20.0, 20.0, 20.0]
    assert capsys.readouterr().err.splitlines() == [
        "arctic-rl: still starting the engines (20 s)",
        "arctic-rl: still starting the engines (40 s)",
    ]


def test_a_wait_that_is_over_at_once_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert wait_with_heartbeat(lambda timeout_s: True, "waiting", clock=lambda: 5.0) == 0.0
    assert capsys.readouterr().err == ""
