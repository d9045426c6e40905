"""The seed-compatible patcher classes (thin wrappers over ``apply_zorro`` / ``remove_zorro``)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from torch import nn

from arctic_dedup.attention import TreeAttentionBackend
from arctic_dedup.plan import PrefixSharing
from arctic_zorro_train.logprobs import LogitsMode
from arctic_zorro_train.patching import QwenAttentionPatcher, ZorroPatch, apply_zorro, remove_zorro
from arctic_zorro_train.settings import ZorroSettings

__all__ = ["Qwen3ModelOncePatcher", "Qwen3ModelPatcher", "QwenAttentionPatcher"]


class Qwen3ModelOncePatcher:
    """Patch a supported model once for its lifetime; afterwards ``model(input_ids, attention_mask, position_ids,
    calculate_entropy=...)`` returns a ``ZorroOutput`` (packed ``logprobs`` / ``entropy`` in sample order).

    Works for every supported family (the name is the seed API's). ``attn_implementation`` is what attention layers
    fall back to when the model is called without a deduplicated batch (default: the implementation it was loaded
    with); the deduplicated path always uses ``tree_attention`` (``use_split_attention=True``) or the
    reconstruct-then-attend mode (``False``).
    """

    def __init__(
        self,
        model: nn.Module,
        use_split_attention: bool = True,
        attn_implementation: str | None = None,
        *,
        logits_optimization: LogitsMode = "none",
        attention_backend: TreeAttentionBackend = "auto",
        sharing: PrefixSharing = "prompt",
        logits_chunk_size: int = 1024,
        fp32_logits: bool = False,
    ) -> None:
        self.model = model
        self.use_split_attention = use_split_attention
        self.attn_implementation = attn_implementation
        self.settings = ZorroSettings(
            use_split_attention=use_split_attention,
            attention_backend=attention_backend,
            logits_mode=logits_optimization,
            logits_chunk_size=logits_chunk_size,
            fp32_logits=fp32_logits,
            sharing=sharing,
        )
        self.zorro_patch: ZorroPatch | None = None

    def patch(
        self,
        response_len: int | None = None,
        rollout_n: int | None = None,
        temperature: float = 1.0,
        **setting_overrides: Any,
    ) -> Qwen3ModelOncePatcher:
        """Install (or update) the patch. ``response_len``: the padded response width ``R`` of the batches the
        model will be called with; ``rollout_n``: samples per prompt (informational); ``temperature``: the default
        logits temperature."""
        self.zorro_patch = apply_zorro(
            self.model,
            settings=self.settings,
            attn_implementation=self.attn_implementation,
            response_length=response_len,
            rollout_n=rollout_n,
            temperature=temperature,
            **setting_overrides,
        )
        self.settings = self.zorro_patch.settings
        return self

    @property
    def is_model_patched(self) -> bool:
        return self.zorro_patch is not None


class Qwen3ModelPatcher(Qwen3ModelOncePatcher):
    """A context manager that patches on enter and restores the model exactly on exit.

    ``with Qwen3ModelPatcher(model, response_len=R) as patcher: out = model(**batch)``; or call ``.patch(...)``
    first and use the returned patcher in the ``with`` statement.
    """

    def __init__(
        self,
        model: nn.Module,
        use_split_attention: bool = True,
        attn_implementation: str | None = None,
        *,
        response_len: int | None = None,
        rollout_n: int | None = None,
        temperature: float = 1.0,
        **options: Any,
    ) -> None:
        super().__init__(model, use_split_attention, attn_implementation, **options)
        self._patch_arguments = (response_len, rollout_n, temperature)

    def __enter__(self) -> Qwen3ModelPatcher:
        if self.zorro_patch is None:
            self.patch(*self._patch_arguments)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.unpatch()

    def unpatch(self) -> None:
        remove_zorro(self.model)
        self.zorro_patch = None
