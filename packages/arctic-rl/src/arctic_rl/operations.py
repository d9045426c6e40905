"""The one definition of the client operations: name, arguments, result type, the engines that serve it, and how it
travels over HTTP. Everything else is derived from this table or checked against it (``tests/test_operations.py``):

- the clients (:mod:`arctic_rl.client`): each typed method is one call of the generic dispatch with its
  :class:`Operation`, which gives the result its type;
- the HTTP API (:mod:`arctic_rl.http_api`, :mod:`arctic_rl.serve`, :mod:`arctic_rl.http_client`): one route per
  operation, its method, request body model, retry class and encodings;
- the service (:mod:`arctic_rl.service`): :meth:`RLService.run` serves exactly these operations, one method each,
  whose parameters are the body model's fields.

An operation's arguments are its body model's fields, with the same names, types and defaults as the client method.
Needs only pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator


def _temperature() -> Any:
    # Log-probs at a sampling temperature: log_softmax(logits / temperature), as the sampler drew the tokens.
    return Field(default=1.0, gt=0, allow_inf_nan=False, description="Score log-probs at this sampling temperature.")


if TYPE_CHECKING:
    import torch

__all__ = [
    "OPERATIONS",
    "FwdBwdBody",
    "FwdNoGradBody",
    "GenerateBody",
    "LoadCheckpointBody",
    "LogProbsBody",
    "NoArguments",
    "Operation",
    "OperationBody",
    "SaveCheckpointBody",
    "SleepInferenceBody",
    "SleepTrainingBody",
    "TrainStepBody",
    "WakeInferenceBody",
]

Result = TypeVar("Result")
EngineRole = Literal["training", "log_prob", "sampling"]


class OperationBody(BaseModel):
    """An operation's arguments (and its HTTP request body)."""

    # Strict: a request says what it means ("step": "1" or a prompt of [[true]] is refused, not coerced).
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, strict=True)


class NoArguments(OperationBody):
    """An operation without arguments: an empty body or ``{}``."""


class GenerateBody(OperationBody):
    # Strict: JSON true or "1" is not a token id (lax pydantic would make them 1).
    prompts: list[str] | list[list[StrictInt]] = Field(min_length=1, description="Texts, or token-id lists.")
    sampling_params: dict[str, Any] = Field(description="vLLM SamplingParams field names (n, max_tokens, ...).")


class FwdNoGradBody(OperationBody):
    batch: dict[str, Any] = Field(description="The padded batch (wire format); see arctic_rl.batch.")
    reference_model: StrictBool = False
    calculate_entropy: StrictBool = False
    temperature: float = _temperature()


class FwdBwdBody(OperationBody):
    batch: dict[str, Any] = Field(description="The padded training batch (wire format); see arctic_rl.batch.")
    processing: dict[str, Any] | None = Field(
        default=None, description="{'loss_fn': <registered loss name>, 'config': {...}}; None: grpo defaults."
    )
    old_log_probs_from_forward: StrictBool = Field(
        default=False, description="The batch has no old_log_probs: use the training forward's (one update per batch)."
    )
    temperature: float = _temperature()

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


class SleepInferenceBody(OperationBody):
    level: Literal[1, 2] = 1


class WakeInferenceBody(OperationBody):
    tags: list[str] | None = None


class SleepTrainingBody(OperationBody):
    mode: Literal["all", "weights", "optimizer", "moments"] = "all"


class SaveCheckpointBody(OperationBody):
    path: str | None = Field(default=None, min_length=1, description="A directory on the server; None: config's.")
    step: StrictInt | None = Field(default=None, ge=0)
    keep_last: StrictInt | None = Field(default=None, ge=1)
    hf_export: StrictBool = False


class LoadCheckpointBody(OperationBody):
    path: str | None = Field(default=None, min_length=1, description="A directory on the server; None: config's.")
    step: StrictInt | None = Field(default=None, ge=0)


class LogProbsBody(OperationBody):
    prompts: list[str]
    completions: list[str]
    temperature: float = _temperature()


@dataclass(frozen=True)
class Operation(Generic[Result]):
    """One client operation: its arguments (``body``), the engines that serve it, and how it travels over HTTP.

    ``Result`` is the type the client method returns. ``sent_when_set`` names arguments added after the operation
    first shipped: the client sends them only when they differ from their default, so a server from before them
    still answers the plain call.
    """

    name: str
    body: type[OperationBody]
    engines: tuple[EngineRole, ...]
    method: Literal["GET", "POST"] = "POST"
    idempotent: bool = False
    tensors_in: bool = False
    tensors_out: bool = False
    sent_when_set: frozenset[str] = frozenset()

    def arguments(self, given: dict[str, Any]) -> dict[str, Any]:
        """The arguments to send: ``given`` less the ``sent_when_set`` ones left at their default."""
        fields = self.body.model_fields
        return {name: value for name, value in given.items() if not self._is_default(name, value, fields)}

    def _is_default(self, name: str, value: Any, fields: dict[str, Any]) -> bool:
        if name not in self.sent_when_set:
            return False
        default = fields[name].get_default()
        # The same type too: 0 is not False, and goes to the service, which refuses it.
        return type(value) is type(default) and bool(value == default)

    def result(self, answer: Any) -> Result:
        """The service's answer as this operation's result type (the transports return untyped values)."""
        return cast(Result, answer)


GENERATE: Operation[list[list[dict[str, Any]]]] = Operation("generate", GenerateBody, ("sampling",))
# Added after the first release: sent only when set, so an older server answers the plain call.
_TEMPERATURE_ADDED = frozenset({"temperature"})
FWD_NO_GRAD: Operation[dict[str, torch.Tensor]] = Operation(
    "fwd_no_grad",
    FwdNoGradBody,
    ("training", "log_prob"),
    idempotent=True,
    tensors_in=True,
    tensors_out=True,
    sent_when_set=_TEMPERATURE_ADDED,
)
FWD_BWD: Operation[dict[str, Any]] = Operation(
    "fwd_bwd",
    FwdBwdBody,
    ("training",),
    tensors_in=True,
    sent_when_set=frozenset({"old_log_probs_from_forward"}) | _TEMPERATURE_ADDED,
)
STEP: Operation[dict[str, Any]] = Operation("step", NoArguments, ("training",))
TRAIN_STEP: Operation[dict[str, Any]] = Operation(
    "train_step", TrainStepBody, ("training", "sampling"), tensors_in=True
)
SYNC_WEIGHTS: Operation[dict[str, float]] = Operation("sync_weights", NoArguments, ("training", "sampling"))
SLEEP_INFERENCE: Operation[None] = Operation("sleep_inference", SleepInferenceBody, ("sampling",))
WAKE_INFERENCE: Operation[None] = Operation("wake_inference", WakeInferenceBody, ("sampling",))
SLEEP_TRAINING: Operation[None] = Operation("sleep_training", SleepTrainingBody, ("training",))
WAKE_TRAINING: Operation[None] = Operation("wake_training", NoArguments, ("training",))
SLEEP_LOG_PROB: Operation[None] = Operation("sleep_log_prob", NoArguments, ("log_prob",))
WAKE_LOG_PROB: Operation[None] = Operation("wake_log_prob", NoArguments, ("log_prob",))
EMPTY_TRAINING_CACHE: Operation[None] = Operation("empty_training_cache", NoArguments, ("training",), idempotent=True)
RESET_PREFIX_CACHE: Operation[None] = Operation("reset_prefix_cache", NoArguments, ("sampling",), idempotent=True)
SAVE_CHECKPOINT: Operation[str] = Operation("save_checkpoint", SaveCheckpointBody, ("training",))
LOAD_CHECKPOINT: Operation[int] = Operation("load_checkpoint", LoadCheckpointBody, ("training", "sampling"))
WEIGHT_NORM: Operation[dict[str, float]] = Operation(
    "weight_norm", NoArguments, ("training", "log_prob", "sampling"), method="GET", idempotent=True
)
LOG_PROBS: Operation[list[list[float]]] = Operation(
    "log_probs", LogProbsBody, ("sampling",), idempotent=True, sent_when_set=_TEMPERATURE_ADDED
)
# Served by the service itself, from what the engines reported.
LAST_STEP_METRICS: Operation[dict[str, float]] = Operation(
    "last_step_metrics", NoArguments, (), method="GET", idempotent=True
)
DESCRIBE: Operation[dict[str, Any]] = Operation("describe", NoArguments, (), method="GET", idempotent=True)
SHUTDOWN: Operation[None] = Operation("shutdown", NoArguments, ("training", "log_prob", "sampling"))

OPERATIONS: dict[str, Operation[Any]] = {
    operation.name: operation
    for operation in (
        GENERATE,
        FWD_NO_GRAD,
        FWD_BWD,
        STEP,
        TRAIN_STEP,
        SYNC_WEIGHTS,
        SLEEP_INFERENCE,
        WAKE_INFERENCE,
        SLEEP_TRAINING,
        WAKE_TRAINING,
        SLEEP_LOG_PROB,
        WAKE_LOG_PROB,
        EMPTY_TRAINING_CACHE,
        RESET_PREFIX_CACHE,
        SAVE_CHECKPOINT,
        LOAD_CHECKPOINT,
        WEIGHT_NORM,
        LOG_PROBS,
        LAST_STEP_METRICS,
        DESCRIBE,
        SHUTDOWN,
    )
}
"""Every operation by name, in the order of the HTTP API's documentation."""
