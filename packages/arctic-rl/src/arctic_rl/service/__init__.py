"""The service: the one implementation of every client operation, over the engine actors.

Every operation validates its inputs (and the engines' sleep state) before it touches an engine, so a refused call
leaves weights, optimizer state and step counter as they were. A step's batch is split across the data-parallel
training ranks by arctic-dedup's group-aware balancing (a prompt group is never split: splitting it would make two
ranks recompute its prompt), the loss denominators are counted once over the whole batch, and each rank receives its
share. An engine that fails to start or fails a call surfaces as ``EngineError`` naming it.

Request values are checked before any engine sees them (``InvalidRequestError`` naming the field). Every engine call
has a time limit (``engine_call_timeout_s``): an engine that misses it, or whose process dies (recognised by Ray's
exception types, never by message text), is declared failed with ``EngineDiedError``; :meth:`RLService.dead_engines`
lists those, and later calls that need them are refused at once.

The service runs as a named Ray actor (:func:`start_service`), so another process can attach to it by name
(:func:`attach_service`); nothing else in the package holds engine state. Its parts, one concern each:
:mod:`.rl_service` (the service: lifecycle, dispatch by name, ``train_step``), its operations by concern
(:mod:`.generation`, :mod:`.training`, :mod:`.weights`, :mod:`.sleep_wake`) over the shared state of :mod:`.base`,
:mod:`.lifecycle` (placement, start and stop), :mod:`.dispatch` (a request spread over engines and merged back),
:mod:`.engine_calls` (typed, time-limited engine calls and dead engines), :mod:`.weight_sync` (trainer -> samplers),
:mod:`.sleep` (sleep states), :mod:`.step_metrics` (a step's metrics), :mod:`.requests` (argument checks) and
:mod:`.actor` (the named Ray actor).
"""

from arctic_rl.service.actor import DEFAULT_SERVICE_NAME, SERVICE_NAMESPACE, attach_service, start_service
from arctic_rl.service.dispatch import split_for_data_parallel
from arctic_rl.service.rl_service import RLService

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "SERVICE_NAMESPACE",
    "RLService",
    "attach_service",
    "split_for_data_parallel",
    "start_service",
]
