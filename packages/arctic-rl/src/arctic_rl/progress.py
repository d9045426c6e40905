"""Progress lines for the waits a user sits through: starting Ray, starting the engines (DeepSpeed, vLLM), waiting
for a launched HTTP server. One line each on stderr (flushed), plus a line every ``HEARTBEAT_S`` seconds while a
wait lasts, so a start-up that takes minutes on a small machine is never silent."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

__all__ = ["HEARTBEAT_S", "report", "wait_with_heartbeat"]

# Long enough not to flood a log, short enough that a user never wonders whether the job hangs.
HEARTBEAT_S = 20.0


def report(message: str) -> None:
    """Print one progress line, ``arctic-rl: <message>``, on stderr."""
    print(f"arctic-rl: {message}", file=sys.stderr, flush=True)


def wait_with_heartbeat(
    done: Callable[[float], bool],
    what: str,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Call ``done(timeout_s)`` (which waits up to ``timeout_s`` seconds and says whether the wait is over) until it
    returns True, reporting ``still <what> (N s)`` after each ``heartbeat_s`` without it; returns the seconds waited."""
    started = clock()
    while not done(heartbeat_s):
        report(f"still {what} ({clock() - started:.0f} s)")
    return clock() - started
