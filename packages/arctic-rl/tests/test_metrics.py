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


def test_step_metrics_report_what_the_fca_totals_grew_by_in_the_step() -> None:
    from arctic_rl.service.step_metrics import StepMetrics

    metrics = StepMetrics()
    samplers = [{"enabled": 1.0, "steps": 10.0, "saved_bytes_per_layer": 1000.0}, {"enabled": 1.0, "steps": 4.0}]
    first = metrics.finish(lambda: samplers)
    assert (first["fca/enabled"], first["fca/steps"], first["fca/saved_bytes_per_layer"]) == (2.0, 14.0, 1000.0)
    samplers[0] = {"enabled": 1.0, "steps": 25.0, "saved_bytes_per_layer": 1600.0}
    second = metrics.finish(lambda: samplers)
    assert (second["fca/enabled"], second["fca/steps"], second["fca/saved_bytes_per_layer"]) == (2.0, 15.0, 600.0)
    # Totals below the previous ones: the samplers' counters were reset, so the step counts from zero.
    samplers[:] = [{"enabled": 1.0, "steps": 3.0, "saved_bytes_per_layer": 50.0}]
    third = metrics.finish(lambda: samplers)
    assert (third["fca/enabled"], third["fca/steps"], third["fca/saved_bytes_per_layer"]) == (1.0, 3.0, 50.0)
    assert not any(key.startswith("fca/") for key in metrics.finish(None))
