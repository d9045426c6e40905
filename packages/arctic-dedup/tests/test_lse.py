"""``merge_attention_states`` against attention over the union of the keys, computed in one piece."""

from __future__ import annotations

import torch

from arctic_dedup.lse import merge_attention_states


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, H, D]`` queries over ``[K, H, D]`` keys -> (out ``[R, H, D]``, lse ``[R, H]``), fp64."""
    scores = torch.einsum("rhd,khd->rhk", query, keys)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("rhk,khd->rhd", torch.softmax(scores, dim=-1), values)
    return out, lse


def test_merge_of_two_key_halves_is_attention_over_all_keys() -> None:
    generator = torch.Generator().manual_seed(0)
    query, keys, values = (torch.randn(size, 3, 8, generator=generator, dtype=torch.float64) for size in (5, 13, 13))
    expected_out, expected_lse = _attend(query, keys, values)
    out_a, lse_a = _attend(query, keys[:6], values[:6])
    out_b, lse_b = _attend(query, keys[6:], values[6:])
    out, lse = merge_attention_states(out_a.float(), lse_a.float(), out_b.float(), lse_b.float())
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, expected_out.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, expected_lse.float(), rtol=1e-6, atol=1e-6)


def test_a_part_without_keys_contributes_nothing_and_empty_rows_stay_finite() -> None:
    out_a = torch.randn(4, 2, 8)
    lse_a = torch.randn(4, 2)
    empty_out = torch.zeros(4, 2, 8)
    empty_lse = torch.full((4, 2), float("-inf"))
    out, lse = merge_attention_states(out_a, lse_a, empty_out, empty_lse)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
    out, lse = merge_attention_states(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, torch.zeros_like(out))
    assert bool(torch.isneginf(lse).all())
