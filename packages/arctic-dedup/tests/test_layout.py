import pytest
import torch

from arctic_dedup import BatchLayoutError, SampleLayout, build_plan
from arctic_dedup.facade import ZoRRoTrain


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [4, 5, 6, 7, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    return ids, mask


def test_padded_layout_reads_valid_tokens_in_sample_order() -> None:
    ids, mask = _batch()
    layout = SampleLayout.from_padded(ids, 3, mask)
    assert layout.token_ids.tolist() == [5, 6, 7, 8, 4, 5, 6, 7]
    assert layout.prompt_lengths.tolist() == [2, 3]
    assert layout.response_lengths.tolist() == [2, 1]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert layout.sample_offsets.tolist() == [0, 4, 8]


def test_unpadded_layout_matches_padded() -> None:
    ids, mask = _batch()
    padded = SampleLayout.from_padded(ids, 3, mask)
    unpadded = SampleLayout.from_unpadded(padded.token_ids, padded.prompt_lengths, padded.response_lengths)
    assert torch.equal(unpadded.position_ids, padded.position_ids)
    assert torch.equal(unpadded.sample_offsets, padded.sample_offsets)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda ids, mask: (ids, mask[:, :5]), "same \\[B, S\\] shape"),
        (lambda ids, mask: (ids[:0], mask[:0]), "empty"),
        (lambda ids, mask: (ids.float(), mask), "integer token ids"),
        (lambda ids, mask: (ids, mask * 2), "only 0 and 1"),
        (lambda ids, mask: (ids, torch.tensor([[1, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])), "left-padded"),
        (lambda ids, mask: (ids, torch.tensor([[0, 1, 1, 1, 0, 1], [1, 1, 1, 1, 0, 0]])), "right-padded"),
        (lambda ids, mask: (ids, torch.tensor([[0, 0, 0, 1, 0, 0], [1, 1, 1, 1, 0, 0]])), "at least one real prompt"),
    ],
)
def test_bad_batches_get_a_clear_error(mutate, message) -> None:  # type: ignore[no-untyped-def]
    ids, mask = mutate(*_batch())
    with pytest.raises(BatchLayoutError, match=message):
        SampleLayout.from_padded(ids, 3, mask)
    with pytest.raises(BatchLayoutError, match=message):
        build_plan(ids, 3, mask)


@pytest.mark.parametrize("response_length", [6, 7, -1])
def test_response_length_must_leave_a_prompt(response_length: int) -> None:
    ids, mask = _batch()
    with pytest.raises(BatchLayoutError, match="response_length"):
        ZoRRoTrain.find_prompt_groups(ids, response_length, mask)


def test_unpadded_length_mismatch_is_reported() -> None:
    with pytest.raises(BatchLayoutError, match="add up to 5 tokens"):
        SampleLayout.from_unpadded(torch.arange(6), torch.tensor([2, 1]), torch.tensor([1, 1]))


def test_position_ids_of_the_wrong_shape_are_rejected() -> None:
    ids, mask = _batch()
    with pytest.raises(BatchLayoutError, match="position_ids"):
        SampleLayout.from_padded(ids, 3, mask, torch.zeros(3, 2, 6, dtype=torch.long))
