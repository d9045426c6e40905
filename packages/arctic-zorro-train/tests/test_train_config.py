"""``ZorroTrainConfig``: ``enable`` plus one ``ZorroSettings``, built from keywords, a settings object or a mapping."""

from __future__ import annotations

import dataclasses

import pytest

from arctic_zorro_train import ZorroTrainConfig
from arctic_zorro_train.deepspeed_hook import _zorro_section
from arctic_zorro_train.settings import ZorroSettings


def test_keyword_options_build_the_settings() -> None:
    config = ZorroTrainConfig(enable=True, logits_mode="memory", response_length=6)
    assert config.enable
    assert config.settings == ZorroSettings(logits_mode="memory", response_length=6)
    assert config == ZorroTrainConfig(enable=True, settings=ZorroSettings(logits_mode="memory", response_length=6))


def test_defaults_are_disabled_with_default_settings() -> None:
    assert ZorroTrainConfig() == ZorroTrainConfig(enable=False, settings=ZorroSettings())
    assert not ZorroTrainConfig().enable


def test_engine_config_mapping_and_nested_settings_mapping() -> None:
    section = {"enable": True, "response_length": 6, "logits_mode": "memory"}
    expected = ZorroTrainConfig(enable=True, settings=ZorroSettings(response_length=6, logits_mode="memory"))
    assert _zorro_section({"zorro_train": section}) == expected
    assert ZorroTrainConfig.from_mapping(section) == expected
    nested = {"enable": True, "settings": {"response_length": 6, "logits_mode": "memory"}}
    assert ZorroTrainConfig.from_mapping(nested) == expected


def test_unknown_options_are_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown zorro_train option\(s\) \['bogus'\].*logits_mode"):
        ZorroTrainConfig.from_mapping({"enable": True, "bogus": 1})
    with pytest.raises(ValueError, match="not both"):
        ZorroTrainConfig(settings=ZorroSettings(), logits_mode="memory")
    with pytest.raises(ValueError, match="logits_mode must be one of"):
        ZorroTrainConfig(logits_mode="nonsense")


def test_frozen_and_replaceable() -> None:
    config = ZorroTrainConfig(enable=True, temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.enable = False  # type: ignore[misc]
    assert dataclasses.replace(config, enable=False).settings.temperature == 0.5
