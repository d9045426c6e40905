"""Per-step FCA statistics: a process-wide counter (read by tests and dashboards) and the log line.

The counters live in the process that runs vLLM's model (the worker). In vLLM's default multiprocess mode that is not
the user's process: read them there with ``collect_stats(llm)`` (``arctic_fca.worker``). The log line goes to the
``vllm.arctic_fca`` logger, a child of vLLM's own logger, so it appears wherever vLLM's log lines do, in every process,
with no logging set-up by the user (``VLLM_LOGGING_LEVEL`` and ``VLLM_CONFIGURE_LOGGING`` govern it).
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass

__all__ = [
    "LOGGER_NAME",
    "FcaStats",
    "flush_stats",
    "get_stats",
    "record_standard_step",
    "record_step",
    "record_steps",
    "reset_stats",
]

# A child of vLLM's logger: vLLM configures a handler on "vllm" in every process it starts, so no set-up is needed.
LOGGER_NAME = "vllm.arctic_fca"
logger = logging.getLogger(LOGGER_NAME)


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


def flush_stats() -> None:
    """Record the counters that GPU planners of this process keep on the device between log intervals (waits for
    the device): after it, ``get_stats()`` covers every step whose attention was queued so far. A no-op in a process
    that runs no FCA backend."""
    # Only a process that loaded a backend has planners; importing the planner elsewhere would import vLLM.
    planner = sys.modules.get("arctic_fca.planner")
    if planner is not None:
        planner.flush_planner_stats()


def get_stats() -> FcaStats:
    """A copy of the totals recorded so far (GPU planners record theirs every ``log_interval`` steps; call
    ``flush_stats()`` first to include the steps since)."""
    with _lock:
        return FcaStats(**vars(_stats))


def reset_stats() -> None:
    """Start the totals from zero, the steps GPU planners still hold on the device included (waits for it)."""
    global _stats
    flush_stats()
    with _lock:
        _stats = FcaStats()


def record_standard_step() -> None:
    with _lock:
        _stats.standard_steps += 1


def record_step(requests: int, groups: int, grouped_requests: int, saved_bytes_per_layer: int, *, log: bool) -> None:
    """Add one grouped-decode step and log it (``arctic-fca step: ...``)."""
    _add(1, int(groups > 0), requests, groups, grouped_requests, saved_bytes_per_layer)
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


def record_steps(
    steps: int,
    steps_grouped: int,
    requests: int,
    groups: int,
    grouped_requests: int,
    saved_bytes_per_layer: int,
    *,
    log: bool,
) -> None:
    """Add the totals of several grouped-decode steps (a GPU planner's counters, read in batches) and log them
    (``arctic-fca, N steps: ...``)."""
    _add(steps, steps_grouped, requests, groups, grouped_requests, saved_bytes_per_layer)
    if log and steps:
        share = grouped_requests / requests if requests else 0.0
        logger.info(
            "arctic-fca, %d steps: %.1f groups a step, %d/%d requests grouped (%.0f%%), %.2f MB of KV reads saved per "
            "layer a step",
            steps,
            groups / steps,
            grouped_requests,
            requests,
            100.0 * share,
            saved_bytes_per_layer / steps / 1e6,
        )


def _add(
    steps: int, steps_grouped: int, requests: int, groups: int, grouped_requests: int, saved_bytes_per_layer: int
) -> None:
    with _lock:
        _stats.steps += steps
        _stats.steps_grouped += steps_grouped
        _stats.requests += requests
        _stats.groups += groups
        _stats.grouped_requests += grouped_requests
        _stats.saved_bytes_per_layer += saved_bytes_per_layer
