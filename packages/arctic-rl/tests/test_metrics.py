import math

import pytest
import torch

from arctic_rl.metrics import StepTimer, logprob_mismatch, tokens_per_second


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_timer_adds_up_phases() -> None:
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    with timer.phase("generate"):
        clock.now += 2.0
    with timer.phase("train"):
        clock.now += 3.0
    with timer.phase("generate"):
        clock.now += 0.5
    assert timer.metrics() == {"time/generate": 2.5, "time/train": 3.0, "time/step": 5.5}
    assert timer.seconds("sync") == 0.0
    with pytest.raises(RuntimeError, match="already being timed"), timer.phase("sync"), timer.phase("sync"):
        pass
    with pytest.raises(ValueError), timer.phase("log_prob"):
        clock.now += 1.0
        raise ValueError("the phase still counts")
    assert timer.seconds("log_prob") == 1.0
    timer.reset()
    assert timer.metrics() == {"time/step": 0.0}


def test_step_timer_measures_wall_time() -> None:
    timer = StepTimer()
    with timer.phase("sync"):
        sum(range(10000))
    assert timer.seconds("sync") > 0.0


def test_tokens_per_second() -> None:
    assert tokens_per_second(300, 1.5) == 200.0
    assert tokens_per_second(300, 0.0) == 0.0
    with pytest.raises(ValueError):
        tokens_per_second(-1, 1.0)


def test_logprob_mismatch_by_hand() -> None:
    sampler = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.1, -1.8, 0.0], [-0.5, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    stats = logprob_mismatch(sampler, trainer, mask)
    differences = [-0.1, 0.2, 0.0]
    assert stats["mismatch/abs_mean"] == pytest.approx(0.3 / 3, abs=1e-7)
    assert stats["mismatch/abs_max"] == pytest.approx(0.2, abs=1e-7)
    kl = sum(math.exp(d) - d - 1 for d in differences) / 3
    assert stats["mismatch/kl"] == pytest.approx(kl, abs=1e-7)
    assert stats["mismatch/tokens"] == 3.0
    assert logprob_mismatch(sampler, sampler, mask)["mismatch/kl"] == 0.0
    assert logprob_mismatch(sampler, trainer, torch.zeros_like(mask))["mismatch/tokens"] == 0.0
    with pytest.raises(ValueError, match="one shape"):
        logprob_mismatch(sampler, trainer[:, :2], mask)
