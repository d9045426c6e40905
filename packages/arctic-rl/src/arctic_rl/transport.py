"""How a client reaches the service: one transport base, with a blocking face and an async face over it.

A transport writes the work of a call once, as a generator (an *exchange*): it builds and encodes the request,
retries, translates errors and decodes the answer, and yields each piece of I/O it needs as an *effect*, getting the
effect's result back at the ``yield`` (or its exception, raised there). The faces only perform effects:
:meth:`TransportBase.call_sync` blocks on each one, :meth:`TransportBase.call` awaits it, so the async client never
blocks its event loop and no step of a call is written twice.

Two effects are the same for every transport and performed here: :class:`Sleep` (a retry's backoff) and
:class:`Blocking` (slow local work, such as writing a GiB batch into shared memory: done in place by the blocking face,
in a worker thread by the async face). A transport performs its own I/O (an HTTP request, a Ray result) in
``perform`` and ``perform_async``, and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Blocking", "Exchange", "Sleep", "Transport", "TransportBase"]

Effect = TypeVar("Effect")


class Transport(Protocol):
    """What a client needs from a transport: one call per operation (keyword arguments), and closing; each blocking
    and async."""

    async def call(self, op: str, arguments: dict[str, Any]) -> Any: ...

    def call_sync(self, op: str, arguments: dict[str, Any]) -> Any: ...

    async def close(self) -> None: ...

    def close_sync(self) -> None: ...


@dataclass(frozen=True)
class Sleep:
    """Wait ``seconds`` (a retry's backoff)."""

    seconds: float


@dataclass(frozen=True)
class Blocking:
    """Run ``work`` (slow local work): in place on the blocking face, in a worker thread on the async face."""

    work: Callable[[], Any]


Exchange = Generator[Sleep | Blocking | Effect, Any, Any]
"""The work of one call: yields effects, gets each one's result back, returns the answer."""


class TransportBase(ABC, Generic[Effect]):
    """The blocking and async faces of a transport, both driving its exchanges; see the module doc."""

    @abstractmethod
    def exchange(self, op: str, arguments: dict[str, Any]) -> Exchange[Effect]:
        """One call of ``op``: the effects it needs, then the service's answer (its errors as arctic-rl's)."""

    @abstractmethod
    def closing(self) -> Exchange[Effect]:
        """Stop what this client owns (the service, a server it launched) and release its connections."""

    @abstractmethod
    def perform(self, effect: Effect) -> Any:
        """This transport's own I/O, blocking."""

    @abstractmethod
    async def perform_async(self, effect: Effect) -> Any:
        """This transport's own I/O, awaited."""

    def call_sync(self, op: str, arguments: dict[str, Any]) -> Any:
        return self._drive(self.exchange(op, arguments))

    async def call(self, op: str, arguments: dict[str, Any]) -> Any:
        return await self._drive_async(self.exchange(op, arguments))

    def close_sync(self) -> None:
        self._drive(self.closing())

    async def close(self) -> None:
        await self._drive_async(self.closing())

    # Every failure of an effect, KeyboardInterrupt and cancellation included, is raised inside the exchange at its
    # yield: the exchange handles it (a retry) or lets it through after its finally clauses, as straight code would.
    def _drive(self, exchange: Exchange[Effect]) -> Any:
        result: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = exchange.send(result) if error is None else exchange.throw(error)
            except StopIteration as done:
                return done.value
            finally:
                # The exchange holds the error now; this frame keeps no reference cycle through it.
                error = None
            try:
                result = self._perform(effect)
            except BaseException as raised:
                error = raised

    async def _drive_async(self, exchange: Exchange[Effect]) -> Any:
        result: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = exchange.send(result) if error is None else exchange.throw(error)
            except StopIteration as done:
                return done.value
            finally:
                error = None
            try:
                result = await self._perform_async(effect)
            except BaseException as raised:
                error = raised

    def _perform(self, effect: Sleep | Blocking | Effect) -> Any:
        if isinstance(effect, Sleep):
            time.sleep(effect.seconds)
            return None
        if isinstance(effect, Blocking):
            return effect.work()
        return self.perform(effect)

    async def _perform_async(self, effect: Sleep | Blocking | Effect) -> Any:
        if isinstance(effect, Sleep):
            await asyncio.sleep(effect.seconds)
            return None
        if isinstance(effect, Blocking):
            return await asyncio.to_thread(effect.work)
        return await self.perform_async(effect)
