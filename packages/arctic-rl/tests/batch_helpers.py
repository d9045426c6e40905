"""A small valid GRPO batch (shared by the batch tests and the engine-side check's test)."""

import torch


def small_batch() -> dict[str, torch.Tensor]:
    # Two samples: prompt [5, 6] (left-padded to P = 3), responses [7, 8] and [9] (right-padded to R = 2).
    input_ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": torch.tensor([[0, 0, 1, 2, 3], [0, 0, 1, 2, 2]]),
        "responses": input_ids[:, 3:].clone(),
        "response_mask": attention_mask[:, 3:].clone(),
        "old_log_probs": torch.tensor([[-1.0, -2.0], [-0.5, 0.0]]),
        "advantages": torch.tensor([1.0, -1.0]),
    }
