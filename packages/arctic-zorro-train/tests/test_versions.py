"""The transformers version guard: untested releases are refused unless the user opts in (the version simulated);
after the opt-in, the parity self-check on a tiny model of the architecture decides."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from zorro_cases import GRADIENT_BREAKS, break_gradient, fresh_model

from arctic_zorro_train import ZorroPatch, ZorroPatchError, apply_zorro, is_patched, parity, versions
from arctic_zorro_train.versions import ALLOW_UNTESTED_ENV, check_transformers_version

# The guard belongs to the per-release parity run (`nox -s zorro_transformers`).
pytestmark = pytest.mark.parity


@pytest.mark.parametrize("version", ["5.17.0", "5.19.0", "5.25.0", "5.25.1"])
def test_tested_versions_pass(version: str) -> None:
    assert check_transformers_version(False, version) is False


@pytest.mark.parametrize("version", ["5.16.2", "5.26.0", "6.0.0"])
def test_untested_version_is_refused_with_both_versions_named(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(
        ZorroPatchError, match=rf"transformers {version} is installed.*tested with transformers 5.17 to 5.25"
    ):
        check_transformers_version(None, version)


def test_apply_zorro_refuses_then_patches_after_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed_transformers", lambda: "5.99.0")
    monkeypatch.setattr(parity, "_SELF_CHECKS", {})
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


def _opt_in_under_an_untested_release(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Fake an untested transformers, opt in, empty the self-check cache; returns the check_parity calls."""
    monkeypatch.setattr(versions, "installed_transformers", lambda: "5.99.0")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(parity, "_SELF_CHECKS", {})
    calls: list[Any] = []
    original = parity.check_parity

    def counting(*args: Any, **kwargs: Any) -> parity.ParityReport:
        calls.append(kwargs.get("dtype", torch.float32))
        return original(*args, **kwargs)

    monkeypatch.setattr(parity, "check_parity", counting)
    return calls


def test_self_check_passes_on_the_real_code_once_per_config_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _opt_in_under_an_untested_release(monkeypatch)
    for _ in range(2):
        model = fresh_model("qwen3_5")
        with pytest.warns(UserWarning, match=r"5\.99\.0 is outside.*parity self-check on a tiny qwen3_5_text.*PASSED"):
            apply_zorro(model)
        assert is_patched(model)
    assert calls == [torch.float32]
    # Another config shape (grouped-query -> multi-head attention) is checked again.
    with pytest.warns(UserWarning, match="parity self-check"):
        apply_zorro(fresh_model("qwen3_5", num_key_value_heads=4))
    assert calls == [torch.float32, torch.float32]


@pytest.mark.parametrize("family", sorted(GRADIENT_BREAKS))
def test_self_check_refuses_a_wrong_gradient_path(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the deduplicated gradient deliberately wrong (forward exact), the opted-in patch is refused, naming the
    worst parameters: a self-check that did nothing would patch."""
    calls = _opt_in_under_an_untested_release(monkeypatch)
    break_gradient(monkeypatch, family)
    model = fresh_model(family)
    projection = "q_proj" if family == "qwen3" else "in_proj_qkv"
    with pytest.raises(ZorroPatchError, match=rf"parity self-check on a tiny {family}\S* model failed.*{projection}"):
        apply_zorro(model)
    assert not is_patched(model)
    # fp32 failed, and float64 (which fp32 rounding cannot fool) confirmed it.
    assert calls == [torch.float32, torch.float64]


def test_self_check_refuses_when_a_mode_switch_drops_the_patched_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #37 on any transformers: a ``train()`` / ``eval()`` switch drops the patched Gated DeltaNet forwards
    (what transformers 5.25's re-kernelization did) and the patch does not put them back: the self-check, which
    switches the patched model between eval and training mode, must refuse."""
    from transformers import PreTrainedModel

    calls = _opt_in_under_an_untested_release(monkeypatch)
    monkeypatch.setattr(ZorroPatch, "reinstall_layer_forwards", lambda self: None)
    original_train = PreTrainedModel.train

    def train_and_drop_gated_delta_forwards(self: Any, mode: bool = True) -> Any:
        result = original_train(self, mode)
        for module in self.modules():
            if type(module).__name__.endswith("GatedDeltaNet"):
                module.__dict__.pop("forward", None)
        return result

    monkeypatch.setattr(PreTrainedModel, "train", train_and_drop_gated_delta_forwards)
    model = fresh_model("qwen3_5")
    with pytest.raises(ZorroPatchError, match=r"parity self-check on a tiny qwen3_5\S* model failed"):
        apply_zorro(model)
    assert not is_patched(model)
    assert calls == [torch.float32, torch.float64]


def _fake_report(passed: bool, dtype: torch.dtype) -> parity.ParityReport:
    error = 1e-7 if passed else 3e-5
    return parity.ParityReport(
        model_type="qwen3",
        dtype=dtype,
        attn_implementation="eager",
        transformers_version="5.99.0",
        logprob_error=1e-7,
        entropy_error=1e-7,
        loss_error=0.0,
        parameters=(parity.ParameterParity("model.layers.0.linear_attn.A_log", error),),
        output_dtype=dtype,
    )


@pytest.mark.parametrize("float64_passes", [True, False])
def test_float64_decides_when_fp32_misses_the_bound(float64_passes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 rounding alone can cross 1e-5 on the Gated DeltaNet decay gradients; a float64 rerun then decides."""
    _opt_in_under_an_untested_release(monkeypatch)
    reports = {
        torch.float32: _fake_report(False, torch.float32),
        torch.float64: _fake_report(float64_passes, torch.float64),
    }
    monkeypatch.setattr(parity, "check_parity", lambda model, **kwargs: reports[kwargs.get("dtype", torch.float32)])
    model = fresh_model("qwen3")
    if float64_passes:
        with pytest.warns(UserWarning, match="float64.*PASSED"):
            apply_zorro(model)
        assert is_patched(model)
    else:
        with pytest.raises(ZorroPatchError, match=r"A_log 3\.00e-05"):
            apply_zorro(model)
        assert not is_patched(model)


def test_self_check_that_cannot_run_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    _opt_in_under_an_untested_release(monkeypatch)

    def crashing(model: Any, **kwargs: Any) -> parity.ParityReport:
        raise TypeError("forward() got an unexpected keyword argument 'cache_position'")

    monkeypatch.setattr(parity, "check_parity", crashing)
    model = fresh_model("qwen3")
    with pytest.raises(ZorroPatchError, match=r"could not run under it.*cache_position.*pip install"):
        apply_zorro(model)
    assert not is_patched(model)


def test_tested_release_runs_no_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _opt_in_under_an_untested_release(monkeypatch)
    monkeypatch.setattr(versions, "installed_transformers", lambda: "5.19.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_zorro(fresh_model("qwen3"))
    assert calls == []
