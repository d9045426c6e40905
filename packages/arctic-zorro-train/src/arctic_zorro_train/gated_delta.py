"""Gated DeltaNet (linear attention) over a prefix tree: each node runs once, children start from the parent's state.

Two pieces of state cross a node boundary:

* the conv tail: the depthwise causal conv of width ``K`` reads the ``K - 1`` previous tokens *along the sample's
  path*, which for the first tokens of a node are its ancestors' last tokens (possibly several ancestors up when a
  node is shorter than ``K - 1``). The conv runs once over the packed stream and only the first ``K - 1`` tokens of
  every node are recomputed from their path predecessors (``GatedDeltaSchedule.fix_lags``);
* the recurrent state: nodes run level by level (roots first), each level as one batch whose initial states are
  the parents' final states. Feeding the same parent state to every child makes autograd sum the children's
  gradients into it, which is the exact gradient of the shared prefix.

The chunked kernel is flash-linear-attention's ``chunk_gated_delta_rule`` (varlen) on CUDA when it is installed,
and transformers' torch fallback otherwise (nodes right-padded to the level's longest node with ``beta = 0`` and
``g = 0``, which leaves the state untouched, so the final states stay exact).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from arctic_dedup import Plan
from arctic_zorro_train.families import GatedDeltaInputs
from arctic_zorro_train.kernels.reference import causal_depthwise_conv_reference

__all__ = [
    "GatedDeltaLevel",
    "GatedDeltaSchedule",
    "build_gated_delta_schedule",
    "gated_delta_tree_forward",
    "tree_causal_conv",
    "tree_gated_delta_rule",
]


@dataclass(frozen=True)
class GatedDeltaLevel:
    """The nodes at one depth. ``m`` nodes, ``n`` tokens.

    token_index ``[n]``: packed positions, node after node; cu_seqlens ``[m+1]`` over them; padded_index
    ``[m * max_length]``: the same positions right-padded per node with -1, and padded_rows ``[n]`` the rows of
    ``padded_index`` that are not padding; parent_row ``[m]``: the row of each node's parent among the previous
    level's nodes (None for the roots); contiguous_start: where ``token_index`` starts when it is one contiguous
    range of packed positions (the nodes sit side by side in the stream), else None, so the level reads a slice
    instead of gathering a copy.
    """

    token_index: torch.Tensor
    cu_seqlens: torch.Tensor
    padded_index: torch.Tensor
    padded_rows: torch.Tensor
    max_length: int
    parent_row: torch.Tensor | None
    contiguous_start: int | None = None

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """The level's tokens of ``x`` ``[T, ...]``, node after node: a slice when they are contiguous."""
        if self.contiguous_start is not None:
            return x[self.contiguous_start : self.contiguous_start + self.token_index.shape[0]]
        return x.index_select(0, self.token_index)

    @property
    def num_nodes(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1


@dataclass(frozen=True)
class GatedDeltaSchedule:
    """Everything a Gated DeltaNet layer needs from the plan, built once per micro-batch.

    fix_index ``[F]``: packed positions whose conv window reaches past their node's start; fix_lags ``[F, K]``:
    column ``L`` is the packed position ``L`` steps earlier along the path (-1 before the sample's start);
    levels: nodes by depth; level_order_inverse ``[T]``: where each packed token sits in the concatenation of the
    levels' ``token_index``; level_order_is_packed_order: that concatenation is the packed order itself (one prompt
    group, or no sharing), so the outputs need no reordering.
    """

    conv_width: int
    fix_index: torch.Tensor
    fix_lags: torch.Tensor
    levels: tuple[GatedDeltaLevel, ...]
    level_order_inverse: torch.Tensor
    level_order_is_packed_order: bool = False


def _ranges(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[m * width]``: row ``i`` holds ``starts[i] + j`` for ``j < lengths[i]`` and -1 after."""
    column = torch.arange(width, device=starts.device)
    rows = starts[:, None] + column[None, :]
    return torch.where(column[None, :] < lengths[:, None], rows, -1).reshape(-1)


def build_gated_delta_schedule(plan: Plan, conv_width: int) -> GatedDeltaSchedule:
    """Build the schedule (a few host syncs for the level sizes; nothing inside the layers syncs)."""
    tree = plan.tree
    device = plan.device
    num_tokens = plan.num_packed_tokens
    packed = torch.arange(num_tokens, device=device)
    node = plan.token_node
    node_start = tree.node_start[node]
    parent = tree.node_parent[node]
    parent_clamped = parent.clamp_min(0)
    parent_last = tree.node_start[parent_clamped] + tree.node_length[parent_clamped] - 1
    # The previous token along the sample's path: inside a node the previous packed token, at a node start the
    # parent's last token, at a root start nothing.
    path_previous = torch.where(packed == node_start, torch.where(parent >= 0, parent_last, -1), packed - 1)
    fix_index = torch.nonzero(packed - node_start < conv_width - 1).squeeze(1)
    lags = [fix_index]
    for _ in range(conv_width - 1):
        previous = lags[-1]
        lags.append(torch.where(previous >= 0, path_previous[previous.clamp_min(0)], -1))
    fix_lags = torch.stack(lags, dim=1)

    offsets = tree.level_offsets.tolist()
    row_in_level = torch.zeros(tree.num_nodes, dtype=torch.long, device=device)
    levels: list[GatedDeltaLevel] = []
    for depth in range(tree.num_levels):
        nodes = tree.level_nodes[offsets[depth] : offsets[depth + 1]]
        lengths = tree.node_length[nodes]
        starts = tree.node_start[nodes]
        max_length = int(lengths.max())
        cu_seqlens = torch.zeros(nodes.numel() + 1, dtype=torch.long, device=device)
        cu_seqlens[1:] = lengths.cumsum(0)
        padded_index = _ranges(starts, lengths, max_length)
        parent_row = None if depth == 0 else row_in_level[tree.node_parent[nodes]]
        row_in_level[nodes] = torch.arange(nodes.numel(), device=device)
        padded_rows = torch.nonzero(padded_index >= 0).squeeze(1)
        token_index = padded_index[padded_rows]
        first = int(token_index[0]) if token_index.numel() else 0
        contiguous = bool((token_index == first + torch.arange(token_index.numel(), device=device)).all())
        levels.append(
            GatedDeltaLevel(
                token_index=token_index,
                cu_seqlens=cu_seqlens,
                padded_index=padded_index,
                padded_rows=padded_rows,
                max_length=max_length,
                parent_row=parent_row,
                contiguous_start=first if contiguous else None,
            )
        )
    order = torch.cat([level.token_index for level in levels])
    inverse = torch.empty_like(order)
    inverse[order] = packed
    return GatedDeltaSchedule(
        conv_width=conv_width,
        fix_index=fix_index,
        fix_lags=fix_lags,
        levels=tuple(levels),
        level_order_inverse=inverse,
        level_order_is_packed_order=bool((order == packed).all()),
    )


def tree_causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    schedule: GatedDeltaSchedule,
    *,
    fused: bool = False,
) -> torch.Tensor:
    """Depthwise causal conv along every sample's path. x ``[T, C]``, weight ``[C, K]`` -> ``[T, C]`` (no activation).

    Matches ``F.conv1d`` with left padding ``K - 1`` on each sample's own sequence. ``fused``: the whole-stream conv
    runs as ``arctic_zorro_train.kernels.causal_conv`` on the ``[T, C]`` layout (no transposed copies).
    """
    channels = x.shape[1]
    width = weight.shape[1]
    if width != schedule.conv_width:
        raise ValueError(f"the conv has width {width} but the schedule was built for {schedule.conv_width}.")
    x = x.to(weight.dtype)
    if fused:
        from arctic_zorro_train.kernels.causal_conv import causal_depthwise_conv

        whole = causal_depthwise_conv(x, weight, bias)
    else:
        whole = causal_depthwise_conv_reference(x, weight, bias)
    lags = schedule.fix_lags
    window = x.index_select(0, lags.clamp_min(0).reshape(-1)).view(lags.shape[0], width, channels)
    window = window * (lags >= 0).unsqueeze(-1).to(window.dtype)
    # Lag L multiplies weight column K - 1 - L (conv1d is a cross-correlation over the last K inputs).
    fixed = torch.einsum("flc,cl->fc", window, weight.flip(1))
    if bias is not None:
        fixed = fixed + bias
    return whole.index_copy(0, schedule.fix_index, fixed)


@functools.cache
def _fla_installed() -> bool:  # looked up once: every Gated DeltaNet layer asks on every call
    return importlib.util.find_spec("fla") is not None


def fla_unusable_reason(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why fla's gated chunk kernels cannot train in ``dtype`` on ``device`` here, or None when they can.

    Decided once per device and dtype by running fla's ``chunk_gated_delta_rule`` forward and backward on a tiny
    input: fla refuses some setups outright (the gated backward on Hopper with Triton >= 3.4 and < 3.7.1 without
    its TileLang backend, fla issue #640: measured on the H200 with Triton 3.6 in bf16 and fp32 alike), and that
    refusal only surfaces inside the backward pass, too late to fall back.
    """
    if not _fla_installed():
        return "flash-linear-attention is not installed (install `arctic-zorro-train[fla]`)"
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _fla_probe(index, dtype)


@contextlib.contextmanager
def isolated_autograd() -> Iterator[None]:
    """A private autograd scope for a forward + backward run inside a layer's forward (fla's probe at first use).

    Gradients on even under ``torch.no_grad()`` (a log-prob forward), and identity saved-tensor hooks on top of the
    caller's, so a non-reentrant gradient checkpoint around the layer neither stores the probe's tensors nor
    recomputes for them: without this, the probe's backward inside a checkpointed forward unpacked through the
    checkpoint's hooks, the probe failed and the recomputation saved other tensors than the forward.
    """
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same_tensor, _same_tensor):
        yield


def _same_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@functools.cache
def _fla_probe(device_index: int, dtype: torch.dtype) -> str | None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    generator = torch.Generator(device=f"cuda:{device_index}").manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        values = torch.randn(*shape, device=f"cuda:{device_index}", generator=generator)
        return values.to(dtype).requires_grad_(True)

    # Two value heads per query/key head: the grouped layout the layers pass.
    q, k, v = tensor(1, 64, 1, 64), tensor(1, 64, 1, 64), tensor(1, 64, 2, 64)
    g = (-torch.rand(1, 64, 2, device=f"cuda:{device_index}", generator=generator)).requires_grad_(True)
    beta = torch.rand(1, 64, 2, device=f"cuda:{device_index}", generator=generator).to(dtype)
    try:
        with isolated_autograd():
            out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
            out.float().sum().backward()
    except Exception as error:  # fla's refusal (or any failure) means: use the torch kernel
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"fla's gated chunk kernels fail in {dtype} on this GPU/Triton ({first_line})"
    return None


def _fla_chunk_rule(device: torch.device, dtype: torch.dtype) -> Callable[..., Any] | None:
    reason = fla_unusable_reason(device, dtype)
    if reason is not None:
        warnings.warn(
            f"{reason}: Gated DeltaNet layers run transformers' torch kernel on CUDA (exact but slow).",
            stacklevel=3,
        )
        return None
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule  # type: ignore[no-any-return]


def _masked_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` at ``index``, zeros where ``index`` is -1."""
    rows = x.index_select(0, index.clamp_min(0))
    mask = (index >= 0).view(-1, *([1] * (x.dim() - 1)))
    return rows * mask.to(rows.dtype)


def tree_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    schedule: GatedDeltaSchedule,
    torch_chunk_rule: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
) -> torch.Tensor:
    """The gated delta rule over the tree. query/key ``[T, Hk, Dk]``, value ``[T, Hv, Dv]``, g/beta ``[T, Hv]``
    -> ``[T, Hv, Dv]``, ``Hv`` a multiple of ``Hk`` (value head ``i`` reads query/key head ``i // (Hv / Hk)``, as
    transformers' ``repeat_interleave`` does). q and k are L2-normalized inside (as transformers' Gated DeltaNet
    layers ask). fla's kernels take the grouped heads as they are (no expanded copies of q and k saved for the
    backward); the torch kernel gets them expanded."""
    if value.shape[1] % query.shape[1] != 0 or key.shape[1] != query.shape[1]:
        raise ValueError(
            f"value heads ({value.shape[1]}) must be a multiple of query/key heads ({query.shape[1]}/{key.shape[1]})."
        )
    fla_rule = _fla_chunk_rule(query.device, query.dtype) if query.is_cuda else None
    if fla_rule is None and value.shape[1] != query.shape[1]:
        heads_per_key = value.shape[1] // query.shape[1]
        query = query.repeat_interleave(heads_per_key, dim=1)
        key = key.repeat_interleave(heads_per_key, dim=1)
    outputs: list[torch.Tensor] = []
    final_states: torch.Tensor | None = None
    for level in schedule.levels:
        initial = None
        if level.parent_row is not None and final_states is not None:
            initial = final_states.index_select(0, level.parent_row)
        if fla_rule is not None:
            out, final_states = fla_rule(
                level.rows_of(query).unsqueeze(0),
                level.rows_of(key).unsqueeze(0),
                level.rows_of(value).unsqueeze(0),
                g=level.rows_of(g).unsqueeze(0),
                beta=level.rows_of(beta).unsqueeze(0),
                initial_state=initial,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=level.cu_seqlens,
            )
            outputs.append(out.squeeze(0))
            continue
        index = level.padded_index
        shape = (level.num_nodes, level.max_length)
        out, final_states = torch_chunk_rule(
            _masked_rows(query, index).view(*shape, *query.shape[1:]),
            _masked_rows(key, index).view(*shape, *key.shape[1:]),
            _masked_rows(value, index).view(*shape, *value.shape[1:]),
            g=_masked_rows(g, index).view(*shape, g.shape[1]),
            beta=_masked_rows(beta, index).view(*shape, beta.shape[1]),
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        outputs.append(out.reshape(-1, *out.shape[2:]).index_select(0, level.padded_rows))
    joined = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    if schedule.level_order_is_packed_order:
        return joined
    return joined.index_select(0, schedule.level_order_inverse)


def _torch_chunk_rule_for(module: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    modeling = sys.modules[type(module).__module__]
    rule = getattr(modeling, "torch_chunk_gated_delta_rule", None)
    if rule is None:
        raise RuntimeError(
            f"{type(module).__module__} has no `torch_chunk_gated_delta_rule`; this transformers version is not "
            "supported by arctic-zorro-train's Gated DeltaNet path (tested with transformers 5.17-5.25)."
        )
    # transformers wraps this function so that it calls fla when fla is importable
    # (``use_kernel_func_from_hub_with_fallback``); the torch kernel is the wrapped function. With `kernels` installed
    # (a dependency of transformers 5.25) that wrapper is turned into a module instance whose forward calls it.
    if isinstance(rule, torch.nn.Module):
        cells = type(rule).forward.__closure__ or ()
        functions = [cell.cell_contents for cell in cells if inspect.isfunction(cell.cell_contents)]
        rule = functions[0] if len(functions) == 1 else rule
    torch_rule = inspect.unwrap(rule)
    if not inspect.isfunction(torch_rule) or torch_rule.__name__ != "torch_chunk_gated_delta_rule":
        raise RuntimeError(
            f"{type(module).__module__}.torch_chunk_gated_delta_rule is a {type(rule).__name__} that does not lead to "
            "transformers' torch kernel; this transformers/kernels version is not supported by arctic-zorro-train's "
            "Gated DeltaNet path (tested with transformers 5.17-5.25)."
        )
    return torch_rule  # type: ignore[no-any-return]


def gated_delta_tree_forward(
    module: Any,
    hidden_states: torch.Tensor,
    schedule: GatedDeltaSchedule,
    projections: Callable[[Any, torch.Tensor], GatedDeltaInputs],
    *,
    fused_conv: bool = False,
) -> torch.Tensor:
    """A transformers Gated DeltaNet layer's forward over the packed stream ``[1, T, hidden]`` -> ``[1, T, hidden]``.

    The activation runs on each of q, k and v separately, so each comes out contiguous (fla's kernels would copy
    the strided views of one activated tensor; the split's backward is one concatenation either way)."""
    from transformers.activations import ACT2FN

    num_tokens = hidden_states.shape[1]
    inputs = projections(module, hidden_states)
    conv = module.conv1d
    mixed = tree_causal_conv(inputs.mixed_qkv, conv.weight.squeeze(1), conv.bias, schedule, fused=fused_conv)
    activation = ACT2FN[module.activation]
    parts = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query, key, value = (activation(part).to(hidden_states.dtype) for part in parts)
    query = query.reshape(num_tokens, -1, module.head_k_dim)
    key = key.reshape(num_tokens, -1, module.head_k_dim)
    value = value.reshape(num_tokens, -1, module.head_v_dim)
    beta = inputs.b.sigmoid()
    # transformers' own formula, casts included (fp32: with fp16/bf16 weights exp(A_log) could overflow), so the
    # deduplicated run rounds where the plain run does, in every dtype.
    g = -module.A_log.float().exp() * F.softplus(inputs.a.float() + module.dt_bias)
    core = tree_gated_delta_rule(query, key, value, g, beta, schedule, _torch_chunk_rule_for(module))
    core = core.to(hidden_states.dtype)
    gated = module.norm(core.reshape(-1, module.head_v_dim), inputs.z.reshape(-1, module.head_v_dim))
    return module.out_proj(gated.reshape(1, num_tokens, -1))  # type: ignore[no-any-return]
