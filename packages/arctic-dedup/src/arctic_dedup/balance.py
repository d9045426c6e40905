"""Load balancing that keeps prompt groups together: token-budget micro-batches and data-parallel partitions.

Splitting a prompt group across micro-batches (or ranks) makes every part recompute the prompt, so groups stay
whole unless a group alone exceeds the budget; then it is split into the fewest parts that fit, with balanced
response tokens, and a warning says so.
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from arctic_dedup.plan.grouping import RowGroups, group_prompts
from arctic_dedup.plan.layout import SampleLayout

__all__ = [
    "GroupSplitWarning",
    "MicroBatch",
    "PromptGroup",
    "format_micro_batch_report",
    "partition_for_data_parallel",
    "partition_items",
    "plan_micro_batches",
    "prompt_groups",
]

PartitionMethod = Literal["karmarkar_karp", "greedy"]


class GroupSplitWarning(UserWarning):
    """A prompt group alone exceeded the token budget and was split (its prompt is recomputed per part)."""


@dataclass(frozen=True)
class PromptGroup:
    """One prompt and the samples that share it (sample indices ascending)."""

    samples: tuple[int, ...]
    prompt_length: int
    response_lengths: tuple[int, ...]

    @property
    def dedup_tokens(self) -> int:
        return self.prompt_length + sum(self.response_lengths)

    @property
    def base_tokens(self) -> int:
        return self.prompt_length * len(self.samples) + sum(self.response_lengths)


@dataclass(frozen=True)
class MicroBatch:
    """Samples run together, with the tokens they cost with and without deduplication."""

    samples: tuple[int, ...]
    base_tokens: int
    dedup_tokens: int
    split_group: bool

    @property
    def token_ratio(self) -> float:
        return self.base_tokens / max(1, self.dedup_tokens)

    @property
    def savings(self) -> float:
        """Share of the non-deduplicated tokens that deduplication removes."""
        return 1.0 - self.dedup_tokens / max(1, self.base_tokens)


def prompt_groups(layout: SampleLayout, groups: RowGroups | None = None) -> list[PromptGroup]:
    """Group a batch's samples by identical prompts (valid token ids and positions), in order of first appearance."""
    if groups is None:
        groups = group_prompts(layout)
    prompt_lengths = layout.prompt_lengths.tolist()
    response_lengths = layout.response_lengths.tolist()
    return [
        PromptGroup(
            samples=tuple(members),
            prompt_length=prompt_lengths[members[0]],
            response_lengths=tuple(response_lengths[sample] for sample in members),
        )
        for members in groups.members()
    ]


def _split_group(group: PromptGroup, token_budget: int) -> list[PromptGroup]:
    room = token_budget - group.prompt_length
    if room < max(group.response_lengths, default=0) or room <= 0:
        raise ValueError(
            f"a prompt of {group.prompt_length} tokens with a response of {max(group.response_lengths)} tokens does "
            f"not fit a token budget of {token_budget}; raise the budget to at least "
            f"{group.prompt_length + max(group.response_lengths)}."
        )
    parts = max(1, -(-sum(group.response_lengths) // room))
    order = sorted(range(len(group.samples)), key=lambda i: -group.response_lengths[i])
    while True:
        loads = [0] * parts
        members: list[list[int]] = [[] for _ in range(parts)]
        for i in order:
            target = min(range(parts), key=lambda p: loads[p])
            loads[target] += group.response_lengths[i]
            members[target].append(i)
        if max(loads) <= room:
            break
        parts += 1
    return [
        PromptGroup(
            samples=tuple(group.samples[i] for i in sorted(part)),
            prompt_length=group.prompt_length,
            response_lengths=tuple(group.response_lengths[i] for i in sorted(part)),
        )
        for part in members
        if part
    ]


def plan_micro_batches(groups: Sequence[PromptGroup], token_budget: int) -> list[MicroBatch]:
    """Pack prompt groups into micro-batches of at most ``token_budget`` deduplicated tokens (first-fit decreasing).

    A group larger than the budget is split evenly into the fewest parts that fit, with a ``GroupSplitWarning``.
    Samples inside a micro-batch are ascending. Every sample appears in exactly one micro-batch.
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}.")
    pieces: list[tuple[PromptGroup, bool]] = []
    for group in groups:
        if group.dedup_tokens <= token_budget:
            pieces.append((group, False))
            continue
        parts = _split_group(group, token_budget)
        warnings.warn(
            f"prompt group of samples {list(group.samples)} needs {group.dedup_tokens} tokens, over the budget of "
            f"{token_budget}: split into {len(parts)} micro-batches, so its {group.prompt_length}-token prompt is "
            "computed once per part.",
            GroupSplitWarning,
            stacklevel=2,
        )
        pieces.extend((part, True) for part in parts)
    pieces.sort(key=lambda piece: -piece[0].dedup_tokens)
    bins: list[list[tuple[PromptGroup, bool]]] = []
    loads: list[int] = []
    for piece in pieces:
        for index, load in enumerate(loads):
            if load + piece[0].dedup_tokens <= token_budget:
                bins[index].append(piece)
                loads[index] += piece[0].dedup_tokens
                break
        else:
            bins.append([piece])
            loads.append(piece[0].dedup_tokens)
    return [
        MicroBatch(
            samples=tuple(sorted(sample for group, _ in contents for sample in group.samples)),
            base_tokens=sum(group.base_tokens for group, _ in contents),
            dedup_tokens=sum(group.dedup_tokens for group, _ in contents),
            split_group=any(split for _, split in contents),
        )
        for contents in bins
    ]


def format_micro_batch_report(micro_batches: Sequence[MicroBatch]) -> str:
    """A small table: one line per micro-batch with its tokens before/after deduplication and the savings."""
    lines = [f"{'micro-batch':>11} {'samples':>7} {'base tok':>9} {'dedup tok':>9} {'ratio':>6} {'saved':>6}"]
    for index, batch in enumerate(micro_batches):
        lines.append(
            f"{index:>11} {len(batch.samples):>7} {batch.base_tokens:>9} {batch.dedup_tokens:>9} "
            f"{batch.token_ratio:>5.2f}x {100 * batch.savings:>5.1f}%" + (" (split group)" if batch.split_group else "")
        )
    return "\n".join(lines)


def _greedy(costs: Sequence[float], num_partitions: int) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(num_partitions)]
    heap = [(0.0, index) for index in range(num_partitions)]
    for item in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, part = heapq.heappop(heap)
        parts[part].append(item)
        heapq.heappush(heap, (load + costs[item], part))
    return parts


def _karmarkar_karp(costs: Sequence[float], num_partitions: int) -> list[list[int]]:
    # Largest differencing: every entry is a k-way partial partition (sums sorted descending); repeatedly merge the
    # two entries with the largest spread, pairing the largest sums of one with the smallest sums of the other.
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for item, cost in enumerate(costs):
        sets = [(float(cost), [item])] + [(0.0, []) for _ in range(num_partitions - 1)]
        heapq.heappush(heap, (-float(cost), item, sets))
    counter = len(costs)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [
            (first[i][0] + second[num_partitions - 1 - i][0], first[i][1] + second[num_partitions - 1 - i][1])
            for i in range(num_partitions)
        ]
        merged.sort(key=lambda entry: -entry[0])
        counter += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
    return [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(num_partitions)]


def partition_items(
    costs: Sequence[float], num_partitions: int, method: PartitionMethod = "karmarkar_karp"
) -> list[list[int]]:
    """Split items into ``num_partitions`` sets with balanced total cost. Returns item indices per set."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}.")
    if method == "karmarkar_karp":
        return _karmarkar_karp(costs, num_partitions)
    if method == "greedy":
        return _greedy(costs, num_partitions)
    raise ValueError(f"method must be 'karmarkar_karp' or 'greedy', got {method!r}.")


def partition_for_data_parallel(
    groups: Sequence[PromptGroup], num_ranks: int, method: PartitionMethod = "karmarkar_karp"
) -> list[list[int]]:
    """Assign whole prompt groups to ``num_ranks`` data-parallel ranks, balancing deduplicated tokens.

    Returns each rank's sample indices (ascending). Needs at least as many groups as ranks.
    """
    if len(groups) < num_ranks:
        raise ValueError(
            f"{len(groups)} prompt groups cannot fill {num_ranks} data-parallel ranks without splitting a group; "
            "use a larger batch or fewer ranks."
        )
    parts = partition_items([group.dedup_tokens for group in groups], num_ranks, method)
    return [sorted(sample for index in part for sample in groups[index].samples) for part in parts]
