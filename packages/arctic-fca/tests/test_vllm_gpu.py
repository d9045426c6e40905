"""FCA inside vLLM on a GPU against vLLM's default attention, same model, same requests (copies of each prompt, so FCA
groups them): in float32 the same greedy tokens; in bf16 teacher-forced logprobs no further from the default's than
the default's own bf16 run is from its float32 run; FCA's decode steps inside vLLM's full CUDA graphs.

Four engines (FCA and the default, float32 and bf16), each in its own process (``vllm_gpu_engine.py``). In float32
both run Triton attention (vLLM's float32 default; FCA wraps it as ``TRITON_ATTN``) with exact float32 dot products:
FCA's kernels use them for float32, and ``TRITON_F32_DEFAULT=ieee`` makes vLLM's Triton attention use them too
(Triton's default for float32 dots is TF32), so the two differ by float32 rounding only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and VLLM_AVAILABLE), reason="needs a CUDA GPU and vLLM"),
]

ENGINES = [("default", "float32"), ("fca", "float32"), ("default", "bfloat16"), ("fca", "bfloat16")]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    import vllm_gpu_engine

    folder = tmp_path_factory.mktemp("fca-vllm-gpu")
    model_dir = folder / "model"
    vllm_gpu_engine.write_model(str(model_dir))
    results: dict[str, dict[str, Any]] = {}
    for backend, dtype in ENGINES:
        out = folder / f"{backend}-{dtype}.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
            "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
        }
        env.pop("ARCTIC_FCA", None)
        if backend == "fca":
            env["ARCTIC_FCA"] = "1"
        if dtype == "float32":
            env["TRITON_F32_DEFAULT"] = "ieee"
        done = subprocess.run(
            [sys.executable, str(HERE / "vllm_gpu_engine.py"), str(model_dir), dtype, str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if not out.exists():
            results[f"{backend}/{dtype}"] = {"error": (done.stdout + done.stderr)[-4000:]}
            continue
        results[f"{backend}/{dtype}"] = json.loads(out.read_text())
    return results


def _engine(engines: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    result = engines[key]
    assert "error" not in result, f"{key} engine failed:\n{result['error']}"
    assert all(result["followed"]), f"{key}: the forced tokens were not followed"
    return result


def _max_difference(first: list[list[float]], second: list[list[float]]) -> float:
    return max(abs(a - b) for x, y in zip(first, second, strict=True) for a, b in zip(x, y, strict=True))


def test_fca_picks_the_defaults_greedy_tokens_in_float32(engines: dict[str, dict[str, Any]]) -> None:
    default, fca = _engine(engines, "default/float32"), _engine(engines, "fca/float32")
    # vLLM's float32 default is its Triton attention; FCA ran around it (TRITON_ATTN replaced) and grouped the copies.
    assert default["attention_classes"] == ["vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"], default
    assert fca["attention_classes"] == ["arctic_fca.backend.FcaTritonAttentionBackend"], fca["attention_classes"]
    assert fca["stats"]["grouped_requests"] > 0, fca["stats"]
    assert fca["greedy"] == default["greedy"]
    assert _max_difference(fca["forced_logprobs"], default["forced_logprobs"]) < 1e-3


def test_fca_bf16_logprobs_are_within_the_defaults_bf16_error(engines: dict[str, dict[str, Any]]) -> None:
    truth = _engine(engines, "default/float32")["forced_logprobs"]
    default, fca = _engine(engines, "default/bfloat16"), _engine(engines, "fca/bfloat16")
    # Both kinds of request: grouped copies (FCA) and prompts asked once (FlashAttention, left out of FCA's plan).
    assert 0 < fca["stats"]["grouped_requests"] < fca["stats"]["requests"], fca["stats"]
    fca_vs_default = _max_difference(fca["forced_logprobs"], default["forced_logprobs"])
    default_vs_truth = _max_difference(default["forced_logprobs"], truth)
    assert fca_vs_default <= default_vs_truth, (fca_vs_default, default_vs_truth)


@pytest.mark.parametrize(("dtype", "backend"), [("bfloat16", "CUSTOM"), ("float32", "TRITON_ATTN")])
def test_fca_decodes_inside_full_cuda_graphs(engines: dict[str, dict[str, Any]], dtype: str, backend: str) -> None:
    fca = _engine(engines, f"fca/{dtype}")
    assert fca["attention_backends"] == [backend], fca["attention_backends"]
    assert fca["cudagraph_mode"] in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"), fca["cudagraph_mode"]
