"""How verl's data, losses and sampling settings map onto the arctic-rl client; needs neither verl nor the engines.

verl 0.9.1's trainer hands its training engine a TensorDict in its "no padding" layout (``left_right_2_no_padding``):
``input_ids`` and ``position_ids`` are jagged nested tensors holding each row's real tokens, while
``attention_mask`` ``[B, S]``, ``responses``, ``response_mask``, ``old_log_probs``, ``advantages`` (``[B, R]``) stay
padded. The client takes the padded layout of :mod:`arctic_rl.batch`, so :func:`to_client_batch` scatters the real
tokens back into their padded slots (row order kept), and :func:`to_verl_token_values` returns per-response-token
values (log-probs, entropy) in the nested per-sequence layout verl's ``no_padding_2_padding`` slices them from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from arctic_rl.batch import FLOAT_KEYS
from arctic_rl.errors import ConfigError

if TYPE_CHECKING:
    from arctic_rl.client import SyncArcticRLClient

__all__ = [
    "ArcticConnection",
    "ppo_processing",
    "to_client_batch",
    "to_client_sampling_params",
    "to_verl_token_values",
]

# verl's padded batch keys the client's layout carries (same names and meaning on both sides); the float training
# fields (FLOAT_KEYS) come along for fwd_bwd only.
_PADDED_KEYS = ("attention_mask", "responses", "response_mask", "prompts")
# verl's kl_loss_type names -> arctic-rl's estimators (verl's "+" suffix, a straight-through variant, has no twin).
_KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
# verl's policy loss modes the client's registered losses reproduce.
_POLICY_LOSSES = {"vanilla": "grpo", "gspo": "gspo"}


def _padded(key: str, values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A jagged nested ``[B, j]`` tensor of each row's real tokens -> ``[B, S]`` with them at the mask's 1s."""
    if not values.is_nested:
        return values
    flat = values.values()
    if flat.dim() != 1:
        raise NotImplementedError(
            f"{key} is a nested tensor of {flat.dim()}-D tokens (e.g. mrope position ids of a vision model); the "
            "arctic-rl client takes text models' 1-D token rows only."
        )
    mask = attention_mask.bool()
    if int(mask.sum()) != flat.numel():
        raise ValueError(
            f"{key} holds {flat.numel()} tokens but attention_mask marks {int(mask.sum())} real ones; pass the "
            "batch as verl's left_right_2_no_padding made it (the mask must stay next to the nested tensors)."
        )
    padded = torch.zeros(mask.shape, dtype=flat.dtype)
    # Row-major order of the mask's 1s is the order left_right_2_no_padding packed the tokens in.
    padded[mask] = flat.cpu()
    return padded


def to_client_batch(data: Mapping[str, Any], *, training: bool) -> dict[str, torch.Tensor]:
    """verl's batch (padded or no-padding layout) -> the client's padded batch, rows in verl's order.

    ``training``: keep ``old_log_probs`` / ``advantages`` (and the reference and rollout log-probs) for ``fwd_bwd``;
    else only what a forward pass reads. Raises ``NotImplementedError`` for fields the client cannot honour
    (verl's rollout importance-sampling weights) instead of dropping them.
    """
    # TensorDict answers `key in data` only through keys().
    keys = set(data.keys())
    for key in ("input_ids", "attention_mask", "responses", "response_mask"):
        if key not in keys:
            raise ValueError(f"verl's batch lacks {key!r}; it has {sorted(keys)}.")
    if training and "rollout_is_weights" in keys:
        raise NotImplementedError(
            "verl's rollout_is_weights (rollout correction) cannot be applied by a remote loss; turn verl's "
            "algorithm.rollout_correction off and use arctic-rl's truncated importance sampling instead (pass "
            "rollout_log_probs and set tis_cap in the loss config)."
        )
    attention_mask = data["attention_mask"]
    if attention_mask.is_nested:
        raise ValueError("attention_mask must be a padded [B, S] tensor, got a nested one.")
    attention_mask = attention_mask.cpu()
    batch = {"input_ids": _padded("input_ids", data["input_ids"], attention_mask)}
    if "position_ids" in keys:
        position_ids = data["position_ids"]
        position_ids = _padded("position_ids", position_ids, attention_mask)
        if position_ids.dim() != 2:
            raise NotImplementedError(
                f"position_ids of shape {list(position_ids.shape)} (mrope) are not supported; the client takes "
                "[B, S] position ids."
            )
        batch["position_ids"] = position_ids
    for key in (*_PADDED_KEYS, *(FLOAT_KEYS if training else ())):
        if key in keys:
            value = data[key]
            if value.is_nested:
                raise ValueError(f"{key} must be a padded tensor, got a nested one.")
            batch[key] = value.cpu()
    return batch


def to_verl_token_values(values: torch.Tensor, data: Mapping[str, Any]) -> torch.Tensor:
    """Per-response-token values ``[B, R]`` from the client -> verl's layout for the same batch.

    For a no-padding batch (nested ``input_ids``): a jagged nested tensor with one entry per real token of each
    sequence, the value of response token ``t`` at position ``prompt_len - 1 + t`` (the position whose logits
    predict it; prompt positions hold 0), which is what verl's ``no_padding_2_padding`` slices back to ``[B, R]``.
    For a padded batch: ``values`` as they are.
    """
    if not data["input_ids"].is_nested:
        return values
    attention_mask = data["attention_mask"].cpu()
    response_width = data["responses"].shape[1]
    prompt_lengths = attention_mask[:, :-response_width].sum(dim=1).tolist()
    response_lengths = attention_mask[:, -response_width:].sum(dim=1).tolist()
    rows = []
    for row, (prompt_length, response_length) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        if prompt_length == 0:
            raise ValueError(f"row {row} has an empty prompt; verl's layout needs at least one prompt token.")
        sequence = torch.zeros(prompt_length + response_length, dtype=values.dtype)
        sequence[prompt_length - 1 : prompt_length - 1 + response_length] = values[row, :response_length]
        rows.append(sequence)
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _option(config: Any, name: str, default: Any = None) -> Any:
    """A field of verl's ActorConfig (a dataclass, an OmegaConf node or a dict)."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def ppo_processing(actor_config: Any) -> dict[str, Any]:
    """verl's actor settings (``ppo_loss``'s ``config``) -> the ``processing`` argument of the client's ``fwd_bwd``.

    Maps the clip ratios (verl's ``clip_ratio`` fills unset low/high), dual clip, ``loss_agg_mode``, the KL loss
    (``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``) and the entropy bonus; the policy loss modes ``vanilla``
    (arctic-rl's ``grpo``) and ``gspo``. Anything else raises ``NotImplementedError`` naming what to change.
    """
    policy_loss = _option(actor_config, "policy_loss") or {}
    mode = str(_option(policy_loss, "loss_mode", "vanilla"))
    if mode not in _POLICY_LOSSES:
        raise NotImplementedError(
            f"verl's policy loss {mode!r} has no arctic-rl twin; use policy_loss.loss_mode in "
            f"{sorted(_POLICY_LOSSES)}, or register the loss on the arctic-rl server (register_loss_fn) and pass "
            "its name as ArcticTrainingEngine(loss_name=...)."
        )
    clip_ratio = _option(actor_config, "clip_ratio", 0.2)
    low = _option(actor_config, "clip_ratio_low")
    high = _option(actor_config, "clip_ratio_high")
    options: dict[str, Any] = {
        "clip_ratio_low": float(clip_ratio if low is None else low),
        "clip_ratio_high": float(clip_ratio if high is None else high),
        "loss_agg_mode": str(_option(actor_config, "loss_agg_mode", "token-mean")),
        "entropy_coef": float(_option(actor_config, "entropy_coeff", 0.0) or 0.0),
    }
    dual_clip = _option(actor_config, "clip_ratio_c")
    if mode == "vanilla" and dual_clip is not None:
        options["clip_ratio_c"] = float(dual_clip)
    if _option(actor_config, "use_kl_loss", False):
        kind = str(_option(actor_config, "kl_loss_type", "low_var_kl"))
        if kind not in _KL_ESTIMATORS:
            raise NotImplementedError(
                f"verl's kl_loss_type {kind!r} has no arctic-rl estimator; use one of {sorted(_KL_ESTIMATORS)}."
            )
        options["kl_coef"] = float(_option(actor_config, "kl_loss_coef", 0.0))
        options["kl_estimator"] = _KL_ESTIMATORS[kind]
    return {"loss_fn": _POLICY_LOSSES[mode], "config": options}


def to_client_sampling_params(
    sampling_params: Mapping[str, Any], *, prompt_length: int, max_prompt_length: int, max_response_length: int
) -> tuple[dict[str, Any], bool]:
    """verl's per-request sampling parameters -> the client's (vLLM names), and whether verl asked for log-probs.

    verl sends ``logprobs`` as a flag; the client always returns the sampled tokens' log-probs, so it is dropped.
    ``max_tokens`` (or ``max_new_tokens``) defaults to verl's response length, capped, as verl's own servers do,
    so the prompt plus the response fit in ``max_prompt_length + max_response_length``.
    """
    params = dict(sampling_params)
    wants_log_probs = bool(params.pop("logprobs", False))
    limit = min(max_response_length, max_prompt_length + max_response_length - prompt_length)
    requested = params.pop("max_tokens", params.pop("max_new_tokens", limit))
    params["max_tokens"] = max(1, min(int(requested), limit))
    params["n"] = 1
    return params, wants_log_probs


@dataclass(frozen=True)
class ArcticConnection:
    """Where verl's processes find the arctic-rl engines (each verl worker connects its own client).

    ``protocol='http'``: a running ``arctic-rl-serve`` at ``host:port`` (``token_file`` when it requires a token).
    ``protocol='ray'``: the service actor ``service_name`` on the Ray cluster at ``ray_address`` (started by another
    process with ``create_arctic_rl_client``).
    """

    protocol: Literal["http", "ray"] = "http"
    host: str = "127.0.0.1"
    port: int = 7000
    token_file: str | None = None
    ray_address: str | None = None
    service_name: str = "arctic_rl_service"

    @classmethod
    def from_environment(cls, environment: Mapping[str, str] | None = None) -> ArcticConnection:
        """Read ``ARCTIC_RL_PROTOCOL``, ``ARCTIC_RL_HOST``, ``ARCTIC_RL_PORT``, ``ARCTIC_RL_TOKEN_FILE``,
        ``ARCTIC_RL_RAY_ADDRESS`` and ``ARCTIC_RL_SERVICE_NAME`` (defaults: HTTP on 127.0.0.1:7000)."""
        env = os.environ if environment is None else environment
        protocol = env.get("ARCTIC_RL_PROTOCOL", "http")
        if protocol not in ("http", "ray"):
            raise ConfigError(f"ARCTIC_RL_PROTOCOL must be 'http' or 'ray', got {protocol!r}.")
        port = env.get("ARCTIC_RL_PORT", "7000")
        if not port.isdigit():
            raise ConfigError(f"ARCTIC_RL_PORT must be a port number, got {port!r}.")
        return cls(
            protocol="http" if protocol == "http" else "ray",
            host=env.get("ARCTIC_RL_HOST", "127.0.0.1"),
            port=int(port),
            token_file=env.get("ARCTIC_RL_TOKEN_FILE") or None,
            ray_address=env.get("ARCTIC_RL_RAY_ADDRESS") or None,
            service_name=env.get("ARCTIC_RL_SERVICE_NAME", "arctic_rl_service"),
        )

    def connect(self, model_name: str) -> SyncArcticRLClient:
        """A blocking client on the running engines; its ``shutdown()`` leaves them running."""
        from arctic_rl.client import SyncArcticRLClient, attach_arctic_rl_client, create_arctic_rl_client
        from arctic_rl.config import ArcticRLClientConfig

        if self.protocol == "ray":
            client = attach_arctic_rl_client(
                ray_address=self.ray_address, service_name=self.service_name, blocking_calls=True
            )
        else:
            config = ArcticRLClientConfig(
                model_name=model_name, comm_protocol="http", host=self.host, port=self.port, token_file=self.token_file
            )
            client = create_arctic_rl_client(config, blocking_calls=True)
        assert isinstance(client, SyncArcticRLClient)
        return client
