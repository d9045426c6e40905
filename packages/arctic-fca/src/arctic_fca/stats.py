"""Per-step FCA statistics: a process-wide counter (read by tests and dashboards) and the log line.

The counters live in the process that runs vLLM's model (the worker). In vLLM's default multiprocess mode that is not
the user's process: read them there with ``collect_stats(llm)`` (``arctic_fca.worker``). The log line goes to the
``vllm.arctic_fca`` logger, a child of vLLM's own logger, so it appears wherever vLLM's log lines do, in every process,
with no logging set-up by the user (``VLLM_LOGGING_LEVEL`` and ``VLLM_CONFIGURE_LOGGING`` govern it).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

__all__ = ["LOGGER_NAME", "FcaStats", "get_stats", "record_standard_step", "record_step", "reset_stats"]

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
