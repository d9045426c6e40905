"""Building the engines' Hugging Face model and tokenizer from an ``ArcticRLClientConfig``.

One place resolves the device and dtype the config asks for and seeds every random generator, so the training and
log-prob engines (and the tests' plain transformers references) see the same model. transformers is imported here
lazily: the thin client never loads it.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from arctic_rl.errors import import_optional

if TYPE_CHECKING:
    from arctic_rl.config import ArcticRLClientConfig

__all__ = [
    "engine_device",
    "engine_dtype",
    "load_causal_lm",
    "load_tokenizer",
    "seed_everything",
]

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_dtype(config: ArcticRLClientConfig) -> torch.dtype:
    """The parameter dtype of every engine: ``config.resolved_dtype()`` as a torch dtype."""
    return _DTYPES[config.resolved_dtype()]


def engine_device(config: ArcticRLClientConfig, rank: int = 0) -> torch.device:
    """``cpu``, or the CUDA device of ``rank`` on its node (Ray shows each worker only its own GPU: index 0)."""
    if config.resolved_device() == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError(
            "the config asks for device='cuda' but torch sees no CUDA device; set device='cpu' or 'auto', or run "
            "on a machine with a GPU."
        )
    return torch.device("cuda", rank % count)


def seed_everything(seed: int, *, full_determinism: bool = False) -> None:
    """Seed Python, NumPy and torch (all devices). ``full_determinism`` also makes torch pick deterministic
    kernels (and fail on ops that have none), so a run and its restart from a checkpoint agree bitwise."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    if full_determinism:
        # cuBLAS needs a fixed workspace to be deterministic; it reads this variable when it initializes.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _require_transformers() -> Any:
    return import_optional("transformers", extra="engines", purpose="by the training and log-prob engines")


def load_causal_lm(config: ArcticRLClientConfig, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model of ``config.model_name`` (hub id or local directory) in ``dtype`` on ``device``, in train mode.

    Weights come from the checkpoint, so every rank and engine holds the same ones without broadcasting. SDPA
    attention: the padded (non-ZoRRO) forward runs it, and the ZoRRO patch replaces it with tree attention.
    """
    _require_transformers()
    from arctic_zorro_train import load_model

    model = load_model(config.model_name, dtype=dtype, attn_implementation="sdpa", device=device)
    model.train()
    return model


def load_tokenizer(config: ArcticRLClientConfig) -> Any:
    """The tokenizer of ``config.tokenizer_name`` (defaults to ``model_name``)."""
    transformers = _require_transformers()
    return transformers.AutoTokenizer.from_pretrained(config.resolved_tokenizer_name())
