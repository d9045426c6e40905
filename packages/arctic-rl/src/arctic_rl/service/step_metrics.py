"""A step's metrics as the service gathers them: phase times, token counts, dedup savings, sampler/trainer mismatch
and FCA counters, summed over the calls of the step and finished (with throughputs) when the optimizer steps."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from arctic_rl.metrics import StepTimer, tokens_per_second

__all__ = ["StepMetrics"]


class StepMetrics:
    """The current step's metrics (``add``, ``update``, ``timer`` phases) and the last finished step's."""

    def __init__(self) -> None:
        self.timer = StepTimer()
        self._current: dict[str, float] = {}
        self._last: dict[str, float] = {}
        # The samplers' FCA counters (running totals, summed over samplers) at the previous finish.
        self._fca_before: dict[str, float] = {}

    def add(self, values: Mapping[str, float]) -> None:
        """Add counts to the step's (tokens generated and trained, ZoRRO tokens)."""
        for key, value in values.items():
            self._current[key] = self._current.get(key, 0.0) + float(value)

    def update(self, values: Mapping[str, float]) -> None:
        """Set values that describe the step's latest call (the sampler/trainer mismatch)."""
        self._current.update(values)

    def reset(self) -> None:
        """Forget the current step (a checkpoint was loaded)."""
        self._current = {}
        self.timer.reset()

    def finish(self, fca_stats: Callable[[], list[dict[str, float]]] | None) -> dict[str, float]:
        """The finished step's metrics with throughputs and savings; the next step starts from zero.

        ``fca_stats`` (None when FCA is off) returns every sampler's FCA running totals; the step reports what they
        grew by since the previous finish (``fca/enabled`` as given)."""
        metrics = {**self._current, **self.timer.metrics()}
        metrics["throughput/generate_tokens_per_s"] = tokens_per_second(
            metrics.get("tokens/generated", 0.0), self.timer.seconds("generate")
        )
        metrics["throughput/train_tokens_per_s"] = tokens_per_second(
            metrics.get("tokens/trained", 0.0), self.timer.seconds("train")
        )
        base, dedup = metrics.get("zorro/base_tokens"), metrics.get("zorro/dedup_tokens")
        if base:
            metrics["zorro/savings"] = 1.0 - (dedup or 0.0) / base
        if fca_stats is not None:
            metrics.update(self._fca_step(fca_stats()))
        self._last = metrics
        self.reset()
        return metrics

    def _fca_step(self, stats: list[dict[str, float]]) -> dict[str, float]:
        totals = {key: sum(float(s.get(key, 0.0)) for s in stats) for key in stats[0]} if stats else {}
        step: dict[str, float] = {}
        for key, total in totals.items():
            before = self._fca_before.get(key, 0.0)
            # A total below its previous value: the counters were reset (a sampler restarted), count from zero.
            step[f"fca/{key}"] = total if key == "enabled" or total < before else total - before
        self._fca_before = totals
        return step

    def last(self) -> dict[str, float]:
        return dict(self._last)
