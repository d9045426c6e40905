"""The transformers versions arctic-zorro-train is tested with, and the guard ``apply_zorro`` runs before patching.

zorro-train reimplements pieces of transformers' layers (the Gated DeltaNet forward, the attention dispatch), so a
transformers release that changes those layers can make the deduplicated gradients silently wrong while the
package's version bound is bypassed (an upgrade after install, a uv override). The guard refuses to patch under an
untested transformers unless the user opts in.
"""

from __future__ import annotations

import os
import warnings

from arctic_zorro_train.errors import ZorroPatchError

__all__ = ["ALLOW_UNTESTED_ENV", "TESTED_TRANSFORMERS", "check_transformers_version", "installed_transformers"]

# Lowest and newest transformers minor releases the parity tests ran on (any patch release of the minors between).
TESTED_TRANSFORMERS: tuple[tuple[int, int], tuple[int, int]] = ((5, 17), (5, 25))
ALLOW_UNTESTED_ENV = "ARCTIC_ZORRO_ALLOW_UNTESTED_TRANSFORMERS"


def installed_transformers() -> str:
    import transformers

    return str(transformers.__version__)


def _minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def check_transformers_version(allow_untested: bool | None = None, version: str | None = None) -> None:
    """Raise ``ZorroPatchError`` when the installed transformers is outside ``TESTED_TRANSFORMERS``, unless
    ``allow_untested`` (default: the ``ARCTIC_ZORRO_ALLOW_UNTESTED_TRANSFORMERS=1`` environment variable)."""
    version = version or installed_transformers()
    low, high = TESTED_TRANSFORMERS
    tested = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    if low <= _minor(version) <= high:
        return
    if allow_untested is None:
        allow_untested = os.environ.get(ALLOW_UNTESTED_ENV, "") == "1"
    if not allow_untested:
        raise ZorroPatchError(
            f"transformers {version} is installed, but arctic-zorro-train is tested with transformers {tested}; "
            "an untested release can make deduplicated gradients silently wrong. Install a tested transformers "
            f"(pip install 'transformers>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'), or opt in with "
            f"{ALLOW_UNTESTED_ENV}=1 (or apply_zorro(..., allow_untested_transformers=True))."
        )
    warnings.warn(
        f"transformers {version} is outside arctic-zorro-train's tested range ({tested}); patching anyway "
        f"because {ALLOW_UNTESTED_ENV}=1 / allow_untested_transformers=True.",
        stacklevel=3,
    )
