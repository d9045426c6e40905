"""The ``varlen`` backend on cuDNN's ragged SDPA kernels (``ARCTIC_VARLEN_KERNELS=cudnn``): bf16 outputs and
gradients within the reference's own bf16 noise on the GPU cases the other backends pass. Run by ``nox -s
gpu_tests``."""

from __future__ import annotations

import pytest
import torch
from test_tree_attention_gpu import _check_bf16, _plans

from arctic_dedup.attention import varlen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _cudnn_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(varlen.KERNEL_SOURCE_VARIABLE, "cudnn")
    if not varlen.varlen_available():
        pytest.skip("this torch build has no cuDNN attention")


@pytest.mark.parametrize("case", list(_plans()))
def test_gpu_varlen_cudnn_bf16(case: str) -> None:
    assert varlen.varlen_kernel_source() == "cudnn"
    _check_bf16(_plans()[case](), "varlen")


@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 8, 64), (8, 1, 256)])
def test_gpu_varlen_cudnn_head_dims_and_groups(heads: tuple[int, int, int]) -> None:
    _check_bf16(_plans()["deep_trie"](), "varlen", heads=heads)
