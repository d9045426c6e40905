"""Cost model: how much work deduplication can save on a batch, for a given model shape.

Bounds (performance.md): with ``N`` active non-embedding matmul parameters, ``L_a`` full-attention layers with
``H_q`` query heads of dim ``d_h``, hidden ``d`` and vocab ``V``::

    F = T * 6N + pairs * 4 * H_q * d_h * L_a * 3.5 + (sum R) * 6 * d * V

for the training forward + backward (logits only where a logprob is needed, in both runs), where ``T`` counts tokens
and ``pairs`` causal attention pairs (``L^2 / 2`` per sequence of length ``L``; a response of length ``R`` under a
prompt of length ``P`` adds ``R * P + R^2 / 2``). Decode reads ``b = 2 * H_kv * d_h * bytes`` of KV per cached token
per layer; deduplicated decode reads each shared prefix once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DedupCost", "ModelShape", "dedup_cost", "dedup_cost_of_plan"]

# Forward + backward of attention costs 3.5x its forward (performance.md: 4 matmul FLOPs per pair per head-dim).
_ATTENTION_TRAINING_FACTOR = 3.5


@dataclass(frozen=True)
class ModelShape:
    """The numbers the cost model needs about a model."""

    num_matmul_params: int
    num_attention_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    kv_bytes_per_element: int = 2

    @staticmethod
    def qwen3_4b() -> ModelShape:
        """Qwen3-4B: 36 layers, hidden 2560, 32 q / 8 kv heads of 128, MLP 9728, vocab 151936."""
        return ModelShape.dense(
            num_layers=36,
            hidden_size=2560,
            intermediate_size=9728,
            num_query_heads=32,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=151936,
        )

    @staticmethod
    def dense(
        *,
        num_layers: int,
        hidden_size: int,
        intermediate_size: int,
        num_query_heads: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
    ) -> ModelShape:
        """A Llama-like decoder (q/k/v/o projections and a gated MLP in every layer)."""
        attention = hidden_size * head_dim * (2 * num_query_heads + 2 * num_kv_heads)
        mlp = 3 * hidden_size * intermediate_size
        return ModelShape(
            num_matmul_params=num_layers * (attention + mlp),
            num_attention_layers=num_layers,
            num_query_heads=num_query_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=hidden_size,
            vocab_size=vocab_size,
        )

    @staticmethod
    def from_module(model: torch.nn.Module, config: Any) -> ModelShape:
        """Count ``N`` from a model's 2-D weights (embeddings and the LM head excluded) and read the attention
        shape from its Hugging Face style ``config`` (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
        ``hidden_size``, ``vocab_size``, ``num_hidden_layers`` and optional ``layer_types``).

        For mixture-of-experts models the count includes every expert; scale it by the active fraction yourself if
        you want active parameters.
        """
        excluded = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
        output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
        if output_embeddings is not None:
            excluded.add(id(output_embeddings.weight))
        matmul_params = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in excluded)
        layer_types = getattr(config, "layer_types", None)
        attention_layers = (
            sum(1 for kind in layer_types if kind == "full_attention") if layer_types else int(config.num_hidden_layers)
        )
        query_heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // query_heads)
        return ModelShape(
            num_matmul_params=int(matmul_params),
            num_attention_layers=attention_layers,
            num_query_heads=query_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", query_heads)),
            head_dim=head_dim,
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
        )

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element


@dataclass(frozen=True)
class DedupCost:
    """Work of the same batch without and with deduplication."""

    tokens_base: int
    tokens_dedup: int
    attention_pairs_base: float
    attention_pairs_dedup: float
    logit_tokens: int
    flops_base: float
    flops_dedup: float
    kv_bytes_base: float
    kv_bytes_dedup: float

    @property
    def token_bound(self) -> float:
        return self.tokens_base / max(1, self.tokens_dedup)

    @property
    def flop_bound(self) -> float:
        return self.flops_base / max(1.0, self.flops_dedup)

    @property
    def kv_byte_bound(self) -> float:
        return self.kv_bytes_base / max(1.0, self.kv_bytes_dedup)


def _flops(tokens: float, pairs: float, logit_tokens: int, shape: ModelShape) -> float:
    attention = 4 * shape.num_query_heads * shape.head_dim * shape.num_attention_layers * _ATTENTION_TRAINING_FACTOR
    return (
        tokens * 6 * shape.num_matmul_params
        + pairs * attention
        + logit_tokens * 6 * shape.hidden_size * shape.vocab_size
    )


def _assemble(
    tokens_base: int, tokens_dedup: int, pairs_base: float, pairs_dedup: float, logits: int, shape: ModelShape
) -> DedupCost:
    kv_per_token = shape.kv_bytes_per_token_per_layer * shape.num_attention_layers
    return DedupCost(
        tokens_base=tokens_base,
        tokens_dedup=tokens_dedup,
        attention_pairs_base=pairs_base,
        attention_pairs_dedup=pairs_dedup,
        logit_tokens=logits,
        flops_base=_flops(tokens_base, pairs_base, logits, shape),
        flops_dedup=_flops(tokens_dedup, pairs_dedup, logits, shape),
        kv_bytes_base=float(tokens_base * kv_per_token),
        kv_bytes_dedup=float(tokens_dedup * kv_per_token),
    )


def dedup_cost(groups: Sequence[tuple[int, Sequence[int]]], shape: ModelShape) -> DedupCost:
    """Cost of a batch given as ``[(prompt_length, [response_length, ...]), ...]``, one entry per prompt group."""
    tokens_base = tokens_dedup = logits = 0
    pairs_base = pairs_dedup = 0.0
    for prompt, responses in groups:
        tokens_dedup += prompt + sum(responses)
        pairs_dedup += prompt * prompt / 2
        for response in responses:
            tokens_base += prompt + response
            pairs_base += (prompt + response) ** 2 / 2
            pairs_dedup += response * prompt + response * response / 2
            logits += response
    return _assemble(tokens_base, tokens_dedup, pairs_base, pairs_dedup, logits, shape)


def dedup_cost_of_plan(plan: Any, shape: ModelShape) -> DedupCost:
    """Cost of a planned micro-batch (any tree depth): every node attends causally to itself and fully to its
    ancestors; the non-deduplicated run processes every sample separately."""
    tree = plan.tree
    lengths = tree.node_length.double()
    ancestor_tokens = torch.zeros_like(lengths)
    current = tree.node_parent.clone()
    while bool((current >= 0).any()):
        has_parent = current >= 0
        ancestor_tokens = ancestor_tokens + torch.where(has_parent, lengths[current.clamp_min(0)], 0.0)
        current = torch.where(has_parent, tree.node_parent[current.clamp_min(0)], -1)
    pairs_dedup = float((lengths * lengths / 2 + lengths * ancestor_tokens).sum())
    sample_lengths = plan.layout.sample_lengths.double()
    pairs_base = float((sample_lengths * sample_lengths / 2).sum())
    logits = int(plan.layout.response_lengths.sum())
    return _assemble(plan.num_sample_tokens, plan.num_packed_tokens, pairs_base, pairs_dedup, logits, shape)
