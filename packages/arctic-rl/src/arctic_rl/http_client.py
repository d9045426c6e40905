"""The HTTP transport of the client (``comm_protocol='http'``): requests to an ``arctic-rl-serve`` server.

``create_arctic_rl_client`` builds it: connected to a running server at ``host:port`` (any process may attach to the
same server and engines this way), or, with ``launch_local_server=True``, to a server it starts as a subprocess and
stops at ``shutdown()``. Each call is written once, as an exchange of :mod:`arctic_rl.transport`: the async client
sends its requests with ``httpx.AsyncClient`` (nothing blocks inside ``async def``), the blocking client with
``httpx.Client``. Timeouts come from ``config.http``; an idempotent operation (``OPERATIONS``) is retried with
exponential backoff after a connection failure or a timeout, one that changes state never is. Errors come back as the
same arctic-rl exceptions as over Ray; a server that cannot be reached raises ``TransportError``.

A batch of at least ``http.shared_memory_min_bytes`` for a server on a loopback host goes through a shared-memory
upload slot (:mod:`arctic_rl.wire_slots`) when ``http.shared_memory`` is on: the tensors' bytes are written once into
the slot instead of being streamed as the body. When the server has no slots, or this process cannot reach them, the
transport sends bodies from then on; a server out of slot space gets the body for that request.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Generator, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from arctic_rl.errors import ArcticRLError, ConfigError, TransportError, WireFormatError
from arctic_rl.http_api import (
    API_PREFIX,
    JSON_CONTENT_TYPE,
    OPERATIONS,
    Operation,
    error_from_body,
    is_loopback,
    read_token,
)
from arctic_rl.transport import Blocking, Exchange, Sleep, TransportBase
from arctic_rl.wire import CONTENT_TYPE, MessagePlan, decode_message, plan_message
from arctic_rl.wire_slots import SLOT_CONTENT_TYPE, SLOTS_PATH, SlotUnusable, write_to_slot

if TYPE_CHECKING:
    import httpx

    from arctic_rl.config import ArcticRLClientConfig

__all__ = ["HttpRequest", "HttpTransport", "LocalServer", "connect_http"]

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
    rebuilt = error_from_body(body, message)
    if rebuilt is not None:
        return rebuilt
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


@dataclass(frozen=True)
class HttpRequest:
    """One request of an exchange (the faces send a body over ``_CHUNK_BYTES`` in chunks)."""

    method: str
    url: str
    content: bytes | None
    headers: Mapping[str, str]


@dataclass(frozen=True)
class _Disconnect:
    """Close the face's connections: the last effect of closing."""


_HttpEffect = HttpRequest | _Disconnect


class HttpTransport(TransportBase[_HttpEffect]):
    """Calls on an arctic-rl HTTP server (see the module doc); ``server`` is the subprocess this client launched.

    Each call and the closing are one exchange (:mod:`arctic_rl.transport`); the blocking face sends its requests
    with ``httpx.Client``, the async face with ``httpx.AsyncClient``.
    """

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

    # ------------------------------------------------------------------------------------ exchanges
    def exchange(self, op: str, arguments: dict[str, Any]) -> Exchange[_HttpEffect]:
        import httpx

        operation = OPERATIONS.get(op)
        if operation is None:
            raise ConfigError(f"{op!r} is not an operation of the arctic-rl server; use one of {sorted(OPERATIONS)}.")
        request = self._request(op, operation, arguments)
        attempts = 1 + (self.settings.retries if operation.idempotent else 0)
        for attempt in range(attempts):
            try:
                # A batch for a slot asks for a new one on every attempt: a slot is used once.
                sent = (yield from self._through_slot(op, request)) if isinstance(request, MessagePlan) else request
                response = yield sent
            except httpx.TransportError as error:
                if attempt + 1 == attempts:
                    raise self._unreachable(op, error, attempts) from None
                yield Sleep(float(self.settings.backoff_s * 2**attempt))
                continue
            return self._result(op, response)
        raise AssertionError("unreachable: the loop returns or raises")

    def closing(self) -> Exchange[_HttpEffect]:
        """Stop the launched server (its engines first), then close the connections; an attached client only closes
        its connections."""
        import httpx

        try:
            if self.server is not None:
                with contextlib.suppress(httpx.HTTPError):
                    yield self._json_request(f"{self.url}{API_PREFIX}/shutdown", "{}")
                yield Blocking(self.server.stop)
        finally:
            yield _Disconnect()

    # ------------------------------------------------------------------------------------ requests
    def _request(self, op: str, operation: Operation[Any], arguments: dict[str, Any]) -> HttpRequest | MessagePlan:
        """The request of ``op``; a batch bound for an upload slot stays a plan (each attempt asks for a slot)."""
        url = f"{self.url}{API_PREFIX}/{op}"
        if operation.method == "GET":
            return HttpRequest("GET", url, None, self.headers)
        # A batch of tensors travels in the wire format, everything else as JSON.
        if operation.tensors_in:
            plan = plan_message(arguments, max_bytes=self.max_bytes)
            if self.use_slots and plan.size >= self.settings.shared_memory_min_bytes:
                return plan
            return self._body_request(url, plan.to_bytes())
        try:
            text = json.dumps(arguments, default=_to_json)
        except (TypeError, ValueError) as error:
            raise WireFormatError(f"{op}: the arguments cannot be sent as JSON ({error}); pass lists, dicts, strings "
                                  "and numbers.") from None  # fmt: skip
        return self._json_request(url, text)

    def _json_request(self, url: str, text: str) -> HttpRequest:
        return HttpRequest("POST", url, text.encode(), {**self.headers, "Content-Type": JSON_CONTENT_TYPE})

    def _body_request(self, url: str, content: bytes) -> HttpRequest:
        # Content-Length set explicitly: a body sent in chunks would otherwise go without a length (chunked
        # encoding), and the server could not refuse an oversize one before reading it.
        headers = {**self.headers, "Content-Type": CONTENT_TYPE, "Content-Length": str(len(content))}
        return HttpRequest("POST", url, content, headers)

    def _through_slot(self, op: str, plan: MessagePlan) -> Generator[HttpRequest | Blocking, Any, HttpRequest]:
        """The request of ``op`` naming a new upload slot that holds ``plan``, or with the blob as its body when the
        server gives no slot this process can use."""
        slot = None
        if self.use_slots:
            answer = yield self._json_request(f"{self.url}{API_PREFIX}{SLOTS_PATH}", json.dumps({"size": plan.size}))
            slot = self._slot_answer(op, answer)
        request: HttpRequest = yield Blocking(partial(self._slot_or_body, f"{self.url}{API_PREFIX}/{op}", plan, slot))
        return request

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

    def _slot_or_body(self, url: str, plan: MessagePlan, slot: Any) -> HttpRequest:
        """The request naming ``slot`` after writing ``plan`` into it, or the body when there is no usable slot."""
        if slot is not None:
            try:
                reference = write_to_slot(slot, plan)
                return HttpRequest("POST", url, reference.encode(), {**self.headers, "Content-Type": SLOT_CONTENT_TYPE})
            except SlotUnusable:
                # Another host, another user, or no room to write: the body from now on.
                self.use_slots = False
        return self._body_request(url, plan.to_bytes())

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

    # ------------------------------------------------------------------------------------ the two faces
    def perform(self, effect: _HttpEffect) -> Any:
        import httpx

        if isinstance(effect, _Disconnect):
            if self._sync_client is not None:
                self._sync_client.close()
            return None
        if self._sync_client is None:
            self._sync_client = httpx.Client(timeout=self.timeout)
        content = effect.content
        # A fresh iterator per request: a retry sends the whole body again (httpx sends the memoryviews as bytes).
        body: Any = _chunks(content) if content is not None and len(content) > _CHUNK_BYTES else content
        return self._sync_client.request(effect.method, effect.url, content=body, headers=effect.headers)

    async def perform_async(self, effect: _HttpEffect) -> Any:
        import httpx

        if isinstance(effect, _Disconnect):
            if self._async_client is not None:
                await self._async_client.aclose()
            # Connections the blocking face opened too, if this transport was used both ways.
            if self._sync_client is not None:
                self._sync_client.close()
            return None
        if self._async_client is None:
            self._async_client = httpx.AsyncClient(timeout=self.timeout)
        content = effect.content
        body: Any = _async_chunks(content) if content is not None and len(content) > _CHUNK_BYTES else content
        return await self._async_client.request(effect.method, effect.url, content=body, headers=effect.headers)


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
