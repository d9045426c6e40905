"""Patching is explicit, idempotent and reversible; unsupported models fail at patch time; a patched model still
runs plain batches exactly as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zorro_cases import fresh_model

from arctic_zorro_train import (
    Qwen3ModelOncePatcher,
    Qwen3ModelPatcher,
    QwenAttentionPatcher,
    UnsupportedModelError,
    ZorroOutput,
    ZorroPatchError,
    apply_zorro,
    create_dummy_batch,
    is_patched,
    remove_zorro,
)
from arctic_zorro_train.testing import per_sample_reference


def _module_state(model: nn.Module) -> dict[str, object]:
    """Everything patching may touch: instance attributes of every module (forward, config, ...)."""
    return {
        f"{name}.{key}": value
        for name, module in model.named_modules()
        for key, value in vars(module).items()
        if not key.startswith("_") or key in ("_arctic_zorro_patch", "_arctic_zorro_layer_patch")
    }


def _batch() -> dict[str, torch.Tensor]:
    return create_dummy_batch(4, 2, 8, 4, vocab_size=120, add_padding=True, seed=11)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe_vlm"])
def test_remove_restores_the_model_exactly(family: str) -> None:
    model = fresh_model(family)
    before = _module_state(model)
    state_dict = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    apply_zorro(model, response_length=4)
    apply_zorro(model, response_length=4, logits_mode="memory")
    assert is_patched(model)
    remove_zorro(model)
    assert not is_patched(model)
    after = _module_state(model)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key] is value, key
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state_dict[name]), name


def test_apply_is_idempotent_and_updates_settings() -> None:
    model = fresh_model("qwen3")
    first = apply_zorro(model, response_length=4)
    forward = model.forward
    configs = [patcher.attention_layer.config for patcher in first.attention_patchers]
    second = apply_zorro(model, response_length=4, use_split_attention=False)
    assert second is first and model.forward is forward
    assert [patcher.attention_layer.config for patcher in second.attention_patchers] == configs
    assert not second.settings.use_split_attention
    assert all(not config.zorro_use_split_attention for config in configs)


def test_patched_model_runs_plain_batches_unchanged() -> None:
    model = fresh_model("qwen3_5", attn_implementation="sdpa")
    batch = _batch()
    expected = per_sample_reference(model, batch, 4).logprobs.detach()
    apply_zorro(model, patch_forward=False)
    torch.testing.assert_close(per_sample_reference(model, batch, 4).logprobs.detach(), expected, rtol=0, atol=0)


def test_unsupported_model_is_rejected_with_the_supported_list() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="qwen3_5_moe") as error:
        apply_zorro(model)
    assert "gpt2" in str(error.value)
    assert not is_patched(model)


def test_once_patcher_makes_model_calls_deduplicated() -> None:
    model = fresh_model("qwen3")
    batch = _batch()
    expected = per_sample_reference(model, batch, 4, temperature=0.5)
    patcher = Qwen3ModelOncePatcher(model, use_split_attention=True, attn_implementation="eager").patch(
        response_len=4, rollout_n=2, temperature=0.5
    )
    assert patcher.is_model_patched
    output = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        calculate_entropy=True,
    )
    assert isinstance(output, ZorroOutput)
    assert output.entropy is not None
    torch.testing.assert_close(output.logprobs, expected.logprobs.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(output.entropy, expected.entropy.detach(), rtol=0, atol=1e-5)
    padded = output.padded(output.logprobs, 4)
    assert padded.shape == (4, 4)
    with pytest.raises(TypeError, match="unexpected keyword"):
        model(input_ids=batch["input_ids"], labels=batch["input_ids"])


def test_context_manager_patcher_restores_the_model() -> None:
    model = fresh_model("llama")
    batch = _batch()
    forward = model.forward
    with Qwen3ModelPatcher(model, response_len=4) as patcher:
        assert patcher.is_model_patched
        output = model(**{name: batch[name] for name in ("input_ids", "attention_mask", "position_ids")})
        assert isinstance(output, ZorroOutput)
    assert not is_patched(model)
    assert model.forward == forward
    assert not isinstance(model(input_ids=batch["input_ids"]), ZorroOutput)


def test_attention_patcher_on_one_layer() -> None:
    model = fresh_model("qwen3")
    attention = model.model.layers[0].self_attn
    original = attention.config
    patcher = QwenAttentionPatcher(attention, use_split_attention=False).patch()
    assert patcher.is_patched and attention.config._attn_implementation == "arctic_zorro"
    assert attention.config.hidden_size == original.hidden_size
    assert model.model.layers[1].self_attn.config is original
    patcher.patch()
    patcher.unpatch()
    assert attention.config is original


def test_response_width_must_be_known() -> None:
    model = fresh_model("qwen3")
    apply_zorro(model)
    with pytest.raises(ZorroPatchError, match="response width"):
        model(input_ids=_batch()["input_ids"])


def test_nothing_is_patched_or_registered_at_import() -> None:
    import subprocess
    import sys

    code = (
        "import sys, arctic_zorro_train;"
        "from transformers import AttentionInterface;"
        "sys.exit(1 if 'arctic_zorro' in AttentionInterface._global_mapping else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_deep_copy_of_a_patched_model_runs_its_own_weights(family: str) -> None:
    """An RL reference model is often ``copy.deepcopy(policy)``: the copy's patched layers (attention, Gated DeltaNet,
    norms) must use the copy's weights and settings, and removing the copy's patch must leave the original's."""
    import copy

    from arctic_zorro_train import DeduplicatedActor
    from arctic_zorro_train.patching import get_patch

    batch = _batch()
    original = fresh_model(family)
    apply_zorro(original, response_length=4)
    patched_state = _module_state(original)
    duplicate = copy.deepcopy(original)
    with torch.no_grad():
        for parameter in duplicate.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    fresh = fresh_model(family)  # unpatched, with the copy's weights: what the copy must compute
    fresh.load_state_dict(duplicate.state_dict())
    width = batch["responses"].shape[1]
    expected = per_sample_reference(fresh, batch, width, 1.0).logprobs
    actual = DeduplicatedActor(duplicate).forward(batch).logprobs
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    assert get_patch(duplicate) is not get_patch(original)
    remove_zorro(duplicate)
    assert is_patched(original) and not is_patched(duplicate)
    assert all("forward" not in vars(module) for module in duplicate.modules())
    assert _module_state(original).keys() == patched_state.keys()
    assert all(_module_state(original)[key] is value for key, value in patched_state.items())
