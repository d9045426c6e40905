"""The engines' sleep state machine: each role is awake or asleep, operations that need a role awake are refused
while it sleeps (naming the call that wakes it), and a sleep or wake that changes nothing is refused. The samplers
sleep by vLLM's memory tags: ``wake_inference(["weights"])`` wakes their weights alone, so that a weight sync runs
before the KV cache takes its memory back (vLLM's order for colocated training), then
``wake_inference(["kv_cache"])``."""

from __future__ import annotations

from collections.abc import Callable

from arctic_rl.errors import ConfigError, EngineStateError
from arctic_rl.placement import Role

__all__ = ["SAMPLER_TAGS", "SleepStates"]

SAMPLER_TAGS: tuple[str, ...] = ("weights", "kv_cache")

_WAKE_CALL: dict[Role, str] = {
    "training": "wake_training()",
    "log_prob": "wake_log_prob()",
    "sampling": "wake_inference()",
}


class SleepStates:
    """Whether each engine role sleeps; all start awake."""

    def __init__(self) -> None:
        self.sleeping: dict[Role, bool] = {"training": False, "log_prob": False, "sampling": False}
        # The samplers' memory tags that sleep: all after sleep_inference(), fewer after wake_inference(tags).
        self.sampler_tags_asleep: set[str] = set()

    def require_awake(self, role: Role, operation: str) -> None:
        if not self.sleeping[role]:
            return
        if role == "sampling" and self.sampler_tags_asleep != set(SAMPLER_TAGS):
            still = sorted(self.sampler_tags_asleep)
            raise EngineStateError(
                f"{operation} needs the sampling engine awake, but its {' and '.join(still)} still sleep(s); call "
                f"wake_inference({still!r}) (or wake_inference()) first.",
                engine=role,
            )
        raise EngineStateError(
            f"{operation} needs the {role} engine awake; call {_WAKE_CALL[role]} first.", engine=role
        )

    def require_sampler_weights_awake(self, operation: str) -> None:
        """Weight updates need only the samplers' weights awake (their KV cache may still sleep)."""
        if "weights" in self.sampler_tags_asleep:
            raise EngineStateError(
                f"{operation} needs the sampling engine's weights awake; call wake_inference(['weights']) (or "
                "wake_inference()) first.",
                engine="sampling",
            )

    def sleep_sampling(self, engines: int, apply: Callable[[], object]) -> None:
        """Put every memory tag of the samplers to sleep (refused while any of them sleeps already)."""
        if self.sampler_tags_asleep and self.sampler_tags_asleep != set(SAMPLER_TAGS):
            still = sorted(self.sampler_tags_asleep)
            raise EngineStateError(
                f"the sampling engine's {' and '.join(still)} still sleep(s); call wake_inference({still!r}) before "
                "putting it to sleep again.",
                engine="sampling",
            )
        self.change("sampling", engines, "sleep", True, apply)
        self.sampler_tags_asleep = set(SAMPLER_TAGS)

    def wake_sampling(self, engines: int, tags: list[str] | None, apply: Callable[[], object]) -> None:
        """Wake the samplers' ``tags`` (None: all); refused when none of them sleeps."""
        wanted = set(SAMPLER_TAGS if tags is None else tags)
        unknown = wanted - set(SAMPLER_TAGS)
        if unknown or not wanted:
            raise ConfigError(
                f"wake_inference tags must be a non-empty list among {list(SAMPLER_TAGS)} (or None for all), got "
                f"{tags!r}."
            )
        if not engines:
            raise ConfigError("there is no sampling engine to wake (its GPU count is 0).")
        if not wanted & self.sampler_tags_asleep:
            raise EngineStateError(
                f"the sampling engine's {' and '.join(sorted(wanted))} are already awake; wake() changes nothing.",
                engine="sampling",
            )
        apply()
        self.sampler_tags_asleep -= wanted
        self.sleeping["sampling"] = bool(self.sampler_tags_asleep)

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
