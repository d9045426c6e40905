"""Ray actors around the plain engine classes: one actor per training / log-prob rank and per sampling replica.

An actor is created empty on its placement bundle and builds its engine in :meth:`EngineActor.start`, so the service
can first ask rank 0 for the rendezvous address (its node's IP and a free port) and then start every data-parallel
rank at once (DeepSpeed's process group forms only when all ranks join). Environment variables that vLLM and
DeepSpeed read at import time travel in the actor's ``runtime_env`` so they exist before the engine module imports
them.

Every actor runs one call at a time (``max_concurrency=1``): an engine is not thread-safe, and the service never has
two calls in flight on one actor. Cross-process weight sync needs no exception to that. vLLM's trainer-side engine
drives the samplers itself, so the service hands the training actors a :class:`SamplerFanout` (the sampler actors'
handles) and trainer rank 0 calls the samplers directly while the service waits on the training actors. Relaying
those calls through the service instead would deadlock: the service actor is blocked in its own ``sync_weights``
and could not serve them. Each sampler receives its transfer calls strictly one after another (join the group;
then per sync start, update, finish): the trainer's half of a rendezvous or a broadcast runs in the training actor,
concurrently with the sampler's one call, so no sampler ever needs a second call in flight.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from arctic_rl.engines.environment import engine_environment
from arctic_rl.errors import ArcticRLError, EngineDiedError, EngineError

if TYPE_CHECKING:
    from arctic_rl.config import ArcticRLClientConfig
    from arctic_rl.placement import Placement, Role, WorkerSlot

__all__ = [
    "DEFAULT_ENGINE_CLASSES",
    "EngineActor",
    "EngineHandle",
    "SamplerFanout",
    "engine_environment",
    "launch_engine_actor",
]

# "module:Class" of each role's engine; the service accepts overrides (tests run the cluster with small fakes).
DEFAULT_ENGINE_CLASSES: dict[str, str] = {
    "training": "arctic_rl.engines.training:TrainingEngine",
    "log_prob": "arctic_rl.engines.log_prob:LogProbEngine",
    "sampling": "arctic_rl.engines.sampling:SamplingEngine",
}


def _load_class(path: str) -> type:
    module_name, _, class_name = path.partition(":")
    if not class_name:
        raise ValueError(f"an engine class is written 'module:Class', got {path!r}.")
    return getattr(importlib.import_module(module_name), class_name)  # type: ignore[no-any-return]


class EngineActor:
    """Holds one engine; ``call`` runs one of its methods. Exceptions raised by the engine pass through unchanged
    (arctic-rl's errors pickle); anything else is wrapped in ``EngineError`` naming the engine."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.engine: Any = None

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return int(probe.getsockname()[1])

    def pid(self) -> int:
        return os.getpid()

    def start(self, engine_class: str, config: ArcticRLClientConfig, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        try:
            self.engine = _load_class(engine_class)(config, **kwargs)
        except Exception as error:
            raise _as_engine_error(self.name, "failed to start", error) from None
        return {
            "pid": os.getpid(),
            "vocab_size": getattr(self.engine, "vocab_size", None),
            # Request limits the service checks before it calls the engine.
            "max_positions": getattr(self.engine, "max_positions", None),
            "max_model_len": getattr(self.engine, "max_model_len", None),
        }

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            raise EngineError(self.name, f"was not started; cannot run {method}().")
        try:
            result = getattr(self.engine, method)(*args, **kwargs)
            # Generators (iter_full_parameters) cannot leave the actor: materialise them here.
            if hasattr(result, "__next__"):
                result = [_own_storage(item) for item in result]
            return result
        except Exception as error:
            raise _as_engine_error(self.name, f"{method}() failed", error) from None

    def call_split(self, method: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """``call`` whose result travels as the second of two return objects (invoke with ``num_returns=2``): the
        caller waits on the first (``True``, or the call's error) and hands the second to other actors by reference,
        never fetching it (the object-store weight sync: the parameters go from the trainer to the samplers)."""
        return True, self.call(method, *args, **kwargs)

    def get(self, attribute: str) -> Any:
        return getattr(self.engine, attribute)

    def stop(self) -> None:
        engine, self.engine = self.engine, None
        close = getattr(engine, "shutdown", None) or getattr(engine, "close", None)
        if close is not None:
            close()


def _own_storage(item: Any) -> Any:
    """``item`` (a tensor, or a tuple such as ``(name, tensor)``) with every tensor that views part of a larger
    storage copied to a storage of its own; other values unchanged.

    Pickling a tensor sends its whole storage, and under ZeRO 0-2 each parameter is a view of DeepSpeed's flat
    buffer of all of them: the 25 parameters of the 2-layer main-job model pickled to 11.5 MB instead of 0.46 MB,
    and the object-store weight sync sends them across two processes a step (training actor -> service -> sampler).
    """
    import torch

    if isinstance(item, tuple):
        return tuple(_own_storage(part) for part in item)
    if isinstance(item, torch.Tensor) and item.untyped_storage().nbytes() > item.nbytes:
        return item.clone()
    return item


def _as_engine_error(name: str, what: str, error: Exception) -> Exception:
    from arctic_rl.errors import ArcticRLError

    if isinstance(error, ArcticRLError):
        return error
    detail = "".join(traceback.format_exception_only(type(error), error)).strip()
    return EngineError(name, f"{what}: {detail}")


class SamplerFanout:
    """A ``SamplerCall`` over the sampler actors: ``fanout(method, args)`` runs ``SamplingEngine.<method>(*args)`` on
    every replica and waits for all of them. It pickles with the actor handles, so the service passes it to the
    training actors and trainer rank 0 calls the samplers directly during a weight transfer (see the module
    docstring). A sampler that dies or fails surfaces as ``EngineError`` naming it; a dead one is reported first."""

    def __init__(self, samplers: list[tuple[str, Any]]) -> None:
        self.samplers = samplers

    def __call__(self, method: str, args: tuple[Any, ...]) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        references = [(name, actor.call.remote(method, *args)) for name, actor in self.samplers]
        ray.wait([reference for _, reference in references], num_returns=len(references))
        failed: list[Exception] = []
        dead: list[Exception] = []
        for name, reference in references:
            try:
                ray.get(reference)
            except RayActorError as error:
                dead.append(
                    EngineDiedError(
                        name,
                        f"its actor process died during the weight transfer ({method}(), {type(error).__name__}); the "
                        "run cannot continue. Shut the client down and start it again (from a checkpoint).",
                    )
                )
            except RayTaskError as error:
                cause = error.cause
                failed.append(
                    cause if isinstance(cause, ArcticRLError) else EngineError(name, f"{method}() failed: {error}")
                )
        if dead or failed:
            raise (dead or failed)[0]


# The engine protocol a handle's actor holds (arctic_rl.engines.protocols): the service's calls are checked against it.
EngineType = TypeVar("EngineType", covariant=True)


@dataclass
class EngineHandle(Generic[EngineType]):
    """An engine actor as the service sees it: the Ray handle, its name (``training[0]``), role, rank and pid."""

    name: str
    role: Role
    rank: int
    actor: Any
    pid: int | None = None


def engines_runtime_env(env_vars: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The Ray runtime environment of the service and engine actors: this process's Python (the environment that
    holds the engines), whoever started the Ray cluster. An RL framework in another environment (verl pins
    transformers<5.11) may own the cluster; its default worker Python cannot import the engines. On a cluster of
    several nodes this Python must exist at the same path on each (one image, or the same shared path)."""
    runtime_env: dict[str, Any] = {"py_executable": sys.executable}
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    return runtime_env


def launch_engine_actor(
    placement: Placement, slot: WorkerSlot, config: ArcticRLClientConfig, *, env: Mapping[str, str] | None = None
) -> EngineHandle:
    """Create the (empty) actor of one worker on its bundle, with its environment."""
    import ray

    name = f"{slot.role}[{slot.rank}]"
    environment = engine_environment(config, slot.role, slot)
    if env:
        environment.update(env)
    options = placement.actor_options(slot)
    remote_class = ray.remote(EngineActor)
    actor = remote_class.options(
        **options, runtime_env=engines_runtime_env(environment), max_restarts=0, max_concurrency=1
    ).remote(name)
    return EngineHandle(name=name, role=slot.role, rank=slot.rank, actor=actor)
