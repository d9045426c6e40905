import tomllib
from pathlib import Path

import arctic_rl

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_matches_the_package_metadata() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert arctic_rl.__version__ == project["version"]
    assert set(arctic_rl.__all__) == {"__version__"}
