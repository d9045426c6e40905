import itertools
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def f64(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.float64)


def run(name: str, config: dict[str, Any], **overrides: Any) -> tuple[LossOutput, torch.Tensor]:
    inputs = inputs_1x2(**overrides)
    out = get_loss_fn(name)(inputs, config)
    out.loss.backward()
    assert inputs.log_probs.grad is not None
    return out, inputs.log_probs.grad


def test_clip_low_and_high_use_their_own_ratios() -> None:
    # Token 0: r = e^0.5 = 1.6487 with A = +1 (clip-high binds); token 1: r = e^-0.5 = 0.6065 with A = -1
    # (clip-low binds). PPO: max(-A r, -A clip(r)).
    old = f64([-1.5, -1.5])
    log_probs = f64([-1.0, -2.0]).requires_grad_()
    advantages = f64([1.0, -1.0])
    out, grad = run("grpo", {}, log_probs=log_probs, old_log_probs=old, advantages=advantages)
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-12)
    torch.testing.assert_close(grad, torch.zeros(1, 2, dtype=torch.float64))
    assert out.metrics["clip_fraction"].item() == 1.0
    out, _ = run(
        "grpo",
        {"clip_ratio_low": 0.3, "clip_ratio_high": 0.28},
        log_probs=log_probs.detach().clone().requires_grad_(),
        old_log_probs=old,
        advantages=advantages,
    )
    assert out.loss.item() == pytest.approx((-1.28 + 0.7) / 2, abs=1e-12)
    # Wide enough clip ratios leave the unclipped objective: -e^0.5 + e^-0.5, with gradient -A r / 2.
    out, grad = run(
        "grpo",
        {"clip_ratio_low": 0.5, "clip_ratio_high": 1.0},
        log_probs=log_probs.detach().clone().requires_grad_(),
        old_log_probs=old,
        advantages=advantages,
    )
    assert out.loss.item() == pytest.approx((-math.exp(0.5) + math.exp(-0.5)) / 2, abs=1e-12)
    torch.testing.assert_close(grad, f64([-math.exp(0.5) / 2, math.exp(-0.5) / 2]))
    assert out.metrics["clip_fraction"].item() == 0.0


def test_dual_clip_caps_negative_advantages() -> None:
    # r = e^1.5 = 4.4817 with A = -1: PPO gives max(4.4817, 1.2) = 4.4817; dual clip caps it at -A * 3 = 3.
    # Token 1 has A = +1 and r = e^1.5: clipped at 1.2 and untouched by the dual clip.
    common = {
        "log_probs": f64([-0.5, -0.5]),
        "old_log_probs": f64([-2.0, -2.0]),
        "advantages": f64([-1.0, 1.0]),
    }
    plain, _ = run("grpo", {}, **{**common, "log_probs": common["log_probs"].clone().requires_grad_()})
    assert plain.loss.item() == pytest.approx((math.exp(1.5) - 1.2) / 2, abs=1e-12)
    dual, grad = run(
        "grpo", {"clip_ratio_c": 3.0}, **{**common, "log_probs": common["log_probs"].clone().requires_grad_()}
    )
    assert dual.loss.item() == pytest.approx((3.0 - 1.2) / 2, abs=1e-12)
    torch.testing.assert_close(grad, torch.zeros(1, 2, dtype=torch.float64))
    assert dual.metrics["dual_clip_fraction"].item() == 0.5


def test_sequence_level_ratio_gspo_by_hand() -> None:
    # Log-ratios 0.1 and -0.5: the sequence ratio is exp((0.1 - 0.5) / 2) = e^-0.2 = 0.81873 for both tokens,
    # inside [0.8, 1.2]: per-token loss -A s; seq-mean-token-mean of one sequence = -s.
    # Gradient wrt log_prob_t: -A s * (1/2) (token mean), the same for both tokens.
    s = math.exp(-0.2)
    out, grad = run("gspo", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2})
    assert out.loss.item() == pytest.approx(-s, abs=1e-12)
    torch.testing.assert_close(grad, f64([-s / 2, -s / 2]))
    token_level, _ = run("grpo", {"loss_agg_mode": "seq-mean-token-mean"})
    assert token_level.loss.item() != pytest.approx(out.loss.item())
    # GSPO's default clip (3e-4 / 4e-4) clips s = 0.8187 to 1 - 3e-4 with A > 0 -> unclipped wins (min objective).
    default, _ = run("gspo", {})
    assert default.loss.item() == pytest.approx(-s, abs=1e-12)
    clipped, clipped_grad = run("gspo", {}, advantages=f64([-1.0, -1.0]))
    assert clipped.loss.item() == pytest.approx(1.0 - 3e-4, abs=1e-12)
    torch.testing.assert_close(clipped_grad, torch.zeros(1, 2, dtype=torch.float64))


@pytest.mark.parametrize(
    ("estimator", "per_token"),
    [
        ("k1", [0.5, -1.0]),
        ("k2", [0.125, 0.5]),
        ("k3", [math.exp(-0.5) + 0.5 - 1.0, math.exp(1.0) - 1.0 - 1.0]),
    ],
)
def test_kl_estimators_by_hand(estimator: str, per_token: list[float]) -> None:
    # log_probs [-1, -2], ref [-1.5, -1]: log p - log q = [0.5, -1].
    ref = f64([-1.5, -1.0])
    base, base_grad = run("grpo", {})
    out, grad = run("grpo", {"kl_coef": 0.1, "kl_estimator": estimator}, ref_log_probs=ref)
    kl = sum(per_token) / 2
    assert out.metrics["kl"].item() == pytest.approx(kl, abs=1e-12)
    assert out.loss.item() == pytest.approx(base.loss.item() + 0.1 * kl, abs=1e-12)
    derivative = {"k1": [1.0, 1.0], "k2": [0.5, -1.0], "k3": [1 - math.exp(-0.5), 1 - math.exp(1.0)]}[estimator]
    torch.testing.assert_close(grad - base_grad, f64([0.1 * d / 2 for d in derivative]))


def test_entropy_bonus_by_hand() -> None:
    entropy = f64([0.5, 1.5]).requires_grad_()
    base, _ = run("grpo", {}, entropy=entropy.detach())
    assert base.metrics["entropy"].item() == pytest.approx(1.0)
    inputs = inputs_1x2(entropy=entropy)
    out = get_loss_fn("grpo")(inputs, {"entropy_coef": 0.1})
    assert out.loss.item() == pytest.approx(base.loss.item() - 0.1 * 1.0, abs=1e-12)
    out.loss.backward()
    torch.testing.assert_close(entropy.grad, f64([-0.05, -0.05]))
    with pytest.raises(ConfigError, match=r"entropy_coef is set but LossInputs\.entropy is None"):
        get_loss_fn("grpo")(inputs_1x2(), {"entropy_coef": 0.1})


def test_truncated_importance_sampling_by_hand() -> None:
    # old [-1.1, -1.5], rollout [-2.0, -1.4]: weights e^0.9 = 2.4596 (capped at 2) and e^-0.1 = 0.90484.
    rollout = f64([-2.0, -1.4])
    out, grad = run("grpo", {"tis_cap": 2.0}, rollout_log_probs=rollout)
    weights = [2.0, math.exp(-0.1)]
    pg = [-math.exp(0.1), -math.exp(-0.5)]
    assert out.loss.item() == pytest.approx((weights[0] * pg[0] + weights[1] * pg[1]) / 2, abs=1e-12)
    torch.testing.assert_close(grad, f64([weights[0] * pg[0] / 2, weights[1] * pg[1] / 2]))
    assert out.metrics["tis_truncated_fraction"].item() == 0.5
    assert out.metrics["tis_weight"].item() == pytest.approx(sum(weights) / 2)
    with pytest.raises(ConfigError, match=r"tis_cap needs LossInputs\.rollout_log_probs"):
        get_loss_fn("grpo")(inputs_1x2(), {"tis_cap": 2.0})


def test_kl_needs_the_reference() -> None:
    with pytest.raises(ConfigError, match=r"kl_coef needs LossInputs.ref_log_probs.*ref_log_prob"):
        get_loss_fn("grpo")(inputs_1x2(), {"kl_coef": 0.1})


AGG_VALUES = f64([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0])
AGG_MASK = f64([1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 + 4) / (2 * 3)),
    ],
)
def test_aggregation_modes_by_hand(mode: str, expected: float) -> None:
    from arctic_rl.losses import aggregate, count_loss_denominators

    tokens, sequences = count_loss_denominators(AGG_MASK)
    assert (tokens, sequences) == (3.0, 2.0)
    value = aggregate(
        AGG_VALUES,
        AGG_MASK,
        mode,
        global_tokens=tokens,
        global_sequences=sequences,
        max_response_length=3,  # type: ignore[arg-type]
    )
    assert value.item() == pytest.approx(expected, abs=1e-12)


def test_zero_denominators_are_refused() -> None:
    with pytest.raises(ConfigError, match="global_tokens must be > 0"):
        get_loss_fn("grpo")(inputs_1x2(global_tokens=0.0), {})
    with pytest.raises(ConfigError, match="global_sequences must be > 0"):
        get_loss_fn("grpo")(inputs_1x2(global_sequences=0.0), {"loss_agg_mode": "seq-mean-token-sum"})
    with pytest.raises(ConfigError, match="max_response_length"):
        get_loss_fn("grpo")(inputs_1x2(max_response_length=0), {"loss_agg_mode": "seq-mean-token-sum-norm"})
    with pytest.raises(ConfigError, match="shape of log_probs"):
        get_loss_fn("grpo")(inputs_1x2(old_log_probs=f64([-1.0])), {})


def random_step(seed: int, rows: int = 7, width: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=generator)
    lengths[0] = width
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float64)

    def values(scale: float, shift: float = 0.0) -> torch.Tensor:
        return ((torch.rand(rows, width, generator=generator, dtype=torch.float64) * scale + shift) * mask).clone()

    log_probs = values(-3.0)
    return {
        "log_probs": log_probs,
        "old_log_probs": (log_probs + values(0.6, -0.3)) * mask,
        "ref_log_probs": (log_probs + values(1.0, -0.5)) * mask,
        "rollout_log_probs": (log_probs + values(2.0, -1.0)) * mask,
        "entropy": values(2.0),
        "advantages": torch.randn(rows, generator=generator, dtype=torch.float64)[:, None] * mask,
        "response_mask": mask,
    }


FULL_OPTIONS: dict[str, Any] = {
    "clip_ratio_low": 0.1,
    "clip_ratio_high": 0.15,
    "clip_ratio_c": 2.0,
    "kl_coef": 0.3,
    "kl_estimator": "k3",
    "entropy_coef": 0.05,
    "tis_cap": 1.5,
}


def loss_and_grads(
    name: str, config: dict[str, Any], step: dict[str, torch.Tensor], parts: list[list[int]]
) -> tuple[float, dict[str, float], torch.Tensor, torch.Tensor]:
    log_probs = step["log_probs"].clone().requires_grad_()
    entropy = step["entropy"].clone().requires_grad_()
    tokens, sequences = count_loss_denominators_for(step["response_mask"])
    total = 0.0
    metrics: dict[str, float] = {}
    for rows in parts:
        index = torch.tensor(rows)
        inputs = LossInputs(
            log_probs=log_probs[index],
            old_log_probs=step["old_log_probs"][index],
            advantages=step["advantages"][index],
            response_mask=step["response_mask"][index],
            ref_log_probs=step["ref_log_probs"][index],
            rollout_log_probs=step["rollout_log_probs"][index],
            entropy=entropy[index],
            global_tokens=tokens,
            global_sequences=sequences,
            max_response_length=int(step["response_mask"].shape[1]),
        )
        out = get_loss_fn(name)(inputs, config)
        out.loss.backward()
        total += out.loss.item()
        for key, value in out.metrics.items():
            assert not value.requires_grad
            metrics[key] = metrics.get(key, 0.0) + value.item()
    assert log_probs.grad is not None
    entropy_grad = torch.zeros_like(entropy) if entropy.grad is None else entropy.grad
    return total, metrics, log_probs.grad, entropy_grad


def count_loss_denominators_for(mask: torch.Tensor) -> tuple[float, float]:
    from arctic_rl.losses import count_loss_denominators

    return count_loss_denominators(mask)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", ["grpo", "gspo"])
@pytest.mark.parametrize("options", [{}, FULL_OPTIONS])
def test_splitting_over_micro_batches_and_ranks_gives_the_same_loss_and_gradient(
    mode: str, name: str, options: dict[str, Any]
) -> None:
    step = random_step(seed=3)
    config = {**options, "loss_agg_mode": mode}
    if name == "gspo":
        config.update(clip_ratio_low=0.05, clip_ratio_high=0.05)
    whole, whole_metrics, whole_grad, whole_entropy_grad = loss_and_grads(name, config, step, [list(range(7))])
    # Two "ranks", each with two micro-batches (uneven, one holding the empty-response rows).
    for parts in ([[0, 1], [2, 3, 4], [5], [6]], [[6, 0], [3], [1, 2, 4, 5]]):
        split, split_metrics, split_grad, split_entropy_grad = loss_and_grads(name, config, step, parts)
        assert split == pytest.approx(whole, rel=1e-12, abs=1e-12)
        assert split_metrics == pytest.approx(whole_metrics, rel=1e-12, abs=1e-12)
        torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(split_entropy_grad, whole_entropy_grad, rtol=1e-12, atol=1e-14)
    assert whole_grad.abs().sum() > 0


@pytest.mark.parametrize(
    "change",
    [
        {"clip_ratio_low": 0.05},
        {"clip_ratio_high": 0.05},
        {"clip_ratio_c": 1.05},
        {"importance_ratio_level": "sequence"},
        {"loss_agg_mode": "seq-mean-token-sum"},
        {"loss_agg_mode": "seq-mean-token-mean"},
        {"loss_agg_mode": "seq-mean-token-sum-norm"},
        {"kl_coef": 0.5},
        {"kl_estimator": "k1"},
        {"kl_estimator": "k2"},
        {"entropy_coef": 0.2},
        {"tis_cap": 1.2},
    ],
)
def test_every_option_changes_the_result(change: dict[str, Any]) -> None:
    step = random_step(seed=5)
    base = {"kl_coef": 0.1, "kl_estimator": "k3", "clip_ratio_c": 10.0, "entropy_coef": 0.01, "tis_cap": 100.0}
    loss, _, grad, entropy_grad = loss_and_grads("grpo", base, step, [list(range(7))])
    changed_loss, _, changed_grad, changed_entropy_grad = loss_and_grads(
        "grpo", {**base, **change}, step, [list(range(7))]
    )
    assert changed_loss != pytest.approx(loss, rel=1e-9, abs=1e-12)
    assert not torch.allclose(changed_grad, grad, rtol=1e-9, atol=1e-12) or not torch.allclose(
        changed_entropy_grad, entropy_grad
    )


def test_advantages_of_shape_b_broadcast() -> None:
    per_token, _ = run("grpo", {})
    per_sample, _ = run("grpo", {}, advantages=torch.tensor([1.0], dtype=torch.float64))
    assert per_sample.loss.item() == per_token.loss.item()


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10**6),
    st.permutations(list(range(7))),
    st.lists(st.integers(1, 6), min_size=1, max_size=6),
    st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    st.sampled_from(["grpo", "gspo"]),
)
def test_any_split_gives_the_same_loss_and_gradient(
    seed: int, order: list[int], cuts: list[int], mode: str, name: str
) -> None:
    step = random_step(seed=seed)
    config = {**FULL_OPTIONS, "loss_agg_mode": mode}
    whole, whole_metrics, whole_grad, whole_entropy_grad = loss_and_grads(name, config, step, [list(range(7))])
    boundaries = sorted({0, 7, *(cut for cut in cuts if cut < 7)})
    parts = [order[start:end] for start, end in itertools.pairwise(boundaries)]
    split, split_metrics, split_grad, split_entropy_grad = loss_and_grads(name, config, step, parts)
    assert split == pytest.approx(whole, rel=1e-12, abs=1e-12)
    assert split_metrics == pytest.approx(whole_metrics, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_entropy_grad, whole_entropy_grad, rtol=1e-12, atol=1e-14)


def test_a_parsed_loss_config_is_taken_as_is() -> None:
    # The training engine parses the loss config once and asks the parsed config what the loss needs.
    grpo = get_loss_fn("grpo")
    parsed = grpo.parse_config({"kl_coef": 0.1, "tis_cap": 2.0})
    assert grpo.parse_config(parsed) is parsed
    assert grpo.needs(parsed) == grpo.needs({"kl_coef": 0.1, "tis_cap": 2.0}) == LossNeeds(False, True, True)
