"""The request checks on their own (no engine): strict types, ranges, the field named; the HTTP bodies do not coerce
step numbers or token ids. The real engines' refusals are tested in test_sampling_engine.py and
test_hostile_input.py."""

from __future__ import annotations

from typing import Any

import pytest

from arctic_rl.errors import InvalidRequestError
from arctic_rl.request_checks import MAX_SEED, check_prompts_shape, check_sampling_params, requested_samples

LIMITS = {"vocab_size": 300, "max_model_len": 64}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"seed": "x"}, "seed"),
        ({"seed": MAX_SEED + 1}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"n": True}, "n"),
        ({"n": 1025}, "n"),
        ({"max_tokens": 65}, "max_tokens"),
        ({"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 301}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"logit_bias": {"300": 1.0}}, "logit_bias"),
        ({"logit_bias": {"1": float("nan")}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"stop_token_ids": [300]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": "a|b"}, "structured_outputs"),
        ({"extra_args": {}}, "extra_args"),
        ({"output_kind": 0}, "output_kind"),
    ],
)
def test_bad_sampling_values_name_their_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        check_sampling_params(params, **LIMITS)
    assert refused.value.field == f"sampling_params.{field}"


def test_good_sampling_values_pass_with_json_keys_made_ints() -> None:
    params = {
        "n": 4,
        "max_tokens": 64,
        "seed": MAX_SEED,
        "temperature": 0,
        "top_k": -1,
        "logprobs": -1,
        "logit_bias": {"17": -100, 3: 2.5},
        "allowed_token_ids": [0, 299],
        "stop": "\n",
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    checked = check_sampling_params(params, **LIMITS)
    assert checked["logit_bias"] == {17: -100.0, 3: 2.5}
    assert requested_samples(5, checked) == 20
    assert check_sampling_params({}, **LIMITS) == {}


@pytest.mark.parametrize(
    ("prompts", "field"),
    [
        ([], "prompts"),
        ("text", "prompts"),
        ([[1, True]], "prompts[0]"),
        (["a", [1]], "prompts"),
        ([None], "prompts[0]"),
    ],
)
def test_bad_prompt_shapes_are_refused(prompts: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        check_prompts_shape(prompts)
    assert refused.value.field == field


def test_http_bodies_take_step_numbers_and_token_ids_strictly() -> None:
    from pydantic import ValidationError

    from arctic_rl.operations import GenerateBody, LoadCheckpointBody, SaveCheckpointBody

    for body, fields in (
        (GenerateBody, {"prompts": [[True]], "sampling_params": {}}),
        (GenerateBody, {"prompts": [["1"]], "sampling_params": {}}),
        (LoadCheckpointBody, {"step": "1"}),
        (SaveCheckpointBody, {"step": True}),
    ):
        with pytest.raises(ValidationError):
            body.model_validate(fields)
    assert LoadCheckpointBody.model_validate({"step": 1}).step == 1
