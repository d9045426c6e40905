"""Choosing the kernels behind ``backend='varlen'`` (CPU-side logic; the kernels themselves run on the GPU)."""

import pytest

from arctic_dedup.attention import varlen


def test_kernel_source_override_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(varlen.KERNEL_SOURCE_VARIABLE, "cudnn")
    assert varlen.varlen_kernel_source() == "cudnn"
    assert varlen._kernels() is varlen._TorchCudnn
    monkeypatch.setenv(varlen.KERNEL_SOURCE_VARIABLE, "flash")
    assert varlen.varlen_kernel_source() == "torch"
    assert varlen._kernels() is varlen._TorchFlash
    monkeypatch.delenv(varlen.KERNEL_SOURCE_VARIABLE)
    assert varlen.varlen_kernel_source() in ("torch", "flash_attn")


def test_unknown_kernel_source_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(varlen.KERNEL_SOURCE_VARIABLE, "cutlass")
    with pytest.raises(ValueError, match="cudnn"):
        varlen.varlen_kernel_source()
