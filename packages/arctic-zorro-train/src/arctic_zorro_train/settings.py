"""How a patched model runs deduplicated batches (one immutable settings object per patch)."""

from __future__ import annotations

from dataclasses import dataclass

from arctic_dedup.attention import TreeAttentionBackend
from arctic_dedup.plan import PrefixSharing
from arctic_zorro_train.fused import FUSED_KERNEL_MODES, FusedKernels
from arctic_zorro_train.logprobs import LOGITS_MODES, LogitsMode

__all__ = ["ZorroSettings"]


@dataclass(frozen=True)
class ZorroSettings:
    """use_split_attention: tree attention (True) or reconstruct-then-attend (False, slower, exact);
    attention_backend: ``tree_attention``'s backend (``"auto"``, ``"reference"``, ``"flex"``, ``"triton"``,
    ``"varlen"``, ``"sdpa"``; ``auto`` takes ``sdpa``, cuDNN, for the prompt trees of ``sharing="prompt"`` on GPUs);
    logits_mode / logits_chunk_size / fp32_logits: see ``token_logprobs``; sharing: ``"prompt"`` or ``"trie"``;
    response_length / temperature / rollout_n: defaults for calls of the patched ``model(...)`` (``rollout_n`` is
    informational: groups are found from the token ids, whatever their size); deduplicate: False runs the same
    packed path without sharing (the baseline); fused_kernels: ``"auto"`` runs the hybrid families' RMSNorms, gated
    RMSNorms, Gated DeltaNet conv and MLP SwiGLU, and every family's ``"memory"``-mode log-prob chunk math, as fused
    Triton kernels on CUDA (same formulas, see ``arctic_zorro_train.fused``), ``"always"`` also on CPU under
    ``TRITON_INTERPRET=1``, ``"never"`` keeps transformers' torch code."""

    use_split_attention: bool = True
    attention_backend: TreeAttentionBackend = "auto"
    logits_mode: LogitsMode = "none"
    logits_chunk_size: int = 1024
    fp32_logits: bool = False
    sharing: PrefixSharing = "prompt"
    response_length: int | None = None
    temperature: float = 1.0
    rollout_n: int | None = None
    deduplicate: bool = True
    fused_kernels: FusedKernels = "auto"

    def __post_init__(self) -> None:
        if self.logits_mode not in LOGITS_MODES:
            raise ValueError(f"logits_mode must be one of {LOGITS_MODES}, got {self.logits_mode!r}.")
        if self.fused_kernels not in FUSED_KERNEL_MODES:
            raise ValueError(f"fused_kernels must be one of {FUSED_KERNEL_MODES}, got {self.fused_kernels!r}.")
        if self.sharing not in ("prompt", "trie"):
            raise ValueError(f"sharing must be 'prompt' or 'trie', got {self.sharing!r}.")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if self.logits_chunk_size < 1:
            raise ValueError(f"logits_chunk_size must be >= 1, got {self.logits_chunk_size}.")
        if self.response_length is not None and self.response_length < 0:
            raise ValueError(f"response_length must be >= 0, got {self.response_length}.")
