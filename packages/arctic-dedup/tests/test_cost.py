import pytest
import torch

from arctic_dedup import ModelShape, build_plan_from_layout, dedup_cost, dedup_cost_of_plan
from arctic_dedup.plan.layout import SampleLayout


def test_performance_doc_example() -> None:
    # performance.md: Qwen3-4B shape, P=8192, G=16, R=512 -> S_tok = 8.5, S_FLOP = 7.32.
    cost = dedup_cost([(8192, [512] * 16)], ModelShape.qwen3_4b())
    assert cost.token_bound == pytest.approx(8.5)
    assert cost.flop_bound == pytest.approx(7.32, abs=5e-3)


def test_kv_byte_bound_is_the_decode_ideal() -> None:
    prompt, suffix, samples = 8192, 512, 16
    cost = dedup_cost([(prompt, [suffix] * samples)] * 8, ModelShape.qwen3_4b())
    ideal = samples * (prompt + suffix) / (prompt + samples * suffix)
    assert cost.kv_byte_bound == pytest.approx(ideal)


def test_no_sharing_has_bound_one() -> None:
    cost = dedup_cost([(100, [20]), (50, [7])], ModelShape.qwen3_4b())
    assert cost.token_bound == cost.flop_bound == cost.kv_byte_bound == 1.0


def test_plan_cost_counts_deeper_trees() -> None:
    # Two prompts sharing a 4-token system prefix; trie sharing stores it once.
    ids = torch.tensor([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 9])
    layout = SampleLayout.from_unpadded(ids, torch.tensor([5, 5]), torch.tensor([1, 1]))
    shape = ModelShape.dense(
        num_layers=1, hidden_size=8, intermediate_size=16, num_query_heads=2, num_kv_heads=1, head_dim=4, vocab_size=10
    )
    trie = dedup_cost_of_plan(build_plan_from_layout(layout, sharing="trie"), shape)
    assert trie.tokens_base == 12 and trie.tokens_dedup == 8
    # Nodes: [1,2,3,4] then [5,9] and [6,9]: 4*4/2 + 2 * (2*2/2 + 2*4) pairs.
    assert trie.attention_pairs_dedup == pytest.approx(8 + 2 * (2 + 8))
    assert trie.attention_pairs_base == pytest.approx(2 * 36 / 2)
