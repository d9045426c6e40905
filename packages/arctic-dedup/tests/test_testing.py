import pytest
import torch

from arctic_dedup import BatchLayoutError
from arctic_dedup.testing import create_dummy_batch, samples_per_prompt


def test_remainder_is_spread_round_robin() -> None:
    assert samples_per_prompt(10, 3) == [4, 3, 3]
    assert samples_per_prompt(8, 8) == [1] * 8


def test_samples_of_a_prompt_are_contiguous_and_identical() -> None:
    batch = create_dummy_batch(10, 3, 6, 4, add_padding=True, include_training_fields=True)
    prompts, mask = batch["prompts"], batch["attention_mask"]
    for lo, hi in [(0, 4), (4, 7), (7, 10)]:
        assert bool((prompts[lo:hi] == prompts[lo]).all())
        assert bool((mask[lo:hi, :6] == mask[lo, :6]).all())
    assert not torch.equal(prompts[0], prompts[4])
    for name in ("old_log_probs", "advantages", "ref_log_prob"):
        assert batch[name].shape == (10, 4) and batch[name].dtype == torch.float32
    assert torch.equal(batch["response_mask"], mask[:, 6:])
    assert torch.equal(batch["input_ids"][:, 6:], batch["responses"])
    assert bool((batch["response_mask"].sum(1) >= 1).all())


def test_without_padding_everything_is_real() -> None:
    batch = create_dummy_batch(4, 2, 5, 3, vocab_size=50)
    assert bool(batch["attention_mask"].bool().all())
    assert batch["position_ids"][0].tolist() == list(range(8))
    assert int(batch["input_ids"].max()) < 50


def test_bad_arguments() -> None:
    with pytest.raises(BatchLayoutError, match="num_unique_prompts"):
        create_dummy_batch(2, 3, 4, 4)
