import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.losses import (
    GspoLossConfig,
    LossInputs,
    LossNeeds,
    LossOutput,
    PolicyLossConfig,
    get_loss_fn,
    loss_needs,
    register_loss_fn,
    registered_loss_names,
)


def inputs_1x2(**overrides: Any) -> LossInputs:
    values: dict[str, Any] = {
        "log_probs": torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True),
        "old_log_probs": torch.tensor([[-1.1, -1.5]], dtype=torch.float64),
        "advantages": torch.tensor([[1.0, 1.0]], dtype=torch.float64),
        "response_mask": torch.ones(1, 2, dtype=torch.float64),
        "global_tokens": 2.0,
        "global_sequences": 1.0,
        "max_response_length": 2,
    }
    values.update(overrides)
    return LossInputs(**values)


def test_grpo_token_mean_by_hand() -> None:
    inputs = inputs_1x2()
    out = get_loss_fn("grpo")(inputs, {})
    # token 0: r = e^0.1 = 1.10517 inside [0.8, 1.2] -> -1.10517; token 1: r = e^-0.5 = 0.60653, A > 0 so
    # max(-0.60653, -0.8) = -0.60653 (unclipped: the min of the PPO objective).
    expected = (-math.exp(0.1) - math.exp(-0.5)) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    out.loss.backward()
    assert inputs.log_probs.grad is not None
    torch.testing.assert_close(
        inputs.log_probs.grad, torch.tensor([[-math.exp(0.1) / 2, -math.exp(-0.5) / 2]], dtype=torch.float64)
    )
    assert out.metrics["clip_fraction"].item() == 0.0
    assert out.metrics["ppo_kl"].item() == pytest.approx((-0.1 + 0.5) / 2)


def test_registry_lists_refuses_duplicates_and_unknown_names() -> None:
    assert {"grpo", "ppo", "gspo"} <= set(registered_loss_names())
    with pytest.raises(ConfigError, match="already registered"):
        register_loss_fn("grpo", lambda inputs, config: LossOutput(inputs.log_probs.sum(), {}))
    with pytest.raises(ConfigError, match=r"registered losses: \[.*'grpo'"):
        get_loss_fn("nope")


def test_unknown_config_keys_list_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown keys \['clip'\]; the known keys are \['clip_ratio_c'"):
        get_loss_fn("grpo").parse_config({"clip": 0.3})
    with pytest.raises(ConfigError, match="one of"):
        get_loss_fn("grpo").parse_config({"loss_agg_mode": "mean"})
    with pytest.raises(ConfigError, match="finite number"):
        get_loss_fn("grpo").parse_config({"kl_coef": "0.1"})
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        get_loss_fn("grpo").parse_config({"clip_ratio_c": 0.5})
    assert get_loss_fn("grpo").parse_config({"kl_coef": 1}) == PolicyLossConfig(kl_coef=1.0)
    assert isinstance(get_loss_fn("gspo").parse_config({}), GspoLossConfig)


def test_loss_needs_follow_the_config() -> None:
    assert loss_needs("grpo", {}) == LossNeeds()
    assert loss_needs("grpo", {"kl_coef": 0.1, "entropy_coef": 0.01, "tis_cap": 2.0}) == LossNeeds(True, True, True)


@dataclass(frozen=True)
class _ScaleConfig:
    scale: float = 1.0


def test_custom_loss_with_typed_config() -> None:
    def scaled(inputs: LossInputs, config: Any) -> LossOutput:
        loss = config.scale * (inputs.log_probs * inputs.response_mask).sum() / inputs.global_tokens
        return LossOutput(loss, {})

    register_loss_fn("test_scaled", scaled, config_type=_ScaleConfig, needs_entropy=True, overwrite=True)
    registered = get_loss_fn("test_scaled")
    assert registered(inputs_1x2(), {"scale": 2}).loss.item() == pytest.approx(-3.0)
    assert loss_needs("test_scaled", {}).entropy
    with pytest.raises(ConfigError, match=r"known keys are \['scale'\]"):
        registered.parse_config({"scael": 2})
