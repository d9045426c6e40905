"""The HTTP server: ``python -m arctic_rl.serve`` (or ``arctic-rl-serve``) hosts the engines behind one endpoint per
client operation.

The server starts the same service as the Ray transport (:func:`arctic_rl.service.start_service`, through a blocking
Ray client) and forwards each request to it, so every operation has one implementation and the same validation:
a refused request leaves every engine as it was. Requests and answers are JSON, except batches and the tensors of
``fwd_no_grad``'s answer, which travel in the wire format of :mod:`arctic_rl.wire` (safetensors, never pickle).

Security: the server binds to 127.0.0.1 by default; any other address needs a bearer token (``--token-file``, at
least ``MIN_TOKEN_CHARS`` characters), which every request must then carry (``Authorization: Bearer <token>``,
compared in constant time; 401 otherwise). Requests a web page could send are refused before any route sees them
(:mod:`arctic_rl.http_guard`: the ``Host`` header, cross-origin requests, the body's content type). No endpoint runs
code or imports modules the request names: a loss is chosen by its registered name.

Same host: batches larger than the client's ``http.shared_memory_min_bytes`` go through shared-memory upload slots
instead of the body (see :mod:`arctic_rl.wire_slots`, and its security model there); ``--no-shared-memory`` turns
this off, and a client on another host sends the body.

Errors: a request the service refuses gets a 4xx whose JSON body names the error type and says what to fix
(``BatchValidationError``, ``ConfigError`` and ``InvalidRequestError`` 422, ``EngineStateError`` 409, a malformed
body 400, an oversize body 413, too many open upload slots 429); an engine that died (``EngineDiedError``, decided
by the exception's type) gets 503 naming it, and ``/health`` reports it from then on. A call that failed inside a
live engine, or anything unexpected, gets a 500 naming the operation, with the details in the server's log only.

Stopping: SIGINT, SIGTERM and ``/v1/shutdown`` stop the engines (and the Ray instance the server started) before the
process exits; engines that do not stop within ``ServerSettings.stop_timeout_s`` are killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from arctic_rl.errors import (
    ArcticRLError,
    ConfigError,
    EngineDiedError,
    EngineError,
    WireFormatError,
    import_optional,
)
from arctic_rl.http_api import (
    API_PREFIX,
    OPERATIONS,
    Operation,
    arguments_from_message,
    error_body,
    is_loopback,
    media_type,
    parse_arguments,
    read_token,
)
from arctic_rl.http_guard import MIN_TOKEN_CHARS, RequestGuard, json_error
from arctic_rl.wire import CONTENT_TYPE, encode_message
from arctic_rl.wire_slots import SLOT_CONTENT_TYPE, SLOTS_PATH, SlotRegistry, SlotUnavailable

import_optional("fastapi", extra="engines", purpose="by the arctic-rl HTTP server (arctic-rl-serve)")

from fastapi import FastAPI, Request, Response  # noqa: E402
from starlette.background import BackgroundTask  # noqa: E402
from starlette.concurrency import run_in_threadpool  # noqa: E402
from starlette.exceptions import HTTPException  # noqa: E402

if TYPE_CHECKING:
    from arctic_rl.client import SyncArcticRLClient
    from arctic_rl.config import ArcticRLClientConfig

__all__ = ["MIN_TOKEN_CHARS", "ServerSettings", "create_app", "is_loopback", "main", "serve"]

logger = logging.getLogger("arctic_rl.serve")

_MAKE_TOKEN = "`python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE`"


@dataclass(frozen=True)
class ServerSettings:
    """Where the server listens, the other names its address answers to (``Host`` header), its token (None: no
    token, loopback only), its request-size limit, whether same-host clients may upload batches through
    shared-memory slots (unused ones close after ``slot_lifetime_s``), and how long stopping waits: for requests
    still running (``graceful_timeout_s``), then for the engines (``stop_timeout_s``) before they are killed."""

    host: str = "127.0.0.1"
    port: int = 7000
    token: str | None = None
    max_request_bytes: int = 2048 * 1024**2
    shared_memory: bool = True
    slot_lifetime_s: float = 120.0
    allowed_hosts: tuple[str, ...] = ()
    graceful_timeout_s: int = 5
    stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            raise ConfigError("the bearer token is empty; write a long random string to the token file.")
        if self.token is None and not is_loopback(self.host):
            raise ConfigError(
                f"binding to {self.host!r} exposes the engines beyond this machine, which needs a bearer token: pass "
                f"--token-file FILE (a long random string, e.g. {_MAKE_TOKEN}), or bind to 127.0.0.1."
            )
        if self.token is not None and not is_loopback(self.host) and len(self.token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"the bearer token has {len(self.token)} characters; a server bound beyond loopback ({self.host!r}) "
                f"needs at least {MIN_TOKEN_CHARS}, or it can be guessed: write a long random string to the token "
                f"file, e.g. {_MAKE_TOKEN}."
            )


@dataclass
class _Activity:
    """What the server is doing (for ``/v1/status``) and the engines it saw die (for ``/health``)."""

    started: float = field(default_factory=time.time)
    running: dict[int, tuple[str, float]] = field(default_factory=dict)
    completed: int = 0
    refused: int = 0
    failed: int = 0
    dead_engines: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_id: int = 0

    def begin(self, op: str) -> int:
        with self.lock:
            self.next_id += 1
            self.running[self.next_id] = (op, time.time())
            return self.next_id

    def end(self, job: int, error: BaseException | None) -> None:
        with self.lock:
            self.running.pop(job, None)
            if error is None:
                self.completed += 1
            elif isinstance(error, EngineError):
                self.failed += 1
                # Only the type says an engine is gone; one that raised on a single call is still alive.
                if isinstance(error, EngineDiedError):
                    self.dead_engines[error.engine] = error.message
            elif isinstance(error, ArcticRLError):
                self.refused += 1
            else:
                self.failed += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            now = time.time()
            return {
                "uptime_s": now - self.started,
                "running": [
                    {"job": job, "operation": op, "running_s": now - since}
                    for job, (op, since) in sorted(self.running.items())
                ],
                "completed": self.completed,
                "refused": self.refused,
                "failed": self.failed,
                "engine_errors": dict(self.dead_engines),
            }


def _json_response(content: Any, status_code: int = 200, background: BackgroundTask | None = None) -> Response:
    # Python's JSON (NaN and Infinity allowed): a metric may legitimately be NaN, and the client parses it back.
    return Response(
        json.dumps(content, allow_nan=True),
        status_code=status_code,
        media_type="application/json",
        background=background,
    )


def _release(arguments: dict[str, Any]) -> None:
    """Drop the last references to a request's decoded arguments (a batch may hold a GiB of memory)."""
    arguments.clear()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge(int(declared), limit)
    chunks: list[bytes] = []
    received = 0
    # Streamed with a running count, so a chunked body without Content-Length cannot exceed the limit either.
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise _TooLarge(received, limit)
        chunks.append(chunk)
    return b"".join(chunks)


# A slot request is a small JSON object; anything longer is not one.
_SLOT_REQUEST_LIMIT = 4096


class _TooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size = size
        self.limit = limit


def create_app(client: SyncArcticRLClient, settings: ServerSettings) -> FastAPI:
    """The FastAPI application over a blocking client of the service (Ray transport); see the module doc."""
    from arctic_rl import __version__

    slots = None
    if settings.shared_memory:
        slots = SlotRegistry(settings.max_request_bytes, lifetime_s=settings.slot_lifetime_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        expiry = asyncio.create_task(_expire_slots(slots)) if slots is not None else None
        try:
            yield
        finally:
            if expiry is not None:
                expiry.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await expiry
            if slots is not None:
                slots.close()

    app = FastAPI(
        lifespan=lifespan,
        title="arctic-rl",
        version=__version__,
        description="The arctic-rl engines over HTTP: one endpoint per client operation. Batches and tensor answers "
        f"use the wire format {CONTENT_TYPE} (safetensors); everything else is JSON.",
    )
    activity = _Activity()
    app.state.activity = activity
    app.state.client = client
    app.state.uvicorn_server = None
    app.state.slots = slots

    _add_operation_routes(app, client, settings, activity, slots)
    _add_error_handlers(app)
    _add_server_routes(app, activity, slots)
    app.add_middleware(
        RequestGuard, bound_host=settings.host, allowed_hosts=settings.allowed_hosts, token=settings.token
    )
    return app


def _add_operation_routes(
    app: FastAPI,
    client: SyncArcticRLClient,
    settings: ServerSettings,
    activity: _Activity,
    slots: SlotRegistry | None,
) -> None:
    """One route per operation of the table (arctic_rl.operations), each forwarding its arguments to the client."""
    from arctic_rl.client import SyncArcticRLClient

    def _arguments(op: str, content_type: str, body: bytes) -> dict[str, Any]:
        if media_type(content_type) != SLOT_CONTENT_TYPE:
            return parse_arguments(op, content_type, body, settings.max_request_bytes)
        if slots is None:
            raise WireFormatError(
                f"{op}: this server runs with --no-shared-memory, so it has no upload slots; send the batch as the "
                f"body ({CONTENT_TYPE})."
            )
        return arguments_from_message(op, slots.take_message(body, settings.max_request_bytes))

    def add_operation(op: str, operation: Operation[Any]) -> None:
        async def endpoint(request: Request) -> Response:
            try:
                body = await _read_body(request, settings.max_request_bytes)
            except _TooLarge as error:
                return _json_response(
                    {
                        "error": "WireFormatError",
                        "message": f"{op}: the request has at least {error.size} bytes, more than this server's limit "
                        f"of {error.limit}; split the batch, or restart the server with a larger --max-request-mb.",
                    },
                    413,
                )
            job = activity.begin(op)
            try:
                # Decoding a large batch takes a while: off the event loop, like the call, so /health still answers.
                arguments = await run_in_threadpool(_arguments, op, request.headers.get("content-type", ""), body)
                result = await run_in_threadpool(getattr(client, op), **arguments)
            except ArcticRLError as error:
                activity.end(job, error)
                status, content = error_body(error, op)
                if status >= 500:
                    logger.error("%s failed (%d): %s", op, status, error)
                return _json_response(content, status)
            except Exception as error:
                activity.end(job, error)
                return _unexpected(op, error)
            activity.end(job, None)
            if op == "shutdown" and app.state.uvicorn_server is not None:
                # The engines are stopped; the server exits once this answer is sent.
                app.state.uvicorn_server.should_exit = True
            # Freeing a large batch takes a while: in a worker thread once the answer is sent, not before it.
            release = BackgroundTask(_release, arguments)
            if operation.tensors_out:
                encoded = await run_in_threadpool(encode_message, result)
                return Response(encoded, media_type=CONTENT_TYPE, background=release)
            return _json_response(result, background=release)

        schema = operation.body.model_json_schema()
        extra = None
        if operation.method == "POST":
            content: dict[str, Any] = {"application/json": {"schema": schema}}
            if operation.tensors_in:
                content = {CONTENT_TYPE: {"schema": schema}}
            extra = {"requestBody": {"content": content, "required": False}}
        app.add_api_route(
            f"{API_PREFIX}/{op}",
            endpoint,
            methods=[operation.method],
            name=op,
            summary=op,
            description=(getattr(SyncArcticRLClient, op).__doc__ or f"The client's {op}().").strip(),
            openapi_extra=extra,
        )

    for op, operation in OPERATIONS.items():
        add_operation(op, operation)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answered in the server's JSON error form."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        """404, 405 and the like in the server's JSON error form (Starlette answers them in plain text)."""
        names = {404: "NotFound", 405: "MethodNotAllowed"}
        message = {
            404: f"{request.url.path} is not an endpoint of this server; see /docs (operations are under "
            f"{API_PREFIX}/).",
            405: f"{request.url.path} does not take {request.method}; see /docs for each endpoint's method.",
        }.get(error.status_code, f"{request.method} {request.url.path}: {error.detail}")
        return json_error(error.status_code, names.get(error.status_code, "HTTPError"), message, error.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> Response:
        return _unexpected(f"{request.method} {request.url.path}", error)


def _add_server_routes(app: FastAPI, activity: _Activity, slots: SlotRegistry | None) -> None:
    """The server's own endpoints: upload slots, health and status."""

    @app.post(f"{API_PREFIX}{SLOTS_PATH}", status_code=201)
    async def wire_slots(request: Request) -> Response:
        """A same-host upload slot for a large batch (see arctic_rl.wire_slots): body ``{"size": <bytes>}``."""
        try:
            body = await _read_body(request, _SLOT_REQUEST_LIMIT)
        except _TooLarge:
            body = b""
        try:
            if slots is None:
                raise SlotUnavailable(501, "this server runs with --no-shared-memory; send the batch as the body.")
            try:
                requested = json.loads(body)
            except (ValueError, RecursionError):
                requested = None
            if not isinstance(requested, dict) or set(requested) != {"size"}:
                raise SlotUnavailable(400, 'a slot request is the JSON object {"size": <bytes of the message>}.')
            client_address = request.client.host if request.client is not None else ""
            return _json_response(await run_in_threadpool(slots.create, requested["size"], client_address), 201)
        except SlotUnavailable as error:
            kind = "WireFormatError" if error.status in (400, 413) else "SlotUnavailable"
            headers = None
            if error.retry_after_s is not None:
                headers = {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
            return json_error(error.status, kind, f"wire_slots: {error.message}", headers)

    @app.get("/health")
    async def health() -> Response:
        """200 while every engine answers; 503 naming the engines the server saw die."""
        snapshot = activity.snapshot()
        dead = snapshot["engine_errors"]
        content = {"status": "failed" if dead else "ok", "engine_errors": dead, "busy": bool(snapshot["running"])}
        return _json_response(content, 503 if dead else 200)

    @app.get(f"{API_PREFIX}/status")
    async def status() -> Response:
        """The jobs (requests) running now, how many were completed, refused (4xx) or failed (5xx), and the
        shared-memory upload slots (open, created, used; null with --no-shared-memory)."""
        snapshot = activity.snapshot()
        snapshot["wire_slots"] = None if slots is None else slots.snapshot()
        return _json_response(snapshot)


def _unexpected(op: str, error: BaseException) -> Response:
    """A generic 500 naming the operation: the exception (a remote traceback may name pids, node addresses and actor
    ids) goes to the server's log, not to the client."""
    logger.error("%s: unexpected server error", op, exc_info=error)
    return json_error(
        500,
        "ServerError",
        f"{op}: unexpected server error ({type(error).__name__}); the server's log has the details. Report it with "
        "that log if the request was valid.",
    )


async def _expire_slots(slots: SlotRegistry) -> None:
    while True:
        await asyncio.sleep(min(5.0, slots.lifetime_s / 4))
        slots.expire()


class _Stopped(BaseException):
    """SIGINT or SIGTERM arrived: unwind to the engine stop (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signum)


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    logger.warning("signal %d during the engine stop: the stop goes on (it has its own time limit)", signum)


def _json_error_protocol() -> type:
    """uvicorn's HTTP protocol, answering a request it cannot parse with the server's JSON error body (uvicorn's own
    400 is plain text)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JsonErrorProtocol(AutoHTTPProtocol):  # type: ignore[valid-type, misc]
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(
                {"error": "BadRequest", "message": f"{msg.rstrip('.')}: the bytes are not an HTTP/1.1 request."}
            ).encode()
            head = (
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            )
            self.transport.write(head + body)
            self.transport.close()

    return JsonErrorProtocol


def _stop_engines(client: SyncArcticRLClient, timeout_s: float) -> None:
    """Stop the engines (and the Ray instance the server started) within ``timeout_s``; engines still busy then (a
    call that never returns) are killed: the service actor, whose engines die with it, then this process's Ray."""
    import ray

    from arctic_rl.service import DEFAULT_SERVICE_NAME, SERVICE_NAMESPACE

    stopper = threading.Thread(target=client.shutdown, name="arctic-rl-stop", daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if stopper.is_alive():
        logger.error("the engines did not stop within %.0f s; killing them", timeout_s)
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(DEFAULT_SERVICE_NAME, namespace=SERVICE_NAMESPACE), no_restart=True)
        ray.shutdown()


def serve(
    config: ArcticRLClientConfig,
    settings: ServerSettings,
    *,
    engine_classes: Mapping[str, str] | None = None,
    placement_overrides: Mapping[str, Any] | None = None,
) -> None:
    """Start the engines (Ray transport, same placement as a Ray client), then serve HTTP until stopped; the engines
    stop with the server. ``engine_classes`` and ``placement_overrides`` as in ``create_arctic_rl_client``.

    In the main thread, SIGINT and SIGTERM end it (also while the engines start): requests still running get
    ``settings.graceful_timeout_s``, then the engines stop (see ``_stop_engines``) and ``_Stopped`` is raised."""
    uvicorn = import_optional("uvicorn", extra="engines", purpose="by the arctic-rl HTTP server")

    from arctic_rl.client import SyncArcticRLClient, create_arctic_rl_client

    main_thread = threading.current_thread() is threading.main_thread()
    stop_signals = (signal.SIGINT, signal.SIGTERM)
    # uvicorn restores these handlers after its own graceful shutdown and raises the signal again: with the default
    # SIGTERM handler the process would die there, before the engines and Ray were stopped.
    previous = {number: signal.signal(number, _raise_stopped) for number in stop_signals} if main_thread else {}
    try:
        engine_config = config.model_copy(update={"comm_protocol": "ray", "launch_local_server": False})
        client = create_arctic_rl_client(
            engine_config, blocking_calls=True, engine_classes=engine_classes, placement_overrides=placement_overrides
        )
        assert isinstance(client, SyncArcticRLClient)
        if main_thread:
            # ray.init installs its own SIGTERM handler (sys.exit(15)): ours again, so the exit code says SIGTERM.
            for number in stop_signals:
                signal.signal(number, _raise_stopped)

        class AnnouncingServer(uvicorn.Server):  # type: ignore[name-defined]
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets=sockets)
                if self.started:  # bound: from here on it answers
                    host = f"[{settings.host}]" if ":" in settings.host else settings.host
                    print(f"arctic-rl-serve: listening on http://{host}:{settings.port}, ready", flush=True)

        try:
            app = create_app(client, settings)
            server = AnnouncingServer(
                uvicorn.Config(
                    app,
                    host=settings.host,
                    port=settings.port,
                    log_level="warning",
                    access_log=False,
                    http=_json_error_protocol(),
                    timeout_graceful_shutdown=settings.graceful_timeout_s,
                )
            )
            app.state.uvicorn_server = server
            server.run()
        finally:
            if main_thread:
                # The stop has its own time limit; a second SIGTERM (e.g. from a supervisor) must not cut it short.
                # A handler, not SIG_IGN: an ignored signal stays ignored in processes started meanwhile.
                signal.signal(signal.SIGTERM, _ignore_signal)
            _stop_engines(client, settings.stop_timeout_s)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arctic-rl-serve", description="Serve the arctic-rl engines over HTTP (one endpoint per operation)."
    )
    parser.add_argument("--config", help="JSON file of an ArcticRLClientConfig; the flags below override it.")
    parser.add_argument("--model", help="Model name or directory (the config's model_name).")
    parser.add_argument("--training-gpus", type=int)
    parser.add_argument("--sampling-gpus", type=int)
    parser.add_argument("--log-prob-gpus", type=int)
    parser.add_argument("--colocate", action="store_true", default=None)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1, this machine only).")
    parser.add_argument("--port", type=int, default=7000)
    parser.add_argument(
        "--token-file",
        help=f"File holding the bearer token (required for a non-loopback --host, then of at least {MIN_TOKEN_CHARS} "
        "characters).",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="Another name of the bound address accepted in the Host header (besides it and the loopback names).",
    )
    parser.add_argument("--max-request-mb", type=int, default=2048, help="Largest request body in MiB (413 above).")
    parser.add_argument(
        "--no-shared-memory",
        dest="shared_memory",
        action="store_false",
        help="Refuse same-host shared-memory upload slots: every batch then travels as the request body.",
    )
    parser.add_argument(
        "--engine-class",
        action="append",
        default=[],
        metavar="ROLE=MODULE:CLASS",
        help="Replace a role's engine class (for tests and unusual clusters; set by the operator, never by a request).",
    )
    parser.add_argument(
        "--placement-override", action="append", default=[], metavar="FIELD=JSON", help="A PlacementRequest field."
    )
    return parser


def _pairs(items: Sequence[str], flag: str, *, as_json: bool) -> dict[str, Any]:
    pairs: dict[str, Any] = {}
    for item in items:
        name, separator, value = item.partition("=")
        if not separator or not name:
            raise ConfigError(f"{flag} takes NAME=VALUE, got {item!r}.")
        pairs[name] = json.loads(value) if as_json else value
    return pairs


def config_from_arguments(arguments: argparse.Namespace) -> ArcticRLClientConfig:
    """The engines' config: ``--config``'s file, with the flags given on top."""
    from arctic_rl.config import ArcticRLClientConfig

    fields: dict[str, Any] = {}
    if arguments.config:
        fields = json.loads(Path(arguments.config).read_text())
    overrides = {
        "model_name": arguments.model,
        "training_gpus": arguments.training_gpus,
        "sampling_gpus": arguments.sampling_gpus,
        "log_prob_gpus": arguments.log_prob_gpus,
        "colocate": arguments.colocate,
        "device": arguments.device,
    }
    fields.update({name: value for name, value in overrides.items() if value is not None})
    if "model_name" not in fields:
        raise ConfigError("arctic-rl-serve needs a model: pass --model NAME_OR_DIR or --config FILE.")
    return ArcticRLClientConfig.model_validate(fields)


def main(argv: Sequence[str] | None = None) -> None:
    """``arctic-rl-serve``: parse the flags, start the engines and serve until SIGINT / SIGTERM or /v1/shutdown."""
    parser = _parser()
    arguments = parser.parse_args(argv)
    try:
        config = config_from_arguments(arguments)
        settings = ServerSettings(
            host=arguments.host,
            port=arguments.port,
            token=None if arguments.token_file is None else read_token(arguments.token_file),
            max_request_bytes=arguments.max_request_mb * 1024**2,
            shared_memory=arguments.shared_memory,
            allowed_hosts=tuple(arguments.allowed_host),
        )
    except (ArcticRLError, ValidationError, OSError, ValueError) as error:
        parser.exit(2, f"arctic-rl-serve: {error}\n")
    code = 0
    try:
        serve(
            config,
            settings,
            engine_classes=_pairs(arguments.engine_class, "--engine-class", as_json=False) or None,
            placement_overrides=_pairs(arguments.placement_override, "--placement-override", as_json=True) or None,
        )
    except _Stopped as stopped:
        code = 128 + stopped.signum
    # A request thread still blocked in an engine call (now killed) would keep the interpreter from exiting.
    if any(not thread.daemon for thread in threading.enumerate() if thread is not threading.main_thread()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
