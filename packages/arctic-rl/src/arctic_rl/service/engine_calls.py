"""Calls from the service to the engine actors: typed, time-limited, and with dead engines recognised by Ray's
exception types.

A method is named by its engine protocol's function (``TrainingEngineProtocol.step``), so mypy checks the arguments
against the protocol and gives the result its type; only the method's name travels to the actor
(:meth:`arctic_rl.actors.EngineActor.call`). Every call has a time limit (``engine_call_timeout_s``): an engine that
misses it, or whose process dies (``RayActorError`` and its subclasses ``ActorDiedError`` and
``ActorUnavailableError``: engines never restart), is declared failed with ``EngineDiedError`` and stays failed; later
calls that need it are refused at once. An ``EngineDiedError`` raised inside an engine (a sampler that died during a
weight transfer the trainer drives) marks that engine failed too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from arctic_rl.errors import ArcticRLError, EngineDiedError, EngineError

if TYPE_CHECKING:
    from arctic_rl.actors import EngineHandle
    from arctic_rl.batch import ValidatedBatch

__all__ = ["EngineCalls", "Pending"]

Engine = TypeVar("Engine")
Arguments = ParamSpec("Arguments")
Result = TypeVar("Result")

RESTART_ADVICE = "Shut the client down and start it again (from a checkpoint)."


@dataclass(frozen=True)
class Pending(Generic[Result]):
    """A call started on one engine; :meth:`EngineCalls.gather` waits for it."""

    handle: EngineHandle[Any]
    reference: Any


class EngineCalls:
    """Starts engine methods on their actors and collects the results, declaring failed engines dead."""

    def __init__(self, call_timeout_s: float) -> None:
        self.call_timeout_s = call_timeout_s
        # Engines declared failed (process gone, or a call past its time limit): name -> reason.
        self.dead: dict[str, str] = {}

    def start(
        self,
        handle: EngineHandle[Engine],
        method: Callable[Concatenate[Engine, Arguments], Result],
        *args: Arguments.args,
        **kwargs: Arguments.kwargs,
    ) -> Pending[Result]:
        """Start ``method`` on the engine of ``handle`` (refused at once if that engine was declared failed)."""
        self.require_alive([handle])
        return Pending(handle, handle.actor.call.remote(method.__name__, *args, **kwargs))

    def call(
        self,
        handle: EngineHandle[Engine],
        method: Callable[Concatenate[Engine, Arguments], Result],
        *args: Arguments.args,
        **kwargs: Arguments.kwargs,
    ) -> Result:
        """Run ``method`` on one engine and return its result."""
        return self.gather([self.start(handle, method, *args, **kwargs)])[0]

    def call_all(
        self,
        handles: Sequence[EngineHandle[Engine]],
        method: Callable[Concatenate[Engine, Arguments], Result],
        *args: Arguments.args,
        **kwargs: Arguments.kwargs,
    ) -> list[Result]:
        """Run ``method`` with the same arguments on every engine of ``handles``."""
        self.require_alive(handles)
        # Launch on every rank before waiting on any: collective operations need all ranks inside them.
        return self.gather([self.start(handle, method, *args, **kwargs) for handle in handles])

    def call_on_shares(
        self,
        handles: Sequence[EngineHandle[Engine]],
        method: Callable[Concatenate[Engine, ValidatedBatch, Arguments], Result],
        batch: ValidatedBatch,
        shares: Sequence[Sequence[int]],
        *args: Arguments.args,
        **kwargs: Arguments.kwargs,
    ) -> list[Result]:
        """Run ``method`` on every engine of ``handles`` with its share of ``batch``'s rows (``shares[i]`` for
        ``handles[i]``) and the same other arguments."""
        self.require_alive(handles)
        calls = [
            self.start(handle, method, batch.select(share), *args, **kwargs)
            for handle, share in zip(handles, shares, strict=True)
        ]
        return self.gather(calls)

    def gather(self, calls: Sequence[Pending[Result]]) -> list[Result]:
        """Results of calls on several engines, all within the call time limit. When one engine dies, its peers in
        a collective fail too (their connection resets): wait for every call and report the dead engine rather
        than the first peer to fail."""
        import ray

        deadline = time.monotonic() + self.call_timeout_s
        ray.wait([call.reference for call in calls], num_returns=len(calls), timeout=self.call_timeout_s)
        results: list[Result] = []
        errors: list[ArcticRLError] = []
        for call in calls:
            try:
                results.append(self.get(call.handle, call.reference, timeout=max(0.0, deadline - time.monotonic())))
            except ArcticRLError as error:
                errors.append(error)
        if errors:
            dead = [error for error in errors if isinstance(error, EngineDiedError)]
            raise (dead or errors)[0]
        return results

    def get(self, handle: EngineHandle[Any], reference: Any, timeout: float | None = None) -> Any:
        """``ray.get`` with the time limit (``timeout``, else ``call_timeout_s``), errors translated."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        limit = self.call_timeout_s if timeout is None else timeout
        try:
            return ray.get(reference, timeout=limit)
        except RayTaskError as error:
            cause = error.cause
            if isinstance(cause, EngineDiedError):
                # An engine this one drives (a sampler during a weight transfer) died.
                self.dead.setdefault(cause.engine, cause.message)
            if isinstance(cause, ArcticRLError):
                raise cause from None
            raise EngineError(handle.name, f"failed: {error}") from None
        except RayActorError as error:
            # ActorDiedError and ActorUnavailableError (engines never restart) both derive from RayActorError.
            raise self.declare_dead(handle, f"its actor process died ({type(error).__name__})") from None
        except GetTimeoutError:
            budget = self.call_timeout_s if timeout is None or timeout < self.call_timeout_s else timeout
            raise self.declare_dead(
                handle, f"a call did not finish within its time limit ({budget:g} s, engine_call_timeout_s)"
            ) from None

    def declare_dead(self, handle: EngineHandle[Any], reason: str) -> EngineDiedError:
        self.dead.setdefault(handle.name, reason)
        return EngineDiedError(handle.name, f"{reason}; the run cannot continue. {RESTART_ADVICE}")

    def require_alive(self, handles: Sequence[EngineHandle[Any]]) -> None:
        for handle in handles:
            if handle.name in self.dead:
                raise EngineDiedError(
                    handle.name, f"was declared failed earlier ({self.dead[handle.name]}). {RESTART_ADVICE}"
                )
