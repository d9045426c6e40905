"""Plans and inputs for the tree-attention tests: awkward layouts, random trees, and a per-sample oracle."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from arctic_dedup import Plan, SampleLayout, build_plan_from_layout, unpack


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Plan]


def _random_tokens(generator: torch.Generator, length: int) -> torch.Tensor:
    return torch.randint(1, 30000, (length,), generator=generator)


def prompt_groups_plan(
    prompt_lengths: list[int],
    responses: list[list[int]],
    *,
    seed: int = 0,
    sharing: str = "prompt",
    device: str | torch.device = "cpu",
) -> Plan:
    """Group ``g`` has one prompt of ``prompt_lengths[g]`` tokens and responses of ``responses[g]`` lengths."""
    generator = torch.Generator().manual_seed(seed)
    ids: list[torch.Tensor] = []
    sample_prompts: list[int] = []
    sample_responses: list[int] = []
    for prompt_length, response_lengths in zip(prompt_lengths, responses):
        prompt = _random_tokens(generator, prompt_length)
        for response_length in response_lengths:
            ids += [prompt, _random_tokens(generator, response_length)]
            sample_prompts.append(prompt_length)
            sample_responses.append(response_length)
    layout = SampleLayout.from_unpadded(
        torch.cat(ids).to(device),
        torch.tensor(sample_prompts, device=device),
        torch.tensor(sample_responses, device=device),
    )
    return build_plan_from_layout(layout, sharing=sharing)  # type: ignore[arg-type]


def random_tree_plan(
    seed: int, *, max_depth: int = 4, max_children: int = 3, max_segment: int = 9, device: str | torch.device = "cpu"
) -> Plan:
    """Samples are root-to-leaf paths of a random segment tree of depth 1..max_depth; planned with trie sharing."""
    generator = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    depth_limit = draw(1, max_depth)
    paths: list[list[torch.Tensor]] = []

    def grow(prefix: list[torch.Tensor], depth: int) -> None:
        segment = _random_tokens(generator, draw(1, max_segment))
        path = [*prefix, segment]
        children = 0 if depth + 1 >= depth_limit else draw(0 if depth > 0 else 1, max_children)
        if children == 0:
            paths.append(path)
        for _ in range(children):
            grow(path, depth + 1)

    for _ in range(draw(1, 2)):
        grow([], 0)
    ids: list[torch.Tensor] = []
    prompt_lengths: list[int] = []
    response_lengths: list[int] = []
    for path in paths:
        sequence = torch.cat(path)
        # The prompt/response split does not change the trie; put it somewhere inside the first segment.
        prompt = draw(1, int(path[0].numel()))
        ids.append(sequence)
        prompt_lengths.append(prompt)
        response_lengths.append(int(sequence.numel()) - prompt)
    layout = SampleLayout.from_unpadded(
        torch.cat(ids).to(device),
        torch.tensor(prompt_lengths, device=device),
        torch.tensor(response_lengths, device=device),
    )
    return build_plan_from_layout(layout, sharing="trie")


def deep_trie_plan(device: str | torch.device = "cpu", seed: int = 0, scale: int = 1) -> Plan:
    """A 4-level tree: a shared system prompt, two questions, partial responses, then branches (lengths x scale)."""
    generator = torch.Generator().manual_seed(seed)
    system = _random_tokens(generator, 11 * scale)
    samples: list[torch.Tensor] = []
    prompt_lengths: list[int] = []
    for question_length in (5 * scale, 7 * scale):
        question = _random_tokens(generator, question_length)
        for partial_length in (3 * scale, 6 * scale):
            partial = _random_tokens(generator, partial_length)
            for tail_length in (1, 4 * scale, 0):
                tail = _random_tokens(generator, tail_length)
                samples.append(torch.cat([system, question, partial, tail]))
                prompt_lengths.append(11 * scale + question_length)
    response_lengths = [int(s.numel()) - p for s, p in zip(samples, prompt_lengths)]
    layout = SampleLayout.from_unpadded(
        torch.cat(samples).to(device),
        torch.tensor(prompt_lengths, device=device),
        torch.tensor(response_lengths, device=device),
    )
    return build_plan_from_layout(layout, sharing="trie")


CPU_CASES: list[Case] = [
    Case("one_sequence", lambda: prompt_groups_plan([13], [[7]])),
    Case("group_of_one", lambda: prompt_groups_plan([9, 6], [[5], [3]])),
    Case("identical_prompts", lambda: prompt_groups_plan([17], [[5, 9, 1, 3]])),
    Case("distinct_prompts", lambda: prompt_groups_plan([5, 7, 3], [[4], [6], [2]])),
    Case("empty_and_one_token", lambda: prompt_groups_plan([10, 4], [[0, 1, 1], [0, 2]])),
    Case("ragged_groups", lambda: prompt_groups_plan([21, 3], [[1, 11, 4], [5, 0, 7, 2]])),
    Case("deep_trie", deep_trie_plan),
    Case("random_tree_1", lambda: random_tree_plan(1)),
    Case("random_tree_2", lambda: random_tree_plan(2)),
    Case("random_tree_3", lambda: random_tree_plan(3)),
]


def make_inputs(
    plan: Plan,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    num_tokens = plan.num_packed_tokens
    kv_shape = (num_tokens, num_kv_heads, head_dim)
    shapes = ((num_tokens, num_q_heads, head_dim), kv_shape, kv_shape)
    tensors = [torch.randn(shape, generator=generator).to(device=plan.device, dtype=dtype) for shape in shapes]
    return tuple(t.requires_grad_(requires_grad) for t in tensors)  # type: ignore[return-value]


def per_sample_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The oracle: unpack every sample, run plain causal attention on it alone, return ``[N, Hq, D]`` (fp32)."""
    head_dim = query.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = query.shape[1] // key.shape[1]
    q_all, k_all, v_all = (unpack(t.float(), plan, backend="torch") for t in (query, key, value))
    outputs = []
    offsets = plan.layout.sample_offsets.tolist()
    for begin, end in itertools.pairwise(offsets):
        q = q_all[begin:end].transpose(0, 1)
        k = k_all[begin:end].transpose(0, 1).repeat_interleave(group, dim=0)
        v = v_all[begin:end].transpose(0, 1).repeat_interleave(group, dim=0)
        scores = q @ k.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        length = end - begin
        row = torch.arange(length)[:, None]
        col = torch.arange(length)[None, :]
        visible = col <= row
        if sliding_window is not None:
            visible &= row - col < sliding_window
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        outputs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
    return torch.cat(outputs)
