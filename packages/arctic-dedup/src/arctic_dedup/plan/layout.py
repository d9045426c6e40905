"""The unpadded view of an RL batch that every planner in this package starts from.

An RL batch arrives either padded (verl style: ``[B, S]`` with prompts left-padded to width ``P = S - R`` and
responses right-padded to width ``R``) or already unpadded (a flat stream of each sample's valid prompt tokens
followed by its valid response tokens, with per-sample lengths). ``SampleLayout`` normalizes both into one form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arctic_dedup.errors import BatchLayoutError

__all__ = ["SampleLayout", "default_position_ids"]


def default_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids a left/right padded batch gets by default: ``cumsum(mask) - 1``, clamped at 0. ``[B, S]``."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise BatchLayoutError(message)


def _as_bool_mask(attention_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    _require(
        tuple(attention_mask.shape) == tuple(shape),
        f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has shape {tuple(shape)}; "
        "pass a mask of the same [B, S] shape (1 for real tokens, 0 for padding).",
    )
    if attention_mask.dtype == torch.bool:
        return attention_mask
    is_binary = bool(((attention_mask == 0) | (attention_mask == 1)).all())
    _require(is_binary, "attention_mask must hold only 0 and 1 (or be a bool tensor); found other values.")
    return attention_mask.bool()


@dataclass(frozen=True)
class SampleLayout:
    """Each sample's valid tokens, flattened in sample order: ``[prompt_0, response_0, prompt_1, response_1, ...]``.

    Fields (``N`` = total valid tokens, ``B`` = samples):
        token_ids ``[N]`` int64, position_ids ``[N]`` int64,
        prompt_lengths / response_lengths ``[B]`` int64 (valid tokens only),
        sample_offsets ``[B+1]`` int64, start of each sample in the flat stream,
        padded_index ``[N]`` int64 or None: where each flat token sits in the padded ``[B*S]`` batch,
        padded_shape ``(B, S)`` or None, prompt_width ``P`` or None (padded inputs only).
    """

    token_ids: torch.Tensor
    position_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    sample_offsets: torch.Tensor
    padded_index: torch.Tensor | None
    padded_shape: tuple[int, int] | None
    prompt_width: int | None

    @property
    def num_samples(self) -> int:
        return int(self.prompt_lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @property
    def sample_lengths(self) -> torch.Tensor:
        return self.prompt_lengths + self.response_lengths

    def token_sample(self) -> torch.Tensor:
        """``[N]`` sample index of every flat token."""
        return torch.repeat_interleave(
            torch.arange(self.num_samples, device=self.device), self.sample_lengths, output_size=self.num_tokens
        )

    def token_offset_in_sample(self) -> torch.Tensor:
        """``[N]`` index of every flat token inside its own sample (0 = first prompt token)."""
        flat = torch.arange(self.num_tokens, device=self.device)
        return flat - self.sample_offsets[:-1][self.token_sample()]

    def prompt_key_rows(self) -> torch.Tensor:
        """``[B, 2*W+1]`` rows that are equal exactly when two samples' prompts are (valid token ids, position ids
        and length; ``W`` = longest prompt, -1 beyond a prompt's end). Feed to ``group_rows``."""
        widest = int(self.prompt_lengths.max())
        token_sample = self.token_sample()
        offset = self.token_offset_in_sample()
        in_prompt = offset < self.prompt_lengths[token_sample]
        rows = torch.full((self.num_samples, 2 * widest + 1), -1, dtype=torch.long, device=self.device)
        rows[token_sample[in_prompt], offset[in_prompt]] = self.token_ids[in_prompt]
        rows[token_sample[in_prompt], widest + offset[in_prompt]] = self.position_ids[in_prompt]
        rows[:, 2 * widest] = self.prompt_lengths
        return rows

    @staticmethod
    def from_padded(
        input_ids: torch.Tensor,
        response_length: int,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> SampleLayout:
        """Read a verl-style padded batch: ``input_ids``/``attention_mask``/``position_ids`` ``[B, S]``.

        Prompts occupy the first ``P = S - response_length`` columns, left-padded; responses the last
        ``response_length`` columns, right-padded. Raises ``BatchLayoutError`` naming the problem otherwise.
        """
        _require(
            isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2,
            f"input_ids must be a [B, S] tensor, got {getattr(input_ids, 'shape', type(input_ids))}.",
        )
        _require(
            not input_ids.dtype.is_floating_point and input_ids.dtype != torch.bool,
            f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.",
        )
        batch_size, seq_len = (int(s) for s in input_ids.shape)
        _require(batch_size > 0, "the batch is empty (input_ids has 0 rows); pass at least one sample.")
        _require(
            isinstance(response_length, int) and 0 <= response_length < seq_len,
            f"response_length must be an int in [0, S) with S = {seq_len} (the prompt needs at least one column), "
            f"got {response_length!r}.",
        )
        prompt_width = seq_len - response_length
        device = input_ids.device
        mask = (
            torch.ones_like(input_ids, dtype=torch.bool)
            if attention_mask is None
            else _as_bool_mask(attention_mask, input_ids.shape).to(device)
        )
        prompt_mask, response_mask = mask[:, :prompt_width], mask[:, prompt_width:]
        # Left padding: once a prompt row turns on it stays on. Right padding: once a response row turns off it
        # stays off. Anything else (holes, padding on the wrong side) would be silently misread.
        left_padded = bool((prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all())
        _require(
            left_padded,
            "prompts must be left-padded (mask 0...0 1...1 in the first P = S - response_length columns); "
            "found a prompt row whose mask turns off after a real token. Check response_length and the padding side.",
        )
        right_padded = bool((response_mask[:, 1:] <= response_mask[:, :-1]).all())
        _require(
            right_padded,
            "responses must be right-padded (mask 1...1 0...0 in the last response_length columns); "
            "found a response row whose mask turns on after padding. Check response_length and the padding side.",
        )
        prompt_lengths = prompt_mask.sum(dim=1)
        _require(
            bool((prompt_lengths > 0).all()),
            "every sample needs at least one real prompt token (the first response token is predicted from the "
            "last prompt token); found a sample whose prompt is all padding.",
        )
        if position_ids is None:
            position_ids = default_position_ids(mask)
        _require(
            tuple(position_ids.shape) == (batch_size, seq_len),
            f"position_ids must have shape [B, S] = {(batch_size, seq_len)}, got {tuple(position_ids.shape)} "
            "(multimodal 3D position ids are not supported here).",
        )
        flat_mask = mask.reshape(-1)
        padded_index = torch.nonzero(flat_mask).squeeze(1)
        response_lengths = response_mask.sum(dim=1)
        lengths = prompt_lengths + response_lengths
        offsets = torch.zeros(batch_size + 1, dtype=torch.long, device=device)
        offsets[1:] = lengths.cumsum(0)
        return SampleLayout(
            token_ids=input_ids.reshape(-1)[padded_index].long(),
            position_ids=position_ids.to(device).reshape(-1)[padded_index].long(),
            prompt_lengths=prompt_lengths.long(),
            response_lengths=response_lengths.long(),
            sample_offsets=offsets,
            padded_index=padded_index,
            padded_shape=(batch_size, seq_len),
            prompt_width=prompt_width,
        )

    @staticmethod
    def from_unpadded(
        input_ids: torch.Tensor,
        prompt_lengths: torch.Tensor,
        response_lengths: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> SampleLayout:
        """Read an unpadded batch: ``input_ids`` ``[N]`` (or ``[1, N]``) holding each sample's prompt then response.

        ``prompt_lengths``/``response_lengths`` ``[B]``; ``position_ids`` like ``input_ids`` (default: 0, 1, ... per
        sample).
        """
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        _require(input_ids.dim() == 1, f"unpadded input_ids must be [N] or [1, N], got {tuple(input_ids.shape)}.")
        device = input_ids.device
        prompt_lengths = torch.as_tensor(prompt_lengths, device=device).long().reshape(-1)
        response_lengths = torch.as_tensor(response_lengths, device=device).long().reshape(-1)
        _require(prompt_lengths.numel() > 0, "the batch is empty (no prompt lengths); pass at least one sample.")
        _require(
            prompt_lengths.shape == response_lengths.shape,
            f"prompt_lengths {tuple(prompt_lengths.shape)} and response_lengths {tuple(response_lengths.shape)} "
            "must both be [B].",
        )
        _require(bool((prompt_lengths > 0).all()), "every sample needs at least one prompt token.")
        _require(bool((response_lengths >= 0).all()), "response lengths must be >= 0.")
        lengths = prompt_lengths + response_lengths
        total = int(lengths.sum())
        _require(
            total == input_ids.numel(),
            f"the lengths add up to {total} tokens but input_ids holds {input_ids.numel()}.",
        )
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=device)
        offsets[1:] = lengths.cumsum(0)
        if position_ids is None:
            flat = torch.arange(total, device=device)
            position_ids = flat - torch.repeat_interleave(offsets[:-1], lengths, output_size=total)
        else:
            if position_ids.dim() == 2 and position_ids.shape[0] == 1:
                position_ids = position_ids[0]
            _require(
                position_ids.shape == input_ids.shape,
                f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}.",
            )
        return SampleLayout(
            token_ids=input_ids.long(),
            position_ids=position_ids.long().to(device),
            prompt_lengths=prompt_lengths,
            response_lengths=response_lengths,
            sample_offsets=offsets,
            padded_index=None,
            padded_shape=None,
            prompt_width=None,
        )
