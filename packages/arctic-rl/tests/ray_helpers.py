from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def retry_start(start: Callable[[], T], attempts: int = 3) -> T:
    """Start a local Ray instance or simulated cluster, retrying: on a loaded 2-core machine a raylet can miss
    Ray's fixed 30 s registration deadline."""
    import ray

    for attempt in range(attempts):
        try:
            return start()
        except Exception as error:  # Ray raises a bare Exception for the registration timeout
            if "timed out during startup" not in str(error) or attempt == attempts - 1:
                raise
            ray.shutdown()
    raise AssertionError("unreachable")
