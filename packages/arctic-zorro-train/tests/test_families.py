"""Every supported family and attention mode: deduplicated logprobs, entropies and every parameter gradient of
the policy loss equal the plain model run on each sample separately (fp32, 1e-5)."""

from __future__ import annotations

import pytest
from zorro_cases import compare_with_reference, fresh_model

from arctic_zorro_train import create_dummy_batch
from arctic_zorro_train.testing import FAMILIES

# (implementation the model is loaded with, split tree attention or reconstruct-then-attend)
ATTENTION_MODES = [("eager", True), ("sdpa", True), ("sdpa", False)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("attn_implementation", "use_split_attention"), ATTENTION_MODES)
def test_family_matches_per_sample_run(family: str, attn_implementation: str, use_split_attention: bool) -> None:
    model = fresh_model(family, attn_implementation)
    batch = create_dummy_batch(6, 2, 9, 5, vocab_size=120, add_padding=True, include_training_fields=True, seed=3)
    compare_with_reference(model, family, batch, temperature=0.8, use_split_attention=use_split_attention)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "qwen3_5"])
def test_flex_backend_forward_on_cpu(family: str) -> None:
    """FlexAttention runs forward-only on CPU (torch refuses its CPU backward); the GPU tests cover its gradients."""
    import torch

    from arctic_zorro_train import DeduplicatedActor
    from arctic_zorro_train.testing import per_sample_reference

    model = fresh_model(family)
    batch = create_dummy_batch(6, 2, 9, 5, vocab_size=120, add_padding=True, seed=4)
    with torch.no_grad():
        expected = per_sample_reference(model, batch, 5)
        output = DeduplicatedActor(model, attention_backend="flex").forward(batch, calculate_entropy=True)
    assert output.entropy is not None
    assert float((output.logprobs - expected.logprobs).abs().max()) <= 1e-5
    assert float((output.entropy - expected.entropy).abs().max()) <= 1e-5
