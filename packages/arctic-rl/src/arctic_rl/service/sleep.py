"""The engines' sleep state machine: each role is awake or asleep, operations that need a role awake are refused
while it sleeps (naming the call that wakes it), and a sleep or wake that changes nothing is refused."""

from __future__ import annotations

from collections.abc import Callable

from arctic_rl.errors import ConfigError, EngineStateError
from arctic_rl.placement import Role

__all__ = ["SleepStates"]

_WAKE_CALL: dict[Role, str] = {
    "training": "wake_training()",
    "log_prob": "wake_log_prob()",
    "sampling": "wake_inference()",
}


class SleepStates:
    """Whether each engine role sleeps; all start awake."""

    def __init__(self) -> None:
        self.sleeping: dict[Role, bool] = {"training": False, "log_prob": False, "sampling": False}

    def require_awake(self, role: Role, operation: str) -> None:
        if self.sleeping[role]:
            raise EngineStateError(
                f"{operation} needs the {role} engine awake; call {_WAKE_CALL[role]} first.", engine=role
            )

    def change(self, role: Role, engines: int, method: str, asleep: bool, apply: Callable[[], object]) -> None:
        """Put ``role`` to sleep (``asleep``) or wake it: ``apply()`` runs the engines' ``method``; refused when the
        role has no engine or is already in that state."""
        if not engines:
            raise ConfigError(f"there is no {role} engine to {method} (its GPU count is 0).")
        if self.sleeping[role] == asleep:
            state = "asleep" if asleep else "awake"
            raise EngineStateError(f"the {role} engine is already {state}; {method}() changes nothing.", engine=role)
        apply()
        self.sleeping[role] = asleep
