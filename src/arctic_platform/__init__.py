"""Arctic Platform: fast, exact RL post-training for LLMs.

The full-stack install. Its parts are the packages ``arctic_dedup``, ``arctic_zorro_train``, ``arctic_fca`` and
``arctic_rl``; ``arctic_platform.rl`` is the RL client's import path (a re-export of ``arctic_rl``).
"""

import importlib.metadata

try:
    __version__: str = importlib.metadata.version("arctic-platform")
except importlib.metadata.PackageNotFoundError:
    # Sources on PYTHONPATH without an install (``nox -s gpu_tests``): the version's one source, pyproject.toml.
    import tomllib
    from pathlib import Path

    __version__ = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]

__all__ = ["__version__"]
