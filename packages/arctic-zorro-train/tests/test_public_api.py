"""The public surface is pinned: exported names, seed API signatures, package metadata."""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import arctic_zorro_train
from arctic_zorro_train import DeduplicatedActor, Qwen3ModelOncePatcher, QwenAttentionPatcher

EXPECTED_EXPORTS = {
    "DeduplicatedActor",
    "LogitsMode",
    "MissingDependencyError",
    "ParameterParity",
    "ParityReport",
    "Qwen3ModelOncePatcher",
    "Qwen3ModelPatcher",
    "QwenAttentionPatcher",
    "RouterStatistics",
    "UnsupportedModelError",
    "ZorroOutput",
    "ZorroPatch",
    "ZorroPatchError",
    "ZorroSettings",
    "ZorroTrainConfig",
    "__version__",
    "apply_zorro",
    "check_parity",
    "create_dummy_batch",
    "install_zorro_for_deepspeed",
    "is_patched",
    "load_model",
    "plan_batch",
    "ppo_policy_loss",
    "remove_zorro",
    "response_token_values",
    "responses_to_padded",
    "supported_model_types",
    "token_logprobs",
    "zorro_forward",
}

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def test_exported_names_are_pinned() -> None:
    assert set(arctic_zorro_train.__all__) == EXPECTED_EXPORTS
    for name in arctic_zorro_train.__all__:
        assert hasattr(arctic_zorro_train, name), name


def test_seed_api_signatures() -> None:
    def parameters(function: object) -> list[str]:
        return list(inspect.signature(function).parameters)  # type: ignore[arg-type]

    assert parameters(Qwen3ModelOncePatcher)[:3] == ["model", "use_split_attention", "attn_implementation"]
    assert parameters(Qwen3ModelOncePatcher.patch)[:4] == ["self", "response_len", "rollout_n", "temperature"]
    assert parameters(QwenAttentionPatcher)[:2] == ["attention_layer", "use_split_attention"]
    assert parameters(DeduplicatedActor)[:6] == [
        "model_name_or_path",
        "device",
        "logits_optimization",
        "use_split_attention",
        "attn_implementation",
        "dtype",
    ]
    assert parameters(DeduplicatedActor.forward)[:4] == ["self", "batch", "temperature", "calculate_entropy"]
    assert parameters(DeduplicatedActor.compute_policy_loss_and_backward)[:4] == [
        "self",
        "batch",
        "temperature",
        "gradient_accumulation",
    ]
    assert parameters(arctic_zorro_train.create_dummy_batch)[:5] == [
        "batch_size",
        "num_unique_prompts",
        "prompt_len",
        "response_len",
        "vocab_size",
    ]
    assert arctic_zorro_train.create_dummy_batch.__module__ == "arctic_dedup.testing"


def test_metadata() -> None:
    project = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == arctic_zorro_train.__version__
    assert f"arctic-dedup=={arctic_zorro_train.__version__}" in project["dependencies"]
    assert (PACKAGE_ROOT / "src" / "arctic_zorro_train" / "py.typed").exists()
