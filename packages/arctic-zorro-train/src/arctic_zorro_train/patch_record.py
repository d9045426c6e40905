"""The record of an installed patch, kept on the model: what was patched, with which settings, and how to undo it.

``patching`` writes it (``apply_zorro``); the deduplicated forward and the engines read it (``get_patch``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from arctic_zorro_train.attention import AttentionConfigView, register_zorro_attention
from arctic_zorro_train.errors import ZorroPatchError
from arctic_zorro_train.families import ArchitectureTable
from arctic_zorro_train.settings import ZorroSettings

__all__ = ["PATCH_ATTRIBUTE", "QwenAttentionPatcher", "ZorroPatch", "get_patch", "is_patched"]

PATCH_ATTRIBUTE = "_arctic_zorro_patch"


class QwenAttentionPatcher:
    """Route one attention module (any transformers attention that calls the attention interface) to zorro attention.

    ``patch()`` swaps the module's ``config`` for an ``AttentionConfigView`` (idempotent: patching a patched module
    only updates its mode); ``unpatch()`` puts the original config back. ``attn_implementation`` is what the module
    falls back to when called without a zorro context (default: the implementation it was loaded with).
    """

    def __init__(
        self, attention_layer: Any, use_split_attention: bool = True, attn_implementation: str | None = None
    ) -> None:
        if not hasattr(attention_layer, "config"):
            raise ZorroPatchError(
                f"{type(attention_layer).__name__} has no `config`; QwenAttentionPatcher expects a transformers "
                "attention module (e.g. Qwen3Attention) that dispatches through config._attn_implementation."
            )
        self.attention_layer = attention_layer
        self.use_split_attention = use_split_attention
        self.attn_implementation = attn_implementation

    @property
    def is_patched(self) -> bool:
        return isinstance(self.attention_layer.config, AttentionConfigView)

    def patch(self) -> QwenAttentionPatcher:
        register_zorro_attention()
        config: Any = self.attention_layer.config
        if isinstance(config, AttentionConfigView):
            config.zorro_use_split_attention = self.use_split_attention
            if self.attn_implementation is not None:
                config.zorro_fallback_implementation = self.attn_implementation
            return self
        fallback = self.attn_implementation or config._attn_implementation or "eager"
        object.__setattr__(
            self.attention_layer, "config", AttentionConfigView(config, fallback, self.use_split_attention)
        )
        return self

    def unpatch(self) -> None:
        config = self.attention_layer.config
        if isinstance(config, AttentionConfigView):
            object.__setattr__(self.attention_layer, "config", config.zorro_base_config)


@dataclass
class ZorroPatch:
    """The record of one installed patch: what was found, the settings, and how to undo every change."""

    model: nn.Module
    architecture: ArchitectureTable
    backbone: nn.Module
    lm_head: nn.Module
    settings: ZorroSettings
    attention_patchers: list[QwenAttentionPatcher]
    linear_attention_modules: list[nn.Module]
    routers: list[nn.Module]
    forward_patched: bool = False
    undo_steps: list[Callable[[], None]] = field(default_factory=list)
    # Every layer whose forward the patch replaced, with the replacing function. transformers 5.25 (which depends on
    # `kernels`) kernelizes a model loaded by from_pretrained again on every train()/eval() switch, and kernelize
    # drops a forward set on a module instance (or sets a hub kernel's) for the classes transformers decorates with
    # `use_kernel_forward_from_hub` (Qwen3.5's Gated DeltaNet layers and norms among them): the layers then ran
    # their own forward over the packed stream, silently (issue #37). The deduplicated forward puts them back first.
    layer_forwards: list[tuple[nn.Module, Callable[..., Any]]] = field(default_factory=list)

    @property
    def text_config(self) -> Any:
        return self.backbone.config

    @property
    def needs_reconstruct(self) -> bool:
        return any(not patcher.use_split_attention for patcher in self.attention_patchers)

    def reinstall_layer_forwards(self) -> None:
        """Put back every patched layer forward that something replaced since (see ``layer_forwards``)."""
        for module, forward in self.layer_forwards:
            installed = module.__dict__.get("forward")
            if (
                getattr(installed, "__func__", None) is not forward
                or getattr(installed, "__self__", None) is not module
            ):
                object.__setattr__(module, "forward", types.MethodType(forward, module))

    def remove(self) -> None:
        for patcher in self.attention_patchers:
            patcher.unpatch()
        for undo in reversed(self.undo_steps):
            undo()
        self.undo_steps.clear()
        self.layer_forwards.clear()


def get_patch(model: nn.Module) -> ZorroPatch:
    patch = model.__dict__.get(PATCH_ATTRIBUTE)
    if patch is None:
        raise ZorroPatchError(
            f"{type(model).__name__} is not patched for zorro-train; call apply_zorro(model) (or "
            "Qwen3ModelOncePatcher(model).patch(...)) first."
        )
    return patch  # type: ignore[no-any-return]


def is_patched(model: nn.Module) -> bool:
    return PATCH_ATTRIBUTE in model.__dict__
