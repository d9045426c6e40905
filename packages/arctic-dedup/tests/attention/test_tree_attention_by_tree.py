"""The reference runs tree by tree: the same function as one dense mask over the stream, with a smaller mask."""

import pytest
import torch

from arctic_dedup import build_plan
from arctic_dedup.attention import api, tree_attention
from arctic_dedup.attention.reference import tree_attention_reference
from arctic_dedup.testing import create_dummy_batch


def test_tree_by_tree_reference_equals_the_dense_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = create_dummy_batch(6, 3, 7, 5, add_padding=True, seed=4)
    plan = build_plan(batch["input_ids"], 5, batch["attention_mask"], batch["position_ids"])
    assert plan.tree.num_trees == 3
    generator = torch.Generator().manual_seed(0)
    tokens = plan.num_packed_tokens
    query = torch.randn(tokens, 4, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    key = torch.randn(tokens, 2, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    value = torch.randn(tokens, 2, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    expected, expected_lse = tree_attention_reference(
        query, key, value, plan.kv_visible_until, position_ids=plan.position_ids
    )
    expected_grads = torch.autograd.grad((expected * expected.detach().cos()).sum(), (query, key, value))
    lengths = plan.tree.cu_seqlens_trees[1:] - plan.tree.cu_seqlens_trees[:-1]
    limit = 4 * int((lengths * lengths).sum())
    out, lse = tree_attention(query, key, value, plan, backend="reference", return_lse=True)
    grads = torch.autograd.grad((out * expected.detach().cos()).sum(), (query, key, value))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=1e-12)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    # Too large even tree by tree: a clear error, not a silent giant allocation.
    monkeypatch.setattr(api, "MAX_REFERENCE_SCORES", limit - 1)
    with pytest.raises(ValueError, match="even tree by tree"):
        tree_attention(query, key, value, plan, backend="reference")
