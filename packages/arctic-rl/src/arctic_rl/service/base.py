"""What every part of the service shares: the config, the started engines, the engine calls, the sleep states, the
step's metrics and the weight sync. The operations live in one module per concern (:mod:`.generation`,
:mod:`.training`, :mod:`.weights`, :mod:`.sleep_wake`), each a class over this base; :class:`.rl_service.RLService`
combines them and creates the state (so that the operations' modules import none of its parts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from arctic_rl.errors import EngineStateError

if TYPE_CHECKING:
    from arctic_rl.config import ArcticRLClientConfig
    from arctic_rl.service.engine_calls import EngineCalls
    from arctic_rl.service.lifecycle import Engines
    from arctic_rl.service.sleep import SleepStates
    from arctic_rl.service.step_metrics import StepMetrics
    from arctic_rl.service.weight_sync import WeightSync

__all__ = ["ServiceBase"]


class ServiceBase:
    """The service's state, declared for the operations' classes (set by ``RLService.__init__``)."""

    config: ArcticRLClientConfig
    engines: Engines
    calls: EngineCalls
    states: SleepStates
    metrics: StepMetrics
    weight_sync: WeightSync
    _closed: bool

    def _require_open(self) -> None:
        if self._closed:
            raise EngineStateError("the service was shut down; create a new client.")
