"""The typed knobs, the environment switch, the version check and the exported names (no vLLM needed)."""

from __future__ import annotations

import dataclasses

import pytest

import arctic_fca
from arctic_dedup.forest import ForestGrouping
from arctic_fca import FcaConfig, check_vllm_version


def test_exported_names_and_version() -> None:
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert arctic_fca.__version__ == pyproject["project"]["version"]
    assert sorted(arctic_fca.__all__) == sorted(
        [
            "TESTED_VLLM_VERSIONS",
            "FcaConfig",
            "FcaStats",
            "FcaWorkerExtension",
            "__version__",
            "check_vllm_version",
            "collect_stats",
            "flush_stats",
            "get_stats",
            "is_active",
            "register",
            "reset_stats",
            "reset_worker_stats",
            "set_active",
        ]
    )


def test_importing_the_package_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = (
        "import sys, arctic_fca, arctic_dedup; assert 'vllm' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    # Every knob's variable, including ones an engine fixture of this session may have set.
    for name in [name for name in os.environ if name == "ARCTIC_FCA" or name.startswith("ARCTIC_FCA_")]:
        monkeypatch.delenv(name, raising=False)
    assert FcaConfig.from_env() == FcaConfig()
    monkeypatch.setenv("ARCTIC_FCA", "1")
    monkeypatch.setenv("ARCTIC_FCA_MAX_QUERY_LEN", "4")
    monkeypatch.setenv("ARCTIC_FCA_MIN_GROUP_SIZE", "3")
    monkeypatch.setenv("ARCTIC_FCA_MIN_ADDITIONAL_PREFIX_BLOCKS", "2")
    monkeypatch.setenv("ARCTIC_FCA_MIN_NON_SINGLETON_FRACTION", "0.5")
    monkeypatch.setenv("ARCTIC_FCA_MAX_NON_SINGLETON_GROUPS", "7")
    config = FcaConfig.from_env()
    assert config == FcaConfig(True, 4, 3, 2, 0.5, 7)
    grouping = config.grouping()
    assert grouping == ForestGrouping(3, 2, 0.5, 7)
    assert FcaConfig().grouping() == ForestGrouping(max_non_singleton_groups=0)


def test_every_grouping_knob_has_the_same_name_and_default_in_forest_grouping() -> None:
    """One name and one meaning from arctic-rl's ``fca`` section through FcaConfig to the planner's rules."""
    grouping_fields = {field.name: field.default for field in dataclasses.fields(ForestGrouping)}
    config_fields = {field.name: field.default for field in dataclasses.fields(FcaConfig)}
    assert grouping_fields.items() <= config_fields.items()
    assert FcaConfig(max_non_singleton_groups=3).grouping().max_non_singleton_groups == 3


def test_bad_values_say_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCTIC_FCA_MIN_GROUP_SIZE", "many")
    with pytest.raises(ValueError, match="ARCTIC_FCA_MIN_GROUP_SIZE"):
        FcaConfig.from_env()
    with pytest.raises(ValueError, match="max_query_len"):
        FcaConfig(max_query_len=0)
    with pytest.raises(ValueError, match="min_group_size"):
        FcaConfig(min_group_size=1)


def test_version_check(monkeypatch: pytest.MonkeyPatch) -> None:
    for version in ("0.26.0", "0.29.1", "0.32.0", "0.33.0+cu130"):
        check_vllm_version(version)
    for version in ("0.25.2", "0.34.0", "0.40.1", "1.0.0", "dev"):
        with pytest.raises(RuntimeError, match=r"0\.26 through 0\.33.*arctic-fca\[vllm\]"):
            check_vllm_version(version)
    monkeypatch.setenv("ARCTIC_FCA_ALLOW_UNTESTED_VLLM", "1")
    check_vllm_version("0.40.1")


def test_register_is_a_no_op_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from arctic_fca import plugin

    monkeypatch.setattr(plugin, "_registered", False)
    # vLLM made unimportable: registering would have to import it, so an attempt fails loudly here.
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)
    for switch in (None, "0", "false"):
        if switch is None:
            monkeypatch.delenv("ARCTIC_FCA", raising=False)
        else:
            monkeypatch.setenv("ARCTIC_FCA", switch)
        arctic_fca.register()
        arctic_fca.register()
        assert not plugin._registered
    # The same call with the switch on does reach vLLM (so the calls above would have failed had they tried).
    monkeypatch.setenv("ARCTIC_FCA", "1")
    with pytest.raises(ImportError, match=r"arctic-fca\[vllm\]"):
        arctic_fca.register()
    assert not plugin._registered


def test_enabled_is_the_deprecated_name_of_enable() -> None:
    with pytest.warns(DeprecationWarning, match="renamed FcaConfig.enable"):
        assert FcaConfig(enable=True).enabled
    assert "enabled" not in repr(FcaConfig())
