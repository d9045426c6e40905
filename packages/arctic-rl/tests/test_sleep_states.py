"""The service's sleep state machine alone (no engines): roles, and the samplers' memory tags woken one at a time."""

from __future__ import annotations

import pytest

from arctic_rl.errors import ConfigError, EngineStateError
from arctic_rl.service.sleep import SAMPLER_TAGS, SleepStates


class Calls:
    def __init__(self) -> None:
        self.made: list[str] = []

    def __call__(self, name: str) -> object:
        return lambda: self.made.append(name)


def test_the_samplers_wake_weights_first_then_the_kv_cache() -> None:
    states, calls = SleepStates(), Calls()
    states.sleep_sampling(1, calls("sleep"))
    assert states.sampler_tags_asleep == set(SAMPLER_TAGS) and states.sleeping["sampling"]
    with pytest.raises(EngineStateError, match=r"weights awake; call wake_inference\(\['weights'\]\)"):
        states.require_sampler_weights_awake("sync_weights()")
    with pytest.raises(EngineStateError, match=r"call wake_inference\(\) first"):
        states.require_awake("sampling", "generate()")

    states.wake_sampling(1, ["weights"], calls("wake weights"))
    states.require_sampler_weights_awake("sync_weights()")  # a weight update may run now
    assert states.sleeping["sampling"] and states.sampler_tags_asleep == {"kv_cache"}
    # Sampling still needs the KV cache; the message names the tag that sleeps.
    with pytest.raises(EngineStateError, match=r"its kv_cache still sleep.*wake_inference\(\['kv_cache'\]\)"):
        states.require_awake("sampling", "generate()")
    with pytest.raises(EngineStateError, match="weights are already awake"):
        states.wake_sampling(1, ["weights"], calls("wake weights again"))
    with pytest.raises(EngineStateError, match=r"kv_cache still sleep.*before putting it to sleep again"):
        states.sleep_sampling(1, calls("sleep again"))

    states.wake_sampling(1, ["kv_cache"], calls("wake kv_cache"))
    states.require_awake("sampling", "generate()")
    assert not states.sleeping["sampling"] and not states.sampler_tags_asleep
    # Refused calls never reached the engines.
    assert calls.made == ["sleep", "wake weights", "wake kv_cache"]


def test_waking_everything_and_waking_what_is_awake() -> None:
    states, calls = SleepStates(), Calls()
    with pytest.raises(EngineStateError, match="already awake"):
        states.wake_sampling(1, None, calls("wake while awake"))
    states.sleep_sampling(1, calls("sleep"))
    with pytest.raises(EngineStateError, match="already asleep"):
        states.sleep_sampling(1, calls("sleep while asleep"))
    # A wake that names an awake tag beside a sleeping one wakes the sleeping one.
    states.wake_sampling(1, ["weights"], calls("wake weights"))
    states.wake_sampling(1, None, calls("wake all"))
    assert not states.sleeping["sampling"]
    assert calls.made == ["sleep", "wake weights", "wake all"]


@pytest.mark.parametrize("tags", [["weights", "gpu"], [], ["KV"]])
def test_unknown_or_empty_tags_are_refused_before_the_engines(tags: list[str]) -> None:
    states, calls = SleepStates(), Calls()
    states.sleep_sampling(1, calls("sleep"))
    with pytest.raises(ConfigError, match=r"tags must be a non-empty list among \['weights', 'kv_cache'\]"):
        states.wake_sampling(1, tags, calls("wake"))
    assert calls.made == ["sleep"] and states.sampler_tags_asleep == set(SAMPLER_TAGS)


def test_no_sampling_engine_to_sleep_or_wake() -> None:
    states, calls = SleepStates(), Calls()
    with pytest.raises(ConfigError, match="no sampling engine"):
        states.sleep_sampling(0, calls("sleep"))
    with pytest.raises(ConfigError, match="no sampling engine"):
        states.wake_sampling(0, None, calls("wake"))
    assert calls.made == []
