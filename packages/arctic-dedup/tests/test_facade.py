import pytest
import torch
from hypothesis import given, settings
from strategies import PaddedBatch, padded_batches

from arctic_dedup import BatchLayoutError, ZoRRoTrain, analyze_normal_batch_via_attention_mask
from arctic_dedup.plan.reference import reference_group_rows
from arctic_dedup.testing import create_dummy_batch


@settings(max_examples=50, deadline=None)
@given(padded_batches())
def test_groups_are_exact_on_ids_and_mask(batch: PaddedBatch) -> None:
    ids, mask, response_length = batch.input_ids, batch.attention_mask, batch.response_length
    prompt_width = ids.shape[1] - response_length
    groups, unique_prompts = ZoRRoTrain.find_prompt_groups(ids, response_length, mask)
    key = torch.cat([ids[:, :prompt_width], mask[:, :prompt_width]], dim=1)
    assert groups == reference_group_rows(key)
    assert torch.equal(unique_prompts, ids[[group[0] for group in groups], :prompt_width])


@settings(max_examples=50, deadline=None)
@given(padded_batches())
def test_deduplicated_batch_round_trips(batch: PaddedBatch) -> None:
    ids, mask, response_length = batch.input_ids, batch.attention_mask, batch.response_length
    batch_size, seq_len = ids.shape
    prompt_width = seq_len - response_length
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    groups, unique_prompts = ZoRRoTrain.find_prompt_groups(ids, response_length, mask)
    dedup_ids, dedup_positions, info = ZoRRoTrain.create_deduplicated_batch(
        ids, positions, response_length, groups, unique_prompts, mask, use_unpad=False
    )
    assert dedup_ids.shape == (1, len(groups) * prompt_width + batch_size * response_length)
    assert dedup_positions.shape == dedup_ids.shape
    # Layout: each group's prompt block, then its members' response blocks, in group order.
    cursor = 0
    for group in groups:
        assert torch.equal(dedup_ids[0, cursor : cursor + prompt_width], ids[group[0], :prompt_width])
        cursor += prompt_width
        for member in group:
            assert torch.equal(dedup_ids[0, cursor : cursor + response_length], ids[member, prompt_width:])
            cursor += response_length
    hidden = torch.randn(1, dedup_ids.shape[1], 3, dtype=torch.float64, requires_grad=True)
    full = ZoRRoTrain.reconstruct_sequences(hidden, info)
    assert full.shape == (batch_size, seq_len, 3)
    assert torch.equal(ZoRRoTrain.reconstruct_sequences(dedup_ids[..., None], info)[..., 0], ids)
    assert torch.equal(ZoRRoTrain.deduplicate_sequences(full, info), hidden)
    # Unpadded: only valid tokens, reconstructed in sample order.
    dedup_valid, valid_positions, info_unpad = ZoRRoTrain.create_deduplicated_batch(
        ids, positions, response_length, groups, unique_prompts, mask, use_unpad=True
    )
    valid = mask.bool()
    expected_tokens = sum(int(mask[g[0], :prompt_width].sum()) for g in groups) + int(mask[:, prompt_width:].sum())
    assert dedup_valid.shape == (1, expected_tokens)
    assert torch.equal(ZoRRoTrain.reconstruct_sequences(dedup_valid[..., None], info_unpad)[0, :, 0], ids[valid])
    assert torch.equal(
        ZoRRoTrain.reconstruct_sequences(valid_positions[..., None], info_unpad)[0, :, 0], positions[valid]
    )
    assert info_unpad["is_unpadded"] and not info["is_unpadded"]
    assert info_unpad["cu_seqlens_packed"].tolist()[-1] == int(mask.sum())


def test_reconstruct_gradient_sums_the_copies() -> None:
    batch = create_dummy_batch(6, 2, 4, 3, add_padding=True)
    ids, mask, positions = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    groups, unique_prompts = ZoRRoTrain.find_prompt_groups(ids, 3, mask)
    dedup_ids, _, info = ZoRRoTrain.create_deduplicated_batch(ids, positions, 3, groups, unique_prompts, mask)
    hidden = torch.randn(1, dedup_ids.shape[1], 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: ZoRRoTrain.reconstruct_sequences(x, info), (hidden,))
    (grad,) = torch.autograd.grad(ZoRRoTrain.reconstruct_sequences(hidden, info).sum(), hidden)
    # Group of 3 samples: each prompt position is copied 3 times; responses once.
    assert grad[0, :4, 0].tolist() == [3.0] * 4
    assert grad[0, 4:7, 0].tolist() == [1.0] * 3


def test_inconsistent_groups_are_rejected() -> None:
    batch = create_dummy_batch(4, 2, 3, 2)
    ids, positions = batch["input_ids"], batch["position_ids"]
    groups, unique_prompts = ZoRRoTrain.find_prompt_groups(ids, 2)
    with pytest.raises(BatchLayoutError, match="differs from the first member"):
        ZoRRoTrain.create_deduplicated_batch(ids, positions, 2, [[0, 2], [1, 3]], unique_prompts)
    with pytest.raises(BatchLayoutError, match="each sample exactly"):
        ZoRRoTrain.create_deduplicated_batch(ids, positions, 2, [[0, 1]], unique_prompts)
    with pytest.raises(BatchLayoutError, match="unique_prompts"):
        ZoRRoTrain.create_deduplicated_batch(ids, positions, 2, groups, unique_prompts[:1])


def test_flash_attn_params_square_and_kv_cache_masks() -> None:
    square = torch.block_diag(torch.ones(5, 5).tril(), torch.ones(3, 3).tril(), torch.ones(4, 4).tril())
    params = ZoRRoTrain.attention_mask_to_flash_attn_params(square)
    assert params["cu_seqlens_q"].tolist() == [0, 5, 8, 12]
    assert params["cu_seqlens_k"].tolist() == [0, 5, 8, 12]
    assert params["max_seqlen_q"] == 5 and params["num_sequences"] == 3
    # Two new query tokens per sequence over cached keys of lengths 5, 3, 4.
    blocks = [torch.ones(2, length) for length in (5, 3, 4)]
    params = ZoRRoTrain.attention_mask_to_flash_attn_params(torch.block_diag(*blocks)[None, None])
    assert params["cu_seqlens_q"].tolist() == [0, 2, 4, 6]
    assert params["cu_seqlens_k"].tolist() == [0, 5, 8, 12]
    assert params["seq_lengths_k"] == [5, 3, 4]
    assert params["total_q_tokens"] == 6 and params["total_kv_tokens"] == 12


def test_analyze_prints_one_line_and_returns_the_numbers(capsys) -> None:  # type: ignore[no-untyped-def]
    batch = create_dummy_batch(8, 2, 6, 4, add_padding=True, seed=3)
    stats = analyze_normal_batch_via_attention_mask(batch["input_ids"], batch["attention_mask"], 4)
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("batch stats:")
    assert stats.non_pad_tokens == int(batch["attention_mask"].sum())
    assert len(stats.unique_prompt_lengths) == 2
    assert stats.response_lengths == batch["response_mask"].sum(1).tolist()
    assert stats.dedup_non_pad_tokens == sum(stats.unique_prompt_lengths) + sum(stats.response_lengths)
