"""``check_parity``: deduplicated vs plain per-sample training on a tiny model shrunk from any supported config, in
eval and training mode; it passes on the real code for every family and real-size shape, and fails on a wrong
gradient path. Also the ``python -m arctic_zorro_train.check`` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import torch
from zorro_cases import GRADIENT_BREAKS, TOLERANCE, break_gradient, fresh_model, long_samples, make_batch

from arctic_zorro_train import UnsupportedModelError, check_parity, parity
from arctic_zorro_train.check import main
from arctic_zorro_train.parity import measure_parity
from arctic_zorro_train.testing import FAMILIES, tiny_config, tiny_config_like

pytestmark = pytest.mark.parity


def real_size_config(family: str) -> Any:
    """``family``'s config at the full size of transformers' defaults (billions of parameters: never built)."""
    import transformers

    configs = {
        "qwen3": lambda: transformers.Qwen3Config(),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(output_router_logits=True, mlp_only_layers=[1, 5]),
        "qwen3_next": lambda: transformers.Qwen3NextConfig(output_router_logits=True),
        "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
        ),
        "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(output_router_logits=True),
        "qwen3_5_vlm": lambda: transformers.Qwen3_5Config(),
        "qwen3_5_moe_vlm": lambda: transformers.Qwen3_5MoeConfig(),
        "llama": lambda: transformers.LlamaConfig(num_key_value_heads=8, attention_dropout=0.1),
        "mistral": lambda: transformers.MistralConfig(),
        "qwen2": lambda: transformers.Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=28),
    }
    return configs[family]()


def spy_on_tiny_models(monkeypatch: pytest.MonkeyPatch) -> list[torch.nn.Module]:
    """The models ``check_parity`` builds, as it builds them."""
    built: list[torch.nn.Module] = []
    original = parity.build_model

    def recording(*args: Any, **kwargs: Any) -> torch.nn.Module:
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(parity, "build_model", recording)
    return built


@pytest.mark.parametrize("family", FAMILIES)
def test_check_parity_passes_for_every_family(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    built = spy_on_tiny_models(monkeypatch)
    report = check_parity(tiny_config(family))
    assert report.passed, report.failures()
    assert report.dtype == torch.float32
    (model,) = built
    assert [parameter.name for parameter in report.parameters] == [name for name, _ in model.named_parameters()]
    assert report.loss_error is not None
    assert max(report.errors().values()) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_check_parity_passes_on_real_size_configs(family: str) -> None:
    report = check_parity(real_size_config(family))
    assert report.passed, report.failures()


def test_tiny_config_keeps_what_makes_the_family() -> None:
    hybrid = tiny_config_like(real_size_config("qwen3_next"))
    assert hybrid.model_type == "qwen3_next"
    assert hybrid.layer_types == ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    assert (hybrid.hidden_size, hybrid.vocab_size, hybrid.num_hidden_layers) == (64, 128, 4)
    assert (hybrid.num_experts, hybrid.num_experts_per_tok, hybrid.norm_topk_prob) == (4, 2, True)
    assert (hybrid.head_dim, hybrid.linear_key_head_dim, hybrid.linear_value_head_dim) == (256, 128, 128)
    # 16 key heads and 32 value heads: value heads stay twice the key heads.
    assert (hybrid.linear_num_key_heads, hybrid.linear_num_value_heads) == (2, 4)
    assert hybrid.output_router_logits and hybrid.shared_expert_intermediate_size == 32

    qwen3_5 = tiny_config_like(real_size_config("qwen3_5"))
    assert qwen3_5.rope_parameters["mrope_section"] == [11, 11, 10]
    assert qwen3_5.rope_parameters["partial_rotary_factor"] == 0.25
    assert qwen3_5.tie_word_embeddings

    moe = tiny_config_like(real_size_config("qwen3_moe"))
    assert moe.mlp_only_layers == [1] and moe.num_hidden_layers == 2

    llama = tiny_config_like(real_size_config("llama"))
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.attention_dropout) == (4, 2, 0.0)
    assert llama.bos_token_id == 1 and llama.eos_token_id == 2

    qwen2 = tiny_config_like(real_size_config("qwen2"))
    assert qwen2.layer_types == ["full_attention"] * 3 + ["sliding_attention"]
    assert tiny_config_like(real_size_config("mistral")).sliding_window == 6

    vlm = tiny_config_like(real_size_config("qwen3_5_vlm"))
    assert type(vlm).__name__ == "Qwen3_5Config"
    assert vlm.text_config.hidden_size == vlm.vision_config.out_hidden_size == 64
    assert max(vlm.image_token_id, vlm.video_token_id) < vlm.text_config.vocab_size


def test_unsupported_architecture_is_rejected_with_the_supported_list() -> None:
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match=r"model_type='gpt2'.*Supported model types: qwen3, "):
        check_parity(GPT2Config())


def test_check_parity_trains_with_and_without_autograd_and_keeps_the_callers_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both runs go forward in eval and in training mode, each with autograd (training step) and without (log-prob
    engine), on a model loaded with from_pretrained; called under no_grad, the check still differentiates, and the
    caller's RNG stream is untouched."""
    built = spy_on_tiny_models(monkeypatch)
    forwards: list[tuple[bool, bool]] = []
    original_build = parity.build_model

    def build_and_watch(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = original_build(*args, **kwargs)
        backbone: Any = model.model
        backbone.register_forward_hook(lambda module, *_: forwards.append((module.training, torch.is_grad_enabled())))
        return model

    monkeypatch.setattr(parity, "build_model", build_and_watch)
    rng = torch.get_rng_state()
    with torch.no_grad():
        report = check_parity(tiny_config("qwen3_moe"))
    assert report.passed, report.failures()
    assert len(built) == 1
    assert set(forwards) == {(True, True), (True, False), (False, True), (False, False)}
    assert report.modes == ("eval", "train")
    assert torch.equal(torch.get_rng_state(), rng)


def test_measure_parity_restores_the_models_mode() -> None:
    model = fresh_model("qwen3").eval()
    report = measure_parity(model, make_batch(long_samples(), extra_prompt_padding=1), check_grads=False)
    assert report.passed and report.parameters == ()
    assert not model.training


@pytest.mark.parametrize("family", sorted(GRADIENT_BREAKS))
def test_check_parity_catches_a_wrong_gradient(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deduplicated forward stays bitwise right, its gradient is halved: only the gradients can tell."""
    break_gradient(monkeypatch, family)
    report = check_parity(tiny_config(family))
    assert not report.passed
    assert report.logprob_error <= TOLERANCE and report.entropy_error <= TOLERANCE
    projection = "self_attn.q_proj" if family == "qwen3" else "linear_attn.in_proj_qkv"
    broken = [parameter for parameter in report.parameters if projection in parameter.name]
    assert broken and all(parameter.relative_error > 1e-2 for parameter in broken)
    assert report.worst_parameters(1)[0].relative_error > 1e-2


def test_float64_check_is_exact_to_rounding() -> None:
    report = check_parity(tiny_config("qwen3_5"), dtype=torch.float64)
    assert report.dtype == report.output_dtype == torch.float64
    assert max(report.errors().values()) < 1e-12


def test_bf16_is_refused() -> None:
    with pytest.raises(ValueError, match=r"float32 or torch\.float64"):
        check_parity(tiny_config("qwen3"), dtype=torch.bfloat16)


def run_check(*argv: str) -> tuple[int, str, str]:
    out, err = StringIO(), StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_prints_every_parameter_and_passes_on_a_family_name() -> None:
    code, out, _ = run_check("qwen3_moe", "--logits-mode", "memory")
    assert code == 0
    model = fresh_model("qwen3_moe")
    for name, _ in model.named_parameters():
        assert any(line.startswith(name + " ") and line.endswith("pass") for line in out.splitlines()), name
    assert "PASSED" in out.splitlines()[-1]


def test_cli_reads_a_model_directory_and_a_config_file(tmp_path: Path) -> None:
    real_size_config("qwen3_next").save_pretrained(tmp_path)
    code, out, _ = run_check(str(tmp_path))
    assert code == 0 and "qwen3_next" in out.splitlines()[-1]
    config_file = tmp_path / "mistral.json"
    config_file.write_text(real_size_config("mistral").to_json_string())
    code, out, _ = run_check(str(config_file), "--reconstruct", "--attn-implementation", "eager")
    assert code == 0 and "mistral, float32, eager attention" in out


def test_cli_fails_with_exit_code_1_on_a_wrong_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    break_gradient(monkeypatch, "qwen3")
    code, out, _ = run_check("qwen3")
    assert code == 1
    assert any("self_attn.q_proj" in line and line.endswith("FAIL") for line in out.splitlines())
    assert "FAILED" in out and "--dtype float64" in out


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (None, "neither a local model directory, a config JSON file nor a family name"),
        ("{not json", "could not read"),
        (json.dumps({"model_type": "no_such_model"}), "model_type='no_such_model'"),
        (json.dumps({"model_type": "gpt2"}), "no patch table for model_type='gpt2'"),
    ],
    ids=["missing", "not-json", "unknown-type", "unsupported"],
)
def test_cli_bad_input_exits_2_with_a_message(contents: str | None, message: str, tmp_path: Path) -> None:
    source = tmp_path / "config.json"
    if contents is not None:
        source.write_text(contents)
    code, out, err = run_check(str(source))
    assert code == 2 and out == ""
    assert message in err


def test_cli_runs_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "arctic_zorro_train.check", "no-such-model"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "qwen3_5_moe_vlm" in result.stderr
