import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import arctic_rl

PACKAGE = Path(__file__).resolve().parents[1]
REPO = PACKAGE.parents[1]
PYPROJECT = PACKAGE / "pyproject.toml"

# The thin client's names (the engines are imported from arctic_rl.engines.* by the engine actors).
CORE_NAMES = {
    "ArcticRLClient",
    "SyncArcticRLClient",
    "attach_arctic_rl_client",
    "create_arctic_rl_client",
    "BATCH_KEYS",
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
    "TrainingConfig",
    "TransportError",
    "WeightSyncConfig",
    "WireFormatError",
    "ZorroTrainSection",
    "__version__",
    "build_grpo_batch",
    "count_loss_denominators",
    "get_loss_fn",
    "grpo_advantages",
    "logprob_mismatch",
    "loss_needs",
    "register_loss_fn",
    "validate_batch",
}
# What only the extras (`arctic-rl[engines]`, `arctic-rl[vllm]`) install; `import arctic_rl` must not load them.
HEAVY_MODULES = [
    "deepspeed",
    "vllm",
    "transformers",
    "arctic_zorro_train",
    "arctic_fca",
    "arctic_dedup",
    "triton",
    "fastapi",
    "uvicorn",
]


def test_version_matches_the_package_metadata() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert arctic_rl.__version__ == project["version"]


def test_public_names_are_pinned() -> None:
    assert set(arctic_rl.__all__) == CORE_NAMES
    for name in arctic_rl.__all__:
        assert hasattr(arctic_rl, name), name


def _fresh_python(code: str, *paths: Path) -> str:
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([*(str(path) for path in paths), environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_importing_the_client_loads_no_engine_dependency() -> None:
    code = (
        "import json, sys; import arctic_rl, arctic_rl.config, arctic_rl.batch, arctic_rl.losses, arctic_rl.metrics,"
        " arctic_rl.wire, arctic_rl.http_api, arctic_rl.http_client;"
        f"print(json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules]))"
    )
    assert json.loads(_fresh_python(code, PACKAGE / "src")) == []


def test_core_dependencies_are_the_thin_set() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    names = {requirement.split(">")[0].split("=")[0].split("<")[0] for requirement in project["dependencies"]}
    assert names == {"torch", "pydantic", "ray", "httpx", "safetensors", "tqdm", "numpy"}
    engines = " ".join(project["optional-dependencies"]["engines"])
    for package in ("arctic-zorro-train[deepspeed]", "arctic-fca", "transformers", "fastapi", "uvicorn"):
        assert package in engines
    # The HTTP server is an entry point of the engines' side; the client needs only httpx.
    assert tomllib.loads(PYPROJECT.read_text())["project"]["scripts"] == {"arctic-rl-serve": "arctic_rl.serve:main"}
    vllm = project["optional-dependencies"]["vllm"]
    assert any(item.startswith("arctic-rl[engines]") for item in vllm)
    assert any(item.startswith("arctic-fca[vllm]") for item in vllm)


def test_arctic_platform_rl_re_exports_every_public_name() -> None:
    # The root package `arctic-platform` ships `arctic_platform.rl`; its sources sit at the repository root.
    code = (
        "import json, arctic_rl, arctic_platform, arctic_platform.rl as rl;"
        "print(json.dumps({'all': sorted(rl.__all__), 'same': all(getattr(rl, n) is getattr(arctic_rl, n) "
        "for n in arctic_rl.__all__), 'version': arctic_platform.__version__}))"
    )
    found = json.loads(_fresh_python(code, REPO / "src", PACKAGE / "src"))
    assert found == {"all": sorted(arctic_rl.__all__), "same": True, "version": arctic_rl.__version__}
    root = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert f"arctic-rl[engines]=={arctic_rl.__version__}" in root["dependencies"]
    assert root["version"] == arctic_rl.__version__
