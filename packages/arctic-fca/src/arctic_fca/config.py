"""The FCA switch and tuning knobs: one typed config, read from ``ARCTIC_FCA*`` environment variables."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields
from typing import Any

from arctic_dedup.forest import ForestGrouping

__all__ = ["ENABLE_VARIABLE", "RENAMED_KNOBS", "FcaConfig", "is_active", "renamed_knob", "set_active"]

ENABLE_VARIABLE = "ARCTIC_FCA"

# Earlier names of three knobs -> their names now, which are arctic_dedup.forest.ForestGrouping's, with its meaning:
# ``max_groups`` None is no limit and 0 groups nothing, where ``max_non_singleton_groups`` used 0 for no limit.
# The earlier names still work (FcaConfig(...), ARCTIC_FCA_<NAME>, arctic-rl's ``fca`` section), with a warning.
RENAMED_KNOBS: dict[str, str] = {
    "min_additional_prefix_blocks": "min_prefix_blocks",
    "min_non_singleton_fraction": "min_grouped_fraction",
    "max_non_singleton_groups": "max_groups",
}

_active = True


def renamed_knob(old: str, value: Any) -> tuple[str, Any]:
    """The current name and value of the knob ``old`` set to ``value`` under its earlier name (with a
    ``DeprecationWarning``): ``max_non_singleton_groups=0`` (no limit) is ``max_groups=None``."""
    new = RENAMED_KNOBS[old]
    meaning = " (None, not 0, means no limit; 0 groups nothing)" if new == "max_groups" else ""
    warnings.warn(f"the FCA knob {old!r} is renamed {new!r}{meaning}.", DeprecationWarning, stacklevel=3)
    if new == "max_groups" and value == 0:
        return new, None
    return new, value


def set_active(active: bool) -> None:
    """Pause (``False``) or resume FCA in this process without restarting vLLM.

    Paused steps are never grouped: they use standard attention, except steps of a batch size vLLM captured in a full
    CUDA graph with FCA inside, which run FCA's per-request decode (the same attention; a graph cannot switch).
    """
    global _active
    _active = active


def is_active() -> bool:
    return _active


@dataclass(frozen=True, init=False)
class FcaConfig:
    """Forest Cascade Attention settings (environment variable ``ARCTIC_FCA_<KNOB>`` in upper case for each knob).

    The names are arctic-rl's ``FcaSection``'s (``fca={...}`` in its client config), which writes these variables,
    and the grouping knobs are arctic-dedup's ``ForestGrouping``'s with the same meaning (:meth:`grouping`).

    Attributes:
        enable: ``ARCTIC_FCA=1`` registers the backend when vLLM loads its plugins; off by default.
            (Reading ``enabled``, its earlier name, still works with a ``DeprecationWarning``.)
        max_query_len: a step whose requests have more query tokens than this (a prefill, or a long speculative
            draft) runs vLLM's standard attention for the whole batch.
        min_group_size: fewest requests that must share a prefix for it to be read once for all of them.
        min_prefix_blocks: fewest shared full KV blocks a group needs; shorter shared prefixes are read per request,
            since reading them once saves less than a separate pass costs.
        min_grouped_fraction: if fewer than this fraction of a step's requests are in groups, the step is not
            grouped (every request reads its own context).
        max_groups: if a step has more groups than this, it is not grouped; None means no limit (0: no step is
            grouped). In the environment, ``none`` or an empty value is None.
        log_interval: log one step's stats every this many grouped-decode steps (on GPUs the counters are read from
            the device in a batch at that point, since reading them waits for the device).

    The earlier names ``min_additional_prefix_blocks``, ``min_non_singleton_fraction`` and
    ``max_non_singleton_groups`` (0: no limit) are still accepted as keywords and variables, with a
    ``DeprecationWarning`` (:data:`RENAMED_KNOBS`).
    """

    enable: bool = False
    max_query_len: int = 1
    min_group_size: int = 2
    min_prefix_blocks: int = 1
    min_grouped_fraction: float = 0.0
    max_groups: int | None = None
    log_interval: int = 100

    def __init__(
        self,
        enable: bool = False,
        max_query_len: int = 1,
        min_group_size: int = 2,
        min_prefix_blocks: int = 1,
        min_grouped_fraction: float = 0.0,
        max_groups: int | None = None,
        log_interval: int = 100,
        **earlier_names: Any,
    ) -> None:
        values: dict[str, Any] = {
            "enable": enable,
            "max_query_len": max_query_len,
            "min_group_size": min_group_size,
            "min_prefix_blocks": min_prefix_blocks,
            "min_grouped_fraction": min_grouped_fraction,
            "max_groups": max_groups,
            "log_interval": log_interval,
        }
        for old, value in earlier_names.items():
            if old not in RENAMED_KNOBS:
                raise TypeError(f"FcaConfig got an unexpected keyword argument {old!r}; its knobs are {list(values)}.")
            new, converted = renamed_knob(old, value)
            values[new] = converted
        for name, value in values.items():
            object.__setattr__(self, name, value)
        if self.max_query_len < 1:
            raise ValueError(f"max_query_len must be >= 1, got {self.max_query_len}")
        if self.log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {self.log_interval}")
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
            min_prefix_blocks=self.min_prefix_blocks,
            min_grouped_fraction=self.min_grouped_fraction,
            max_groups=self.max_groups,
        )

    @classmethod
    def from_env(cls) -> FcaConfig:
        """Read ``ARCTIC_FCA`` and ``ARCTIC_FCA_<KNOB>``; unset variables keep the defaults. A knob's variable under
        its earlier name is read when the current one is unset."""
        values: dict[str, Any] = {"enable": os.environ.get(ENABLE_VARIABLE, "0").strip().lower() in ("1", "true")}
        earlier = {new: old for old, new in RENAMED_KNOBS.items()}
        for field in fields(cls):
            if field.name == "enable":
                continue
            name = field.name
            raw = os.environ.get(_variable(name))
            if raw is None and name in earlier and _variable(earlier[name]) in os.environ:
                name, raw = earlier[name], os.environ[_variable(earlier[name])]
            if raw is None:
                continue
            value = _parse(field.name, _variable(name), raw)
            values[field.name] = renamed_knob(name, value)[1] if name != field.name else value
        return cls(**values)


def _variable(knob: str) -> str:
    return f"{ENABLE_VARIABLE}_{knob.upper()}"


def _parse(knob: str, variable: str, raw: str) -> int | float | None:
    if knob == "max_groups" and raw.strip().lower() in ("", "none"):
        return None
    kind = float if knob == "min_grouped_fraction" else int
    try:
        return kind(raw)
    except ValueError:
        default = getattr(FcaConfig(), knob)
        raise ValueError(
            f"{variable}={raw!r} is not a valid {kind.__name__}; set it to a number like {default!r} or unset it for "
            "the default."
        ) from None
