"""The FCA switch and tuning knobs: one typed config, read from ``ARCTIC_FCA*`` environment variables."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields

from arctic_dedup.forest import ForestGrouping

__all__ = ["ENABLE_VARIABLE", "FcaConfig", "is_active", "set_active"]

ENABLE_VARIABLE = "ARCTIC_FCA"

_active = True


def set_active(active: bool) -> None:
    """Pause (``False``) or resume FCA in this process without restarting vLLM.

    Paused steps are never grouped: they use standard attention, except steps of a batch size vLLM captured in a full
    CUDA graph with FCA inside, which run FCA's per-request decode (the same attention; a graph cannot switch).
    """
    global _active
    _active = active


def is_active() -> bool:
    return _active


@dataclass(frozen=True)
class FcaConfig:
    """Forest Cascade Attention settings (environment variable ``ARCTIC_FCA_<KNOB>`` in upper case for each knob).

    The names are arctic-rl's ``FcaSection``'s (``fca={...}`` in its client config), which writes these variables;
    :meth:`grouping` is the one translation into arctic-dedup's kernel-level ``ForestGrouping``.

    Attributes:
        enable: ``ARCTIC_FCA=1`` registers the backend when vLLM loads its plugins; off by default.
            (Reading ``enabled``, its earlier name, still works with a ``DeprecationWarning``.)
        max_query_len: a step whose requests have more query tokens than this (a prefill, or a long speculative
            draft) runs vLLM's standard attention for the whole batch.
        min_group_size: fewest requests that must share a prefix for it to be read once for all of them.
        min_additional_prefix_blocks: fewest shared full KV blocks a group needs; shorter shared prefixes are read per
            request, since reading them once saves less than a separate pass costs.
        min_non_singleton_fraction: if fewer than this fraction of a step's requests are in groups, the step is not
            grouped (every request reads its own context).
        max_non_singleton_groups: if a step has more groups than this, it is not grouped; 0 means no limit.
        log_interval: log the stats every this many grouped-decode steps: on CPU one step's line, on GPUs the
            interval's totals (the counters are summed on the device and read at that point, since reading them
            waits for the device).
    """

    enable: bool = False
    max_query_len: int = 1
    min_group_size: int = 2
    min_additional_prefix_blocks: int = 1
    min_non_singleton_fraction: float = 0.0
    max_non_singleton_groups: int = 0
    log_interval: int = 100

    def __post_init__(self) -> None:
        if self.max_query_len < 1:
            raise ValueError(f"max_query_len must be >= 1, got {self.max_query_len}")
        if self.max_non_singleton_groups < 0 or self.log_interval < 1:
            raise ValueError(
                f"max_non_singleton_groups must be >= 0 and log_interval >= 1, got {self.max_non_singleton_groups} "
                f"and {self.log_interval}"
            )
        self.grouping()

    @property
    def enabled(self) -> bool:
        """Deprecated: ``enable``, the name arctic-rl's ``fca`` section uses."""
        warnings.warn("FcaConfig.enabled is renamed FcaConfig.enable.", DeprecationWarning, stacklevel=2)
        return self.enable

    def grouping(self) -> ForestGrouping:
        """The kernel-level grouping rules these knobs stand for (the same names and meanings)."""
        return ForestGrouping(
            min_group_size=self.min_group_size,
            min_additional_prefix_blocks=self.min_additional_prefix_blocks,
            min_non_singleton_fraction=self.min_non_singleton_fraction,
            max_non_singleton_groups=self.max_non_singleton_groups,
        )

    @classmethod
    def from_env(cls) -> FcaConfig:
        """Read ``ARCTIC_FCA`` and ``ARCTIC_FCA_<KNOB>``; unset variables keep the defaults."""
        values: dict[str, object] = {"enable": os.environ.get(ENABLE_VARIABLE, "0").strip().lower() in ("1", "true")}
        for field in fields(cls):
            if field.name == "enable":
                continue
            variable = f"{ENABLE_VARIABLE}_{field.name.upper()}"
            raw = os.environ.get(variable)
            if raw is None:
                continue
            kind = float if field.type in ("float", float) else int
            try:
                values[field.name] = kind(raw)
            except ValueError:
                raise ValueError(
                    f"{variable}={raw!r} is not a valid {kind.__name__}; set it to a number like "
                    f"{getattr(cls(), field.name)!r} or unset it for the default."
                ) from None
        return cls(**values)  # type: ignore[arg-type]
