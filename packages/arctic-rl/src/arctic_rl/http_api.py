"""The HTTP API shared by the server and the client: the operations (their request bodies, HTTP methods and
whether they may be retried), how an arctic-rl error maps to a status and a JSON body, and how a request body
(JSON, or the wire format of :mod:`arctic_rl.wire`) becomes an operation's keyword arguments. Needs only pydantic.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

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


class _Body(BaseModel):
    # Strict: a request says what it means ("step": "1" or a prompt of [[true]] is refused, not coerced).
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, strict=True)


class NoArguments(_Body):
    """An operation without arguments: an empty body or ``{}``."""


class GenerateBody(_Body):
    # Strict: JSON true or "1" is not a token id (lax pydantic would make them 1).
    prompts: list[str] | list[list[StrictInt]] = Field(min_length=1, description="Texts, or token-id lists.")
    sampling_params: dict[str, Any] = Field(description="vLLM SamplingParams field names (n, max_tokens, ...).")


class FwdNoGradBody(_Body):
    batch: dict[str, Any] = Field(description="The padded batch (wire format); see arctic_rl.batch.")
    reference_model: StrictBool = False
    calculate_entropy: StrictBool = False


class FwdBwdBody(_Body):
    batch: dict[str, Any] = Field(description="The padded training batch (wire format); see arctic_rl.batch.")
    processing: dict[str, Any] | None = Field(
        default=None, description="{'loss_fn': <registered loss name>, 'config': {...}}; None: grpo defaults."
    )
    old_log_probs_from_forward: StrictBool = Field(
        default=False, description="The batch has no old_log_probs: use the training forward's (one update per batch)."
    )

    @field_validator("processing")
    @classmethod
    def _processing_shape(cls, processing: dict[str, Any] | None) -> dict[str, Any] | None:
        if processing is None:
            return None
        unknown = sorted(set(processing) - {"loss_fn", "config"})
        if unknown:
            raise ValueError(f"processing accepts the keys 'loss_fn' and 'config', got also {unknown}")
        if "loss_fn" in processing and not isinstance(processing["loss_fn"], str):
            raise ValueError(
                f"processing.loss_fn is a registered loss name (a string), got {type(processing['loss_fn']).__name__}"
            )
        if processing.get("config") is not None and not isinstance(processing["config"], dict):
            raise ValueError(
                f"processing.config is an object of the loss's fields, got {type(processing['config']).__name__}"
            )
        return processing


class TrainStepBody(FwdBwdBody):
    sync_weights: StrictBool = Field(default=False, description="Also sync the trainer's weights to the samplers.")


class SleepInferenceBody(_Body):
    level: Literal[1, 2] = 1


class WakeInferenceBody(_Body):
    tags: list[str] | None = None


class SleepTrainingBody(_Body):
    mode: Literal["all", "weights", "optimizer"] = "all"


class SaveCheckpointBody(_Body):
    path: str | None = Field(default=None, min_length=1, description="A directory on the server; None: config's.")
    step: StrictInt | None = Field(default=None, ge=0)
    keep_last: StrictInt | None = Field(default=None, ge=1)
    hf_export: StrictBool = False


class LoadCheckpointBody(_Body):
    path: str | None = Field(default=None, min_length=1, description="A directory on the server; None: config's.")
    step: StrictInt | None = Field(default=None, ge=0)


class LogProbsBody(_Body):
    prompts: list[str]
    completions: list[str]


@dataclass(frozen=True)
class Operation:
    """One client operation as an endpoint: its body model, whether it changes state, and its answer's encoding."""

    body: type[_Body]
    method: Literal["GET", "POST"] = "POST"
    idempotent: bool = False
    tensors_out: bool = False


OPERATIONS: dict[str, Operation] = {
    "generate": Operation(GenerateBody),
    "fwd_no_grad": Operation(FwdNoGradBody, idempotent=True, tensors_out=True),
    "fwd_bwd": Operation(FwdBwdBody),
    "step": Operation(NoArguments),
    "train_step": Operation(TrainStepBody),
    "sync_weights": Operation(NoArguments),
    "sleep_inference": Operation(SleepInferenceBody),
    "wake_inference": Operation(WakeInferenceBody),
    "sleep_training": Operation(SleepTrainingBody),
    "wake_training": Operation(NoArguments),
    "sleep_log_prob": Operation(NoArguments),
    "wake_log_prob": Operation(NoArguments),
    "empty_training_cache": Operation(NoArguments, idempotent=True),
    "reset_prefix_cache": Operation(NoArguments, idempotent=True),
    "save_checkpoint": Operation(SaveCheckpointBody),
    "load_checkpoint": Operation(LoadCheckpointBody),
    "weight_norm": Operation(NoArguments, method="GET", idempotent=True),
    "log_probs": Operation(LogProbsBody, idempotent=True),
    "last_step_metrics": Operation(NoArguments, method="GET", idempotent=True),
    "describe": Operation(NoArguments, method="GET", idempotent=True),
    "shutdown": Operation(NoArguments),
}


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
