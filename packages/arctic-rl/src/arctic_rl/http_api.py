"""The HTTP API shared by the server and the client: how an arctic-rl error maps to a status and a JSON body (and
back), and how a request body (JSON, or the wire format of :mod:`arctic_rl.wire`) becomes an operation's keyword
arguments. The operations themselves (request bodies, HTTP methods, whether they may be retried) are the table of
:mod:`arctic_rl.operations`. Needs only pydantic.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from arctic_rl.errors import (
    ArcticRLError,
    BatchValidationError,
    ConfigError,
    EngineDiedError,
    EngineError,
    EngineStateError,
    InvalidRequestError,
    MissingDependencyError,
    WireFormatError,
)
from arctic_rl.operations import OPERATIONS, Operation
from arctic_rl.wire import CONTENT_TYPE, decode_message
from arctic_rl.wire_slots import SLOT_CONTENT_TYPE

__all__ = [
    "ACCEPTED_CONTENT_TYPES",
    "API_PREFIX",
    "JSON_CONTENT_TYPE",
    "OPERATIONS",
    "Operation",
    "arguments_from_message",
    "error_body",
    "error_from_body",
    "is_loopback",
    "media_type",
    "parse_arguments",
    "read_token",
]

API_PREFIX = "/v1"
JSON_CONTENT_TYPE = "application/json"
# The request bodies the server parses; a browser sends text/plain and form bodies cross-origin without a preflight,
# so none of those reach a parser.
ACCEPTED_CONTENT_TYPES = frozenset({JSON_CONTENT_TYPE, CONTENT_TYPE, SLOT_CONTENT_TYPE})


def media_type(content_type: str) -> str:
    """The media type of a ``Content-Type`` header, lowercase and without parameters (``; charset=...``)."""
    return content_type.split(";")[0].strip().lower()


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (only this machine can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: str | Path) -> str:
    """The bearer token in ``path`` (surrounding whitespace dropped); refuses a missing or empty file."""
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        raise ConfigError(f"cannot read the token file {str(path)!r}: {error.strerror}; check the path.") from None
    if not token:
        raise ConfigError(f"the token file {str(path)!r} is empty; write a long random string to it.")
    return token


# First match wins: EngineDiedError before EngineError. A plain EngineError (one call failed, the engine lives) is
# neither the user's mistake nor a dead engine: error_body answers it with a 500 that keeps its details server-side.
_STATUS: tuple[tuple[type[ArcticRLError], int], ...] = (
    (BatchValidationError, 422),
    (ConfigError, 422),
    (InvalidRequestError, 422),
    (EngineStateError, 409),
    (EngineDiedError, 503),
    (EngineError, 500),
    (WireFormatError, 400),
    (MissingDependencyError, 501),
)


def error_body(error: ArcticRLError, op: str = "") -> tuple[int, dict[str, Any]]:
    """The status and JSON body of an arctic-rl error (the client rebuilds the same exception from it).

    A plain ``EngineError`` (a failed call) may carry an engine's internals (a remote traceback, pids, node
    addresses): its body names the engine and the operation only, and the server logs the rest.
    """
    status = next((code for kind, code in _STATUS if isinstance(error, kind)), 400)
    body: dict[str, Any] = {"error": type(error).__name__, "message": str(error)}
    if isinstance(error, BatchValidationError):
        body.update(key=error.key, detail=error.message)
    elif isinstance(error, InvalidRequestError):
        body.update(field=error.field, detail=error.message)
    elif isinstance(error, EngineDiedError):
        body.update(engine=error.engine, detail=error.message)
    elif isinstance(error, EngineError):
        detail = (
            f"{op or 'the call'} failed inside the engine (it is still running); the server's log has the details. "
            "Report it with that log if the request was valid."
        )
        body.update(message=f"{error.engine} engine: {detail}", engine=error.engine, detail=detail)
    elif isinstance(error, EngineStateError):
        body.update(engine=error.engine, detail=error.message)
    elif isinstance(error, MissingDependencyError):
        body.update(package=error.package, extra=error.extra, purpose=error.purpose)
    return status, body


def error_from_body(body: dict[str, Any], message: str) -> ArcticRLError | None:
    """The arctic-rl exception an error body of :func:`error_body` describes (same type and fields), with ``message``
    as the text of those that carry only one; None when the body names none or lacks its fields."""
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
    try:
        return None if builder is None else builder()
    except (KeyError, TypeError):
        return None


def _validation_message(error: ValidationError, op: str) -> str:
    problems = []
    for item in error.errors()[:10]:
        where = ".".join(str(part) for part in item["loc"]) or "<body>"
        problems.append(f"{where}: {item['msg']}")
    fields = ", ".join(OPERATIONS[op].body.model_fields) or "none (send {} or an empty body)"
    return f"{op}: the request body is not valid ({'; '.join(problems)}); its fields are: {fields}."


def parse_arguments(op: str, content_type: str, body: bytes, limit: int) -> dict[str, Any]:
    """The keyword arguments of ``op`` from a JSON or wire-format body (``content_type`` says which)."""
    kind = media_type(content_type)
    if kind == CONTENT_TYPE:
        message = decode_message(body, max_bytes=limit)
    elif not body.strip():
        # A GET has no body (and the server refuses a POST without a JSON or wire content type before this).
        message = {}
    elif kind != JSON_CONTENT_TYPE:
        raise WireFormatError(
            f"{op}: a body of Content-Type {content_type!r} is not parsed; send JSON (application/json) or the wire "
            f"format ({CONTENT_TYPE})."
        )
    else:
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):
            raise WireFormatError(
                f"{op}: the body is neither JSON nor the arctic-rl wire format ({CONTENT_TYPE}); send a JSON object."
            ) from None
    return arguments_from_message(op, message)


def arguments_from_message(op: str, message: Any) -> dict[str, Any]:
    """The keyword arguments of ``op`` from a decoded request message, checked against the operation's body model."""
    if not isinstance(message, dict):
        raise ConfigError(
            f"{op}: the body must be a JSON object of the operation's fields, got {type(message).__name__}."
        )
    try:
        parsed = OPERATIONS[op].body.model_validate(message)
    except ValidationError as error:
        raise ConfigError(_validation_message(error, op)) from None
    return {name: getattr(parsed, name) for name in type(parsed).model_fields}
