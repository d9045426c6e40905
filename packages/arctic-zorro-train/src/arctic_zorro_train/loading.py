"""Load a supported model from a local directory or a hub id (text-only causal LMs and VLM wrappers)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

__all__ = ["load_model"]


def load_model(
    model_name_or_path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str | None = "sdpa",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> nn.Module:
    """``AutoModelForCausalLM`` for text models, ``AutoModelForImageTextToText`` for VLM checkpoints (a config with a
    ``vision_config``, e.g. Qwen3.5/3.6); the text backbone is what zorro-train runs."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    source = os.fspath(model_name_or_path)
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    loader = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model: Any = loader.from_pretrained(
        source, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    return model.to(device)  # type: ignore[no-any-return]
