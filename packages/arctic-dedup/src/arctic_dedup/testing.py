"""Synthetic RL batches for tests, examples and benchmarks (verl layout)."""

from __future__ import annotations

import torch

from arctic_dedup.errors import BatchLayoutError
from arctic_dedup.plan.layout import default_position_ids

__all__ = ["create_dummy_batch", "samples_per_prompt"]


def samples_per_prompt(batch_size: int, num_unique_prompts: int) -> list[int]:
    """``batch_size // num_unique_prompts`` samples per prompt, the remainder spread one each over the first ones."""
    base, remainder = divmod(batch_size, num_unique_prompts)
    return [base + (1 if prompt < remainder else 0) for prompt in range(num_unique_prompts)]


def create_dummy_batch(
    batch_size: int,
    num_unique_prompts: int,
    prompt_len: int,
    response_len: int,
    vocab_size: int = 1000,
    device: str | torch.device = "cpu",
    include_training_fields: bool = False,
    add_padding: bool = False,
    *,
    seed: int = 0,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """A random verl-style batch where each of ``num_unique_prompts`` prompts is sampled several times.

    Samples of a prompt are contiguous (``batch_size // num_unique_prompts`` each, the remainder spread one each
    over the first prompts). With ``add_padding`` every prompt gets a random real length in ``[1, prompt_len]``
    (one per prompt, so a group's padded prompts stay identical) and every sample a random response length in
    ``[1, response_len]``; padding uses ``pad_token_id``.

    Returns a dict of ``[B, S]`` tensors ``input_ids``, ``attention_mask``, ``position_ids`` (S = prompt_len +
    response_len), ``prompts`` ``[B, P]``, ``responses`` and ``response_mask`` ``[B, R]``; with
    ``include_training_fields`` also float32 ``old_log_probs``, ``advantages`` and ``ref_log_prob`` ``[B, R]``.
    """
    if batch_size < 1 or num_unique_prompts < 1 or num_unique_prompts > batch_size:
        raise BatchLayoutError(
            f"need 1 <= num_unique_prompts <= batch_size, got num_unique_prompts={num_unique_prompts}, "
            f"batch_size={batch_size}."
        )
    if prompt_len < 1 or response_len < 1:
        raise BatchLayoutError(f"prompt_len and response_len must be >= 1, got {prompt_len} and {response_len}.")
    if vocab_size < 2:
        raise BatchLayoutError(f"vocab_size must be >= 2, got {vocab_size}.")
    generator = torch.Generator().manual_seed(seed)
    counts = samples_per_prompt(batch_size, num_unique_prompts)
    prompt_of_sample = torch.repeat_interleave(torch.arange(num_unique_prompts), torch.tensor(counts))
    unique_prompts = torch.randint(1, vocab_size, (num_unique_prompts, prompt_len), generator=generator)
    responses = torch.randint(1, vocab_size, (batch_size, response_len), generator=generator)
    prompt_mask = torch.ones(num_unique_prompts, prompt_len, dtype=torch.long)
    response_mask = torch.ones(batch_size, response_len, dtype=torch.long)
    if add_padding:
        real_prompt = torch.randint(1, prompt_len + 1, (num_unique_prompts,), generator=generator)
        prompt_mask = (torch.arange(prompt_len)[None, :] >= (prompt_len - real_prompt)[:, None]).long()
        real_response = torch.randint(1, response_len + 1, (batch_size,), generator=generator)
        response_mask = (torch.arange(response_len)[None, :] < real_response[:, None]).long()
        unique_prompts = torch.where(prompt_mask.bool(), unique_prompts, pad_token_id)
        responses = torch.where(response_mask.bool(), responses, pad_token_id)
    prompts = unique_prompts[prompt_of_sample]
    attention_mask = torch.cat([prompt_mask[prompt_of_sample], response_mask], dim=1)
    batch = {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": default_position_ids(attention_mask),
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
    }
    if include_training_fields:
        shape = (batch_size, response_len)
        old_log_probs = -torch.rand(shape, generator=generator) * 5.0
        batch["old_log_probs"] = old_log_probs
        batch["advantages"] = torch.randn(shape, generator=generator)
        batch["ref_log_prob"] = old_log_probs + 0.1 * torch.randn(shape, generator=generator)
    return {name: tensor.to(device) for name, tensor in batch.items()}
