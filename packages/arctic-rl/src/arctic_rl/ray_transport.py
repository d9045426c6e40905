"""The Ray transport of the client (``comm_protocol='ray'``): every operation is one call of the service actor's
``run``. A service-side arctic-rl error comes back as itself (same type, fields and message), a dead service actor
as ``EngineError``. Both faces come from :class:`arctic_rl.transport.TransportBase`; the only I/O is waiting for a
Ray result.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, NoReturn

from arctic_rl.errors import ArcticRLError, EngineError
from arctic_rl.transport import Exchange, TransportBase

__all__ = ["SHUTDOWN_WAIT_S", "RayResult", "RayTransport"]

SHUTDOWN_WAIT_S = 120.0
"""How long shutdown() waits for the service to stop its engines (each gets 30 s) before killing the service actor,
which takes the engine actors and placement groups it created with it: shutdown ends even when an engine is stuck."""


@dataclass(frozen=True)
class RayResult:
    """The value of the Ray object ``ref``; after ``timeout_s`` (None: no limit), ``TimeoutError``."""

    ref: Any
    timeout_s: float | None = None


def _raise_from_ray(error: BaseException) -> NoReturn:
    from ray.exceptions import RayActorError, RayTaskError

    # Ray raises a service-side ArcticRLError as a class deriving from both it and RayTaskError, whose message is
    # the remote traceback: re-raise the original exception (same type, fields and message).
    if isinstance(error, RayTaskError) and isinstance(error.cause, ArcticRLError):
        raise error.cause from None
    if isinstance(error, ArcticRLError):
        raise error
    if isinstance(error, RayActorError):
        raise EngineError(
            "service", f"the arctic-rl service actor died ({type(error).__name__}); create a new client."
        ) from None
    raise error


class RayTransport(TransportBase[RayResult]):
    """Calls on the service actor; ``owns_service``: shutdown stops the engines, ``owns_ray``: and Ray."""

    def __init__(self, service: Any, *, owns_service: bool, owns_ray: bool) -> None:
        self._service = service
        self._owns_service = owns_service
        self._owns_ray = owns_ray

    def exchange(self, op: str, arguments: dict[str, Any]) -> Exchange[RayResult]:
        try:
            return (yield RayResult(self._service.run.remote(op, arguments)))
        except Exception as error:
            _raise_from_ray(error)

    def closing(self) -> Exchange[RayResult]:
        try:
            if self._owns_service:
                yield RayResult(self._service.shutdown.remote(), timeout_s=SHUTDOWN_WAIT_S)
        except TimeoutError:
            pass  # a service stuck in a call: _release kills it, and its engine actors with it
        finally:
            self._release()

    def perform(self, effect: RayResult) -> Any:
        import ray

        # Ray's GetTimeoutError is a TimeoutError, as asyncio's timeout is on the async face.
        return ray.get(effect.ref, timeout=effect.timeout_s)

    async def perform_async(self, effect: RayResult) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(effect.ref.future()), effect.timeout_s)

    def _release(self) -> None:
        import ray

        if self._owns_service:
            ray.kill(self._service, no_restart=True)
        if self._owns_ray:
            ray.shutdown()
