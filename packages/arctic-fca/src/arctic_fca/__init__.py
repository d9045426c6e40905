"""arctic_fca: Forest Cascade Attention as a vLLM attention-backend plugin (``ARCTIC_FCA=1``)."""

from arctic_fca._version import __version__
from arctic_fca.config import FcaConfig, is_active, set_active
from arctic_fca.plugin import TESTED_VLLM_VERSIONS, check_vllm_version, register
from arctic_fca.stats import FcaStats, flush_stats, get_stats, reset_stats
from arctic_fca.worker import FcaWorkerExtension, collect_stats, reset_worker_stats

__all__ = [
    "TESTED_VLLM_VERSIONS",
    "FcaConfig",
    "FcaStats",
    "FcaWorkerExtension",
    "__version__",
    "check_vllm_version",
    "collect_stats",
    "flush_stats",
    "get_stats",
    "is_active",
    "register",
    "reset_stats",
    "reset_worker_stats",
    "set_active",
]
