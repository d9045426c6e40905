"""The main job's set-up on a CPU machine with no CPU-torch folder (``noxfile._ensure_cpu_torch_wheel``): torch's CPU
wheel is fetched once from the index (here a local HTTP server standing in for PyTorch's, through
``ARCTIC_TORCH_INDEX_URL``), cached, and named for the installs; an unreachable index stops the job with the
commands that fix it."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest

ROOT = Path(__file__).resolve().parents[2]


class SessionError(Exception):
    pass


class RecordingSession:
    """What ``_ensure_cpu_torch_wheel`` uses of a nox session: log lines and a stop with a message."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)

    def error(self, message: str) -> None:
        raise SessionError(message)


@functools.cache
def _load_noxfile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("arctic_noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # once: nox registers each session of the file as it is read
    return module


@pytest.fixture
def noxfile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    module = _load_noxfile()
    for name in ("ARCTIC_TORCH_FIND_LINKS", "PIP_FIND_LINKS", "ARCTIC_TORCH_INDEX_URL"):
        monkeypatch.setenv(name, "")  # recorded, so that what the set-up writes is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("shutil.which", lambda name: None)  # no nvidia-smi: a CPU machine
    return module


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: ClassVar[list[str]] = []

    def log_message(self, format: str, *args: object) -> None:
        _QuietHandler.requests.append(self.path)


@pytest.fixture
def index(tmp_path: Path, noxfile: ModuleType) -> Iterator[tuple[str, bytes]]:
    """A folder served over HTTP holding a file under the CPU wheel's name (its bytes are what the fetch must keep)."""
    served = tmp_path / "index"
    (served / "whl" / "cpu").mkdir(parents=True)
    payload = bytes(range(256)) * 4096
    (served / "whl" / "cpu" / noxfile.CPU_TORCH_WHEEL).write_bytes(payload)
    _QuietHandler.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu/", payload
    finally:
        server.shutdown()
        server.server_close()


def test_the_wheel_is_fetched_once_cached_and_named_for_the_installs(
    noxfile: ModuleType, index: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url, payload = index
    monkeypatch.setenv("ARCTIC_TORCH_INDEX_URL", url)
    session = RecordingSession()
    noxfile._ensure_cpu_torch_wheel(session)
    folder = tmp_path / "cache" / "arctic-platform" / "cpu-wheels"
    wheel = folder / noxfile.CPU_TORCH_WHEEL
    assert wheel.read_bytes() == payload
    assert list(folder.iterdir()) == [wheel]  # no partial file left
    assert noxfile._find_links() == [str(folder)]
    # The job says where torch comes from: the fetched address, '+' escaped as the index serves it.
    assert any("torch-2.13.0%2Bcpu" in line and url.rstrip("/") in line for line in session.lines), session.lines
    assert _QuietHandler.requests == [f"/whl/cpu/{noxfile.CPU_TORCH_WHEEL.replace('+', '%2B')}"]
    # A second run finds the cached wheel and fetches nothing.
    monkeypatch.delenv("ARCTIC_TORCH_FIND_LINKS")
    noxfile._ensure_cpu_torch_wheel(RecordingSession())
    assert len(_QuietHandler.requests) == 1
    assert noxfile._find_links() == [str(folder)]
    install = noxfile._cpu_install_args()
    assert install[:2] == ["--constraint", str(ROOT / "ci" / "constraints-cpu.txt")]
    assert install[2:] == ["--find-links", str(folder)]


def test_an_unreachable_index_stops_with_the_commands_that_fix_it(
    noxfile: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ARCTIC_TORCH_INDEX_URL", "http://127.0.0.1:9/whl/cpu")  # the discard port: refused
    with pytest.raises(SessionError) as stopped:
        noxfile._ensure_cpu_torch_wheel(RecordingSession())
    message = str(stopped.value)
    assert "pip download --no-deps -d DIR torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu" in message
    assert "ARCTIC_TORCH_FIND_LINKS=DIR" in message and "ARCTIC_TORCH_INDEX_URL" in message
    folder = tmp_path / "cache" / "arctic-platform" / "cpu-wheels"
    assert not any(folder.iterdir())  # nothing half-written stays in the cache
    assert "ARCTIC_TORCH_FIND_LINKS" not in noxfile.os.environ


def test_a_wheel_folder_or_a_gpu_means_no_fetch(
    noxfile: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ARCTIC_TORCH_INDEX_URL", "http://127.0.0.1:9/whl/cpu")
    monkeypatch.setenv("ARCTIC_TORCH_FIND_LINKS", str(tmp_path))
    noxfile._ensure_cpu_torch_wheel(RecordingSession())  # a folder is named: nothing fetched, no error
    monkeypatch.delenv("ARCTIC_TORCH_FIND_LINKS")
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/nvidia-smi")
    noxfile._ensure_cpu_torch_wheel(RecordingSession())  # a GPU machine installs CUDA torch from PyPI
    assert "ARCTIC_TORCH_FIND_LINKS" not in noxfile.os.environ
    assert not (tmp_path / "cache").exists()
