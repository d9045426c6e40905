"""Gated DeltaNet over the tree: the conv tail and the recurrent state pass from parent to child exactly.

Op level: ``tree_causal_conv`` and ``tree_gated_delta_rule`` against running every sample's path on its own, with
transformers' chunked kernel and with the token-by-token float64 twin (forward and backward), for responses
shorter than the conv width, lengths that are not chunk multiples, and deep tries whose nodes are shorter than the
conv. Model level: prompts longer than one 64-token chunk. All in float64 (``float64_everywhere`` runs
transformers' chunked kernel in float64 too): the kernel's fp32 rounding depends on where its chunks fall, and the
decay parameters' gradients are sums with heavy cancellation, so in fp32 transformers does not reproduce itself to
1e-5 when only the chunk alignment moves; in float64 the tree and per-sample runs agree to about 1e-14.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from zorro_cases import TOLERANCE, Sample, compare_with_reference, float64_model, make_batch

from arctic_zorro_train import plan_batch
from arctic_zorro_train.gated_delta import build_gated_delta_schedule, tree_causal_conv, tree_gated_delta_rule
from arctic_zorro_train.testing import float64_everywhere, float64_recurrent_gated_delta_rule

TREES = {
    "prompt_groups": [Sample([1, 2, 3, 4, 5], [6]), Sample([1, 2, 3, 4, 5], [7, 8, 9]), Sample([3, 4], [5, 6])],
    "short_trie_nodes": [Sample([9, 1], [2]), Sample([9, 3], [4, 5]), Sample([9, 1], [6]), Sample([9], [7])],
    "long_nodes": [Sample(list(range(1, 67)), list(range(70, 80))), Sample(list(range(1, 67)), [3, 4])],
}


def _plan(name: str, sharing: str = "trie") -> tuple[object, list[torch.Tensor]]:
    batch = make_batch(TREES[name])
    plan = plan_batch(batch["input_ids"], batch["responses"].shape[1], batch["attention_mask"], sharing=sharing)  # type: ignore[arg-type]
    # Each sample's packed path, in its token order.
    layout = plan.layout
    paths = [
        plan.sample_packed_index[layout.sample_offsets[b] : layout.sample_offsets[b + 1]]
        for b in range(layout.num_samples)
    ]
    return plan, paths


@pytest.mark.parametrize("name", sorted(TREES))
def test_conv_follows_every_sample_path(name: str) -> None:
    plan, paths = _plan(name)
    width, channels = 4, 6
    schedule = build_gated_delta_schedule(plan, width)  # type: ignore[arg-type]
    x = torch.randn(plan.num_packed_tokens, channels, dtype=torch.float64, requires_grad=True)  # type: ignore[attr-defined]
    weight = torch.randn(channels, width, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(channels, dtype=torch.float64, requires_grad=True)
    out = tree_causal_conv(x, weight, bias, schedule)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), (x, weight, bias))
    # Reference: conv1d per sample; a shared packed token's output is the same on every path through it, and its
    # gradient is the sum over paths of the upstream gradient it receives (counted once per packed token).
    expected_out = torch.zeros_like(out)
    expected_loss = torch.zeros((), dtype=torch.float64)
    seen = torch.zeros(out.shape[0], dtype=torch.bool)
    for path in paths:
        sample_out = F.conv1d(x[path].t()[None], weight[:, None, :], bias, padding=width - 1, groups=channels)
        sample_out = sample_out[0, :, : path.numel()].t()
        first = ~seen[path]
        expected_out[path] = sample_out.detach()
        expected_loss = expected_loss + (sample_out[first] * upstream[path][first]).sum()
        seen[path] = True
    torch.testing.assert_close(out, expected_out)
    expected_grads = torch.autograd.grad(expected_loss, (x, weight, bias))
    for actual, expected in zip(grads, expected_grads):
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("kernel", ["float64_recurrent", "transformers_chunked"])
def test_recurrent_state_passes_to_children(name: str, kernel: str) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    rule = float64_recurrent_gated_delta_rule if kernel == "float64_recurrent" else torch_chunk_gated_delta_rule
    plan, paths = _plan(name)
    schedule = build_gated_delta_schedule(plan, 4)  # type: ignore[arg-type]
    tokens, heads, dim = plan.num_packed_tokens, 2, 16  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(tokens, heads, dim, generator=generator, dtype=torch.float64),
        torch.randn(tokens, heads, dim, generator=generator, dtype=torch.float64),
        torch.randn(tokens, heads, dim, generator=generator, dtype=torch.float64),
        -torch.rand(tokens, heads, generator=generator, dtype=torch.float64) * 2,
        torch.rand(tokens, heads, generator=generator, dtype=torch.float64),
    ]
    for tensor in inputs:
        tensor.requires_grad_(True)
    query, key, value, g, beta = inputs
    with float64_everywhere():
        out = tree_gated_delta_rule(query, key, value, g, beta, schedule, rule)
        assert out.dtype == torch.float64
        upstream = torch.randn(out.shape, generator=generator, dtype=torch.float64)
        grads = torch.autograd.grad((out * upstream).sum(), inputs)
        expected_loss = torch.zeros((), dtype=torch.float64)
        seen = torch.zeros(tokens, dtype=torch.bool)
        for path in paths:
            q, k, v, g, beta = (x[path][None] for x in inputs)
            sample_out, _ = rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
            first = ~seen[path]
            torch.testing.assert_close(out[path], sample_out[0].detach(), rtol=TOLERANCE, atol=TOLERANCE)
            expected_loss = expected_loss + (sample_out[0][first] * upstream[path][first]).sum()
            seen[path] = True
        expected_grads = torch.autograd.grad(expected_loss, inputs)
    for actual, expected in zip(grads, expected_grads):
        scale = float(expected.norm())
        assert float((actual - expected).norm()) <= TOLERANCE * scale


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_nodes_across_chunk_boundaries(family: str) -> None:
    """Model level: a 66-token prompt and a 70-token response (past transformers' 64-token chunks, not multiples of
    them) next to short ones, with padding on both sides."""
    generator = torch.Generator().manual_seed(2)

    def tokens(length: int) -> list[int]:
        return torch.randint(1, 120, (length,), generator=generator).tolist()

    long_prompt, short_prompt = tokens(66), tokens(40)
    samples = [
        Sample(long_prompt, tokens(10)),
        Sample(short_prompt, tokens(70)),
        Sample(long_prompt, tokens(2)),
        Sample(short_prompt, tokens(1)),
    ]
    model = float64_model(family, output_router_logits=False) if family == "qwen3_next" else float64_model(family)
    compare_with_reference(model, make_batch(samples, extra_prompt_padding=3, extra_response_padding=1))


@pytest.mark.parametrize("name", sorted(TREES))
def test_grouped_value_heads_read_their_query_key_head(name: str) -> None:
    """Value head ``i`` reads query/key head ``i // (Hv / Hk)``: the same as expanding q and k with
    ``repeat_interleave`` first (what transformers' layers do)."""
    plan, _ = _plan(name)
    schedule = build_gated_delta_schedule(plan, 4)  # type: ignore[arg-type]
    tokens, key_heads, value_heads, dim = plan.num_packed_tokens, 2, 6, 8  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(1)
    query, key = (torch.randn(tokens, key_heads, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    value = torch.randn(tokens, value_heads, dim, generator=generator, dtype=torch.float64)
    g = -torch.rand(tokens, value_heads, generator=generator, dtype=torch.float64)
    beta = torch.rand(tokens, value_heads, generator=generator, dtype=torch.float64)
    inputs = [query, key, value, g, beta]
    for tensor in inputs:
        tensor.requires_grad_(True)
    rule = float64_recurrent_gated_delta_rule
    grouped = tree_gated_delta_rule(query, key, value, g, beta, schedule, rule)
    ratio = value_heads // key_heads
    expanded = tree_gated_delta_rule(
        query.repeat_interleave(ratio, dim=1), key.repeat_interleave(ratio, dim=1), value, g, beta, schedule, rule
    )
    torch.testing.assert_close(grouped, expanded, rtol=0, atol=0)
    upstream = torch.randn(grouped.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((grouped * upstream).sum(), inputs)
    expected = torch.autograd.grad((expanded * upstream).sum(), inputs)
    for actual, wanted in zip(grads, expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="multiple of query/key heads"):
        tree_gated_delta_rule(query, key, value[:, :5], g[:, :5], beta[:, :5], schedule, rule)


def test_levels_read_slices_when_their_nodes_sit_side_by_side() -> None:
    """One prompt group (and a batch without sharing) keep the packed order level by level: every level is one
    contiguous range and the outputs need no reordering; several groups interleave prompts and responses."""
    one_group = make_batch([Sample([1, 2, 3], [4, 5]), Sample([1, 2, 3], [6]), Sample([1, 2, 3], [7, 8, 9])])
    plan = plan_batch(one_group["input_ids"], one_group["responses"].shape[1], one_group["attention_mask"])
    schedule = build_gated_delta_schedule(plan, 4)
    assert schedule.level_order_is_packed_order
    assert [level.contiguous_start for level in schedule.levels] == [0, 3]
    unshared = plan_batch(
        one_group["input_ids"], one_group["responses"].shape[1], one_group["attention_mask"], deduplicate=False
    )
    schedule = build_gated_delta_schedule(unshared, 4)
    assert schedule.level_order_is_packed_order and schedule.levels[0].contiguous_start == 0
    plan, _ = _plan("prompt_groups")
    schedule = build_gated_delta_schedule(plan, 4)  # type: ignore[arg-type]
    assert not schedule.level_order_is_packed_order
    assert schedule.levels[0].contiguous_start is None  # the two prompts have responses between them
    x = torch.arange(plan.num_packed_tokens * 2.0).view(-1, 2)  # type: ignore[attr-defined]
    for level in schedule.levels:
        assert torch.equal(level.rows_of(x), x[level.token_index])


def _checkpointed_layer_with_a_first_use_probe(isolate: bool) -> tuple[list[object], object]:
    """A layer that, like fla's probe at first use, runs a small forward + backward inside its own forward, under a
    non-reentrant gradient checkpoint; returns (what the probe saw, the layer's outcome)."""
    from contextlib import nullcontext

    from torch.utils.checkpoint import checkpoint

    from arctic_zorro_train.gated_delta import isolated_autograd

    probe: list[object] = []

    def layer(x: torch.Tensor) -> torch.Tensor:
        if not probe:
            with isolated_autograd() if isolate else nullcontext():
                try:
                    w = torch.ones(3, requires_grad=True)
                    (w * w).sum().backward()
                    probe.append(w.grad.clone() if w.grad is not None else None)
                except Exception as error:  # what fla's probe would report as "fla unusable"
                    probe.append(error)
        return (x.sin() * x).sum()

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    try:
        checkpoint(layer, x, use_reentrant=False).backward()
    except Exception as error:
        return probe, error
    assert x.grad is not None
    return probe, torch.allclose(x.grad, x.sin() + x * x.cos())


def test_the_fla_probe_runs_apart_from_a_gradient_checkpoint() -> None:
    """The probe's backward inside a checkpointed forward: without isolation it unpacks through the checkpoint's
    hooks, fails (so fla would be disabled) and the recomputation saves other tensors (the H200 error of
    2026-12-01); inside ``isolated_autograd`` it sees its gradient and the checkpoint is untouched."""
    probe, outcome = _checkpointed_layer_with_a_first_use_probe(isolate=False)
    assert isinstance(probe[0], Exception) and isinstance(outcome, Exception)
    probe, outcome = _checkpointed_layer_with_a_first_use_probe(isolate=True)
    assert len(probe) == 1 and torch.equal(probe[0], torch.full((3,), 2.0))  # type: ignore[arg-type]
    assert outcome is True


def test_the_fla_probe_gets_gradients_under_no_grad() -> None:
    """A log-prob forward runs under ``torch.no_grad()``; the probe's backward must still work there."""
    from arctic_zorro_train.gated_delta import isolated_autograd

    with torch.no_grad(), isolated_autograd():
        w = torch.ones(3, requires_grad=True)
        (w * w).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.full((3,), 2.0))
