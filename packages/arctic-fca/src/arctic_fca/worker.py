"""Reading FCA's counters from the process where vLLM runs the model.

In vLLM's default multiprocess mode the attention backend, and so ``arctic_fca.get_stats()``'s counters, live in the
worker process; the user's process only holds zeros. ``FcaWorkerExtension`` adds two methods to vLLM's worker
(``LLM(..., worker_extension_cls="arctic_fca.FcaWorkerExtension")``), and ``collect_stats(llm)`` calls them through
vLLM's ``collective_rpc`` and sums over the workers. Method names travel, not code, so this works without
``VLLM_ALLOW_INSECURE_SERIALIZATION``.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from arctic_fca.stats import FcaStats, flush_stats, get_stats, reset_stats

__all__ = ["WORKER_EXTENSION", "FcaWorkerExtension", "collect_stats", "reset_worker_stats"]

WORKER_EXTENSION = "arctic_fca.FcaWorkerExtension"


class FcaWorkerExtension:
    """Methods vLLM mixes into its worker class (``worker_extension_cls``); they run in the worker process."""

    def fca_stats(self) -> dict[str, int]:
        """This worker's FCA totals, GPU planners' pending steps included."""
        flush_stats()
        return asdict(get_stats())

    def fca_reset_stats(self) -> None:
        reset_stats()


def _rpc(llm: Any, method: str) -> list[Any]:
    try:
        return list(llm.collective_rpc(method))
    except Exception as error:
        # In-process vLLM raises NotImplementedError for an unknown method; a multiprocess executor re-raises the
        # worker's error with its message, so the method's name is what identifies this case.
        if method not in str(error):
            raise
        raise RuntimeError(
            f"vLLM's workers have no `{method}` method: create the engine with "
            f'`LLM(..., worker_extension_cls="{WORKER_EXTENSION}")` (or `--worker-extension-cls {WORKER_EXTENSION}` '
            "for `vllm serve`) to read FCA's counters from the worker processes."
        ) from error


def collect_stats(llm: Any) -> FcaStats:
    """FCA's totals summed over every worker of ``llm`` (a ``vllm.LLM``), in any executor mode.

    Needs the engine to be created with ``worker_extension_cls="arctic_fca.FcaWorkerExtension"``.
    """
    totals = FcaStats()
    for worker_stats in _rpc(llm, "fca_stats"):
        for field in fields(FcaStats):
            setattr(totals, field.name, getattr(totals, field.name) + int(worker_stats[field.name]))
    return totals


def reset_worker_stats(llm: Any) -> None:
    """Clear FCA's totals in every worker of ``llm``."""
    _rpc(llm, "fca_reset_stats")
