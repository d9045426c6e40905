"""The plan: a prefix tree over one micro-batch, built once and read by every layer.

Each sample's valid tokens form a root-to-node path in a tree whose nodes are token segments shared by the same
set of samples. The packed stream holds every node's tokens once, nodes in preorder (a node, then its children's
subtrees in order of first appearance), so ``[prompt A][response A1][response A2]...[prompt B]...`` in the common
two-level case. Everything a layer needs (gather maps both ways, position ids, cu_seqlens, attention metadata, the
parent order for state passing, token multiplicities, response/logprob indices) is a device tensor on the plan.

Sharing modes:
  * ``"prompt"``: samples whose prompts are identical (valid token ids and position ids) share one prompt node;
    every response is its own node. Two levels.
  * ``"trie"``: every common prefix of the samples' full sequences (prompt and response) is shared: prompts that
    overlap only partly (a common system prompt), multi-turn and branched rollouts give deeper trees.
  * ``"none"``: nothing is shared; every sample is its own root (the non-deduplicated packed baseline, with the
    same conventions and maps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from arctic_dedup.errors import BatchLayoutError, PlanError
from arctic_dedup.plan.attention_meta import VarlenParams, build_varlen_params
from arctic_dedup.plan.grouping import group_prompts, hash_int64
from arctic_dedup.plan.index_map import IndexMap
from arctic_dedup.plan.layout import SampleLayout

__all__ = ["Plan", "PrefixSharing", "PrefixTree", "ResponseIndex", "build_plan", "build_plan_from_layout"]

PrefixSharing = Literal["prompt", "trie", "none"]


@dataclass(frozen=True)
class PrefixTree:
    """Nodes in preorder (the packed order). ``N`` nodes, ``D`` levels.

    node_start / node_length ``[N]``: the node's packed token range; node_parent ``[N]`` (-1 for roots);
    node_depth ``[N]``; node_subtree_end ``[N]``: end of the packed range of the node and all its descendants;
    node_num_samples ``[N]``: samples whose path passes through the node (the multiplicity of its tokens);
    level_offsets ``[D+1]`` and level_nodes ``[N]``: nodes grouped by depth (roots first), for passing recurrent
    state from parents to children level by level; cu_seqlens_nodes ``[N+1]``; cu_seqlens_trees ``[roots+1]``.
    """

    node_start: torch.Tensor
    node_length: torch.Tensor
    node_parent: torch.Tensor
    node_depth: torch.Tensor
    node_subtree_end: torch.Tensor
    node_num_samples: torch.Tensor
    level_offsets: torch.Tensor
    level_nodes: torch.Tensor
    cu_seqlens_nodes: torch.Tensor
    cu_seqlens_trees: torch.Tensor
    max_node_length: int
    max_tree_length: int
    num_levels: int

    @property
    def num_nodes(self) -> int:
        return int(self.node_start.shape[0])

    @property
    def num_trees(self) -> int:
        return int(self.cu_seqlens_trees.shape[0]) - 1


@dataclass(frozen=True)
class ResponseIndex:
    """Where each valid response token and its predictor sit in the packed stream (original sample order).

    token_index ``[M]``: packed position of every valid response token (sample 0's tokens first);
    predictor_index ``[M]``: packed position of the token whose logits predict it (the previous token of the
    same sample); labels ``[M]``: the token ids; offsets ``[B+1]``: sample ``b`` owns ``[offsets[b], offsets[b+1])``.
    """

    token_index: torch.Tensor
    predictor_index: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.shape[0])


@dataclass(frozen=True)
class Plan:
    """Everything needed to run a model once over a deduplicated micro-batch. Immutable; device tensors.

    Packed stream (``T`` tokens): token_ids, position_ids, token_node, multiplicity (samples containing each packed
    token) and kv_visible_until (query ``q`` sees key ``k`` iff ``k <= q < kv_visible_until[k]``), all ``[T]``.
    Maps: ``unpack_map`` packed -> each sample's valid tokens ``[N]`` (sample order); ``pack_map`` back, taking each
    shared token from the first sample containing it; ``*_padded_map`` the same for the padded ``[B*S]`` layout
    (padded inputs only).
    """

    layout: SampleLayout
    sharing: PrefixSharing
    tree: PrefixTree
    token_ids: torch.Tensor
    position_ids: torch.Tensor
    token_node: torch.Tensor
    multiplicity: torch.Tensor
    kv_visible_until: torch.Tensor
    unpack_map: IndexMap
    pack_map: IndexMap
    unpack_padded_map: IndexMap | None
    pack_padded_map: IndexMap | None
    responses: ResponseIndex
    varlen: VarlenParams
    sample_packed_index: torch.Tensor = field(repr=False)

    @property
    def num_samples(self) -> int:
        return self.layout.num_samples

    @property
    def num_packed_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_sample_tokens(self) -> int:
        """Valid tokens over all samples, counting shared tokens once per sample (the non-deduplicated count)."""
        return self.layout.num_tokens

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @property
    def token_ratio(self) -> float:
        """Non-deduplicated tokens over packed tokens (the token bound on the speedup)."""
        return self.num_sample_tokens / max(1, self.num_packed_tokens)


def _prompt_classes(layout: SampleLayout, token_sample: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Prefix classes for ``"prompt"`` sharing: prompt token t of group g -> (g, t); responses unique."""
    widest = int(layout.prompt_lengths.max())
    in_prompt = offset < layout.prompt_lengths[token_sample]
    groups = group_prompts(layout)
    prompt_class = groups.group_index[token_sample] * widest + offset
    unique_class = groups.num_groups * widest + torch.arange(layout.num_tokens, device=layout.device)
    return torch.where(in_prompt, prompt_class, unique_class)


def _trie_classes(layout: SampleLayout, token_sample: torch.Tensor, offset: torch.Tensor, seed: int) -> torch.Tensor:
    """Prefix classes for ``"trie"`` sharing: a 64-bit hash of each (prefix length, prefix) pair."""
    token_key = hash_int64(layout.token_ids, seed=seed) ^ hash_int64(layout.position_ids, seed=seed + 11)
    weighted = hash_int64(token_key ^ hash_int64(offset, seed=seed + 23), seed=seed + 37)
    running = torch.cumsum(weighted, 0)
    # Subtract the running sum before each sample's first token (wrapping int64 arithmetic is exact here).
    before_sample = torch.cat([running.new_zeros(1), running])[layout.sample_offsets[:-1]]
    prefix_hash = running - before_sample[token_sample]
    return hash_int64(prefix_hash ^ hash_int64(offset, seed=seed + 51), seed=seed + 67)


@dataclass(frozen=True)
class _TreeBuild:
    tree: PrefixTree
    token_packed_index: torch.Tensor
    pack_source: torch.Tensor
    token_node: torch.Tensor


def _tree_from_classes(layout: SampleLayout, classes: torch.Tensor, offset: torch.Tensor) -> _TreeBuild:
    """Nodes from prefix classes: a node starts where the number of samples sharing the prefix changes."""
    device = layout.device
    num_tokens = layout.num_tokens
    flat = torch.arange(num_tokens, device=device)
    _, dense_class = torch.unique(classes, return_inverse=True)
    class_count = torch.bincount(dense_class)
    sharing = class_count[dense_class]
    previous_sharing = torch.cat([sharing.new_full((1,), -1), sharing[:-1]])
    is_start = (offset == 0) | (sharing != previous_sharing)
    start_positions = torch.nonzero(is_start).squeeze(1)
    _, node_of_start = torch.unique(dense_class[start_positions], return_inverse=True)
    num_nodes = int(node_of_start.max()) + 1
    # The first sample through a node (smallest flat index) is its representative.
    node_first_flat = torch.full((num_nodes,), num_tokens, dtype=torch.long, device=device)
    node_first_flat.scatter_reduce_(0, node_of_start, start_positions, reduce="amin")
    next_start = torch.cat([start_positions[1:], start_positions.new_full((1,), num_tokens)])
    sample_end = layout.sample_offsets[1:][layout.token_sample()[start_positions]]
    run_length = torch.minimum(next_start, sample_end) - start_positions
    node_length = run_length[torch.searchsorted(start_positions, node_first_flat)]
    # Token -> node: the node of the latest node start at or before it (never crosses samples: offset 0 starts).
    latest_start = torch.cummax(torch.where(is_start, flat, 0), dim=0).values
    start_slot = torch.searchsorted(start_positions, latest_start)
    token_node_unordered = node_of_start[start_slot]
    node_offset0 = offset[node_first_flat]
    parent = torch.where(
        node_offset0 > 0, token_node_unordered[(node_first_flat - 1).clamp_min(0)], torch.full_like(node_offset0, -1)
    )
    node_sample = layout.token_sample()[node_first_flat]
    depth, ancestors = _depth_and_ancestors(parent)
    num_levels = int(depth.max()) + 1
    # Preorder: sort by the path of representative samples from the root (children by first appearance).
    path_key = torch.full((num_nodes, num_levels), -1, dtype=torch.long, device=device)
    valid_ancestor = ancestors >= 0
    ancestor_depth = depth[ancestors.clamp_min(0)]
    rows = torch.arange(num_nodes, device=device)[:, None].expand_as(ancestors)
    path_key[rows[valid_ancestor], ancestor_depth[valid_ancestor]] = node_sample[ancestors[valid_ancestor]]
    order = torch.arange(num_nodes, device=device)
    for column in reversed(range(num_levels)):
        order = order[torch.argsort(path_key[order, column], stable=True)]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_nodes, device=device)
    # Renumber everything in preorder.
    node_length = node_length[order]
    node_first_flat = node_first_flat[order]
    node_offset0 = node_offset0[order]
    depth = depth[order]
    parent = torch.where(parent[order] >= 0, rank[parent[order].clamp_min(0)], -1)
    ancestors = torch.where(ancestors[order] >= 0, rank[ancestors[order].clamp_min(0)], -1)
    token_node = rank[token_node_unordered]
    node_start = torch.cumsum(node_length, 0) - node_length
    subtree_tokens = torch.zeros(num_nodes, dtype=torch.long, device=device)
    contributor = torch.arange(num_nodes, device=device)[:, None].expand_as(ancestors)
    has_ancestor = ancestors >= 0
    subtree_tokens.scatter_add_(0, ancestors[has_ancestor], node_length[contributor[has_ancestor]])
    node_subtree_end = node_start + subtree_tokens
    node_num_samples = class_count[dense_class[node_first_flat]]
    token_packed_index = node_start[token_node] + offset - node_offset0[token_node]
    total = int(node_length.sum())
    packed_node = torch.repeat_interleave(torch.arange(num_nodes, device=device), node_length, output_size=total)
    pack_source = node_first_flat[packed_node] + torch.arange(total, device=device) - node_start[packed_node]
    level_order = torch.argsort(depth, stable=True)
    level_counts = torch.bincount(depth, minlength=num_levels)
    level_offsets = torch.zeros(num_levels + 1, dtype=torch.long, device=device)
    level_offsets[1:] = level_counts.cumsum(0)
    cu_nodes = torch.zeros(num_nodes + 1, dtype=torch.int32, device=device)
    cu_nodes[1:] = torch.cumsum(node_length, 0)
    roots = torch.nonzero(parent < 0).squeeze(1)
    cu_trees = torch.cat([node_start[roots], node_subtree_end[roots][-1:]]).to(torch.int32)
    tree_lengths = node_subtree_end[roots] - node_start[roots]
    tree = PrefixTree(
        node_start=node_start,
        node_length=node_length,
        node_parent=parent,
        node_depth=depth,
        node_subtree_end=node_subtree_end,
        node_num_samples=node_num_samples,
        level_offsets=level_offsets,
        level_nodes=level_order,
        cu_seqlens_nodes=cu_nodes,
        cu_seqlens_trees=cu_trees,
        max_node_length=int(node_length.max()),
        max_tree_length=int(tree_lengths.max()),
        num_levels=num_levels,
    )
    return _TreeBuild(tree=tree, token_packed_index=token_packed_index, pack_source=pack_source, token_node=token_node)


def _depth_and_ancestors(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth of every node and its ancestor chain ``[N, D]`` (column 0 = itself, then parent, ...; -1 past root)."""
    chain = [torch.arange(parent.shape[0], device=parent.device)]
    current = parent
    while bool((current >= 0).any()):
        chain.append(current)
        current = torch.where(current >= 0, parent[current.clamp_min(0)], -1)
    ancestors = torch.stack(chain, dim=1)
    depth = (ancestors >= 0).sum(dim=1) - 1
    return depth, ancestors


def _verify(layout: SampleLayout, build: _TreeBuild, offset: torch.Tensor, packed_ids: torch.Tensor) -> str | None:
    """Check that every sample's tokens equal its root-to-node path in the packed stream. None when exact."""
    tree = build.tree
    packed_index = build.token_packed_index
    total = int(packed_ids.shape[0])
    if bool((packed_index < 0).any()) or bool((packed_index >= total).any()):
        return "a token maps outside the packed stream"
    if not bool((packed_ids[packed_index] == layout.token_ids).all()):
        return "a token differs from its packed copy"
    if not bool((layout.position_ids[build.pack_source][packed_index] == layout.position_ids).all()):
        return "a position id differs from its packed copy"
    node = build.token_node
    is_node_start = packed_index == tree.node_start[node]
    parent = tree.node_parent[node]
    parent_end = tree.node_start[parent.clamp_min(0)] + tree.node_length[parent.clamp_min(0)] - 1
    expected_previous = torch.where(is_node_start, torch.where(parent >= 0, parent_end, -1), packed_index - 1)
    previous = torch.cat([packed_index.new_full((1,), -1), packed_index[:-1]])
    previous = torch.where(offset == 0, -1, previous)
    if not bool((previous == expected_previous).all()):
        return "a sample's token sequence does not follow one root-to-node path"
    copies = torch.bincount(packed_index, minlength=total)
    node_of_packed = torch.repeat_interleave(
        torch.arange(tree.num_nodes, device=layout.device), tree.node_length, output_size=total
    )
    if not bool((copies == tree.node_num_samples[node_of_packed]).all()):
        return "a packed token's copy count differs from its node's sample count"
    return None


def build_plan_from_layout(
    layout: SampleLayout,
    *,
    sharing: PrefixSharing = "prompt",
) -> Plan:
    """Build the plan for a ``SampleLayout`` (see ``build_plan`` for padded batches)."""
    if sharing not in ("prompt", "trie", "none"):
        raise ValueError(f"sharing must be 'prompt', 'trie' or 'none', got {sharing!r}")
    if bool((layout.token_ids < 0).any()):
        raise BatchLayoutError("token ids must be >= 0; found a negative id among the valid tokens.")
    token_sample = layout.token_sample()
    offset = layout.token_offset_in_sample()
    problem: str | None = "not built"
    build: _TreeBuild | None = None
    attempts = 3 if sharing == "trie" else 1
    for seed in range(attempts):
        if sharing == "prompt":
            classes = _prompt_classes(layout, token_sample, offset)
        elif sharing == "trie":
            classes = _trie_classes(layout, token_sample, offset, seed)
        else:
            classes = torch.arange(layout.num_tokens, device=layout.device)
        build = _tree_from_classes(layout, classes, offset)
        packed_ids = layout.token_ids[build.pack_source]
        problem = _verify(layout, build, offset, packed_ids)
        if problem is None:
            break
    if problem is not None or build is None:
        raise PlanError(f"plan verification failed ({problem}); this is a bug, please report it with the batch.")
    tree = build.tree
    num_packed = int(build.pack_source.shape[0])
    node_of_packed = torch.repeat_interleave(
        torch.arange(tree.num_nodes, device=layout.device), tree.node_length, output_size=num_packed
    )
    unpack_map = IndexMap.build(build.token_packed_index, num_packed)
    pack_map = IndexMap.build(build.pack_source, layout.num_tokens)
    unpack_padded_map = pack_padded_map = None
    if layout.padded_index is not None and layout.padded_shape is not None:
        batch, seq = layout.padded_shape
        padded_gather = torch.full((batch * seq,), -1, dtype=torch.long, device=layout.device)
        padded_gather[layout.padded_index] = build.token_packed_index
        unpack_padded_map = IndexMap.build(padded_gather, num_packed)
        pack_padded_map = IndexMap.build(layout.padded_index[build.pack_source], batch * seq)
    in_response = offset >= layout.prompt_lengths[token_sample]
    response_flat = torch.nonzero(in_response).squeeze(1)
    response_offsets = torch.zeros(layout.num_samples + 1, dtype=torch.long, device=layout.device)
    response_offsets[1:] = layout.response_lengths.cumsum(0)
    responses = ResponseIndex(
        token_index=build.token_packed_index[response_flat],
        predictor_index=build.token_packed_index[response_flat - 1],
        labels=layout.token_ids[response_flat],
        offsets=response_offsets,
    )
    kv_visible_until = tree.node_subtree_end[node_of_packed].to(torch.int32)
    return Plan(
        layout=layout,
        sharing=sharing,
        tree=tree,
        token_ids=layout.token_ids[build.pack_source],
        position_ids=layout.position_ids[build.pack_source],
        token_node=node_of_packed,
        multiplicity=tree.node_num_samples[node_of_packed],
        kv_visible_until=kv_visible_until,
        unpack_map=unpack_map,
        pack_map=pack_map,
        unpack_padded_map=unpack_padded_map,
        pack_padded_map=pack_padded_map,
        responses=responses,
        varlen=build_varlen_params(tree.node_start, tree.node_length, tree.node_subtree_end, tree.node_depth),
        sample_packed_index=build.token_packed_index,
    )


def build_plan(
    input_ids: torch.Tensor,
    response_length: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    sharing: PrefixSharing = "prompt",
) -> Plan:
    """Plan a verl-style padded micro-batch.

    Args:
        input_ids: ``[B, S]`` token ids; prompts left-padded in the first ``P = S - response_length`` columns,
            responses right-padded in the rest.
        response_length: ``R``, the padded response width.
        attention_mask: ``[B, S]`` 1 for real tokens, 0 for padding (default: all real).
        position_ids: ``[B, S]`` (default: ``cumsum(mask) - 1``). Tokens are shared only when ids and positions match.
        sharing: ``"prompt"`` (identical prompts share a node), ``"trie"`` (every common prefix is shared) or
            ``"none"`` (no sharing: the non-deduplicated baseline in the same packed form).

    Returns:
        The ``Plan``. Building it synchronizes with the device a few times; using it never does.
    """
    layout = SampleLayout.from_padded(input_ids, response_length, attention_mask, position_ids)
    return build_plan_from_layout(layout, sharing=sharing)
