"""arctic-zorro-train: run Hugging Face causal LMs once over deduplicated RL batches, exactly.

Entry points: ``apply_zorro(model)`` (generic), the seed API (``Qwen3ModelOncePatcher``, ``Qwen3ModelPatcher``,
``QwenAttentionPatcher``, ``DeduplicatedActor``), ``zorro_forward(model, plan)`` for a prebuilt plan, and
``install_zorro_for_deepspeed`` for the DeepSpeed engines, and ``check_parity(model)`` (deduplicated vs plain
training on a tiny model of the same architecture; ``python -m arctic_zorro_train.check`` on the command line).
Nothing is patched at import time.
"""

import importlib.metadata

from arctic_dedup.testing import create_dummy_batch
from arctic_zorro_train.actor import DeduplicatedActor, response_token_values
from arctic_zorro_train.compat import Qwen3ModelOncePatcher, Qwen3ModelPatcher, QwenAttentionPatcher
from arctic_zorro_train.deepspeed_hook import ZorroTrainConfig, install_zorro_for_deepspeed
from arctic_zorro_train.errors import MissingDependencyError, UnsupportedModelError, ZorroPatchError
from arctic_zorro_train.families import supported_model_types
from arctic_zorro_train.forward import ZorroOutput, zorro_forward
from arctic_zorro_train.loading import load_model
from arctic_zorro_train.logprobs import LogitsMode, token_logprobs
from arctic_zorro_train.loss import ppo_policy_loss
from arctic_zorro_train.moe import RouterStatistics
from arctic_zorro_train.parity import ParameterParity, ParityReport, check_parity
from arctic_zorro_train.patching import ZorroPatch, apply_zorro, is_patched, remove_zorro
from arctic_zorro_train.plans import plan_batch, responses_to_padded
from arctic_zorro_train.settings import ZorroSettings

try:
    __version__: str = importlib.metadata.version("arctic-zorro-train")
except importlib.metadata.PackageNotFoundError:
    # Sources on PYTHONPATH without an install (``nox -s gpu_tests``): the version's one source, pyproject.toml.
    import tomllib
    from pathlib import Path

    __version__ = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]

__all__ = [
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
]
