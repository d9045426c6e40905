"""arctic-rl: exact, fast RL post-training driven from your own loop.

A thin client (this package's core: config, batches, losses, metrics) over Ray-orchestrated engines: DeepSpeed
training and log-prob engines and vLLM sampling engines, installed with the ``arctic-rl[engines]`` /
``arctic-rl[vllm]`` extras and imported only when an engine starts.
"""

import importlib.metadata

from arctic_rl.batch import BATCH_KEYS, build_grpo_batch, grpo_advantages, validate_batch
from arctic_rl.client import ArcticRLClient, SyncArcticRLClient, attach_arctic_rl_client, create_arctic_rl_client
from arctic_rl.config import (
    ArcticRLClientConfig,
    FcaSection,
    HttpConfig,
    SamplingConfig,
    TrainingConfig,
    WeightSyncConfig,
    ZorroTrainSection,
)
from arctic_rl.errors import (
    ArcticRLError,
    BatchValidationError,
    ConfigError,
    EngineDiedError,
    EngineError,
    EngineStateError,
    InvalidRequestError,
    MissingDependencyError,
    TransportError,
    WireFormatError,
)
from arctic_rl.losses import (
    LossFn,
    LossInputs,
    LossNeeds,
    LossOutput,
    PolicyLossConfig,
    count_loss_denominators,
    get_loss_fn,
    loss_needs,
    register_loss_fn,
)
from arctic_rl.metrics import StepTimer, logprob_mismatch

try:
    __version__: str = importlib.metadata.version("arctic-rl")
except importlib.metadata.PackageNotFoundError:
    # Sources on PYTHONPATH without an install (``nox -s gpu_tests``): the version's one source, pyproject.toml.
    import tomllib
    from pathlib import Path

    __version__ = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]

__all__ = [
    "BATCH_KEYS",
    "ArcticRLClient",
    "ArcticRLClientConfig",
    "ArcticRLError",
    "BatchValidationError",
    "ConfigError",
    "EngineDiedError",
    "EngineError",
    "EngineStateError",
    "FcaSection",
    "HttpConfig",
    "InvalidRequestError",
    "LossFn",
    "LossInputs",
    "LossNeeds",
    "LossOutput",
    "MissingDependencyError",
    "PolicyLossConfig",
    "SamplingConfig",
    "StepTimer",
    "SyncArcticRLClient",
    "TrainingConfig",
    "TransportError",
    "WeightSyncConfig",
    "WireFormatError",
    "ZorroTrainSection",
    "__version__",
    "attach_arctic_rl_client",
    "build_grpo_batch",
    "count_loss_denominators",
    "create_arctic_rl_client",
    "get_loss_fn",
    "grpo_advantages",
    "logprob_mismatch",
    "loss_needs",
    "register_loss_fn",
    "validate_batch",
]
