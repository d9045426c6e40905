"""Weight sync orchestration: the trainer's weights to every sampling replica, by the configured method.

``object_store``: every training rank gathers its parameters (collective under ZeRO-3), rank 0's full tensors go to
Ray's object store once, and each replica reads them from there. The cross-process methods (``nccl``,
``cuda_ipc``, ``gloo``) form a transfer group at the first sync that serves every later one: every rank iterates
its parameters and trainer rank 0 drives the samplers' start / update / finish through the fan-out it was given
(:class:`arctic_rl.actors.SamplerFanout`); finishing resets their prefix caches. The engines leave the group when
they stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from arctic_rl.engines.protocols import SamplingEngineProtocol, TrainingEngineProtocol

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
        import ray

        if self.method == "object_store":
            gathered = self.calls.call_all(training, TrainingEngineProtocol.iter_full_parameters)
            reference = ray.put(gathered[0])
            del gathered
            self.calls.call_all(sampling, SamplingEngineProtocol.update_weights, reference)
            return
        if not self.ready:
            self._set_up(training, sampling)
        self.calls.call_all(training, TrainingEngineProtocol.send_weights)

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
