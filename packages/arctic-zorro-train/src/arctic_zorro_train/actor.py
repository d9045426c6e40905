"""``DeduplicatedActor``: load a model, patch it, and run verl-style forward / policy-loss steps on it."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from arctic_dedup.attention import TreeAttentionBackend
from arctic_dedup.plan import PrefixSharing
from arctic_zorro_train.forward import ZorroOutput, zorro_forward
from arctic_zorro_train.fused import FusedKernels
from arctic_zorro_train.loading import load_model
from arctic_zorro_train.logprobs import LogitsMode
from arctic_zorro_train.loss import ppo_policy_loss
from arctic_zorro_train.patching import apply_zorro
from arctic_zorro_train.plans import plan_batch

__all__ = ["DeduplicatedActor", "response_token_values"]

Batch = Mapping[str, torch.Tensor]


def response_token_values(batch: Batch, name: str) -> torch.Tensor:
    """A ``[B, R]`` batch field at the valid response tokens, packed in sample order (the ``ZorroOutput`` order)."""
    values = batch[name]
    width = values.shape[1]
    valid = batch["attention_mask"][:, -width:].bool()
    return values[valid]


class DeduplicatedActor:
    """A policy model that runs every micro-batch deduplicated.

    Args:
        model_name_or_path: local directory or hub id (or an already loaded model).
        device: where the model runs.
        logits_optimization: ``"none"``, ``"compute"`` or ``"memory"`` (see ``token_logprobs``).
        use_split_attention: tree attention (True) or reconstruct-then-attend (False).
        attn_implementation: transformers attention implementation the model is loaded with (used for plain calls).
        dtype: parameter dtype when loading.
        clip_ratio / kl_coef: PPO clip range and k1 KL coefficient (the KL term needs ``ref_log_prob``).
        sharing / attention_backend / deduplicate / logits_chunk_size / fp32_logits / fused_kernels: see
            ``ZorroSettings``.
    """

    def __init__(
        self,
        model_name_or_path: str | os.PathLike[str] | nn.Module,
        device: str | torch.device = "cpu",
        logits_optimization: LogitsMode = "none",
        use_split_attention: bool = True,
        attn_implementation: str | None = "sdpa",
        dtype: torch.dtype = torch.bfloat16,
        *,
        clip_ratio: float = 0.2,
        kl_coef: float = 0.0,
        sharing: PrefixSharing = "prompt",
        attention_backend: TreeAttentionBackend = "auto",
        deduplicate: bool = True,
        logits_chunk_size: int = 1024,
        fp32_logits: bool = False,
        fused_kernels: FusedKernels = "auto",
    ) -> None:
        if isinstance(model_name_or_path, nn.Module):
            self.model = model_name_or_path.to(device)
        else:
            self.model = load_model(
                model_name_or_path, dtype=dtype, attn_implementation=attn_implementation, device=device
            )
        self.device = torch.device(device)
        self.clip_ratio = clip_ratio
        self.kl_coef = kl_coef
        self.patch = apply_zorro(
            self.model,
            patch_forward=False,
            use_split_attention=use_split_attention,
            logits_mode=logits_optimization,
            sharing=sharing,
            attention_backend=attention_backend,
            deduplicate=deduplicate,
            logits_chunk_size=logits_chunk_size,
            fp32_logits=fp32_logits,
            fused_kernels=fused_kernels,
        )

    def forward(self, batch: Batch, temperature: float = 1.0, calculate_entropy: bool = False) -> ZorroOutput:
        """Deduplicated forward over a verl batch (``input_ids``, ``attention_mask``, ``position_ids``,
        ``responses``); ``.logprobs`` / ``.entropy`` are packed ``[M]`` in sample order."""
        plan = plan_batch(
            batch["input_ids"].to(self.device),
            int(batch["responses"].shape[1]),
            batch["attention_mask"].to(self.device),
            None if batch.get("position_ids") is None else batch["position_ids"].to(self.device),
            sharing=self.patch.settings.sharing,
            deduplicate=self.patch.settings.deduplicate,
        )
        return zorro_forward(self.model, plan, temperature=temperature, calculate_entropy=calculate_entropy)

    def _forward_micro_batch(
        self, micro_batch: Batch, temperature: float = 1.0, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """verl-style: (entropy, log_probs) as ``[B, R]`` tensors (zeros at padding)."""
        output = self.forward(micro_batch, temperature=temperature, calculate_entropy=calculate_entropy)
        width = int(micro_batch["responses"].shape[1])
        entropy = None if output.entropy is None else output.padded(output.entropy, width)
        return entropy, output.padded(output.logprobs, width)

    def compute_policy_loss_and_backward(
        self, batch: Batch, temperature: float = 1.0, gradient_accumulation: int = 1
    ) -> dict[str, float]:
        """Forward, token-mean PPO clip loss (plus k1 KL and the MoE aux loss when enabled), backward.

        Needs ``old_log_probs`` and ``advantages`` ``[B, R]`` (and ``ref_log_prob`` for the KL term); the loss is
        divided by ``gradient_accumulation`` before ``backward()``. Returns float metrics, including
        ``actor/policy_loss`` (the loss before that division).
        """
        if gradient_accumulation < 1:
            raise ValueError(f"gradient_accumulation must be >= 1, got {gradient_accumulation}.")
        batch = {name: value.to(self.device) for name, value in batch.items()}
        output = self.forward(batch, temperature=temperature)
        # Batch fields in the logprobs' dtype (fp32, or float64 for a float64 model).
        dtype = output.logprobs.dtype
        loss_mask = (
            response_token_values(batch, "response_mask").to(dtype)
            if "response_mask" in batch
            else torch.ones_like(output.logprobs)
        )
        use_kl = self.kl_coef != 0.0 and "ref_log_prob" in batch
        loss, metrics = ppo_policy_loss(
            output.logprobs,
            response_token_values(batch, "old_log_probs").to(dtype),
            response_token_values(batch, "advantages").to(dtype),
            loss_mask,
            clip_ratio=self.clip_ratio,
            ref_logprobs=response_token_values(batch, "ref_log_prob").to(dtype) if use_kl else None,
            kl_coef=self.kl_coef,
        )
        config = self.patch.text_config
        if output.aux_loss is not None:
            metrics["moe_aux_loss"] = output.aux_loss.detach()
            if getattr(config, "output_router_logits", False):
                loss = loss + float(config.router_aux_loss_coef) * output.aux_loss
        (loss / gradient_accumulation).backward()
        result = {f"actor/{name}": float(value) for name, value in metrics.items()}
        result["actor/policy_loss"] = float(loss.detach())
        return result
