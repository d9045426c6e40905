"""The seed-compatible facade: ``ZoRRoTrain`` and ``analyze_normal_batch_via_attention_mask``.

Code written against the original Arctic Platform calls these names. They sit on the same machinery as the plan
(exact row grouping, index maps, Triton gathers) but keep the original layout conventions:

* ``use_unpad=False``: the packed row holds each group's full padded prompt block once, then every member's full
  padded response block (``T = G*P + B*R``); reconstruction gives ``[B, S, *]``.
* ``use_unpad=True``: padding is dropped (each group's valid prompt tokens once, then each member's valid response
  tokens); reconstruction gives ``[1, N, *]``, every sample's valid tokens in sample order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from arctic_dedup._triton_support import Backend
from arctic_dedup.errors import BatchLayoutError
from arctic_dedup.packing.rows import gather_rows
from arctic_dedup.plan.grouping import group_prompts
from arctic_dedup.plan.index_map import IndexMap
from arctic_dedup.plan.layout import SampleLayout

__all__ = ["BatchStats", "ReconstructionInfo", "ZoRRoTrain", "analyze_normal_batch_via_attention_mask"]


@dataclass(frozen=True)
class ReconstructionInfo(Mapping[str, Any]):
    """What ``reconstruct_sequences`` / ``deduplicate_sequences`` need. Read-only; also readable as a mapping
    (``info["prompt_len"]``) like the original dict.

    reconstruct_map: packed ``[T]`` -> output rows (``B*S`` padded, or ``N`` valid tokens when unpadded);
    deduplicate_map: output rows -> packed ``[T]`` (each shared prompt from the group's first listed member).
    cu_seqlens_packed ``[B+1]``: each sample's valid tokens (sample order); cu_seqlens_dedup ``[B+1]``: in packed
    order, one virtual sequence per response (its prompt's valid tokens + its valid response tokens).
    """

    prompt_groups: list[list[int]]
    prompt_len: int
    response_length: int
    original_batch_size: int
    original_seq_len: int
    is_unpadded: bool
    original_attention_mask: torch.Tensor | None
    num_dedup_tokens: int
    reconstruct_map: IndexMap
    deduplicate_map: IndexMap
    cu_seqlens_packed: torch.Tensor
    max_seqlen_packed: int
    cu_seqlens_dedup: torch.Tensor
    max_seqlen_dedup: int

    def __getitem__(self, key: str) -> Any:
        if key not in self._field_names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._field_names())

    def __len__(self) -> int:
        return len(self._field_names())

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        return tuple(item.name for item in fields(cls))


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = lengths.cumsum(0)
    return out


def _check_groups(prompt_groups: list[list[int]], batch_size: int) -> None:
    seen = sorted(index for group in prompt_groups for index in group)
    if any(len(group) == 0 for group in prompt_groups) or seen != list(range(batch_size)):
        raise BatchLayoutError(
            f"prompt_groups must split the batch's {batch_size} samples into non-empty groups, each sample exactly "
            "once; pass the groups returned by ZoRRoTrain.find_prompt_groups."
        )


class ZoRRoTrain:
    """Seed-compatible static methods for prompt deduplication of a verl-style padded batch."""

    @staticmethod
    def find_prompt_groups(
        input_ids: torch.Tensor, response_length: int, attention_mask: torch.Tensor | None = None
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Group samples whose padded prompt blocks are identical in token ids AND attention mask.

        Returns ``(prompt_groups, unique_prompts)``: groups in order of first appearance, members ascending (need
        not be contiguous); ``unique_prompts`` ``[G, P]`` holds each group's padded prompt block.
        """
        layout = SampleLayout.from_padded(input_ids, response_length, attention_mask)
        prompt_width = layout.prompt_width
        assert prompt_width is not None
        prompts = input_ids[:, :prompt_width]
        # Left padding is checked by the layout, so a prompt's length fixes its mask: equal valid tokens and
        # lengths plus equal ids at padding is equal ids and mask over the padded block.
        groups = group_prompts(layout, padded_prompts=prompts)
        return groups.members(), prompts[groups.first_member]

    @staticmethod
    def create_deduplicated_batch(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        response_length: int,
        prompt_groups: list[list[int]],
        unique_prompts: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        use_unpad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, ReconstructionInfo]:
        """Pack each group's prompt once followed by its members' responses, in the order of ``prompt_groups``.

        Returns ``(dedup_input_ids [1, T], dedup_position_ids [1, T], reconstruction_info)``; see the module
        docstring for the two layouts. Raises ``BatchLayoutError`` when the groups do not match the prompts.
        """
        layout = SampleLayout.from_padded(input_ids, response_length, attention_mask, position_ids)
        batch_size, seq_len = input_ids.shape
        prompt_width = seq_len - response_length
        _check_groups(prompt_groups, batch_size)
        device = input_ids.device
        group_of_sample = torch.empty(batch_size, dtype=torch.long)
        rank_in_group = torch.empty(batch_size, dtype=torch.long)
        for group_index, group in enumerate(prompt_groups):
            group_of_sample[group] = group_index
            rank_in_group[group] = torch.arange(len(group))
        group_of_sample, rank_in_group = group_of_sample.to(device), rank_in_group.to(device)
        first_member = torch.tensor([group[0] for group in prompt_groups], device=device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
        representative = first_member[group_of_sample]
        same_ids = (input_ids[:, :prompt_width] == input_ids[representative, :prompt_width]).all()
        same_mask = (mask[:, :prompt_width] == mask[representative, :prompt_width]).all()
        if not bool(same_ids & same_mask):
            raise BatchLayoutError(
                "a sample's prompt (ids or mask) differs from the first member of its group; the groups must come "
                "from ZoRRoTrain.find_prompt_groups on this same batch."
            )
        if tuple(unique_prompts.shape) != (len(prompt_groups), prompt_width) or not torch.equal(
            unique_prompts.to(device), input_ids[first_member, :prompt_width]
        ):
            raise BatchLayoutError(
                f"unique_prompts must be [G, P] = {(len(prompt_groups), prompt_width)} holding each group's prompt "
                f"block, got shape {tuple(unique_prompts.shape)} or different tokens."
            )
        if use_unpad:
            prompt_lengths, response_lengths = layout.prompt_lengths, layout.response_lengths
            positions = layout.token_offset_in_sample()
            token_sample = layout.token_sample()
            source_ids, source_positions = layout.token_ids, layout.position_ids
        else:
            prompt_lengths = torch.full((batch_size,), prompt_width, dtype=torch.long, device=device)
            response_lengths = torch.full((batch_size,), response_length, dtype=torch.long, device=device)
            positions = torch.arange(seq_len, device=device).repeat(batch_size)
            token_sample = torch.arange(batch_size, device=device).repeat_interleave(seq_len)
            source_ids = input_ids.reshape(-1)
            source_positions = position_ids.to(device).reshape(-1)
        num_groups = len(prompt_groups)
        group_prompt_length = prompt_lengths[first_member]
        group_response_total = torch.zeros(num_groups, dtype=torch.long, device=device)
        group_response_total.index_add_(0, group_of_sample, response_lengths)
        group_size = torch.bincount(group_of_sample, minlength=num_groups)
        group_base = torch.cumsum(group_prompt_length + group_response_total, 0) - (
            group_prompt_length + group_response_total
        )
        # Responses of a group follow its prompt in the listed member order.
        member_order = torch.argsort(group_of_sample * batch_size + rank_in_group)
        ordered_lengths = response_lengths[member_order]
        ordered_group = group_of_sample[member_order]
        inclusive = torch.cumsum(ordered_lengths, 0)
        group_first_slot = torch.cumsum(group_size, 0) - group_size
        before_group = torch.cat([inclusive.new_zeros(1), inclusive])[group_first_slot]
        within_group = inclusive - ordered_lengths - before_group[ordered_group]
        response_start = torch.empty_like(response_lengths)
        response_start[member_order] = group_base[ordered_group] + group_prompt_length[ordered_group] + within_group
        sample_group = group_of_sample[token_sample]
        in_prompt = positions < prompt_lengths[token_sample]
        packed_index = torch.where(
            in_prompt,
            group_base[sample_group] + positions,
            response_start[token_sample] + positions - prompt_lengths[token_sample],
        )
        total = int((group_prompt_length + group_response_total).sum())
        canonical = ~in_prompt | (token_sample == first_member[sample_group])
        source_of_packed = torch.empty(total, dtype=torch.long, device=device)
        source_of_packed[packed_index[canonical]] = torch.nonzero(canonical).squeeze(1)
        reconstruct_map = IndexMap.build(packed_index, total)
        deduplicate_map = IndexMap.build(source_of_packed, int(packed_index.shape[0]))
        ordered_sequence = (group_prompt_length[ordered_group] + ordered_lengths).to(torch.int32)
        cu_packed = _cumulative(layout.sample_lengths)
        info = ReconstructionInfo(
            prompt_groups=[list(group) for group in prompt_groups],
            prompt_len=prompt_width,
            response_length=response_length,
            original_batch_size=batch_size,
            original_seq_len=seq_len,
            is_unpadded=use_unpad,
            original_attention_mask=attention_mask,
            num_dedup_tokens=total,
            reconstruct_map=reconstruct_map,
            deduplicate_map=deduplicate_map,
            cu_seqlens_packed=cu_packed,
            max_seqlen_packed=int(layout.sample_lengths.max()),
            cu_seqlens_dedup=_cumulative(ordered_sequence),
            max_seqlen_dedup=int(ordered_sequence.max()),
        )
        dedup_ids = source_ids[source_of_packed].unsqueeze(0)
        dedup_positions = source_positions[source_of_packed].unsqueeze(0)
        return dedup_ids, dedup_positions, info

    @staticmethod
    def reconstruct_sequences(
        dedup_hidden: torch.Tensor, reconstruction_info: ReconstructionInfo, *, backend: Backend = "auto"
    ) -> torch.Tensor:
        """``[1, T, *]`` -> ``[B, S, *]`` (padded info) or ``[1, N, *]`` (unpadded info). Differentiable: the
        gradient of a shared prompt token is the sum over the samples that copy it."""
        info = reconstruction_info
        if dedup_hidden.dim() < 2 or dedup_hidden.shape[0] != 1 or dedup_hidden.shape[1] != info.num_dedup_tokens:
            raise BatchLayoutError(
                f"reconstruct_sequences expects [1, T={info.num_dedup_tokens}, *], got {tuple(dedup_hidden.shape)}."
            )
        rows = gather_rows(dedup_hidden[0], info.reconstruct_map, backend=backend)
        if info.is_unpadded:
            return rows.unsqueeze(0)
        return rows.reshape(info.original_batch_size, info.original_seq_len, *dedup_hidden.shape[2:])

    @staticmethod
    def deduplicate_sequences(
        x: torch.Tensor, reconstruction_info: ReconstructionInfo, *, backend: Backend = "auto"
    ) -> torch.Tensor:
        """The inverse of ``reconstruct_sequences``: ``[B, S, *]`` (or ``[1, N, *]``) -> ``[1, T, *]``, taking
        each shared prompt token from the group's first member."""
        info = reconstruction_info
        rows_expected = info.deduplicate_map.num_sources
        if info.is_unpadded:
            if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != rows_expected:
                raise BatchLayoutError(
                    f"deduplicate_sequences expects [1, N={rows_expected}, *], got {tuple(x.shape)}."
                )
            flat = x[0]
        else:
            expected = (info.original_batch_size, info.original_seq_len)
            if x.dim() < 2 or tuple(x.shape[:2]) != expected:
                raise BatchLayoutError(f"deduplicate_sequences expects [B, S, *] = {expected}, got {tuple(x.shape)}.")
            flat = x.reshape(rows_expected, *x.shape[2:])
        return gather_rows(flat, info.deduplicate_map, backend=backend).unsqueeze(0)

    @staticmethod
    def attention_mask_to_flash_attn_params(
        attention_mask: torch.Tensor, device: torch.device | None = None
    ) -> dict[str, Any]:
        """Varlen parameters from a block-diagonal ``[Tq, Tk]`` mask (``[1, Tq, Tk]``/``[1, 1, Tq, Tk]`` accepted)
        of packed sequences, causal or not: a query row starts a new sequence when every key it sees lies after
        every key the rows before it saw.

        Returns ``cu_seqlens_q``, ``cu_seqlens_k`` (int32), ``max_seqlen_q``, ``max_seqlen_k``, ``total_q_tokens``,
        ``total_kv_tokens``, ``num_sequences``, ``seq_lengths_q``, ``seq_lengths_k``.
        """
        mask = attention_mask
        while mask.dim() > 2 and mask.shape[0] == 1:
            mask = mask[0]
        if mask.dim() != 2:
            raise BatchLayoutError(f"expected a [Tq, Tk] mask, got shape {tuple(attention_mask.shape)}.")
        device = device or mask.device
        mask = mask.bool()
        total_q, total_k = (int(size) for size in mask.shape)
        key_positions = torch.arange(total_k, device=mask.device)
        attends = mask.any(dim=1)
        first_key = torch.where(mask, key_positions, total_k).min(dim=1).values
        last_key = torch.where(mask, key_positions, -1).max(dim=1).values
        seen_before = torch.cummax(torch.cat([last_key.new_full((1,), -1), last_key[:-1]]), dim=0).values
        starts = attends & (first_key > seen_before)
        if total_q > 0:
            starts[0] = True
        sequence_of_row = torch.cumsum(starts.long(), 0) - 1
        num_sequences = int(starts.sum())
        sequence_last_key = torch.full((num_sequences,), -1, dtype=torch.long, device=mask.device)
        sequence_last_key.scatter_reduce_(0, sequence_of_row, last_key, reduce="amax")
        key_end = torch.cummax(sequence_last_key + 1, dim=0).values if num_sequences else sequence_last_key
        query_start = torch.nonzero(starts).squeeze(1)
        cu_q = torch.cat([query_start, query_start.new_full((1,), total_q)]).to(torch.int32)
        cu_k = torch.cat([key_end.new_zeros(1), key_end]).to(torch.int32)
        lengths_q = (cu_q[1:] - cu_q[:-1]).tolist()
        lengths_k = (cu_k[1:] - cu_k[:-1]).tolist()
        return {
            "cu_seqlens_q": cu_q.to(device),
            "cu_seqlens_k": cu_k.to(device),
            "max_seqlen_q": max(lengths_q, default=0),
            "max_seqlen_k": max(lengths_k, default=0),
            "total_q_tokens": total_q,
            "total_kv_tokens": total_k,
            "num_sequences": num_sequences,
            "seq_lengths_q": lengths_q,
            "seq_lengths_k": lengths_k,
        }


@dataclass(frozen=True)
class BatchStats:
    """Token counts of a padded batch, before and after prompt deduplication."""

    batch_size: int
    padded_prompt_len: int
    padded_response_len: int
    unique_prompt_lengths: list[int]
    response_lengths: list[int]
    non_pad_tokens: int
    pad_tokens: int
    dedup_non_pad_tokens: int

    @property
    def non_pad_percent(self) -> float:
        return 100.0 * self.non_pad_tokens / max(1, self.non_pad_tokens + self.pad_tokens)

    @property
    def dedup_ratio(self) -> float:
        return self.non_pad_tokens / max(1, self.dedup_non_pad_tokens)

    def summary_line(self) -> str:
        responses = self.response_lengths
        mean = sum(responses) / max(1, len(responses))
        prompt_lengths = ",".join(_kilo(length) for length in self.unique_prompt_lengths)
        return (
            f"batch stats: {self.batch_size} samples, {len(self.unique_prompt_lengths)} unique prompts "
            f"(lengths {prompt_lengths}) | responses count={len(responses)} min={_kilo(min(responses))} "
            f"mean={_kilo(mean)} max={_kilo(max(responses))} | non-pad tokens={self.non_pad_tokens} "
            f"({self.non_pad_percent:.1f}% of {self.non_pad_tokens + self.pad_tokens}) | after dedup "
            f"{self.dedup_non_pad_tokens} ({self.dedup_ratio:.2f}x fewer)"
        )


def _kilo(count: float) -> str:
    return f"{count / 1024:.1f}Ki" if count >= 1024 else f"{count:.0f}" if float(count).is_integer() else f"{count:.1f}"


def analyze_normal_batch_via_attention_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, padded_response_len: int
) -> BatchStats:
    """Print a one-line summary of a ``[B, P + R]`` padded batch (prompt lengths, response count/min/mean/max,
    non-pad tokens, tokens after deduplication) and return the numbers."""
    groups, _ = ZoRRoTrain.find_prompt_groups(input_ids, padded_response_len, attention_mask)
    layout = SampleLayout.from_padded(input_ids, padded_response_len, attention_mask)
    prompt_lengths = layout.prompt_lengths.tolist()
    response_lengths = layout.response_lengths.tolist()
    unique_prompt_lengths = [prompt_lengths[group[0]] for group in groups]
    non_pad = layout.num_tokens
    stats = BatchStats(
        batch_size=layout.num_samples,
        padded_prompt_len=input_ids.shape[1] - padded_response_len,
        padded_response_len=padded_response_len,
        unique_prompt_lengths=unique_prompt_lengths,
        response_lengths=response_lengths,
        non_pad_tokens=non_pad,
        pad_tokens=input_ids.numel() - non_pad,
        dedup_non_pad_tokens=sum(unique_prompt_lengths) + sum(response_lengths),
    )
    print(stats.summary_line())
    return stats
