"""Install and remove zorro-train on a Hugging Face model: explicit, table-driven, idempotent, reversible.

``apply_zorro(model)`` looks the model up in the architecture tables (``families.py``) and then:

1. registers ``"arctic_zorro"`` with transformers' attention interface (once per process);
2. gives every attention module of the table a config view routing it to tree attention (``attention.py``);
3. gives every Gated DeltaNet module a forward with a tree path (``gated_delta.py``);
4. notes the MoE routers (their logits are collected per forward, no patch needed);
5. optionally replaces ``model.forward`` so ``model(input_ids=..., attention_mask=..., position_ids=...)`` runs the
   deduplicated forward and returns a ``ZorroOutput``.

Each change is recorded with how to undo it; ``remove_zorro(model)`` restores the model exactly. Without a zorro
context, patched layers behave like the originals, so a patched model still runs plain batches.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from arctic_zorro_train.context import CONTEXT_KWARG, ZorroContext
from arctic_zorro_train.errors import ZorroPatchError
from arctic_zorro_train.families import resolve_architecture
from arctic_zorro_train.forward import zorro_model_forward
from arctic_zorro_train.fused import (
    fused_gated_norm_forward,
    fused_mlp_forward,
    fused_zero_centered_norm_forward,
    use_fused_kernels,
)
from arctic_zorro_train.gated_delta import gated_delta_tree_forward
from arctic_zorro_train.patch_record import PATCH_ATTRIBUTE, QwenAttentionPatcher, ZorroPatch, get_patch, is_patched
from arctic_zorro_train.settings import ZorroSettings
from arctic_zorro_train.versions import guard_transformers_version

__all__ = [
    "QwenAttentionPatcher",
    "ZorroPatch",
    "apply_zorro",
    "find_backbone",
    "get_patch",
    "is_patched",
    "remove_zorro",
]

# Every patched layer holds its patch too, so its forward (a method bound to the layer) finds the settings, and a
# ``copy.deepcopy`` of the model copies patch, layers and undo records together (an RL reference model is often a
# deep copy of the policy): no forward or undo step of the copy reaches back into the original.
LAYER_PATCH_ATTRIBUTE = "_arctic_zorro_layer_patch"


class _Absent:
    """Marks an attribute that did not exist before the patch; the same object in every copy."""

    def __copy__(self) -> _Absent:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Absent:
        return self


_ABSENT = _Absent()


@dataclass
class _AttributeUndo:
    """Puts back one attribute set by ``_set_attribute`` (data, not a closure, so deep copies undo their own)."""

    target: Any
    name: str
    previous: Any

    def __call__(self) -> None:
        if self.previous is _ABSENT:
            # Gone already where transformers' kernelize dropped a patched forward (see ZorroPatch.layer_forwards).
            self.target.__dict__.pop(self.name, None)
        else:
            object.__setattr__(self.target, self.name, self.previous)


def _set_attribute(target: Any, name: str, value: Any) -> _AttributeUndo:
    """Set ``target.name`` (bypassing nn.Module registration) and return the undo."""
    previous = target.__dict__.get(name, _ABSENT)
    object.__setattr__(target, name, value)
    return _AttributeUndo(target, name, previous)


def _layer_patch(module: nn.Module) -> ZorroPatch:
    return module.__dict__[LAYER_PATCH_ATTRIBUTE]  # type: ignore[no-any-return]


def _gated_delta_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A Gated DeltaNet layer's forward under the patch (bound to the layer): the tree path inside a zorro context,
    the layer's own forward otherwise. Arguments other than the context go to the original forward as the caller
    passed them: transformers 5.25 renamed the cache argument ``cache_params`` to ``cache`` (and warns on the old
    name), so the patch must not rename it."""
    context: ZorroContext | None = kwargs.pop(CONTEXT_KWARG, None)
    if context is None:
        original: Any = type(self).forward
        return original(self, hidden_states, *args, **kwargs)  # type: ignore[no-any-return]
    has_cache = any(value is not None for value in args[:1]) or any(
        kwargs.get(name) is not None for name in ("cache", "cache_params")
    )
    if has_cache or context.gated_delta is None:
        raise ZorroPatchError(
            "a Gated DeltaNet layer got a zorro context without a schedule or with a cache; deduplicated runs "
            "are training/log-prob forwards with use_cache=False."
        )
    patch = _layer_patch(self)
    table = patch.architecture.linear_attention
    assert table is not None  # only hybrid architectures patch Gated DeltaNet layers
    fused = use_fused_kernels(patch.settings.fused_kernels, hidden_states)
    return gated_delta_tree_forward(self, hidden_states, context.gated_delta, table.projections, fused_conv=fused)


def _zero_centered_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return fused_zero_centered_norm_forward(self, _layer_patch(self).settings.fused_kernels, hidden_states)


def _gated_norm_forward(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return fused_gated_norm_forward(self, _layer_patch(self).settings.fused_kernels, hidden_states, gate)


def _mlp_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return fused_mlp_forward(self, _layer_patch(self).settings.fused_kernels, hidden_states)


def _patch_layer(patch: ZorroPatch, module: nn.Module, forward: Callable[..., torch.Tensor]) -> None:
    patch.undo_steps.append(_set_attribute(module, LAYER_PATCH_ATTRIBUTE, patch))
    patch.undo_steps.append(_set_attribute(module, "forward", types.MethodType(forward, module)))
    patch.layer_forwards.append((module, forward))


def find_backbone(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(text backbone, LM head) of a causal LM or a VLM wrapper whose text model is supported."""
    get_output_embeddings: Any = getattr(model, "get_output_embeddings", None)
    lm_head = get_output_embeddings() if get_output_embeddings is not None else None
    inner = getattr(model, "model", None)
    backbone = getattr(inner, "language_model", inner)
    if lm_head is None or backbone is None or not hasattr(backbone, "embed_tokens"):
        raise ZorroPatchError(
            f"could not find the text backbone and LM head of {type(model).__name__}; pass the *ForCausalLM or "
            "*ForConditionalGeneration model (with `.model` and an output embedding), not a bare backbone."
        )
    return backbone, lm_head


def apply_zorro(
    model: nn.Module,
    *,
    settings: ZorroSettings | None = None,
    patch_forward: bool = True,
    attn_implementation: str | None = None,
    allow_untested_transformers: bool | None = None,
    **setting_overrides: Any,
) -> ZorroPatch:
    """Patch ``model`` for deduplicated training. Idempotent: on a patched model it updates the settings.

    Args:
        model: a supported ``*ForCausalLM`` or ``*ForConditionalGeneration`` (text backbone supported).
        settings: a ``ZorroSettings``; keyword overrides (``use_split_attention=False``, ``logits_mode="memory"``,
            ``response_length=512``, ...) apply on top.
        patch_forward: also replace ``model.forward`` by the deduplicated forward (``zorro_model_forward``).
        attn_implementation: what attention layers fall back to without a zorro context (default: as loaded).
        allow_untested_transformers: patch under a transformers outside the tested range (default: the
            ``ARCTIC_ZORRO_ALLOW_UNTESTED_TRANSFORMERS=1`` environment variable) if the parity self-check on a
            tiny model of this architecture passes (``check_parity``, once per config shape); see ``versions.py``.

    Raises:
        UnsupportedModelError: the architecture has no table (the message lists the supported ones).
        ZorroPatchError: transformers is outside the tested range and the user did not opt in, or the parity
            self-check failed (the message names the worst parameters).
    """
    architecture = resolve_architecture(model)
    settings = replace(settings or ZorroSettings(), **setting_overrides)
    guard_transformers_version(model, settings, allow_untested_transformers)
    if is_patched(model):
        patch = get_patch(model)
        patch.settings = settings
        for patcher in patch.attention_patchers:
            patcher.use_split_attention = settings.use_split_attention
            patcher.patch()
        patch.reinstall_layer_forwards()
        if patch_forward and not patch.forward_patched:
            _patch_forward(patch)
        return patch
    backbone, lm_head = find_backbone(model)
    patchers: list[QwenAttentionPatcher] = []
    linear_attention: list[nn.Module] = []
    routers: list[nn.Module] = []
    for module in model.modules():
        name = type(module).__name__
        if name in architecture.attention_classes:
            patchers.append(QwenAttentionPatcher(module, settings.use_split_attention, attn_implementation))
        elif architecture.linear_attention is not None and name in architecture.linear_attention.class_names:
            linear_attention.append(module)
        elif name in architecture.router_classes:
            routers.append(module)
    if not patchers and not linear_attention:
        raise ZorroPatchError(
            f"found no attention module of {architecture.attention_classes} in {type(model).__name__}; this "
            "transformers version may have renamed them (tested with transformers 5.17-5.25)."
        )
    patch = ZorroPatch(
        model=model,
        architecture=architecture,
        backbone=backbone,
        lm_head=lm_head,
        settings=settings,
        attention_patchers=patchers,
        linear_attention_modules=linear_attention,
        routers=routers,
    )
    for patcher in patchers:
        patcher.patch()

    for module in linear_attention:
        _patch_layer(patch, module, _gated_delta_forward)
    for module in backbone.modules():
        name = type(module).__name__
        if name in architecture.gated_norm_classes:
            _patch_layer(patch, module, _gated_norm_forward)
        elif name in architecture.zero_centered_norm_classes:
            _patch_layer(patch, module, _zero_centered_norm_forward)
        elif name in architecture.mlp_classes:
            _patch_layer(patch, module, _mlp_forward)
    patch.undo_steps.append(_set_attribute(model, PATCH_ATTRIBUTE, patch))
    if patch_forward:
        _patch_forward(patch)
    return patch


@dataclass
class _ForwardUndo:
    patch: ZorroPatch
    undo: _AttributeUndo

    def __call__(self) -> None:
        self.undo()
        self.patch.forward_patched = False


def _patch_forward(patch: ZorroPatch) -> None:
    undo = _set_attribute(patch.model, "forward", types.MethodType(zorro_model_forward, patch.model))
    patch.undo_steps.append(_ForwardUndo(patch, undo))
    patch.forward_patched = True


def remove_zorro(model: nn.Module) -> None:
    """Undo ``apply_zorro`` (no-op on an unpatched model)."""
    if is_patched(model):
        get_patch(model).remove()
