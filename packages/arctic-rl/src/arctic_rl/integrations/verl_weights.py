"""verl's weight update after each PPO step, for an arctic-rl server: the weights never leave the server.

verl's trainer ends every step with ``CheckpointEngineManager.update_weights``: its colocated backend (``naive``)
pulls every tensor out of the actor's engine into the hybrid worker's in-process rollout, the others stream them
through a transfer group into the replicas' worker processes. Both move weights through verl's processes; the
arctic-rl trainer and samplers already share a transfer of their own (the client's ``sync_weights()``). Select
:class:`ArcticCheckpointEngineManager` with ``actor_rollout_ref.rollout.checkpoint_manager_class=`` ``FQN`` (verl's
hook for a custom manager): its ``update_weights`` wakes the samplers (verl put them to sleep after generating) and
calls ``sync_weights()`` once.

:class:`ArcticRollout` is the in-process rollout verl's hybrid worker builds for ``rollout.name=arctic``
(``actor_rollout_ref.hybrid_engine=true`` is the only layout verl 0.9.1's trainer runs): it holds nothing, and
refuses the weight pull of the ``naive`` backend, naming the manager above.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

try:
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.ray_utils import auto_await
    from verl.workers.rollout.base import BaseRollout
except ImportError as error:
    raise ImportError(
        f"arctic_rl.integrations.verl_weights is part of the verl plugin and needs verl ({error}); install it in "
        "the RL framework's environment beside the thin client: `pip install verl==0.9.1 arctic-rl`."
    ) from error

from arctic_rl.client import SyncArcticRLClient
from arctic_rl.integrations.verl_mapping import ArcticConnection

__all__ = ["MANAGER_CLASS", "ArcticCheckpointEngineManager", "ArcticRollout"]

# The value of verl's actor_rollout_ref.rollout.checkpoint_manager_class for an arctic-rl server.
MANAGER_CLASS = "arctic_rl.integrations.verl_weights.ArcticCheckpointEngineManager"


def _pull_refused(method: str) -> NotImplementedError:
    return NotImplementedError(
        f"ArcticRollout.{method}: verl's colocated weight pull (checkpoint_engine.backend=naive) moves every tensor "
        "through verl's worker, but the weights stay in the arctic-rl server; set "
        f"actor_rollout_ref.rollout.checkpoint_manager_class={MANAGER_CLASS} so that each step syncs them there "
        "(the client's sync_weights())."
    )


class ArcticRollout(BaseRollout):  # type: ignore[misc]
    """The hybrid worker's in-process rollout for ``rollout.name=arctic``: sampling goes through
    :class:`~arctic_rl.integrations.verl.ArcticRolloutReplica`, weight updates through
    :class:`ArcticCheckpointEngineManager`, so nothing lives here."""

    async def resume(self, tags: list[str]) -> None:
        raise _pull_refused("resume")

    async def release(self) -> None:
        raise _pull_refused("release")

    async def update_weights(self, weights: Generator[tuple[str, Any], None, None], **kwargs: Any) -> None:
        raise _pull_refused("update_weights")


class ArcticCheckpointEngineManager(CheckpointEngineManager):  # type: ignore[misc]
    """verl's ``CheckpointEngineManager`` for an arctic-rl server: ``update_weights`` is the client's
    ``sync_weights()`` (trainer -> samplers inside the server), after waking the samplers verl put to sleep.

    The sleep / wake / abort / KV-cache calls go to the replicas (:class:`~arctic_rl.integrations.verl.
    ArcticRolloutServer`) as with verl's own manager; elastic scaling (``add_replicas`` / ``remove_replicas``)
    only changes which replicas those calls reach, since every replica samples from the same server.
    """

    def __init__(
        self, config: Any, actor_wg: Any, replicas: list[Any], *, connection: ArcticConnection | None = None
    ) -> None:
        # verl's manager looks the backend class up for its transfer group; this one builds none.
        self.config = config
        self.backend = "arctic"
        self.actor_wg = actor_wg
        self.replicas = replicas
        self.connection = connection or ArcticConnection.from_environment()
        self._client: SyncArcticRLClient | None = None

    @property
    def client(self) -> SyncArcticRLClient:
        if self._client is None:
            self._client = self.connection.connect("arctic")
        return self._client

    def build_process_group(self, rollout: Any) -> None:
        raise NotImplementedError(
            "the arctic-rl trainer and samplers sync inside the server (the client's sync_weights()); there is no "
            "transfer group between verl's workers to build."
        )

    @auto_await  # type: ignore[untyped-decorator]
    async def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        """Wake the samplers, then sync the trainer's weights to them (verl's trainer calls this after every
        update, with the samplers asleep); returns ``{"arctic/sync_time_s": ...}`` for verl's step metrics."""
        await self.wake_up_replicas()
        # The blocking client runs in a thread: auto_await may have started a loop here that it must not block.
        timing = await asyncio.to_thread(self.client.sync_weights)
        return {f"arctic/sync_{name}": float(value) for name, value in timing.items()}
