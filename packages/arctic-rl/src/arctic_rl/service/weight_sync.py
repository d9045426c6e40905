"""Weight sync orchestration: the trainer's weights to every sampling replica, by the configured method.

``object_store``: every training rank gathers its parameters (collective under ZeRO-3); rank 0's full tensors stay in
Ray's object store as its call's result, and each replica reads them from there (the service passes the reference
on, never fetching them). The cross-process methods (``nccl``,
``cuda_ipc``, ``gloo``) form a transfer group at the first sync that serves every later one: every rank iterates
its parameters and trainer rank 0 drives the samplers' start / update / finish through the fan-out it was given
(:class:`arctic_rl.actors.SamplerFanout`); finishing resets their prefix caches. The engines leave the group when
they stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from arctic_rl.engines.protocols import SamplingEngineProtocol, TrainingEngineProtocol
from arctic_rl.errors import ArcticRLError

if TYPE_CHECKING:
    from arctic_rl.actors import EngineHandle
    from arctic_rl.service.engine_calls import EngineCalls

__all__ = ["WeightSync"]


class WeightSync:
    """Sends the trainer's weights to the samplers; ``setups`` counts the transfer groups formed."""

    def __init__(self, calls: EngineCalls, method: str, sampler_tensor_parallel_size: int) -> None:
        self.calls = calls
        self.method = method
        self.sampler_tensor_parallel_size = sampler_tensor_parallel_size
        self.ready = False
        self.setups = 0

    def sync(
        self,
        training: Sequence[EngineHandle[TrainingEngineProtocol]],
        sampling: Sequence[EngineHandle[SamplingEngineProtocol]],
    ) -> None:
        if self.method == "object_store":
            self._sync_by_reference(training, sampling)
            return
        if not self.ready:
            self._set_up(training, sampling)
        self.calls.call_all(training, TrainingEngineProtocol.send_weights)

    def _sync_by_reference(
        self,
        training: Sequence[EngineHandle[TrainingEngineProtocol]],
        sampling: Sequence[EngineHandle[SamplingEngineProtocol]],
    ) -> None:
        """Rank 0's gathered parameters go to the samplers as a reference to its call's second return object: the
        samplers start as soon as rank 0 is done, and the tensors never pass through the service (no fetch, no
        second ``ray.put``)."""
        import ray

        from arctic_rl.service.engine_calls import Pending

        self.calls.require_alive([*training, *sampling])
        first = training[0]
        done, parameters = first.actor.call_split.options(num_returns=2).remote(
            TrainingEngineProtocol.iter_full_parameters.__name__
        )
        # Every rank gathers (a collective under ZeRO-3): start them all before waiting on any.
        gathers = [
            Pending(first, done),
            *(self.calls.start(handle, TrainingEngineProtocol.iter_full_parameters) for handle in training[1:]),
        ]
        updates: list[Pending[None]] = [
            Pending(handle, handle.actor.call.remote(SamplingEngineProtocol.update_weights.__name__, parameters))
            for handle in sampling
        ]
        try:
            self.calls.gather(gathers)
        except ArcticRLError:
            # The samplers' updates fail with rank 0's gather: the error is the trainer's, not theirs.
            ray.wait([call.reference for call in updates], num_returns=len(updates), timeout=self.calls.call_timeout_s)
            raise
        self.calls.gather(updates)

    def _set_up(
        self,
        training: Sequence[EngineHandle[TrainingEngineProtocol]],
        sampling: Sequence[EngineHandle[SamplingEngineProtocol]],
    ) -> None:
        """Form the trainer -> samplers transfer group once: every training rank builds vLLM's trainer-side engine,
        and rank 0 makes the samplers join while it opens its end (the rendezvous blocks both sides until the group
        forms). On failure both sides are closed, so the next sync starts the setup afresh."""
        from arctic_rl.actors import SamplerFanout

        fanout = SamplerFanout([(handle.name, handle.actor) for handle in sampling])
        rendezvous: dict[str, Any] = {}
        if self.method in ("nccl", "gloo"):
            # Trainer rank 0 hosts the rendezvous on its own node.
            rank0 = training[0]
            address, port = self.calls.get(rank0, [rank0.actor.node_ip.remote(), rank0.actor.free_port.remote()])
            rendezvous = {
                "master_address": address,
                "master_port": port,
                "sampler_world_size": len(sampling) * self.sampler_tensor_parallel_size,
            }
        try:
            self.calls.call_all(training, TrainingEngineProtocol.transfer_setup, self.method, fanout, **rendezvous)
        except BaseException:
            self.close([*training, *sampling])
            raise
        self.ready = True
        self.setups += 1

    def close(self, handles: Sequence[EngineHandle[Any]]) -> None:
        """Best effort: every engine leaves the transfer group (one that is gone has nothing to close)."""
        import ray

        closes = [handle.actor.call.remote("transfer_shutdown") for handle in handles]
        if closes:
            ray.wait(closes, num_returns=len(closes), timeout=30)
        self.ready = False
