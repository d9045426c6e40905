"""bf16 on a CUDA GPU: the deduplicated gradients are as exact as the non-deduplicated run's, for every
tree-attention backend available and for the Gated DeltaNet path.

The yardstick is the fp32 truth (the same bf16 weights upcast to fp32, run without deduplication): for every
parameter, ``1 - cosine(dedup bf16, truth)`` must stay within ``NOISE_FACTOR`` times ``1 - cosine(non-dedup bf16,
truth)``, i.e. deduplication may not add more than sqrt(2) to the run's own bf16 gradient error. Why not a fixed
cosine between the two bf16 runs (the issue's ``>= 0.9999``): on the H200 the non-dedup bf16 run is itself up to
``1 - cos = 2.8e-4`` away from the truth (q/k projections and q/k norms; benchmarks/results/
zorro_bf16_noise_qwen3.json), so two equally valid bf16 roundings of the same gradient (the dedup run sums a shared
prompt token's gradient once in fp32, the plain run rounds each copy to bf16) land 1.3-1.8e-4 apart. A real dedup
mistake (a missed child gradient, a wrong mask) moves gradients by orders of magnitude more. On top of the per
parameter bound, the distances summed over all parameters may not exceed ``SUM_FACTOR`` times the control's sum: a
systematic error spread thinly over many parameters shows there.

The hybrid test has two non-dedup controls (the packed baseline and plain transformers on each sample) and bounds
the dedup run by the larger of their distances: its ``A_log`` and ``dt_bias`` have 8 values per layer, and for such
tiny vectors two equally valid non-dedup bf16 runs land up to 4.7x apart in ``1 - cos`` to the truth
(benchmarks/lab/results/zorro_bf16_noise_qwen3_5.json, H200, seeds 0-2: the packed baseline with and without the fused
kernels, and plain transformers), so one control alone is no noise estimate there; a third control measured against
the larger of the other two reached 1.49x, the dedup run 1.14-1.60x.

Run on the H200 with ``nox -s gpu_tests`` (or ``pytest -m gpu packages/arctic-zorro-train/tests``).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from zorro_cases import Sample, make_batch

from arctic_zorro_train import DeduplicatedActor
from arctic_zorro_train.testing import build_model, collect_grads, per_sample_reference, tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Measured on the H200 (2026-11-30, dense qwen3 test model): per parameter, the dedup run's distance to the truth is
# 0.87-1.38x the non-dedup run's (1 - cosine), 1.07x summed over parameters.
NOISE_FACTOR = 2.0
# A floor for parameters whose non-dedup bf16 gradient happens to be almost exact.
NOISE_FLOOR = 1e-6
# Measured: the dedup run's summed distance is 0.92-1.07x the control's (dense qwen3 and the hybrid, seeds 0-2).
SUM_FACTOR = 1.3

GPU_SHAPE: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
HYBRID_SHAPE: dict[str, Any] = {
    **GPU_SHAPE,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def tokens(length: int) -> list[int]:
        return torch.randint(1, GPU_SHAPE["vocab_size"], (length,), generator=generator).tolist()

    samples = []
    for prompt_length, group in ((700, 6), (333, 5), (90, 1)):
        prompt = tokens(prompt_length)
        for _ in range(group):
            samples.append(Sample(prompt, tokens(int(torch.randint(1, 260, (1,), generator=generator)))))
    order = torch.randperm(len(samples), generator=generator).tolist()
    batch = make_batch([samples[i] for i in order], extra_prompt_padding=3, seed=seed)
    return {name: tensor.cuda() for name, tensor in batch.items()}


def _model(family: str) -> Any:
    shape = HYBRID_SHAPE if family == "qwen3_5" else GPU_SHAPE
    return build_model(tiny_config(family, **shape), dtype=torch.bfloat16, attn_implementation="sdpa").cuda()


def _grads(model: Any, batch: dict[str, torch.Tensor], **options: Any) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    DeduplicatedActor(model, "cuda", **options).compute_policy_loss_and_backward(batch)
    return {name: grad.float() for name, grad in collect_grads(model).items()}


def _one_minus_cosine(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return 1.0 - float(torch.nn.functional.cosine_similarity(actual.double().flatten(), expected.double().flatten(), 0))


def _truth(model: Any, batch: dict[str, torch.Tensor], attention_backend: str = "flex") -> dict[str, torch.Tensor]:
    """fp32 gradients of the same (bf16-rounded) weights, without deduplication."""
    exact = copy.deepcopy(model).float()
    return _grads(exact, batch, deduplicate=False, attention_backend=attention_backend, fp32_logits=True)


def _assert_as_exact_as_plain(
    dedup: dict[str, torch.Tensor],
    plain: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
    truth: dict[str, torch.Tensor],
    label: str,
) -> None:
    """Every parameter: the dedup bf16 gradient is no further from the fp32 truth than NOISE_FACTOR times the
    non-dedup bf16 gradient is (the farther one, given several controls; distances as 1 - cosine); summed over the
    parameters, no further than SUM_FACTOR times the control's sum (the larger one)."""
    controls = plain if isinstance(plain, list) else [plain]
    failures = []
    dedup_total, control_totals = 0.0, [0.0] * len(controls)
    for name, exact in truth.items():
        if float(exact.norm()) == 0.0:
            continue
        ours = _one_minus_cosine(dedup[name], exact)
        theirs = [_one_minus_cosine(control[name], exact) for control in controls]
        dedup_total += ours
        control_totals = [total + distance for total, distance in zip(control_totals, theirs)]
        if ours > NOISE_FACTOR * max(theirs) + NOISE_FLOOR:
            failures.append(f"{name}: 1-cos to truth {ours:.2e} vs non-dedup {', '.join(f'{t:.2e}' for t in theirs)}")
    if dedup_total > SUM_FACTOR * max(control_totals):
        failures.append(
            f"summed over parameters: 1-cos to truth {dedup_total:.2e} vs non-dedup "
            + ", ".join(f"{total:.2e}" for total in control_totals)
        )
    assert not failures, f"{label}: deduplication adds gradient error beyond bf16 noise: " + "; ".join(failures)


@contextlib.contextmanager
def _torch_gated_delta_where_fla_refuses(model: Any) -> Iterator[None]:
    """transformers' Gated DeltaNet layers call fla's chunk kernel whenever fla imports, and fla refuses the gated
    backward on Hopper with Triton >= 3.4 and < 3.7.1 (fla issue #640; the H200 image has Triton 3.6). Where it
    does, the plain control runs transformers' own torch kernel for that call, as arctic-zorro-train's layers do."""
    from arctic_zorro_train.gated_delta import _torch_chunk_rule_for, fla_unusable_reason

    layers = [module for module in model.modules() if type(module).__name__.endswith("GatedDeltaNet")]
    if not layers or fla_unusable_reason(torch.device("cuda"), torch.bfloat16) is None:
        yield
        return
    modeling = sys.modules[type(layers[0]).__module__]
    wrapped = modeling.torch_chunk_gated_delta_rule
    modeling.torch_chunk_gated_delta_rule = _torch_chunk_rule_for(layers[0])
    try:
        yield
    finally:
        modeling.torch_chunk_gated_delta_rule = wrapped


def plain_transformers_grads(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The policy-loss gradients of the unpatched transformers model run on each sample separately."""
    width = batch["responses"].shape[1]
    valid = batch["attention_mask"][:, -width:].bool()
    from arctic_zorro_train import ppo_policy_loss

    model.zero_grad(set_to_none=True)
    with _torch_gated_delta_where_fla_refuses(model):
        reference = per_sample_reference(model, batch, width)
        loss, _ = ppo_policy_loss(
            reference.logprobs,
            batch["old_log_probs"][valid],
            batch["advantages"][valid],
            batch["response_mask"][valid].float(),
        )
        loss.backward()
    return {name: grad.float() for name, grad in collect_grads(model).items()}


def _backends() -> list[str]:
    from arctic_dedup.attention.varlen import varlen_available

    backends = ["flex", "triton", "sdpa"]
    if varlen_available():
        backends.append("varlen")
    return backends


def _baseline_backend() -> str:
    from arctic_dedup.attention.varlen import varlen_available

    return "varlen" if varlen_available() else "flex"


@pytest.mark.parametrize("backend", _backends() if torch.cuda.is_available() else [])
def test_dense_bf16_gradients_match_the_non_deduplicated_run(backend: str) -> None:
    model = _model("qwen3")
    batch = _batch()
    truth = _truth(model, batch)
    baseline = _grads(model, batch, deduplicate=False, attention_backend=_baseline_backend())
    dedup = _grads(model, batch, attention_backend=backend, logits_optimization="memory")
    _assert_as_exact_as_plain(dedup, baseline, truth, f"qwen3 {backend}")


def test_dense_bf16_gradients_match_plain_transformers() -> None:
    model = _model("qwen3")
    batch = _batch(seed=1)
    plain = plain_transformers_grads(model, batch)
    truth = _truth(model, batch)
    dedup = _grads(model, batch, kl_coef=0.0)
    _assert_as_exact_as_plain(dedup, plain, truth, "qwen3 vs transformers sdpa")


def test_hybrid_bf16_gradients_match_the_non_deduplicated_run() -> None:
    from arctic_zorro_train.gated_delta import fla_unusable_reason

    kernel = "torch" if fla_unusable_reason(torch.device("cuda"), torch.bfloat16) else "fla"
    model = _model("qwen3_5")
    batch = _batch(seed=2)
    # No torch.compile here (reference, varlen and sdpa attention), so this test also runs with a newer Triton
    # first on the path for fla (scripts/gpu_triton.sh), which torch's own compiler may not accept.
    truth = _truth(model, batch, attention_backend="reference")
    baseline = _grads(model, batch, deduplicate=False, attention_backend=_baseline_backend())
    plain = plain_transformers_grads(model, batch)
    dedup = _grads(model, batch, attention_backend="sdpa")
    _assert_as_exact_as_plain(dedup, [baseline, plain], truth, f"qwen3_5 ({kernel} Gated DeltaNet kernel)")
