"""The verl-free half of the verl plugin (``arctic_rl.integrations.verl_mapping``): verl's no-padding batches to the
client's padded layout and back in the same row order, verl's PPO settings to the client's loss config, sampling
parameters, the connection settings, and the plugin's message when verl is missing. The plugin against real engines
is ``tests_verl/`` (``nox -s verl_integration``)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from typing import Any

import pytest
import torch

from arctic_rl import ConfigError
from arctic_rl.batch import validate_batch
from arctic_rl.integrations import verl_mapping
from arctic_rl.integrations.verl_mapping import (
    ArcticConnection,
    ppo_processing,
    to_client_batch,
    to_client_sampling_params,
    to_verl_token_values,
)
from arctic_rl.losses import PolicyLossConfig, parse_dataclass_config

PROMPT_WIDTH, RESPONSE_WIDTH = 5, 4


def padded_batch() -> dict[str, torch.Tensor]:
    """Four rows of verl's padded layout: left-padded prompts of 5, 1, 3, 5 tokens; responses of 4, 2, 1, 3."""
    prompt_lengths, response_lengths = [5, 1, 3, 5], [4, 2, 1, 3]
    rows = len(prompt_lengths)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, 250, (rows, PROMPT_WIDTH + RESPONSE_WIDTH), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        attention_mask[row, PROMPT_WIDTH - prompt : PROMPT_WIDTH + response] = 1
    # Padding holds a pad id, as in verl's batches; only real tokens must survive the round trip.
    input_ids = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, 256))
    response_mask = attention_mask[:, PROMPT_WIDTH:].clone()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "prompts": input_ids[:, :PROMPT_WIDTH],
        "responses": input_ids[:, PROMPT_WIDTH:],
        "response_mask": response_mask,
        "old_log_probs": -torch.rand(rows, RESPONSE_WIDTH, generator=generator) * response_mask,
        "advantages": torch.randn(rows, RESPONSE_WIDTH, generator=generator) * response_mask,
    }


def no_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """verl's left_right_2_no_padding: input_ids and position_ids as jagged nested tensors of the real tokens."""
    mask = batch["attention_mask"].bool()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(dim=1).cumsum(dim=0)])
    converted = dict(batch)
    for key in ("input_ids", "position_ids"):
        converted[key] = torch.nested.nested_tensor_from_jagged(batch[key][mask], offsets=offsets)
    return converted


def verl_slice(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """verl's no_padding_2_padding: response token t of a row sits at sequence position prompt_len - 1 + t."""
    mask = batch["attention_mask"]
    prompt_lengths = mask[:, :PROMPT_WIDTH].sum(dim=1)
    response_lengths = mask[:, PROMPT_WIDTH:].sum(dim=1)
    flat = values.values()
    ends = (prompt_lengths + response_lengths).cumsum(dim=0)
    rows = []
    for length, end in zip(response_lengths.tolist(), ends.tolist(), strict=True):
        row = flat[end - length - 1 : end - 1]
        rows.append(torch.nn.functional.pad(row, (0, RESPONSE_WIDTH - length)))
    return torch.stack(rows)


def test_exported_names() -> None:
    assert verl_mapping.__all__ == [
        "ArcticConnection",
        "ppo_processing",
        "to_client_batch",
        "to_client_sampling_params",
        "to_verl_token_values",
    ]


def test_a_no_padding_batch_comes_back_padded_in_verls_row_order() -> None:
    padded = padded_batch()
    batch = to_client_batch(no_padding(padded), training=True)
    mask = padded["attention_mask"].bool()
    assert sorted(batch) == sorted(padded)
    assert batch["input_ids"].shape == padded["input_ids"].shape
    assert torch.equal(batch["input_ids"][mask], padded["input_ids"][mask])
    assert torch.equal(batch["position_ids"][mask], padded["position_ids"][mask])
    for key in ("attention_mask", "responses", "response_mask", "prompts", "old_log_probs", "advantages"):
        assert torch.equal(batch[key], padded[key]), key
    # The client's own validation accepts it (responses equal input_ids[:, P:] at real tokens, masks consistent).
    validate_batch(batch, vocab_size=320)


def test_a_forward_batch_drops_the_training_fields_and_a_padded_batch_passes_through() -> None:
    padded = padded_batch()
    forward = to_client_batch(no_padding(padded), training=False)
    assert "old_log_probs" not in forward and "advantages" not in forward
    assert set(forward) == {"input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask"}
    assert torch.equal(to_client_batch(padded, training=True)["input_ids"], padded["input_ids"])


def test_token_values_land_where_verls_slicing_reads_them() -> None:
    padded = padded_batch()
    data = no_padding(padded)
    values = torch.randn(4, RESPONSE_WIDTH) * padded["response_mask"]
    nested = to_verl_token_values(values, data)
    assert nested.is_nested
    assert nested.offsets().diff().tolist() == padded["attention_mask"].sum(dim=1).tolist()
    assert torch.equal(verl_slice(nested, padded), values)
    assert to_verl_token_values(values, padded) is values


def test_batches_the_client_cannot_honour_are_refused() -> None:
    padded = padded_batch()
    with pytest.raises(NotImplementedError, match="tis_cap"):
        to_client_batch({**no_padding(padded), "rollout_is_weights": torch.ones(4, RESPONSE_WIDTH)}, training=True)
    short = no_padding(padded)
    short["attention_mask"] = padded["attention_mask"].clone()
    short["attention_mask"][0, -1] = 0
    with pytest.raises(ValueError, match="attention_mask marks"):
        to_client_batch(short, training=False)
    missing = {key: value for key, value in padded.items() if key != "responses"}
    with pytest.raises(ValueError, match="lacks 'responses'"):
        to_client_batch(missing, training=False)
    mrope = no_padding(padded)
    mrope["position_ids"] = torch.nested.as_nested_tensor(
        [torch.zeros(3, int(length)) for length in padded["attention_mask"].sum(dim=1)], layout=torch.jagged
    )
    with pytest.raises(NotImplementedError, match="mrope"):
        to_client_batch(mrope, training=False)


VERL_ACTOR_DEFAULTS: dict[str, Any] = {
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 3.0,
    "loss_agg_mode": "seq-mean-token-mean",
    "entropy_coeff": 0.001,
    "use_kl_loss": True,
    "kl_loss_coef": 0.05,
    "kl_loss_type": "low_var_kl",
    "policy_loss": {"loss_mode": "vanilla"},
}


def test_verls_ppo_settings_become_the_clients_loss_config() -> None:
    processing = ppo_processing(VERL_ACTOR_DEFAULTS)
    assert processing == {
        "loss_fn": "grpo",
        "config": {
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "clip_ratio_c": 3.0,
            "loss_agg_mode": "seq-mean-token-mean",
            "entropy_coef": 0.001,
            "kl_coef": 0.05,
            "kl_estimator": "k3",
        },
    }
    # Every key is a field of the client's loss config, with a valid value.
    parse_dataclass_config(PolicyLossConfig, processing["config"], what="policy loss")
    unset = ppo_processing({**VERL_ACTOR_DEFAULTS, "clip_ratio_low": None, "clip_ratio_high": None})
    assert unset["config"]["clip_ratio_low"] == unset["config"]["clip_ratio_high"] == 0.2
    gspo = ppo_processing({**VERL_ACTOR_DEFAULTS, "use_kl_loss": False, "policy_loss": {"loss_mode": "gspo"}})
    assert gspo["loss_fn"] == "gspo" and "clip_ratio_c" not in gspo["config"] and "kl_coef" not in gspo["config"]


def test_verl_losses_without_a_twin_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="register_loss_fn"):
        ppo_processing({**VERL_ACTOR_DEFAULTS, "policy_loss": {"loss_mode": "sapo"}})
    with pytest.raises(NotImplementedError, match="kl_loss_type 'low_var_kl\\+'"):
        ppo_processing({**VERL_ACTOR_DEFAULTS, "kl_loss_type": "low_var_kl+"})


def test_sampling_parameters() -> None:
    verl_params = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    params, wants = to_client_sampling_params(
        verl_params, prompt_length=10, max_prompt_length=12, max_response_length=8
    )
    assert wants and params == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "n": 1,
    }
    assert verl_params["logprobs"] is True
    capped, wants = to_client_sampling_params(
        {"max_tokens": 50}, prompt_length=15, max_prompt_length=12, max_response_length=8
    )
    assert not wants and capped["max_tokens"] == 5


def test_connection_from_the_environment() -> None:
    assert ArcticConnection.from_environment({}) == ArcticConnection()
    connection = ArcticConnection.from_environment(
        {
            "ARCTIC_RL_PROTOCOL": "ray",
            "ARCTIC_RL_HOST": "10.0.0.2",
            "ARCTIC_RL_PORT": "7100",
            "ARCTIC_RL_TOKEN_FILE": "/run/token",
            "ARCTIC_RL_RAY_ADDRESS": "10.0.0.2:6379",
            "ARCTIC_RL_SERVICE_NAME": "engines",
        }
    )
    assert connection == ArcticConnection("ray", "10.0.0.2", 7100, "/run/token", "10.0.0.2:6379", "engines")
    with pytest.raises(ConfigError, match="ARCTIC_RL_PROTOCOL"):
        ArcticConnection.from_environment({"ARCTIC_RL_PROTOCOL": "grpc"})
    with pytest.raises(ConfigError, match="ARCTIC_RL_PORT"):
        ArcticConnection.from_environment({"ARCTIC_RL_PORT": "http"})


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed here")
def test_the_plugin_says_how_to_install_verl_when_it_is_missing() -> None:
    with pytest.raises(ImportError, match=re.escape("pip install verl==0.9.1 arctic-rl")):
        importlib.import_module("arctic_rl.integrations.verl")
