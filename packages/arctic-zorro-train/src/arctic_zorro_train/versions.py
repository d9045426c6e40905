"""The transformers versions arctic-zorro-train is tested with, and the guard ``apply_zorro`` runs before patching.

zorro-train reimplements pieces of transformers' layers (the Gated DeltaNet forward, the attention dispatch), so a
transformers release that changes those layers can make the deduplicated gradients silently wrong while the
package's version bound is bypassed (an upgrade after install, a uv override). The guard refuses to patch under an
untested transformers unless the user opts in; after the opt-in it runs ``check_parity`` on a tiny model of the
architecture being patched (once per architecture and config shape per process) and patches only if it passes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from arctic_zorro_train.errors import ZorroPatchError

if TYPE_CHECKING:
    from arctic_zorro_train.parity import ParityReport
    from arctic_zorro_train.settings import ZorroSettings

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "TESTED_TRANSFORMERS",
    "check_transformers_version",
    "guard_transformers_version",
    "installed_transformers",
    "parity_check_running",
    "register_self_check",
]

# Lowest and newest transformers minor releases the parity tests ran on (any patch release of the minors between).
TESTED_TRANSFORMERS: tuple[tuple[int, int], tuple[int, int]] = ((5, 17), (5, 25))
ALLOW_UNTESTED_ENV = "ARCTIC_ZORRO_ALLOW_UNTESTED_TRANSFORMERS"

# Set while check_parity patches its own tiny model: that patch is the self-check, not a user's patch to guard.
_PARITY_CHECK_RUNNING: ContextVar[bool] = ContextVar("arctic_zorro_parity_check_running", default=False)


# The parity self-check (``arctic_zorro_train.parity`` registers it when imported; the package's ``__init__`` imports
# it): the guard calls it without importing the parity harness, which itself patches models through ``apply_zorro``.
SelfCheck = Callable[[Any, "ZorroSettings"], "ParityReport"]
_registered_self_check: SelfCheck | None = None


def register_self_check(check: SelfCheck) -> None:
    """Make ``check`` (``check_parity`` on a tiny copy of the model, cached per config shape) the guard's self-check."""
    global _registered_self_check
    _registered_self_check = check


def installed_transformers() -> str:
    import transformers

    return str(transformers.__version__)


def _minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def _tested_range() -> str:
    low, high = TESTED_TRANSFORMERS
    return f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"


def _install_tested() -> str:
    low, high = TESTED_TRANSFORMERS
    return f"pip install 'transformers>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'"


def check_transformers_version(allow_untested: bool | None = None, version: str | None = None) -> bool:
    """Whether the installed transformers (or ``version``) is outside ``TESTED_TRANSFORMERS`` and the user opted
    in; ``False`` for a tested release.

    Raises:
        ZorroPatchError: the release is untested and ``allow_untested`` is false (default: the
            ``ARCTIC_ZORRO_ALLOW_UNTESTED_TRANSFORMERS=1`` environment variable).
    """
    version = version or installed_transformers()
    low, high = TESTED_TRANSFORMERS
    if low <= _minor(version) <= high:
        return False
    if allow_untested is None:
        allow_untested = os.environ.get(ALLOW_UNTESTED_ENV, "") == "1"
    if not allow_untested:
        raise ZorroPatchError(
            f"transformers {version} is installed, but arctic-zorro-train is tested with transformers "
            f"{_tested_range()}; an untested release can make deduplicated gradients silently wrong. Install a "
            f"tested transformers ({_install_tested()}), or opt in with {ALLOW_UNTESTED_ENV}=1 (or "
            "apply_zorro(..., allow_untested_transformers=True)): zorro-train then checks parity on a tiny model "
            "of your architecture before patching."
        )
    return True


@contextmanager
def parity_check_running() -> Iterator[None]:
    """Within the block the guard lets patches through unchecked: ``check_parity`` patches its own tiny model
    under the very transformers it is checking."""
    token = _PARITY_CHECK_RUNNING.set(True)
    try:
        yield
    finally:
        _PARITY_CHECK_RUNNING.reset(token)


def guard_transformers_version(model: Any, settings: ZorroSettings, allow_untested: bool | None = None) -> None:
    """What ``apply_zorro`` runs before patching ``model``.

    A tested transformers passes. An untested one raises ``ZorroPatchError`` unless the user opted in
    (``check_transformers_version``); after the opt-in, the parity self-check must pass (then a warning says that
    patching goes ahead on an untested release), else ``ZorroPatchError`` names the worst parameters.
    """
    if _PARITY_CHECK_RUNNING.get() or not check_transformers_version(allow_untested):
        return
    version = installed_transformers()
    model_type = getattr(model.config, "model_type", type(model).__name__)
    command = "python -m arctic_zorro_train.check <model directory or config.json>"
    self_check = _registered_self_check
    if self_check is None:
        raise ZorroPatchError(
            f"transformers {version} is outside arctic-zorro-train's tested range ({_tested_range()}) and no parity "
            "self-check is registered to vet it: import arctic_zorro_train (its arctic_zorro_train.parity registers "
            f"the check), or install a tested transformers ({_install_tested()})."
        )
    try:
        report = self_check(model, settings)
    except Exception as error:
        raise ZorroPatchError(
            f"transformers {version} is outside arctic-zorro-train's tested range ({_tested_range()}), and the "
            f"parity self-check on a tiny {model_type} model could not run under it ({type(error).__name__}: "
            f"{error}); this release likely changed the layers zorro-train patches. Install a tested transformers "
            f"({_install_tested()})."
        ) from error
    if not report.passed:
        worst = ", ".join(f"{name} {error:.2e}" for name, error in list(report.failures().items())[:5])
        raise ZorroPatchError(
            f"transformers {version} is outside arctic-zorro-train's tested range ({_tested_range()}), and the "
            f"parity self-check on a tiny {model_type} model failed: deduplicated training would differ from plain "
            f"training (bound {report.tolerance:g}; worst: {worst}). Not patching. Install a tested transformers "
            f"({_install_tested()}); `{command}` prints the full table."
        )
    warnings.warn(
        f"transformers {version} is outside arctic-zorro-train's tested range ({_tested_range()}); patching "
        f"because {ALLOW_UNTESTED_ENV}=1 / allow_untested_transformers=True and the parity self-check on a tiny "
        f"{model_type} model passed ({report.summary()}).",
        stacklevel=3,
    )
