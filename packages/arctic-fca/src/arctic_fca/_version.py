"""The installed arctic-fca's version (one source: the package's pyproject.toml), for the package and its plugin."""

import importlib.metadata

__all__ = ["__version__"]

try:
    __version__: str = importlib.metadata.version("arctic-fca")
except importlib.metadata.PackageNotFoundError:
    # Sources on PYTHONPATH without an install (``nox -s gpu_tests``): the version's one source, pyproject.toml.
    import tomllib
    from pathlib import Path

    __version__ = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]
