"""Tiny random-init models of every supported family (or shrunk from a real model"s config): what ``check_parity``,
the transformers guard"s self-check and ``python -m arctic_zorro_train.check`` run on, and what the tests build."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "build_model", "tiny_config", "tiny_config_like"]


# Family name -> what tiny_config builds. "*_vlm" are the Qwen3.5 image-text wrappers around the text models.
FAMILIES: tuple[str, ...] = (
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_vlm",
    "qwen3_5_moe_vlm",
    "llama",
    "mistral",
    "qwen2",
)

_COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.1,
}
_DENSE: dict[str, Any] = {"intermediate_size": 128}
_LINEAR: dict[str, Any] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_hidden_layers": 4,
}


def _text_config(family: str, overrides: Mapping[str, Any]) -> Any:
    from transformers import (
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    dense = _DENSE
    builders: dict[str, tuple[Any, dict[str, Any]]] = {
        "qwen3": (Qwen3Config, dense),
        "qwen3_moe": (Qwen3MoeConfig, {**dense, **_MOE, "decoder_sparse_step": 1}),
        "qwen3_next": (
            Qwen3NextConfig,
            {**dense, **_MOE, **_LINEAR, "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1},
        ),
        "qwen3_5": (Qwen3_5TextConfig, {**dense, **_LINEAR}),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, {**_MOE, **_LINEAR, "shared_expert_intermediate_size": 32}),
        "llama": (LlamaConfig, dense),
        "mistral": (MistralConfig, {**dense, "sliding_window": 6}),
        "qwen2": (Qwen2Config, dense),
    }
    config_class, defaults = builders[family]
    return config_class(**{**_COMMON, **defaults, **overrides})


def tiny_config(family: str, **overrides: Any) -> Any:
    """A transformers config of ``family`` (see ``FAMILIES``) small enough for CPU tests; overrides apply to the
    text config."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}.")
    if not family.endswith("_vlm"):
        return _text_config(family, overrides)
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text_family = family.removesuffix("_vlm")
    wrapper = Qwen3_5Config if text_family == "qwen3_5" else Qwen3_5MoeConfig
    return _tiny_image_text_config(wrapper, _text_config(text_family, overrides).to_dict(), {}, {})


# A tiny vision tower: text-only batches never run it, but the wrapper model builds it.
_TINY_VISION: dict[str, Any] = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
# The image-text wrappers' special tokens sit at the top of the tiny vocabulary, above the batches' token ids (< 120).
_TINY_SPECIAL_TOKENS: dict[str, int] = {
    "vision_start_token_id": 124,
    "image_token_id": 125,
    "video_token_id": 126,
    "vision_end_token_id": 127,
}


def _tiny_image_text_config(
    wrapper: Any, text: dict[str, Any], vision: Mapping[str, Any], wrapper_fields: Mapping[str, Any]
) -> Any:
    """An image-text wrapper config around the tiny ``text`` config (``vision`` and ``wrapper_fields`` are kept
    where the tiny sizes do not replace them)."""
    tiny_vision = {**vision, **_TINY_VISION, "out_hidden_size": text["hidden_size"]}
    return wrapper(text_config=text, vision_config=tiny_vision, **{**wrapper_fields, **_TINY_SPECIAL_TOKENS})


# What a real config is shrunk to: these fields, where the config has them, take the tiny sizes of ``tiny_config``.
_TINY_SIZES: dict[str, int] = {
    **{name: _COMMON[name] for name in ("vocab_size", "hidden_size", "num_attention_heads")},
    **_DENSE,
    "moe_intermediate_size": _MOE["moe_intermediate_size"],
    "shared_expert_intermediate_size": _MOE["moe_intermediate_size"],
    "linear_num_key_heads": _LINEAR["linear_num_key_heads"],
}
_TINY_MAX_EXPERTS = _MOE["num_experts"]
_TINY_MAX_EXPERTS_PER_TOKEN = _MOE["num_experts_per_tok"]
_TINY_MAX_SLIDING_WINDOW = 6
# Fields of a checkpoint's config that describe the checkpoint, not the architecture.
_CHECKPOINT_FIELDS = (
    "quantization_config",
    "auto_map",
    "_name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
)


_TINY_MAX_RUN = 3


def _tiny_layer_types(layer_types: Sequence[str]) -> list[str]:
    """Runs of one kind of layer cut to three, then the shortest prefix that holds every kind (two layers at least,
    where there are): ``[linear x3, full] x12`` keeps its 4-layer period, ``[full x28, sliding x4]`` becomes
    ``[full x3, sliding]``."""
    runs: list[str] = []
    for index, kind in enumerate(layer_types):
        if index < _TINY_MAX_RUN or any(earlier != kind for earlier in layer_types[index - _TINY_MAX_RUN : index]):
            runs.append(kind)
    kinds = set(runs)
    end = next(end for end in range(1, len(runs) + 1) if set(runs[:end]) == kinds)
    return runs[: max(end, min(2, len(runs)))]


def _tiny_token_id(token: Any) -> Any:
    vocab = _TINY_SIZES["vocab_size"]
    if isinstance(token, list):
        kept = [value for value in token if value < vocab]
        return kept or None
    return token if token is None or token < vocab else None


def _shrink_text_config(text: Any) -> dict[str, Any]:
    """``text``'s fields with the sizes of a tiny model (see ``tiny_config_like``)."""
    values = {name: value for name, value in text.to_dict().items() if name not in _CHECKPOINT_FIELDS}
    for name, size in _TINY_SIZES.items():
        if values.get(name):
            values[name] = size
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if values.get("num_key_value_heads"):
        # Keep the kind of attention: multi-head, multi-query or grouped-query.
        values["num_key_value_heads"] = 4 if kv_heads == heads else 1 if kv_heads == 1 else 2
    for name in ("num_experts", "num_local_experts"):
        if values.get(name):
            values[name] = min(int(values[name]), _TINY_MAX_EXPERTS)
    if values.get("num_experts_per_tok"):
        values["num_experts_per_tok"] = min(int(values["num_experts_per_tok"]), _TINY_MAX_EXPERTS_PER_TOKEN)
    if values.get("linear_num_value_heads") and text.linear_num_key_heads:
        ratio = max(1, int(text.linear_num_value_heads) // int(text.linear_num_key_heads))
        values["linear_num_value_heads"] = _TINY_SIZES["linear_num_key_heads"] * ratio
    if values.get("layer_types"):
        values["layer_types"] = _tiny_layer_types(values["layer_types"])
        layers = len(values["layer_types"])
    else:
        layers = min(2, int(text.num_hidden_layers))
    values["num_hidden_layers"] = layers
    if values.get("mlp_only_layers"):
        values["mlp_only_layers"] = [index for index in values["mlp_only_layers"] if index < layers]
    for name in ("max_window_layers", "decoder_sparse_step"):
        if values.get(name):
            values[name] = min(int(values[name]), layers)
    if values.get("sliding_window"):
        values["sliding_window"] = min(int(values["sliding_window"]), _TINY_MAX_SLIDING_WINDOW)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if name in values:
            values[name] = _tiny_token_id(values[name])
    # Dropout would make the deduplicated and the per-sample run draw different masks (and zorro attention
    # refuses attention dropout).
    for name, value in values.items():
        if name.endswith("dropout") and isinstance(value, float):
            values[name] = 0.0
    return values


def tiny_config_like(config: Any) -> Any:
    """A tiny config of ``config``'s architecture: few layers, hidden size 64, vocabulary 128, at most four experts.

    Kept from ``config``: the model type and everything that makes the family, e.g. the pattern of layer types (the
    shortest prefix holding every kind, so a hybrid keeps its Gated DeltaNet and attention layers in order), MoE
    routing (top-k capped at 2, ``norm_topk_prob``, shared experts, dense layers), the attention kind (multi-head,
    grouped or multi-query), head dims, RoPE parameters, norms, activation, biases and tied embeddings. Sliding
    windows shrink to at most 6 tokens, so short sequences still cross them; dropout is set to 0. An image-text
    wrapper keeps its class with the tiny text config and a one-block vision tower.

    Raises:
        UnsupportedModelError: ``config.model_type`` has no patch table (the message lists the supported ones).
    """
    from arctic_zorro_train.families import architecture_for_model_type

    architecture_for_model_type(getattr(config, "model_type", None), type(config).__name__)
    text = config.get_text_config()
    text_values = _shrink_text_config(text)
    if getattr(config, "vision_config", None) is None:
        return type(text).from_dict(text_values)
    wrapper_fields = {
        name: value
        for name, value in config.to_dict().items()
        if name not in {"text_config", "vision_config", "model_type", *_CHECKPOINT_FIELDS}
    }
    return _tiny_image_text_config(type(config), text_values, config.vision_config.to_dict(), wrapper_fields)


def build_model(
    config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    seed: int = 0,
    from_pretrained: bool = False,
) -> nn.Module:
    """A random-init causal LM (or image-text model, for a VLM config) in ``dtype``.

    ``from_pretrained``: saved to a temporary directory and loaded back (in eval mode), as users get a model. A loaded
    model is not the same object as a built one: transformers 5.25 (which depends on ``kernels``) kernelizes it, and
    kernelizes it again on every ``train()`` / ``eval()`` switch.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    loader = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    config._attn_implementation = attn_implementation
    if dtype == torch.float64 and getattr(config.get_text_config(), "num_experts", None):
        # transformers' default grouped_mm experts have no float64 kernel; the eager loop over experts has.
        config._experts_implementation = "eager"
    model = loader.from_config(config, dtype=dtype)
    # Norm weights start at exactly 1 (or 0 for Qwen3.5's zero-centred norms); perturb them so that gradient
    # checks see every parameter's effect. Gated DeltaNet decay rates exp(A_log) start in [0.01, 16]: most heads
    # then keep under 1% of their state per token, so the state a child takes from its parent barely matters and
    # the decay parameters' gradients nearly vanish (1e-10). Rates in [0.02, 0.3] keep 67-97% per token, like the
    # long memories of trained models.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
            if name.endswith("A_log"):
                parameter.copy_(torch.empty_like(parameter).uniform_(0.02, 0.3).log())
    if from_pretrained:
        return _saved_and_loaded(model, loader, dtype=dtype, attn_implementation=attn_implementation)
    return model  # type: ignore[no-any-return]


def _saved_and_loaded(model: nn.Module, loader: Any, *, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    options: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_implementation}
    experts = getattr(model.config, "_experts_implementation", None)
    if experts == "eager":
        options["experts_implementation"] = experts
    save: Any = model.save_pretrained
    with tempfile.TemporaryDirectory(prefix="arctic-zorro-tiny-") as directory:
        save(directory)
        loaded = loader.from_pretrained(directory, **options)
    return loaded  # type: ignore[no-any-return]
