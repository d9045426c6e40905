"""Per-step metrics the service reports: phase times, throughput, and the train/inference mismatch."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["PHASES", "StepTimer", "logprob_mismatch", "tokens_per_second"]

PHASES: tuple[str, ...] = ("generate", "log_prob", "train", "sync")


class StepTimer:
    """Wall-clock time per phase of a step; a phase timed twice adds up.

    ``with timer.phase("generate"): ...`` then ``timer.metrics()`` gives ``{"time/generate": seconds, ...,
    "time/step": total}``. Phases other than ``PHASES`` are allowed (reported under their own name).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._seconds: dict[str, float] = {}
        self._running: set[str] = set()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name in self._running:
            raise RuntimeError(f"phase {name!r} is already being timed; phases of one name cannot nest.")
        self._running.add(name)
        start = self._clock()
        try:
            yield
        finally:
            self._running.discard(name)
            self._seconds[name] = self._seconds.get(name, 0.0) + (self._clock() - start)

    def seconds(self, name: str) -> float:
        """Time spent in ``name`` so far (0 if it never ran)."""
        return self._seconds.get(name, 0.0)

    def metrics(self) -> dict[str, float]:
        """``time/<phase>`` for every phase that ran, and ``time/step``, their sum."""
        times = {f"time/{name}": seconds for name, seconds in self._seconds.items()}
        times["time/step"] = sum(self._seconds.values())
        return times

    def reset(self) -> None:
        if self._running:
            raise RuntimeError(f"cannot reset while phases {sorted(self._running)} are being timed.")
        self._seconds.clear()


def tokens_per_second(tokens: float, seconds: float) -> float:
    """Throughput; 0 when no time was measured (a phase that did not run)."""
    if tokens < 0 or seconds < 0:
        raise ValueError(f"tokens and seconds must be >= 0, got {tokens} and {seconds}.")
    return float(tokens) / seconds if seconds > 0 else 0.0


def logprob_mismatch(
    sampler_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's on the same tokens (the train/inference mismatch).

    Over the tokens where ``response_mask`` is 1 (all ``[B, R]``):

    - ``mismatch/abs_mean`` and ``mismatch/abs_max``: mean and max of ``|sampler - trainer|``;
    - ``mismatch/kl``: KL(sampler || trainer) estimated from the sampled tokens with the non-negative k3 estimator
      ``t/s - log(t/s) - 1`` (s, t the two probabilities), averaged over tokens;
    - ``mismatch/tokens``: the number of tokens compared.

    Computed in float64; an empty mask gives zeros.
    """
    shape = tuple(sampler_log_probs.shape)
    if tuple(trainer_log_probs.shape) != shape or tuple(response_mask.shape) != shape:
        raise ValueError(
            f"sampler_log_probs, trainer_log_probs and response_mask must have one shape, got {list(shape)}, "
            f"{list(trainer_log_probs.shape)} and {list(response_mask.shape)}."
        )
    mask = response_mask.detach().to("cpu").bool()
    sampler = sampler_log_probs.detach().to("cpu", torch.float64)[mask]
    trainer = trainer_log_probs.detach().to("cpu", torch.float64)[mask]
    tokens = int(mask.sum())
    if tokens == 0:
        return {"mismatch/abs_mean": 0.0, "mismatch/abs_max": 0.0, "mismatch/kl": 0.0, "mismatch/tokens": 0.0}
    difference = trainer - sampler
    absolute = difference.abs()
    kl = torch.expm1(difference) - difference
    return {
        "mismatch/abs_mean": float(absolute.mean()),
        "mismatch/abs_max": float(absolute.max()),
        "mismatch/kl": float(kl.mean()),
        "mismatch/tokens": float(tokens),
    }
