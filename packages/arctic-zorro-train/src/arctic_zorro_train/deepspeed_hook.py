"""Installing zorro-train inside the DeepSpeed engines when ``zorro_train.enable`` is set.

The training and log-prob engines call ``install_zorro_for_deepspeed(engine_or_model, config)`` once, after
``deepspeed.initialize`` (or before it, on the bare model). Patching only touches module attributes, so it works
under every ZeRO stage; under ZeRO-3 the parameters that zorro-train reads outside their own module's forward
(Gated DeltaNet conv weights, the LM head weight for fp32 logits) are registered as external parameters so that
DeepSpeed gathers them when the reading module runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from arctic_zorro_train.errors import MissingDependencyError
from arctic_zorro_train.patching import ZorroPatch, apply_zorro
from arctic_zorro_train.settings import ZorroSettings

__all__ = ["ZorroTrainConfig", "install_zorro_for_deepspeed"]


_SETTINGS_OPTIONS = frozenset(option.name for option in fields(ZorroSettings))


def _settings_from(options: Mapping[str, Any]) -> ZorroSettings:
    unknown = set(options) - _SETTINGS_OPTIONS
    if unknown:
        raise ValueError(
            f"unknown zorro_train option(s) {sorted(unknown)}; known options: "
            f"{sorted(_SETTINGS_OPTIONS | {'enable', 'settings'})}."
        )
    return ZorroSettings(**options)


@dataclass(frozen=True, init=False)
class ZorroTrainConfig:
    """The ``zorro_train`` section of an engine config: ``enable`` turns the patch on, ``settings`` is how the
    patched model runs.

    The settings' options are also accepted as keywords, as in the engine config's mapping:
    ``ZorroTrainConfig(enable=True, logits_mode="memory")`` equals ``ZorroTrainConfig(enable=True,
    settings=ZorroSettings(logits_mode="memory"))``.
    """

    enable: bool
    settings: ZorroSettings

    def __init__(
        self, enable: bool = False, settings: ZorroSettings | Mapping[str, Any] | None = None, **options: Any
    ) -> None:
        if settings is not None and options:
            raise ValueError(
                f"pass either settings=ZorroSettings(...) or its options as keywords ({sorted(options)}), not both."
            )
        if not isinstance(settings, ZorroSettings):
            settings = _settings_from(options if settings is None else settings)
        object.__setattr__(self, "enable", enable)
        object.__setattr__(self, "settings", settings)

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> ZorroTrainConfig:
        """From the engine config's ``zorro_train`` mapping: ``enable`` and any ``ZorroSettings`` option."""
        return cls(**section)


def _zorro_section(config: ZorroTrainConfig | Mapping[str, Any] | None) -> ZorroTrainConfig:
    if config is None:
        return ZorroTrainConfig()
    if isinstance(config, ZorroTrainConfig):
        return config
    section = config.get("zorro_train", config) if isinstance(config, Mapping) else config
    if isinstance(section, ZorroTrainConfig):
        return section
    return ZorroTrainConfig.from_mapping(section)


def _is_zero3_partitioned(module: nn.Module) -> bool:
    return any(hasattr(parameter, "ds_id") for parameter in module.parameters())


def _register_external_parameters(patch: ZorroPatch) -> None:
    try:
        from deepspeed.runtime.zero import register_external_parameter
    except ImportError as error:
        raise MissingDependencyError(
            "the model's parameters are ZeRO-3 partitioned but deepspeed cannot be imported; install "
            "`arctic-zorro-train[deepspeed]`."
        ) from error
    for module in patch.linear_attention_modules:
        conv: Any = module.conv1d
        register_external_parameter(module, conv.weight)
    if patch.settings.fp32_logits:
        head: Any = patch.lm_head
        register_external_parameter(patch.model, head.weight)


def install_zorro_for_deepspeed(
    engine_or_model: Any, config: ZorroTrainConfig | Mapping[str, Any] | None
) -> ZorroPatch | None:
    """Patch the engine's model when ``zorro_train.enable`` is set; return the patch (None when disabled).

    ``config`` is a ``ZorroTrainConfig``, the ``zorro_train`` mapping, or a whole engine config holding one.
    Afterwards ``engine(input_ids=..., attention_mask=..., position_ids=..., responses=...)`` returns a
    ``ZorroOutput``. Idempotent.
    """
    section = _zorro_section(config)
    if not section.enable:
        return None
    model = getattr(engine_or_model, "module", engine_or_model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a DeepSpeed engine or an nn.Module, got {type(engine_or_model).__name__}.")
    patch = apply_zorro(model, settings=section.settings)
    if _is_zero3_partitioned(model):
        _register_external_parameters(patch)
    return patch
