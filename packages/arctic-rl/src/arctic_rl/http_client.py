"""The HTTP transport of the client (``comm_protocol='http'``): requests to an ``arctic-rl-serve`` server.

``create_arctic_rl_client`` builds it: connected to a running server at ``host:port`` (any process may attach to the
same server and engines this way), or, with ``launch_local_server=True``, to a server it starts as a subprocess and
stops at ``shutdown()``. The async client uses ``httpx.AsyncClient`` (nothing blocks inside ``async def``), the
blocking client ``httpx.Client``. Timeouts come from ``config.http``; an idempotent operation (``OPERATIONS``) is
retried with exponential backoff after a connection failure or a timeout, one that changes state never is. Errors
come back as the same arctic-rl exceptions as over Ray; a server that cannot be reached raises ``TransportError``.

A batch of at least ``http.shared_memory_min_bytes`` for a server on a loopback host goes through a shared-memory
upload slot (:mod:`arctic_rl.wire_slots`) when ``http.shared_memory`` is on: the tensors' bytes are written once into
the slot instead of being streamed as the body. When the server has no slots, or this process cannot reach them, the
transport sends bodies from then on; a server out of slot space gets the body for that request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

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
from arctic_rl.http_api import API_PREFIX, OPERATIONS, is_loopback, read_token
from arctic_rl.wire import CONTENT_TYPE, MessagePlan, decode_message, plan_message
from arctic_rl.wire_slots import SLOT_CONTENT_TYPE, SLOTS_PATH, SlotUnusable, write_to_slot

if TYPE_CHECKING:
    import httpx

    from arctic_rl.config import ArcticRLClientConfig

__all__ = ["HttpTransport", "LocalServer", "connect_http"]

# A body larger than this is sent in chunks of this size (views, no copies): httpcore re-slices the unsent rest of
# one large bytes body after every socket write, which copies it again each time (0.03 GB/s at 256 MiB).
_CHUNK_BYTES = 1 << 20


def _chunks(content: bytes) -> Iterator[memoryview]:
    view = memoryview(content)
    for start in range(0, len(view), _CHUNK_BYTES):
        yield view[start : start + _CHUNK_BYTES]


async def _async_chunks(content: bytes) -> AsyncIterator[memoryview]:
    for chunk in _chunks(content):
        yield chunk


def _base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _to_json(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} cannot be sent as JSON")


def _rebuild_error(op: str, url: str, response: httpx.Response) -> ArcticRLError:
    """The arctic-rl exception the server raised (same type and fields), from its JSON error body."""
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    message = str(body.get("message") or response.text[:500])
    status = response.status_code
    if status in (401, 403, 415, 421) or body.get("error") == "Unauthorized":
        # The token, the Host or Origin header, or the content type: this client's configuration or headers.
        return ConfigError(f"{op}: the server at {url} refused the request ({status}): {message}")
    builders: dict[str, Callable[[], ArcticRLError]] = {
        "BatchValidationError": lambda: BatchValidationError(body["key"], body["detail"]),
        "InvalidRequestError": lambda: InvalidRequestError(body["field"], body["detail"]),
        "EngineDiedError": lambda: EngineDiedError(body["engine"], body["detail"]),
        "EngineError": lambda: EngineError(body["engine"], body["detail"]),
        "EngineStateError": lambda: EngineStateError(body["detail"], engine=body.get("engine")),
        "ConfigError": lambda: ConfigError(message),
        "WireFormatError": lambda: WireFormatError(message),
        "MissingDependencyError": lambda: MissingDependencyError(body["package"], body["extra"], body["purpose"]),
    }
    builder = builders.get(str(body.get("error")))
    if builder is not None:
        with contextlib.suppress(KeyError, TypeError):
            return builder()
    return ArcticRLError(f"{op}: the server at {url} answered {status}: {message}")


class LocalServer:
    """An ``arctic-rl-serve`` subprocess started by this client (its own process group), stopped at shutdown."""

    def __init__(self, process: subprocess.Popen[bytes], log_path: Path, directory: tempfile.TemporaryDirectory[str]):
        self.process = process
        self.log_path = log_path
        self._directory = directory

    @classmethod
    def start(
        cls,
        config: ArcticRLClientConfig,
        *,
        engine_classes: Mapping[str, str] | None = None,
        placement_overrides: Mapping[str, Any] | None = None,
    ) -> LocalServer:
        """Launch ``python -m arctic_rl.serve`` with ``config`` on ``config.host:config.port`` (refused when the port
        is taken: a server already there would answer /health for a different config)."""
        with socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET) as probe:
            probe.settimeout(1.0)
            if probe.connect_ex((config.host, config.port)) == 0:
                raise ConfigError(
                    f"launch_local_server=True but {config.host}:{config.port} is already in use; pick a free port, "
                    "or set launch_local_server=False to connect to the server running there."
                )
        directory = tempfile.TemporaryDirectory(prefix="arctic-rl-serve-")
        config_path = Path(directory.name) / "config.json"
        config_path.write_text(config.model_dump_json())
        command = [
            sys.executable,
            "-m",
            "arctic_rl.serve",
            "--config",
            str(config_path),
            "--host",
            config.host,
            "--port",
            str(config.port),
            "--max-request-mb",
            str(config.http.max_request_mb),
        ]
        if config.token_file is not None:
            command += ["--token-file", config.token_file]
        if not config.http.shared_memory:
            command.append("--no-shared-memory")
        for role, target in (engine_classes or {}).items():
            command += ["--engine-class", f"{role}={target}"]
        for name, value in (placement_overrides or {}).items():
            command += ["--placement-override", f"{name}={json.dumps(value)}"]
        log_path = Path(directory.name) / "server.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(process, log_path, directory)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def wait_ready(self, url: str, headers: Mapping[str, str], timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200; raises if the server exits first or the time runs out."""
        import httpx

        from arctic_rl.progress import HEARTBEAT_S, report

        report(f"waiting for the arctic-rl server launched on {url} to start its engines (its log: {self.log_path})")
        started = time.monotonic()
        deadline = started + timeout_s
        next_report = started + HEARTBEAT_S
        while time.monotonic() < deadline:
            if time.monotonic() >= next_report:
                report(f"still waiting for the arctic-rl server on {url} ({time.monotonic() - started:.0f} s)")
                next_report += HEARTBEAT_S
            code = self.process.poll()
            if code is not None:
                raise TransportError(
                    f"the arctic-rl server launched on {url} exited with code {code} before it answered /health; "
                    f"the end of its log:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", headers=dict(headers), timeout=2.0).status_code == 200:
                    report(f"the arctic-rl server on {url} is ready ({time.monotonic() - started:.0f} s)")
                    return
            time.sleep(0.5)
        self.stop()
        raise TransportError(
            f"the arctic-rl server launched on {url} did not answer /health within {timeout_s:.0f} s (its engines may "
            f"still be loading: raise http.server_start_timeout_s); the end of its log:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 60.0) -> None:
        """Wait for the process to exit (after /v1/shutdown), then SIGTERM and finally SIGKILL its process group."""
        for stop_signal in (None, signal.SIGTERM, signal.SIGKILL):
            if stop_signal is not None and self.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, stop_signal)
            try:
                self.process.wait(timeout=timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._directory.cleanup()


class HttpTransport:
    """Calls on an arctic-rl HTTP server (see the module doc); ``server`` is the subprocess this client launched."""

    def __init__(self, config: ArcticRLClientConfig, *, server: LocalServer | None = None) -> None:
        import httpx

        self.url = _base_url(config.host, config.port)
        self.server = server
        self.settings = config.http
        self.max_bytes = config.http.max_request_mb * 1024**2
        self.headers: dict[str, str] = {}
        if config.token_file is not None:
            self.headers["Authorization"] = f"Bearer {read_token(config.token_file)}"
        self.timeout = httpx.Timeout(config.http.request_timeout_s, connect=config.http.connect_timeout_s)
        # Turned off for good once the server shows it has no slots this process can use.
        self.use_slots = config.http.shared_memory and is_loopback(config.host)
        self._async_client: httpx.AsyncClient | None = None
        self._sync_client: httpx.Client | None = None

    # ------------------------------------------------------------------------------------------ requests
    def _request(
        self, op: str, arguments: dict[str, Any]
    ) -> tuple[str, str, bytes | MessagePlan | None, dict[str, str]]:
        if op not in OPERATIONS:
            raise ConfigError(f"{op!r} is not an operation of the arctic-rl server; use one of {sorted(OPERATIONS)}.")
        operation = OPERATIONS[op]
        method = operation.method
        url = f"{self.url}{API_PREFIX}/{op}"
        if method == "GET":
            return method, url, None, self.headers
        # A batch of tensors travels in the wire format, everything else as JSON.
        if operation.tensors_in:
            plan = plan_message(arguments, max_bytes=self.max_bytes)
            if self.use_slots and plan.size >= self.settings.shared_memory_min_bytes:
                return method, url, plan, self.headers
            content = plan.to_bytes()
            return method, url, content, self._body_headers(content)
        try:
            text = json.dumps(arguments, default=_to_json)
        except (TypeError, ValueError) as error:
            raise WireFormatError(f"{op}: the arguments cannot be sent as JSON ({error}); pass lists, dicts, strings "
                                  "and numbers.") from None  # fmt: skip
        return method, url, text.encode(), {**self.headers, "Content-Type": "application/json"}

    def _body_headers(self, content: bytes) -> dict[str, str]:
        # Content-Length set explicitly: a body sent in chunks would otherwise go without a length (chunked
        # encoding), and the server could not refuse an oversize one before reading it.
        return {**self.headers, "Content-Type": CONTENT_TYPE, "Content-Length": str(len(content))}

    def _slot_answer(self, op: str, response: httpx.Response) -> Any:
        """The server's slot (JSON), or None: send the body. Raises the server's error for a refused size."""
        if response.status_code == 201:
            return response.json()
        if response.status_code in (400, 401, 413):
            raise _rebuild_error(op, self.url, response)
        if response.status_code not in (429, 503):
            # A server without slots (404) or run with --no-shared-memory (501): the body from now on.
            self.use_slots = False
        return None

    def _slot_or_body(self, plan: MessagePlan, slot: Any) -> tuple[bytes, dict[str, str]]:
        """The request naming ``slot`` after writing ``plan`` into it, or the body when there is no usable slot."""
        if slot is not None:
            try:
                reference = write_to_slot(slot, plan)
                return reference.encode(), {**self.headers, "Content-Type": SLOT_CONTENT_TYPE}
            except SlotUnusable:
                # Another host, another user, or no room to write: the body from now on.
                self.use_slots = False
        content = plan.to_bytes()
        return content, self._body_headers(content)

    def _result(self, op: str, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise _rebuild_error(op, self.url, response)
        if len(response.content) > self.max_bytes:
            raise WireFormatError(
                f"{op}: the answer has {len(response.content)} bytes, more than http.max_request_mb allows; raise it."
            )
        if response.headers.get("content-type", "").startswith(CONTENT_TYPE):
            return decode_message(response.content, max_bytes=self.max_bytes)
        return json.loads(response.content) if response.content else None

    def _unreachable(self, op: str, error: Exception, attempts: int) -> TransportError:
        import httpx

        what = "could not be reached" if isinstance(error, httpx.ConnectError) else "stopped answering"
        advice = (
            f"{op} was tried {attempts} times"
            if OPERATIONS[op].idempotent
            else f"{op} changes state, so it was not retried (it may or may not have run): after a server restart, "
            "load_checkpoint() and redo the step"
        )
        return TransportError(
            f"{op}: the arctic-rl server at {self.url} {what} ({type(error).__name__}: {error}); check that it runs "
            f"(`arctic-rl-serve --host ... --port ...`) at this address. {advice}."
        )

    def _attempts(self, op: str) -> int:
        return 1 + (self.settings.retries if OPERATIONS[op].idempotent else 0)

    def _backoff(self, attempt: int) -> float:
        return float(self.settings.backoff_s * 2**attempt)

    async def call(self, op: str, arguments: dict[str, Any]) -> Any:
        import httpx

        method, url, content, headers = self._request(op, arguments)
        if self._async_client is None:
            self._async_client = httpx.AsyncClient(timeout=self.timeout)
        attempts = self._attempts(op)
        slots_url = f"{self.url}{API_PREFIX}{SLOTS_PATH}"
        for attempt in range(attempts):
            try:
                payload: bytes | None
                payload_headers = headers
                if isinstance(content, MessagePlan):
                    # A new slot per attempt: a slot is used once.
                    slot = None
                    if self.use_slots:
                        asked = await self._async_client.post(slots_url, json={"size": content.size}, headers=headers)
                        slot = self._slot_answer(op, asked)
                    payload, payload_headers = await asyncio.to_thread(self._slot_or_body, content, slot)
                else:
                    payload = content
                body: Any = payload
                if payload is not None and len(payload) > _CHUNK_BYTES:
                    # A fresh iterator per attempt: a retry sends the whole body again.
                    body = _async_chunks(payload)
                response = await self._async_client.request(method, url, content=body, headers=payload_headers)
            except httpx.TransportError as error:
                if attempt + 1 == attempts:
                    raise self._unreachable(op, error, attempts) from None
                await asyncio.sleep(self._backoff(attempt))
                continue
            return self._result(op, response)
        raise AssertionError("unreachable: the loop returns or raises")

    def call_sync(self, op: str, arguments: dict[str, Any]) -> Any:
        import httpx

        method, url, content, headers = self._request(op, arguments)
        if self._sync_client is None:
            self._sync_client = httpx.Client(timeout=self.timeout)
        attempts = self._attempts(op)
        slots_url = f"{self.url}{API_PREFIX}{SLOTS_PATH}"
        for attempt in range(attempts):
            try:
                payload: bytes | None
                payload_headers = headers
                if isinstance(content, MessagePlan):
                    slot = None
                    if self.use_slots:
                        asked = self._sync_client.post(slots_url, json={"size": content.size}, headers=headers)
                        slot = self._slot_answer(op, asked)
                    payload, payload_headers = self._slot_or_body(content, slot)
                else:
                    payload = content
                body: Any = payload
                if payload is not None and len(payload) > _CHUNK_BYTES:
                    body = _chunks(payload)
                response = self._sync_client.request(method, url, content=body, headers=payload_headers)
            except httpx.TransportError as error:
                if attempt + 1 == attempts:
                    raise self._unreachable(op, error, attempts) from None
                time.sleep(self._backoff(attempt))
                continue
            return self._result(op, response)
        raise AssertionError("unreachable: the loop returns or raises")

    # ------------------------------------------------------------------------------------------- closing
    async def close(self) -> None:
        """Stop the launched server (its engines first), then close the connections; an attached client only
        closes its connections."""
        import httpx

        try:
            if self.server is not None:
                if self._async_client is None:
                    self._async_client = httpx.AsyncClient(timeout=self.timeout)
                with contextlib.suppress(httpx.HTTPError):
                    await self._async_client.post(f"{self.url}{API_PREFIX}/shutdown", json={}, headers=self.headers)
                await asyncio.to_thread(self.server.stop)
        finally:
            if self._async_client is not None:
                await self._async_client.aclose()
            if self._sync_client is not None:
                self._sync_client.close()

    def close_sync(self) -> None:
        import httpx

        try:
            if self.server is not None:
                if self._sync_client is None:
                    self._sync_client = httpx.Client(timeout=self.timeout)
                with contextlib.suppress(httpx.HTTPError):
                    self._sync_client.post(f"{self.url}{API_PREFIX}/shutdown", json={}, headers=self.headers)
                self.server.stop()
        finally:
            if self._sync_client is not None:
                self._sync_client.close()


def connect_http(
    config: ArcticRLClientConfig,
    *,
    engine_classes: Mapping[str, str] | None = None,
    placement_overrides: Mapping[str, Any] | None = None,
) -> HttpTransport:
    """The transport of ``create_arctic_rl_client`` for ``comm_protocol='http'``: launch the server if the config
    says so (and wait for it), else check that one answers at ``host:port``."""
    import httpx

    if not config.launch_local_server and (engine_classes or placement_overrides):
        raise ConfigError(
            "engine_classes and placement_overrides configure engines this client starts; over HTTP that needs "
            "launch_local_server=True (a running server was configured when it started)."
        )
    if not config.launch_local_server:
        transport = HttpTransport(config)
        try:
            response = httpx.get(f"{transport.url}/health", headers=transport.headers, timeout=transport.timeout)
        except httpx.TransportError as error:
            raise TransportError(
                f"no arctic-rl server answers at {transport.url} ({type(error).__name__}: {error}); start one with "
                f"`arctic-rl-serve --host {config.host} --port {config.port} ...`, or set launch_local_server=True."
            ) from None
        if response.status_code == 401:
            raise _rebuild_error("health", transport.url, response)
        return transport
    server = LocalServer.start(config, engine_classes=engine_classes, placement_overrides=placement_overrides)
    try:
        transport = HttpTransport(config, server=server)
        server.wait_ready(transport.url, transport.headers, config.http.server_start_timeout_s)
    except BaseException:
        server.stop()
        raise
    return transport
