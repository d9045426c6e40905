"""The padded batch layout every engine consumes: validation, a GRPO batch builder, and row selection.

A batch is a ``dict[str, torch.Tensor]`` (``B`` samples, prompt width ``P``, response width ``R``, ``S = P + R``):

- ``input_ids`` ``[B, S]``: each row is its prompt (left-padded to ``P``) then its response (right-padded to ``R``);
- ``attention_mask`` ``[B, S]``: 1 at real tokens, 0 at padding; optional ``position_ids`` ``[B, S]``;
- ``responses`` ``[B, R]`` (= ``input_ids[:, P:]``) and ``response_mask`` ``[B, R]`` (1 at the tokens the loss
  trains on, a subset of the real response tokens; 0 at padding); optional ``prompts`` ``[B, P]``;
- training fields ``old_log_probs`` ``[B, R]``, ``advantages`` ``[B, R]`` or ``[B]``, optional ``ref_log_prob`` and
  ``rollout_log_probs`` ``[B, R]``.

The samples of one prompt are contiguous rows (a group), which is what GRPO and deduplicated training expect.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from arctic_rl.errors import BatchValidationError

__all__ = [
    "BATCH_KEYS",
    "FLOAT_KEYS",
    "REQUIRED_KEYS",
    "ValidatedBatch",
    "batch_size",
    "build_grpo_batch",
    "check_batch",
    "grpo_advantages",
    "select_rows",
    "validate_batch",
]

REQUIRED_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "responses", "response_mask")
# Per-response-token float fields, [B, R].
FLOAT_KEYS: tuple[str, ...] = ("old_log_probs", "advantages", "ref_log_prob", "rollout_log_probs")
BATCH_KEYS: tuple[str, ...] = (*REQUIRED_KEYS, "position_ids", "prompts", *FLOAT_KEYS)
_INTEGER_KEYS = ("input_ids", "responses", "position_ids", "prompts")
_MASK_KEYS = ("attention_mask", "response_mask")


def validate_batch(
    batch: Mapping[str, Any],
    *,
    vocab_size: int | None = None,
    require: Collection[str] = ("old_log_probs", "advantages"),
    max_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Check ``batch`` against the padded layout and return a new dict of contiguous CPU tensors.

    Token ids, positions and masks come back as int64; float fields keep their floating dtype; ``advantages`` of
    shape ``[B]`` come back broadcast to ``[B, R]``. ``require`` names the optional keys that must be present (a
    training batch needs ``old_log_probs`` and ``advantages``; pass ``()`` for a forward-only batch); ``max_length``
    bounds the sequence width ``S`` (the model's positions). When
    ``advantages`` is required the batch must hold at least one response token to train on.

    Raises ``BatchValidationError`` naming the key, what was expected, what was received and how to fix it.
    """
    if not isinstance(batch, Mapping):
        raise BatchValidationError("<batch>", f"expected a dict of tensors, got {type(batch).__name__}.")
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise BatchValidationError(
            unknown[0],
            f"unknown key (a misspelt optional key would be silently ignored); the known keys are {list(BATCH_KEYS)}: "
            "rename it or remove it.",
        )
    unknown_required = sorted(set(require) - set(BATCH_KEYS))
    if unknown_required:
        raise BatchValidationError(unknown_required[0], f"required but not a batch key; use keys of {BATCH_KEYS}.")
    for key in (*REQUIRED_KEYS, *require):
        if batch.get(key) is None:
            raise BatchValidationError(key, f"missing; a batch needs {sorted({*REQUIRED_KEYS, *require})}.")
    tensors = {key: _as_tensor(key, value) for key, value in batch.items() if value is not None}

    input_ids = _integer(tensors, "input_ids")
    if input_ids.dim() != 2:
        raise BatchValidationError("input_ids", f"expected a [B, S] tensor, got shape {list(input_ids.shape)}.")
    rows, width = (int(size) for size in input_ids.shape)
    if max_length is not None and width > max_length:
        raise BatchValidationError(
            "input_ids",
            f"rows are {width} tokens wide (prompt + response); the model has {max_length} positions. Shorten the "
            "prompts or responses.",
        )
    if rows == 0:
        raise BatchValidationError("input_ids", "the batch is empty (0 rows); pass at least one sample.")
    responses = _integer(tensors, "responses")
    if responses.dim() != 2 or int(responses.shape[0]) != rows:
        raise BatchValidationError("responses", f"expected [B, R] with B = {rows}, got {list(responses.shape)}.")
    response_width = int(responses.shape[1])
    prompt_width = width - response_width
    if response_width < 1 or prompt_width < 1:
        raise BatchValidationError(
            "responses",
            f"expected 1 <= R < S = {width} (each row holds at least one prompt column), got R = {response_width}.",
        )
    full, response_shape = [rows, width], [rows, response_width]
    attention_mask = _mask(tensors, "attention_mask", full)
    response_mask = _mask(tensors, "response_mask", response_shape)
    out: dict[str, torch.Tensor] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "responses": responses,
        "response_mask": response_mask,
    }
    _check_padding(attention_mask, prompt_width)
    if bool((response_mask > attention_mask[:, prompt_width:]).any()):
        row = int((response_mask > attention_mask[:, prompt_width:]).any(dim=1).nonzero()[0])
        raise BatchValidationError(
            "response_mask",
            f"row {row} marks a padding position (attention_mask 0 in the response part) as a response token; "
            "response_mask must be 0 wherever attention_mask[:, P:] is 0.",
        )
    real_response = attention_mask[:, prompt_width:].bool()
    if not torch.equal(responses[real_response], input_ids[:, prompt_width:][real_response]):
        raise BatchValidationError(
            "responses",
            "differs from input_ids[:, P:] at real response tokens; responses must be the last R columns of "
            "input_ids (each row is its prompt then its response).",
        )
    if vocab_size is not None and vocab_size < 1:
        raise BatchValidationError("input_ids", f"vocab_size must be >= 1, got {vocab_size}.")
    for key in ("input_ids", "responses"):
        _check_token_range(key, out[key], vocab_size)
    if "prompts" in tensors:
        prompts = _integer(tensors, "prompts")
        _check_shape("prompts", prompts, [rows, prompt_width])
        real_prompt = attention_mask[:, :prompt_width].bool()
        if not torch.equal(prompts[real_prompt], input_ids[:, :prompt_width][real_prompt]):
            raise BatchValidationError("prompts", "differs from input_ids[:, :P] at real prompt tokens.")
        out["prompts"] = prompts
    if "position_ids" in tensors:
        position_ids = _integer(tensors, "position_ids")
        _check_shape("position_ids", position_ids, full)
        if bool((position_ids < 0).any()):
            raise BatchValidationError("position_ids", "holds negative positions; positions start at 0.")
        if max_length is not None and int(position_ids.max()) >= max_length:
            raise BatchValidationError(
                "position_ids", f"holds position {int(position_ids.max())}; the model has {max_length} positions."
            )
        out["position_ids"] = position_ids
    for key in FLOAT_KEYS:
        if key in tensors:
            out[key] = _float_field(key, tensors[key], rows, response_width)
    if "advantages" in require and not bool(response_mask.any()):
        raise BatchValidationError(
            "response_mask", "is 0 everywhere: a training batch needs at least one response token to train on."
        )
    return out


@dataclass(frozen=True, eq=False)
class ValidatedBatch(Mapping[str, torch.Tensor]):
    """A batch that passed :func:`validate_batch` (read-only), with the limits it was checked against.

    The service checks a request's batch once and sends each engine its rows as a ``ValidatedBatch``; an engine
    skips its own check only when :meth:`covers` says this one was at least as strict. Selecting rows or dropping a
    key keeps every per-row guarantee (shapes, padding, masks, token range, finite values), so :meth:`select` and
    :meth:`without` keep the proof. Not kept: a training batch's "at least one response token", which holds for the
    whole batch, not for each share of it (the service checks the whole step's token count).
    """

    tensors: Mapping[str, torch.Tensor]
    vocab_size: int | None
    max_length: int | None
    required: frozenset[str]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def covers(self, *, vocab_size: int | None, max_length: int | None, require: Collection[str]) -> bool:
        """Whether ``validate_batch(self, vocab_size=..., max_length=..., require=...)`` is implied by this check
        (up to the batch-wide response-token rule above)."""
        vocab_ok = vocab_size is None or (self.vocab_size is not None and self.vocab_size <= vocab_size)
        length_ok = max_length is None or (self.max_length is not None and self.max_length <= max_length)
        return vocab_ok and length_ok and set(require) <= self.required

    def select(self, rows: Sequence[int] | torch.Tensor) -> ValidatedBatch:
        """The rows ``rows`` (see :func:`select_rows`), still validated."""
        return ValidatedBatch(select_rows(self.tensors, rows), self.vocab_size, self.max_length, self.required)

    def without(self, key: str) -> ValidatedBatch:
        """The batch less ``key`` (no longer required), still validated."""
        tensors = {name: value for name, value in self.tensors.items() if name != key}
        return ValidatedBatch(tensors, self.vocab_size, self.max_length, self.required - {key})


def check_batch(
    batch: Mapping[str, Any],
    *,
    vocab_size: int | None,
    require: Collection[str],
    max_length: int | None,
) -> ValidatedBatch:
    """:func:`validate_batch`, returning the checked tensors with the limits they were checked against."""
    checked = validate_batch(batch, vocab_size=vocab_size, require=require, max_length=max_length)
    return ValidatedBatch(checked, vocab_size, max_length, frozenset(require))


def _as_tensor(key: str, value: Any) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise BatchValidationError(key, f"expected a torch.Tensor (or numpy array), got {type(value).__name__}.")
    return value.detach().to("cpu").contiguous()


def _integer(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    tensor = tensors[key]
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise BatchValidationError(key, f"expected integer token ids or positions, got dtype {tensor.dtype}.")
    return tensor.long()


def _check_shape(key: str, tensor: torch.Tensor, shape: list[int]) -> None:
    if list(tensor.shape) != shape:
        raise BatchValidationError(key, f"expected shape {shape}, got {list(tensor.shape)}.")


def _mask(tensors: Mapping[str, torch.Tensor], key: str, shape: list[int]) -> torch.Tensor:
    tensor = tensors[key]
    _check_shape(key, tensor, shape)
    if tensor.dtype.is_complex:
        raise BatchValidationError(key, f"expected a 0/1 mask (bool, integer or float), got dtype {tensor.dtype}.")
    if tensor.dtype != torch.bool and not bool(((tensor == 0) | (tensor == 1)).all()):
        bad = tensor[(tensor != 0) & (tensor != 1)][0].item()
        raise BatchValidationError(key, f"must hold only 0 and 1, found {bad!r}.")
    return tensor.long()


def _check_padding(attention_mask: torch.Tensor, prompt_width: int) -> None:
    prompt_mask, response_mask = attention_mask[:, :prompt_width], attention_mask[:, prompt_width:]
    left_padded = (prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all(dim=1)
    if not bool(left_padded.all()):
        row = int((~left_padded).nonzero()[0])
        raise BatchValidationError(
            "attention_mask",
            f"row {row}: prompts must be left-padded (0...0 1...1 in the first P = {prompt_width} columns); "
            "check the padding side and that R = responses.shape[1] is the response width.",
        )
    if not bool(prompt_mask[:, -1].all()):
        row = int((prompt_mask[:, -1] == 0).nonzero()[0])
        raise BatchValidationError(
            "attention_mask",
            f"row {row} has no real prompt token; every sample needs at least one (it predicts the first response "
            "token).",
        )
    right_padded = (response_mask[:, 1:] <= response_mask[:, :-1]).all(dim=1)
    if not bool(right_padded.all()):
        row = int((~right_padded).nonzero()[0])
        raise BatchValidationError(
            "attention_mask",
            f"row {row}: responses must be right-padded (1...1 0...0 in the last R columns); check the padding side.",
        )


def _check_token_range(key: str, ids: torch.Tensor, vocab_size: int | None) -> None:
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise BatchValidationError(key, f"holds a negative token id ({low}); token ids are in [0, vocab_size).")
    if vocab_size is not None and high >= vocab_size:
        raise BatchValidationError(
            key,
            f"holds token id {high}, outside the model's vocabulary [0, {vocab_size}); check the tokenizer matches "
            "the model and that the pad id is a real token id.",
        )


def _float_field(key: str, tensor: torch.Tensor, rows: int, response_width: int) -> torch.Tensor:
    if not tensor.dtype.is_floating_point:
        raise BatchValidationError(key, f"expected a floating tensor, got dtype {tensor.dtype}.")
    if key == "advantages" and tensor.dim() == 1 and int(tensor.shape[0]) == rows:
        tensor = tensor[:, None].expand(rows, response_width).contiguous()
    expected = f"[B, R] = {[rows, response_width]}" + (" or [B]" if key == "advantages" else "")
    if list(tensor.shape) != [rows, response_width]:
        raise BatchValidationError(key, f"expected shape {expected}, got {list(tensor.shape)}.")
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        row, column = (int(index) for index in (~finite).nonzero()[0])
        raise BatchValidationError(
            key,
            f"holds {tensor[row, column].item()} at row {row}, column {column}; every entry must be finite (put 0 "
            "at padding, and check the reward and advantage computation).",
        )
    return tensor


def grpo_advantages(
    rewards: Sequence[Sequence[float]], *, normalize_std: bool = True, epsilon: float = 1e-6
) -> list[list[float]]:
    """GRPO's group-normalised advantages: ``(r - mean(group)) / (std(group) + epsilon)``.

    ``std`` is the unbiased (Bessel-corrected) standard deviation of the group; without ``normalize_std`` the
    advantage is ``r - mean(group)`` (Dr. GRPO). A group of one sample has no baseline and gets advantage 0.
    """
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}.")
    advantages = []
    for prompt, group in enumerate(rewards):
        values = torch.tensor([float(reward) for reward in group], dtype=torch.float64)
        if not bool(torch.isfinite(values).all()):
            raise BatchValidationError("rewards", f"prompt {prompt} has a non-finite reward: {list(group)}.")
        if values.numel() < 2:
            advantages.append([0.0] * values.numel())
            continue
        centred = values - values.mean()
        if normalize_std:
            centred = centred / (values.std() + epsilon)
        advantages.append(centred.tolist())
    return advantages


def build_grpo_batch(
    prompt_token_ids: Sequence[Sequence[int]],
    samples: Sequence[Sequence[Mapping[str, Any]]],
    rewards: Sequence[Sequence[float]],
    *,
    pad_token_id: int,
    max_response_length: int | None = None,
    normalize_std: bool = True,
    epsilon: float = 1e-6,
) -> dict[str, torch.Tensor]:
    """A training batch from ``generate()`` output and one reward per sample.

    Args:
        prompt_token_ids: the prompts' token ids, one list per prompt (what ``generate`` was given).
        samples: ``generate()``'s output: per prompt, a list of sample dicts with ``token_ids`` (generated tokens
            only) and ``logprobs`` (one float per generated token, the sampler's log-prob).
        rewards: per prompt, one reward per sample (same nesting as ``samples``).
        pad_token_id: the id placed at padding (any id in the vocabulary; padding is masked out).
        max_response_length: the response width ``R``; None: the longest response. A longer response is refused.
        normalize_std, epsilon: see ``grpo_advantages``.

    Returns the padded layout (module docstring) with ``position_ids``, ``prompts``, ``advantages`` ``[B, R]``
    (the sample's advantage at its response tokens, 0 at padding), and ``old_log_probs`` and
    ``rollout_log_probs`` both set to the sampler's log-probs (0 at padding). Rows follow the prompts, each
    prompt's samples contiguous.
    """
    if not len(prompt_token_ids) == len(samples) == len(rewards):
        raise BatchValidationError(
            "samples",
            f"prompt_token_ids, samples and rewards must have one entry per prompt, got {len(prompt_token_ids)}, "
            f"{len(samples)} and {len(rewards)}.",
        )
    if pad_token_id < 0:
        raise BatchValidationError("input_ids", f"pad_token_id must be a token id >= 0, got {pad_token_id}.")
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    log_probs: list[list[float]] = []
    for prompt, (prompt_ids, group, group_rewards) in enumerate(zip(prompt_token_ids, samples, rewards)):
        if len(prompt_ids) == 0:
            raise BatchValidationError("prompts", f"prompt {prompt} is empty; every prompt needs at least one token.")
        if len(group) != len(group_rewards):
            raise BatchValidationError(
                "rewards", f"prompt {prompt} has {len(group)} samples but {len(group_rewards)} rewards."
            )
        for index, sample in enumerate(group):
            token_ids, sample_log_probs = _sample_tokens(sample, f"samples[{prompt}][{index}]")
            prompts.append(list(prompt_ids))
            responses.append(token_ids)
            log_probs.append(sample_log_probs)
    if not responses:
        raise BatchValidationError("samples", "there are no samples; pass at least one prompt with one sample.")
    longest = max(len(tokens) for tokens in responses)
    if longest == 0:
        raise BatchValidationError("responses", "every response is empty; there is nothing to train on.")
    if max_response_length is None:
        max_response_length = longest
    elif longest > max_response_length:
        raise BatchValidationError(
            "responses",
            f"a response has {longest} tokens, more than max_response_length={max_response_length}; raise it (or "
            "generate with max_tokens <= max_response_length).",
        )
    prompt_width = max(len(tokens) for tokens in prompts)
    rows = len(responses)
    input_ids = torch.full((rows, prompt_width + max_response_length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    old_log_probs = torch.zeros(rows, max_response_length, dtype=torch.float32)
    for row, (prompt_ids, token_ids, sample_log_probs) in enumerate(zip(prompts, responses, log_probs)):
        start = prompt_width - len(prompt_ids)
        end = prompt_width + len(token_ids)
        input_ids[row, start:end] = torch.tensor([*prompt_ids, *token_ids], dtype=torch.long)
        attention_mask[row, start:end] = 1
        old_log_probs[row, : len(token_ids)] = torch.tensor(sample_log_probs, dtype=torch.float32)
    response_mask = attention_mask[:, prompt_width:].clone()
    per_sample = [
        advantage
        for group in grpo_advantages(rewards, normalize_std=normalize_std, epsilon=epsilon)
        for advantage in group
    ]
    advantages = torch.tensor(per_sample, dtype=torch.float32)[:, None] * response_mask.float()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=-1) - 1).clamp(min=0),
        "prompts": input_ids[:, :prompt_width].clone(),
        "responses": input_ids[:, prompt_width:].clone(),
        "response_mask": response_mask,
        "old_log_probs": old_log_probs,
        "rollout_log_probs": old_log_probs.clone(),
        "advantages": advantages,
    }


def _sample_tokens(sample: Mapping[str, Any], where: str) -> tuple[list[int], list[float]]:
    if not isinstance(sample, Mapping) or "token_ids" not in sample:
        raise BatchValidationError("samples", f"{where} must be a generate() sample dict with 'token_ids'.")
    token_ids = [int(token) for token in sample["token_ids"]]
    if any(token < 0 for token in token_ids):
        raise BatchValidationError("responses", f"{where} has a negative token id.")
    raw = sample.get("logprobs")
    if raw is None or len(raw) != len(token_ids):
        raise BatchValidationError(
            "old_log_probs",
            f"{where} needs 'logprobs' with one float per generated token ({len(token_ids)}), got "
            f"{None if raw is None else len(raw)}; generate() returns them.",
        )
    values = [float(value) for value in raw]
    if not all(math.isfinite(value) for value in values):
        raise BatchValidationError("old_log_probs", f"{where} has a non-finite log-prob.")
    return token_ids, values


def batch_size(batch: Mapping[str, torch.Tensor]) -> int:
    """Rows of a batch (``input_ids.shape[0]``)."""
    return int(batch["input_ids"].shape[0])


def select_rows(batch: Mapping[str, torch.Tensor], rows: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
    """The sub-batch of ``rows`` (in that order); every ``[B, ...]`` entry is indexed along its first dimension."""
    index = torch.as_tensor(rows, dtype=torch.long)
    if index.dim() != 1:
        raise ValueError(f"rows must be a 1-D list of row indices, got shape {list(index.shape)}.")
    size = batch_size(batch)
    if index.numel() and (int(index.min()) < -size or int(index.max()) >= size):
        raise IndexError(f"row indices must be in [0, {size}), got {index.tolist()}.")
    return {key: value.index_select(0, index.to(value.device) % size) for key, value in batch.items()}
