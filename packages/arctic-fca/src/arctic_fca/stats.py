"""Per-step FCA statistics: a process-wide counter (read by tests and dashboards) and the log line."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

__all__ = ["FcaStats", "get_stats", "record_standard_step", "record_step", "reset_stats"]

logger = logging.getLogger("arctic_fca")


@dataclass
class FcaStats:
    """Totals since the last reset.

    ``steps`` counts decode-eligible steps seen by the backend, ``steps_grouped`` those where at least one group was
    found, ``standard_steps`` those sent to vLLM's standard attention (prefill, long query, ...).
    ``saved_bytes_per_layer`` is the KV bytes a layer did not read thanks to grouping, summed over steps.
    """

    steps: int = 0
    steps_grouped: int = 0
    standard_steps: int = 0
    groups: int = 0
    requests: int = 0
    grouped_requests: int = 0
    saved_bytes_per_layer: int = 0


_lock = threading.Lock()
_stats = FcaStats()


def get_stats() -> FcaStats:
    """A copy of the totals."""
    with _lock:
        return FcaStats(**vars(_stats))


def reset_stats() -> None:
    global _stats
    with _lock:
        _stats = FcaStats()


def record_standard_step() -> None:
    with _lock:
        _stats.standard_steps += 1


def record_step(requests: int, groups: int, grouped_requests: int, saved_bytes_per_layer: int, *, log: bool) -> None:
    """Add one grouped-decode step (or several, when the device counters are read in batches) and log it."""
    with _lock:
        _stats.steps += 1
        _stats.steps_grouped += int(groups > 0)
        _stats.requests += requests
        _stats.groups += groups
        _stats.grouped_requests += grouped_requests
        _stats.saved_bytes_per_layer += saved_bytes_per_layer
    if log:
        share = grouped_requests / requests if requests else 0.0
        logger.info(
            "arctic-fca step: %d groups, %d/%d requests grouped (%.0f%%), %.2f MB of KV reads saved per layer",
            groups,
            grouped_requests,
            requests,
            100.0 * share,
            saved_bytes_per_layer / 1e6,
        )
