"""The transformers version guard: untested releases are refused unless the user opts in (the version simulated)."""

from __future__ import annotations

import warnings

import pytest
from zorro_cases import fresh_model

from arctic_zorro_train import ZorroPatchError, apply_zorro, is_patched, versions
from arctic_zorro_train.versions import ALLOW_UNTESTED_ENV, check_transformers_version


@pytest.mark.parametrize("version", ["5.17.0", "5.19.0", "5.25.0", "5.25.1"])
def test_tested_versions_pass(version: str) -> None:
    check_transformers_version(False, version)


@pytest.mark.parametrize("version", ["5.16.2", "5.26.0", "6.0.0"])
def test_untested_version_is_refused_with_both_versions_named(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(
        ZorroPatchError, match=rf"transformers {version} is installed.*tested with transformers 5.17 to 5.25"
    ):
        check_transformers_version(None, version)


def test_apply_zorro_refuses_then_patches_after_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed_transformers", lambda: "5.99.0")
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    model = fresh_model("qwen3")
    with pytest.raises(ZorroPatchError, match=r"5\.99\.0"):
        apply_zorro(model)
    assert not is_patched(model)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match="outside arctic-zorro-train's tested range"):
        apply_zorro(model)
    assert is_patched(model)


def test_patched_gated_delta_fallback_keeps_the_callers_cache_argument() -> None:
    """Without a zorro context the patched layer calls transformers' forward with the arguments as given (5.25
    renamed ``cache_params`` to ``cache`` and warns when both names arrive)."""
    import torch

    model = fresh_model("qwen3_5")
    apply_zorro(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model.model.layers[0].linear_attn(torch.randn(1, 5, 64))
