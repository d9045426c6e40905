"""Hypothesis strategies for awkward RL batch layouts (padded verl batches)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_length: int
    prompt_of_sample: list[int]


@st.composite
def padded_batches(draw: st.DrawFn, max_samples: int = 8, max_prompt: int = 7, max_response: int = 5) -> PaddedBatch:
    """Random batches: ragged prompts (left-padded) and responses (right-padded, possibly empty), groups of any
    size with non-contiguous members, prompts sharing partial prefixes, padding ids that collide with real ids
    (identical ids with different masks), tiny vocabularies so accidental equalities happen."""
    vocab = draw(st.integers(2, 6))
    num_prompts = draw(st.integers(1, 4))
    prompt_width = draw(st.integers(1, max_prompt))
    response_width = draw(st.integers(0, max_response))
    base = draw(st.lists(st.integers(0, vocab - 1), min_size=prompt_width, max_size=prompt_width))
    prompts = []
    for _ in range(num_prompts):
        length = draw(st.integers(1, prompt_width))
        shared = draw(st.integers(0, length))
        tail = draw(st.lists(st.integers(0, vocab - 1), min_size=length - shared, max_size=length - shared))
        prompts.append(base[:shared] + tail)
    num_samples = draw(st.integers(1, max_samples))
    prompt_of_sample = draw(st.lists(st.integers(0, num_prompts - 1), min_size=num_samples, max_size=num_samples))
    pad_id = draw(st.integers(0, vocab - 1))
    rows, masks = [], []
    for prompt_index in prompt_of_sample:
        prompt = prompts[prompt_index]
        pad = prompt_width - len(prompt)
        response_len = draw(st.integers(0, response_width))
        response = draw(st.lists(st.integers(0, vocab - 1), min_size=response_len, max_size=response_len))
        rows.append([pad_id] * pad + prompt + response + [pad_id] * (response_width - response_len))
        masks.append([0] * pad + [1] * len(prompt) + [1] * response_len + [0] * (response_width - response_len))
    return PaddedBatch(
        input_ids=torch.tensor(rows, dtype=torch.long),
        attention_mask=torch.tensor(masks, dtype=torch.long),
        response_length=response_width,
        prompt_of_sample=prompt_of_sample,
    )
