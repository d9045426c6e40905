"""Per-layer overhead of the deduplicated path over plain transformers: no gradient that is zero-filled and copied
into (``x[0]``'s backward), and FlexAttention's output gradient arrives with the strides its compiled backward
traced, so AOTAutograd does not copy it (see benchmarks/results/zorro_profile_notes.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from arctic_dedup.attention.flex import _from_flex_layout, _to_flex_layout
from arctic_zorro_train import apply_zorro, plan_batch, zorro_forward
from arctic_zorro_train.testing import build_model, tiny_config


class _OurSelectBackwards(TorchDispatchMode):
    """Records the forward call sites (under anomaly mode) of the ``select_backward`` ops that backward runs for
    selects made in this project's code (transformers' own kernels make some too, as in a plain run)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ == "select_backward":
            node = torch._C._current_autograd_node()
            stack = [] if node is None else node.metadata.get("traceback_", [])
            frames = [line for entry in stack for line in entry.splitlines() if line.strip().startswith("File")]
            user = [line for line in frames if "/torch/" not in line and "_pytest" not in line and "pluggy" not in line]
            if user and ("arctic_zorro_train" in user[-1] or "arctic_dedup" in user[-1]):
                self.sites.append(user[-1].strip())
        return func(*args, **(kwargs or {}))


# Anomaly mode is what records each autograd node's forward call site; torch warns whenever it is switched on.
@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled:UserWarning")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_dedup_backward_has_no_select_backward(family: str) -> None:
    model = build_model(tiny_config(family), attn_implementation="sdpa")
    apply_zorro(model, patch_forward=False, attention_backend="reference")
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (3, 20))
    ids[:, :12] = ids[0, :12].clone()
    mask = torch.ones_like(ids)
    plan = plan_batch(ids, 8, mask, mask.cumsum(-1) - 1)
    counter = _OurSelectBackwards()
    with torch.autograd.detect_anomaly(check_nan=False):
        output = zorro_forward(model, plan)
        with counter:
            output.logprobs.sum().backward()
    assert counter.sites == []


@pytest.mark.parametrize("num_tokens, padded_length", [(256, 256), (200, 256)])
def test_flex_output_gradient_has_the_output_strides(num_tokens: int, padded_length: int) -> None:
    # HF hands q over as proj(h).view(1, T, H, D).transpose(1, 2); zorro_attention makes it [T, H, D].
    heads, head_dim = 4, 16
    query = torch.randn(1, num_tokens, heads, head_dim).transpose(1, 2).squeeze(0).transpose(0, 1)
    flex_query = _to_flex_layout(query, padded_length)
    # FlexAttention lays its output out like the query (for a dense query: the query's own strides).
    out = torch.empty_like(flex_query).normal_().requires_grad_(True)
    assert out.stride() == flex_query.stride()
    seen: list[torch.Tensor] = []
    out.register_hook(seen.append)
    result = _from_flex_layout(out, num_tokens)
    assert result.shape == (num_tokens, heads, head_dim) and result.is_contiguous()
    # The attention output's gradient, as o_proj's backward hands it back: contiguous [T, H, D].
    result.backward(torch.randn(num_tokens, heads, head_dim))
    assert seen[0].stride() == out.stride()
