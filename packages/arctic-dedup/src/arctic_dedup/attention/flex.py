"""The ``flex`` backend: FlexAttention with a block mask built straight from the plan's block tables.

The plan's ``kv_visible_until`` classifies every 128x128 tile as skipped, partial or full with a few vectorized ops
(``_tables``, prepared once per plan in ``TreeAttentionMetadata``), so the ``BlockMask`` comes from
``BlockMask.from_kv_blocks`` (no dense mask, no ``create_block_mask`` sweep) and the ``mask_mod`` only reads
``kv_visible_until`` (and the logical positions for a sliding window).

Compilation: the block mask is built inside the compiled region from tensors passed as arguments, so a new plan
with the same padded length reuses the compiled code. The packed length is padded up to a bucket (four per octave,
multiples of 128) so that a new batch of lengths rarely recompiles; padded queries see nothing and padded keys are
seen by nobody, and their rows are cut off before returning.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from arctic_dedup.attention.metadata import FLEX_BLOCK_SIZE, TreeAttentionMetadata

__all__ = ["FLEX_BLOCK_SIZE", "flex_padded_length", "flex_tree_attention"]

# Shape classes compiled per process before dynamo gives up: four buckets per octave from 128 tokens to 1M tokens.
_RECOMPILE_LIMIT = 64

_compiled_core: Callable[..., Any] | None = None


def flex_padded_length(num_tokens: int) -> int:
    """The bucket a packed length is padded to: a multiple of 128 and of an eighth of the enclosing power of two
    (so at most 25% padding above 1024 tokens and at most four shape classes per octave)."""
    block = FLEX_BLOCK_SIZE
    if num_tokens <= 8 * block:
        return max(block, -(-num_tokens // block) * block)
    granule = max(block, 1 << (num_tokens.bit_length() - 3))
    return -(-num_tokens // granule) * granule


def _has_return_aux() -> bool:
    """Whether this torch's ``flex_attention`` takes ``return_aux`` (``return_lse`` is deprecated there)."""
    from torch.nn.attention.flex_attention import flex_attention

    return "return_aux" in inspect.signature(flex_attention).parameters


def _flex_core(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    full_kv_num_blocks: torch.Tensor,
    full_kv_indices: torch.Tensor,
    kv_visible_until: torch.Tensor,
    position_ids: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    return_lse: bool,
    use_return_aux: bool,
) -> Any:
    """``[1, H, Tp, D]`` inputs, padded; builds the block mask and calls FlexAttention (compiled or eager)."""
    from torch.nn.attention import flex_attention as flex_module

    padded_length = query.shape[2]

    def mask_mod(batch: torch.Tensor, head: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        visible = (k_index <= q_index) & (q_index < kv_visible_until[k_index])
        if sliding_window is not None:
            visible = visible & (position_ids[q_index] - position_ids[k_index] < sliding_window)
        return visible

    score_mod = None
    if softcap is not None:
        cap = softcap

        def score_mod(
            score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor
        ) -> torch.Tensor:
            return cap * torch.tanh(score / cap)

    aux_kwargs: dict[str, Any] = {"return_lse": return_lse}
    if use_return_aux:
        aux_kwargs = {"return_aux": flex_module.AuxRequest(lse=True) if return_lse else None}
    block_mask = flex_module.BlockMask.from_kv_blocks(
        kv_num_blocks[None, None],
        kv_indices[None, None],
        full_kv_num_blocks[None, None],
        full_kv_indices[None, None],
        BLOCK_SIZE=FLEX_BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=(padded_length, padded_length),
    )
    return flex_module.flex_attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
        **aux_kwargs,
    )


def _core(compiled: bool) -> Callable[..., Any]:
    global _compiled_core
    if not compiled:
        return _flex_core
    if _compiled_core is None:
        _compiled_core = torch.compile(_flex_core, dynamic=False, fullgraph=True)
    return _compiled_core


@contextlib.contextmanager
def _recompile_limit(limit: int) -> Iterator[None]:
    """Let dynamo compile one variant per length bucket (its default limit of 8 would fall back to eager)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name, limit) >= limit:
        yield
        return
    with config.patch({name: limit}):
        yield


def _pad_table(counts: torch.Tensor, indices: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = indices.shape
    if rows == cols == num_blocks:  # F.pad by nothing would still copy, once per layer
        return counts.contiguous(), indices.contiguous()
    counts = F.pad(counts, (0, num_blocks - rows))
    indices = F.pad(indices, (0, num_blocks - cols, 0, num_blocks - rows))
    return counts.contiguous(), indices.contiguous()


def _pad_tokens(values: torch.Tensor, padded_length: int) -> torch.Tensor:
    """``[T]`` -> int32 ``[Tp]``, zero-padded (no copy when it is int32 already and needs no padding)."""
    values = values.to(torch.int32)
    extra = padded_length - values.shape[0]
    return F.pad(values, (0, extra)) if extra else values


def _to_flex_layout(tensor: torch.Tensor, padded_length: int) -> torch.Tensor:
    """``[T, H, D]`` -> ``[1, H, Tp, D]`` (a view when no padding is needed).

    unsqueeze, then transpose: the size-1 batch dim then gets the outermost stride, so FlexAttention's output (laid
    out like the query) has exactly the strides of the gradient ``_from_flex_layout``'s backward hands it, and the
    compiled backward takes that gradient as it is instead of copying it to the strides it traced.
    """
    extra = padded_length - tensor.shape[0]
    if extra:
        tensor = F.pad(tensor, (0, 0, 0, 0, 0, extra))
    return tensor.unsqueeze(0).transpose(1, 2)


def _from_flex_layout(tensor: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[1, H, Tp, ...]`` -> ``[T, H, ...]``: views only, contiguous for a query-like output. Neither ``tensor[0]``
    nor a slice that keeps everything: their backwards zero-fill a gradient of the input's size and copy into it."""
    tensor = tensor.transpose(1, 2).squeeze(0)
    if tensor.shape[0] != num_tokens:
        tensor = tensor[:num_tokens]
    return tensor.contiguous()


def flex_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: TreeAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = True,
    compile: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlexAttention over the plan: ``[T, Hq, D]``, ``[T, Hkv, D]`` -> (out ``[T, Hq, D]``, lse ``[T, Hq]`` or None).

    ``metadata``: ``prepare_tree_attention(plan, backends=("flex",), ...)`` covering ``sliding_window``.
    ``compile`` defaults to True on CUDA. On CPU torch refuses FlexAttention's backward and its compiled path does
    not return the log-sum-exp, so CPU runs eagerly (torch's unfused math path) unless told otherwise.
    """
    if query.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise NotImplementedError(
            "backend='flex' cannot differentiate on CPU (torch refuses FlexAttention's backward there). Use "
            "backend='reference' for small CPU inputs, or run on a GPU."
        )
    if compile is None:
        compile = query.is_cuda
    num_tokens = query.shape[0]
    padded_length = flex_padded_length(num_tokens)
    num_blocks = padded_length // FLEX_BLOCK_SIZE
    plan = metadata.plan
    # 128x128 tables whose full blocks never reach past T: the inputs are padded, so a block FlexAttention treats
    # as full would otherwise see padded keys without its mask function.
    tables = metadata.tables(FLEX_BLOCK_SIZE, FLEX_BLOCK_SIZE, sliding_window)
    kv_num, kv_idx = _pad_table(tables.kv_part_num, tables.kv_part_indices, num_blocks)
    full_num, full_idx = _pad_table(tables.kv_full_num, tables.kv_full_indices, num_blocks)
    # Padded keys get 0: no query index is below it, so nobody sees them.
    until = _pad_tokens(plan.kv_visible_until, padded_length)
    positions = _pad_tokens(plan.position_ids, padded_length)
    core = _core(compile)
    with _recompile_limit(_RECOMPILE_LIMIT), warnings.catch_warnings():
        # Eager use is deliberate here (CPU); torch's advice to compile does not apply.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        result = core(
            _to_flex_layout(query, padded_length),
            _to_flex_layout(key, padded_length),
            _to_flex_layout(value, padded_length),
            kv_num,
            kv_idx,
            full_num,
            full_idx,
            until,
            positions,
            float(scale),
            sliding_window,
            None if softcap is None else float(softcap),
            return_lse,
            _has_return_aux(),
        )
    if not return_lse:
        return _from_flex_layout(result, num_tokens), None
    out, aux = result
    lse = aux if isinstance(aux, torch.Tensor) else aux.lse
    return _from_flex_layout(out, num_tokens), lse[0, :, :num_tokens].transpose(0, 1).float()
