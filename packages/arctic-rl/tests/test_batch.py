import math
from typing import Any

import numpy as np
import pytest
import torch
from batch_helpers import small_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from arctic_rl.batch import (
    BATCH_KEYS,
    ValidatedBatch,
    build_grpo_batch,
    check_batch,
    grpo_advantages,
    select_rows,
    validate_batch,
)
from arctic_rl.errors import BatchValidationError


def test_a_valid_batch_comes_back_normalised() -> None:
    batch = small_batch()
    batch["attention_mask"] = batch["attention_mask"].bool()
    batch["response_mask"] = batch["response_mask"].float()
    out = validate_batch(batch, vocab_size=10)
    assert out is not batch and set(out) == set(batch)
    assert out["attention_mask"].dtype == torch.long and out["response_mask"].dtype == torch.long
    torch.testing.assert_close(out["advantages"], torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))
    assert all(value.is_contiguous() and value.device.type == "cpu" for value in out.values())
    numpy_batch = {key: value.numpy() for key, value in small_batch().items()}
    assert isinstance(numpy_batch["input_ids"], np.ndarray)
    torch.testing.assert_close(validate_batch(numpy_batch)["input_ids"], small_batch()["input_ids"])
    forward_only = {key: value for key, value in small_batch().items() if key not in ("old_log_probs", "advantages")}
    assert set(validate_batch(forward_only, require=())) == set(forward_only)


def broken(key: str, value: Any) -> dict[str, Any]:
    batch: dict[str, Any] = small_batch()
    batch[key] = value
    return batch


@pytest.mark.parametrize(
    ("batch", "key", "message"),
    [
        ({k: v for k, v in small_batch().items() if k != "advantages"}, "advantages", "missing"),
        (broken("ref_log_probs", torch.zeros(2, 2)), "ref_log_probs", "unknown key"),
        (broken("input_ids", small_batch()["input_ids"].float()), "input_ids", "integer"),
        (broken("input_ids", torch.zeros(5, dtype=torch.long)), "input_ids", r"\[B, S\]"),
        ({k: v[:0] for k, v in small_batch().items()}, "input_ids", "empty"),
        (broken("responses", torch.zeros(2, 5, dtype=torch.long)), "responses", "at least one prompt column"),
        (broken("responses", torch.tensor([[7, 8], [3, 0]])), "responses", "differs from input_ids"),
        (broken("attention_mask", torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 2, 0]])), "attention_mask", "only 0 and 1"),
        (broken("attention_mask", torch.tensor([[1, 0, 1, 1, 1], [0, 1, 1, 1, 0]])), "attention_mask", "left-padded"),
        (
            broken("attention_mask", torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 1, 0]])),
            "attention_mask",
            "no real prompt",
        ),
        (broken("attention_mask", torch.tensor([[0, 1, 1, 0, 1], [0, 1, 1, 1, 0]])), "attention_mask", "right-padded"),
        (broken("attention_mask", torch.ones(2, 4, dtype=torch.long)), "attention_mask", r"shape \[2, 5\]"),
        (broken("response_mask", torch.tensor([[1, 1], [1, 1]])), "response_mask", "padding position"),
        (broken("response_mask", torch.tensor([[1, 1], [1, -1]])), "response_mask", "only 0 and 1"),
        (broken("advantages", torch.tensor([1.0, math.nan])), "advantages", "nan at row 1"),
        (broken("advantages", torch.tensor([1, 2])), "advantages", "floating"),
        (broken("advantages", torch.zeros(3)), "advantages", r"or \[B\]"),
        (broken("old_log_probs", torch.tensor([[-1.0, -math.inf], [0.0, 0.0]])), "old_log_probs", "-inf at row 0"),
        (broken("old_log_probs", torch.zeros(2, 3)), "old_log_probs", r"\[B, R\]"),
        (broken("rollout_log_probs", torch.full((2, 2), math.inf)), "rollout_log_probs", "finite"),
        (broken("position_ids", torch.zeros(2, 4, dtype=torch.long)), "position_ids", "shape"),
        (broken("position_ids", -torch.ones(2, 5, dtype=torch.long)), "position_ids", "negative"),
        (broken("prompts", torch.tensor([[0, 5, 1], [0, 5, 6]])), "prompts", "differs"),
        (broken("input_ids", torch.tensor([[0, 5, 6, 7, 8], [0, -5, 6, 9, 0]])), "input_ids", "negative"),
        (broken("old_log_probs", [[0.0, 0.0]]), "old_log_probs", "torch.Tensor"),
        (
            broken("response_mask", torch.zeros(2, 2, dtype=torch.long)),
            "response_mask",
            "at least one response token",
        ),
    ],
)
def test_bad_batches_name_the_key(batch: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(BatchValidationError, match=message) as raised:
        validate_batch(batch)
    assert raised.value.key == key
    assert str(raised.value).startswith(f"batch[{key!r}]")


def test_ids_outside_the_vocabulary() -> None:
    with pytest.raises(BatchValidationError, match=r"token id 9, outside the model's vocabulary \[0, 9\)") as raised:
        validate_batch(small_batch(), vocab_size=9)
    assert raised.value.key == "input_ids"
    validate_batch(small_batch(), vocab_size=10)


def test_advantages_by_hand() -> None:
    rewards = [[1.0, 0.0, 0.0, 1.0], [2.0], [3.0, 3.0]]
    std = math.sqrt(1.0 / 3.0)  # unbiased std of [1, 0, 0, 1]
    expected = [[0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)], [0.0], [0.0, 0.0]]
    for got, want in zip(grpo_advantages(rewards), expected):
        assert got == pytest.approx(want, abs=1e-12)
    assert grpo_advantages(rewards, normalize_std=False)[0] == [0.5, -0.5, -0.5, 0.5]
    assert grpo_advantages([[1.0, 0.0]], epsilon=1.0)[0] == pytest.approx(
        [0.5 / (math.sqrt(0.5) + 1.0), -0.5 / (math.sqrt(0.5) + 1.0)]
    )
    with pytest.raises(BatchValidationError, match="non-finite reward"):
        grpo_advantages([[1.0, math.nan]])


def sample(tokens: list[int]) -> dict[str, Any]:
    return {
        "text": "",
        "token_ids": tokens,
        "logprobs": [-0.1 * (i + 1) for i in range(len(tokens))],
        "finish_reason": "stop",
    }


def test_build_grpo_batch_by_hand() -> None:
    batch = build_grpo_batch(
        [[11, 12, 13], [21]],
        [[sample([1, 2]), sample([3])], [sample([4, 5, 6])]],
        [[1.0, 0.0], [5.0]],
        pad_token_id=0,
    )
    torch.testing.assert_close(
        batch["input_ids"], torch.tensor([[11, 12, 13, 1, 2, 0], [11, 12, 13, 3, 0, 0], [0, 0, 21, 4, 5, 6]])
    )
    torch.testing.assert_close(
        batch["attention_mask"], torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    )
    torch.testing.assert_close(
        batch["position_ids"], torch.tensor([[0, 1, 2, 3, 4, 4], [0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3]])
    )
    torch.testing.assert_close(batch["response_mask"], torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(batch["advantages"], torch.tensor([[a, a, 0.0], [-a, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(
        batch["old_log_probs"], torch.tensor([[-0.1, -0.2, 0.0], [-0.1, 0.0, 0.0], [-0.1, -0.2, -0.3]])
    )
    torch.testing.assert_close(batch["rollout_log_probs"], batch["old_log_probs"])
    validated = validate_batch(batch, vocab_size=22)
    assert set(validated) <= set(BATCH_KEYS)
    wide = build_grpo_batch([[1]], [[sample([2])]], [[0.0]], pad_token_id=7, max_response_length=4)
    assert wide["responses"].tolist() == [[2, 7, 7, 7]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([[1]], [[sample([2])]], [[0.0], [1.0]]), "one entry per prompt"),
        (([[1]], [[sample([2]), sample([3])]], [[0.0]]), "2 samples but 1 rewards"),
        (([[]], [[sample([2])]], [[0.0]]), "prompt 0 is empty"),
        (([[1]], [[{"token_ids": [2]}]], [[0.0]]), "needs 'logprobs'"),
        (([[1]], [[{"token_ids": [2], "logprobs": [math.nan]}]], [[0.0]]), "non-finite log-prob"),
        (([[1]], [[sample([])]], [[0.0]]), "every response is empty"),
        (([[1]], [[]], [[]]), "no samples"),
        (([[1]], [[sample([2, 3, 4])]], [[0.0]]), "more than max_response_length=2"),
    ],
)
def test_build_grpo_batch_refuses_bad_input(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(BatchValidationError, match=message):
        build_grpo_batch(*args, pad_token_id=0, max_response_length=2 if "max_response" in message else None)


groups = st.lists(
    st.tuples(
        st.lists(st.integers(1, 50), min_size=1, max_size=6),
        st.lists(
            st.tuples(st.lists(st.integers(1, 50), min_size=0, max_size=5), st.floats(-5, 5)), min_size=1, max_size=4
        ),
    ),
    min_size=1,
    max_size=4,
).filter(lambda prompts: any(tokens for _, group in prompts for tokens, _ in group))


@settings(max_examples=60, deadline=None)
@given(groups, st.booleans(), st.integers(0, 3))
def test_build_grpo_batch_over_ragged_lengths(
    prompts: list[tuple[list[int], list[tuple[list[int], float]]]], normalize_std: bool, extra_width: int
) -> None:
    prompt_ids = [prompt for prompt, _ in prompts]
    samples = [[sample(tokens) for tokens, _ in group] for _, group in prompts]
    rewards = [[reward for _, reward in group] for _, group in prompts]
    longest = max(len(tokens) for _, group in prompts for tokens, _ in group)
    batch = build_grpo_batch(
        prompt_ids,
        samples,
        rewards,
        pad_token_id=0,
        max_response_length=longest + extra_width,
        normalize_std=normalize_std,
    )
    validated = validate_batch(batch, vocab_size=51)
    width = longest + extra_width
    assert validated["responses"].shape[1] == width
    advantages = grpo_advantages(rewards, normalize_std=normalize_std)
    row = 0
    for prompt, group, group_advantages in zip(prompt_ids, samples, advantages):
        for item, advantage in zip(group, group_advantages):
            mask = batch["attention_mask"][row].bool()
            assert batch["input_ids"][row][mask].tolist() == prompt + item["token_ids"]
            length = len(item["token_ids"])
            assert int(batch["response_mask"][row].sum()) == length
            assert batch["old_log_probs"][row, :length].tolist() == pytest.approx(item["logprobs"])
            assert batch["advantages"][row, :length].tolist() == pytest.approx([advantage] * length, abs=1e-6)
            assert not batch["advantages"][row, length:].any()
            row += 1
        if len(group) > 1:
            assert sum(group_advantages) == pytest.approx(0.0, abs=1e-6)
        else:
            assert group_advantages == [0.0]
    assert row == batch["input_ids"].shape[0]
    # Every data-parallel share (the service's select_rows) holds its rows of every key, row for row.
    rows = batch["input_ids"].shape[0]
    for part in (list(range(0, rows, 2)), list(range(1, rows, 2))):
        piece = select_rows(validated, part)
        assert set(piece) == set(validated)
        for key, value in piece.items():
            torch.testing.assert_close(value, validated[key][part])


def test_row_helpers_refuse_bad_input() -> None:
    batch = validate_batch(small_batch())
    with pytest.raises(IndexError):
        select_rows(batch, [2])
    assert select_rows(batch, [1])["input_ids"].tolist() == [[0, 5, 6, 9, 0]]


def test_a_checked_batch_carries_its_limits_through_row_selection() -> None:
    batch = small_batch()
    checked = check_batch(batch, vocab_size=10, require=("old_log_probs", "advantages"), max_length=8)
    plain = validate_batch(batch, vocab_size=10, require=("old_log_probs", "advantages"), max_length=8)
    assert set(checked) == set(plain)
    assert all(torch.equal(checked[key], plain[key]) for key in plain)
    share = checked.select([1])
    assert isinstance(share, ValidatedBatch) and share["input_ids"].tolist() == [[0, 5, 6, 9, 0]]
    assert share.covers(vocab_size=10, max_length=8, require=("old_log_probs", "advantages"))
    # Checked against at least as strict limits: covered. Looser or missing limits, or more keys: not covered.
    assert share.covers(vocab_size=12, max_length=None, require=("advantages",))
    assert not share.covers(vocab_size=9, max_length=8, require=())
    assert not share.covers(vocab_size=10, max_length=7, require=())
    assert not share.covers(vocab_size=10, max_length=8, require=("ref_log_prob",))
    unlimited = check_batch(batch, vocab_size=None, require=(), max_length=None)
    assert not unlimited.covers(vocab_size=10, max_length=None, require=())
    assert not unlimited.covers(vocab_size=None, max_length=8, require=())
    dropped = checked.without("old_log_probs")
    assert "old_log_probs" not in dropped
    assert not dropped.covers(vocab_size=10, max_length=8, require=("old_log_probs",))
    assert dropped.covers(vocab_size=10, max_length=8, require=("advantages",))
