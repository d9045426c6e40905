import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from strategies import PaddedBatch, padded_batches

from arctic_dedup import (
    ModelShape,
    SampleLayout,
    build_plan,
    build_plan_from_layout,
    dedup_cost,
    dedup_cost_of_plan,
    prompt_groups,
    unpack,
)
from arctic_dedup.plan import Plan
from arctic_dedup.plan.attention_meta import dense_tree_mask
from arctic_dedup.plan.reference import reference_tree_mask


def _sample_paths(plan: Plan) -> list[list[int]]:
    offsets = plan.layout.sample_offsets.tolist()
    index = plan.sample_packed_index.tolist()
    return [index[offsets[b] : offsets[b + 1]] for b in range(plan.num_samples)]


def _sample_tokens(layout: SampleLayout) -> list[list[tuple[int, int]]]:
    offsets = layout.sample_offsets.tolist()
    pairs = list(zip(layout.token_ids.tolist(), layout.position_ids.tolist(), strict=True))
    return [pairs[offsets[b] : offsets[b + 1]] for b in range(layout.num_samples)]


def _check_plan(plan: Plan) -> None:
    layout = plan.layout
    paths = _sample_paths(plan)
    # Every sample reads back its own tokens and positions.
    assert torch.equal(unpack(plan.token_ids, plan), layout.token_ids)
    assert torch.equal(unpack(plan.position_ids, plan), layout.position_ids)
    # The one-int-per-token mask equals the mask derived from first principles.
    assert torch.equal(dense_tree_mask(plan.kv_visible_until), reference_tree_mask(paths))
    # Multiplicity: how many samples contain each packed token.
    counts = Counter(position for path in paths for position in path)
    assert plan.multiplicity.tolist() == [counts[p] for p in range(plan.num_packed_tokens)]
    # Responses: labels and predictors follow each sample's own sequence.
    response_offsets = plan.responses.offsets.tolist()
    prompt_lengths = layout.prompt_lengths.tolist()
    tokens = _sample_tokens(layout)
    for b, path in enumerate(paths):
        lo, hi = response_offsets[b], response_offsets[b + 1]
        assert plan.responses.token_index[lo:hi].tolist() == path[prompt_lengths[b] :]
        assert plan.responses.predictor_index[lo:hi].tolist() == path[prompt_lengths[b] - 1 : -1]
        assert plan.responses.labels[lo:hi].tolist() == [token for token, _ in tokens[b][prompt_lengths[b] :]]
    # Preorder: every node's subtree is one contiguous packed range after the node.
    tree = plan.tree
    start, end = tree.node_start.tolist(), tree.node_subtree_end.tolist()
    for node, parent in enumerate(tree.node_parent.tolist()):
        if parent >= 0:
            assert start[parent] < start[node] and end[node] <= end[parent]
            assert tree.node_depth[node] == tree.node_depth[parent] + 1
    assert tree.node_depth[tree.level_nodes].tolist() == sorted(tree.node_depth.tolist())
    _check_varlen_covers_mask(plan)


def _check_varlen_covers_mask(plan: Plan) -> None:
    total = plan.num_packed_tokens
    covered = torch.zeros(total, total, dtype=torch.long)
    cu = plan.varlen.cu_seqlens_nodes.tolist()
    for lo, hi in itertools.pairwise(cu):
        covered[lo:hi, lo:hi] += torch.ones(hi - lo, hi - lo, dtype=torch.long).tril()
    for level in plan.varlen.cross_levels:
        cq, ck = level.cu_seqlens_q.tolist(), level.cu_seqlens_k.tolist()
        for s in range(len(cq) - 1):
            queries = level.query_index[cq[s] : cq[s + 1]]
            keys = level.key_index[ck[s] : ck[s + 1]]
            covered[queries[:, None], keys[None, :]] += 1
    assert torch.equal(covered, dense_tree_mask(plan.kv_visible_until).long())


@settings(max_examples=60, deadline=None)
@given(padded_batches())
def test_prompt_sharing_plan_is_exact(batch: PaddedBatch) -> None:
    plan = build_plan(batch.input_ids, batch.response_length, batch.attention_mask, sharing="prompt")
    _check_plan(plan)
    tokens = _sample_tokens(plan.layout)
    prompt_lengths = plan.layout.prompt_lengths.tolist()
    unique_prompts = {tuple(t[: prompt_lengths[b]]) for b, t in enumerate(tokens)}
    expected = sum(len(p) for p in unique_prompts) + int(plan.layout.response_lengths.sum())
    assert plan.num_packed_tokens == expected
    groups = prompt_groups(plan.layout)
    shape = ModelShape.qwen3_4b()
    by_groups = dedup_cost([(g.prompt_length, list(g.response_lengths)) for g in groups], shape)
    by_plan = dedup_cost_of_plan(plan, shape)
    assert by_plan.flops_dedup == pytest.approx(by_groups.flops_dedup)
    assert by_plan.flops_base == pytest.approx(by_groups.flops_base)


@settings(max_examples=60, deadline=None)
@given(padded_batches())
def test_trie_sharing_plan_stores_every_distinct_prefix_once(batch: PaddedBatch) -> None:
    plan = build_plan(batch.input_ids, batch.response_length, batch.attention_mask, sharing="trie")
    _check_plan(plan)
    prefixes = {tuple(t[: i + 1]) for t in _sample_tokens(plan.layout) for i in range(len(t))}
    assert plan.num_packed_tokens == len(prefixes)


def test_shared_system_prompt_gives_a_deeper_tree() -> None:
    system = [7, 7, 8, 9]
    questions = [[1, 2], [3], [4, 5, 6]]
    ids, prompt_lengths, response_lengths = [], [], []
    for q, question in enumerate(questions):
        for r in range(3):
            response = [10 + q, 20 + r]
            ids += system + question + response
            prompt_lengths.append(len(system) + len(question))
            response_lengths.append(len(response))
    layout = SampleLayout.from_unpadded(torch.tensor(ids), torch.tensor(prompt_lengths), torch.tensor(response_lengths))
    exact = build_plan_from_layout(layout, sharing="prompt")
    trie = build_plan_from_layout(layout, sharing="trie")
    assert exact.tree.num_levels == 2
    assert trie.tree.num_levels == 3
    # The system prompt is stored once; each question once; responses share their first token per question.
    assert trie.num_packed_tokens == 4 + 6 + 3 + 9
    assert trie.tree.node_num_samples[0].item() == 9
    _check_plan(trie)


@pytest.mark.parametrize("num_unique", [1, 3, 6])
def test_dummy_batches_plan(num_unique: int) -> None:
    from arctic_dedup.testing import create_dummy_batch

    batch = create_dummy_batch(6, num_unique, 5, 4, add_padding=True, seed=num_unique)
    plan = build_plan(batch["input_ids"], 4, batch["attention_mask"], batch["position_ids"])
    _check_plan(plan)
    assert plan.tree.num_trees == num_unique


def test_one_sample_plan_is_one_causal_sequence() -> None:
    plan = build_plan(torch.tensor([[3, 4, 5, 6]]), 2)
    assert plan.num_packed_tokens == 4
    assert plan.tree.num_nodes == 1
    assert torch.equal(dense_tree_mask(plan.kv_visible_until), torch.ones(4, 4, dtype=torch.bool).tril())


def test_identical_ids_with_different_masks_are_different_prompts() -> None:
    ids = torch.tensor([[5, 5, 6, 1], [5, 5, 6, 2]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    plan = build_plan(ids, 1, mask)
    assert plan.tree.num_trees == 2


@settings(max_examples=30, deadline=None)
@given(padded_batches())
def test_no_sharing_plan_is_the_packed_baseline(batch: PaddedBatch) -> None:
    plan = build_plan(batch.input_ids, batch.response_length, batch.attention_mask, sharing="none")
    _check_plan(plan)
    assert plan.num_packed_tokens == plan.num_sample_tokens
    assert plan.tree.num_trees == plan.num_samples
    assert bool((plan.multiplicity == 1).all())
