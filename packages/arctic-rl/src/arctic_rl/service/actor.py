"""The service as a named Ray actor: :func:`start_service` creates it and starts every engine through it,
:func:`attach_service` finds it from another process on the same Ray cluster."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from arctic_rl.errors import ArcticRLError, EngineStateError
from arctic_rl.service.rl_service import RLService

if TYPE_CHECKING:
    from arctic_rl.config import ArcticRLClientConfig

__all__ = ["DEFAULT_SERVICE_NAME", "SERVICE_NAMESPACE", "attach_service", "start_service"]

SERVICE_NAMESPACE = "arctic_rl"
DEFAULT_SERVICE_NAME = "arctic_rl_service"


def start_service(
    config: ArcticRLClientConfig,
    *,
    name: str = DEFAULT_SERVICE_NAME,
    engine_classes: Mapping[str, str] | None = None,
    placement_overrides: Mapping[str, Any] | None = None,
    start_timeout_s: float = 600.0,
) -> Any:
    """Create the named service actor, start every engine through it, and return its handle.

    A failure while starting kills the service actor too and raises the error (``EngineError`` naming the engine).
    """
    import ray

    from arctic_rl.actors import engines_runtime_env

    actor_class = ray.remote(RLService)
    handle = actor_class.options(
        name=name,
        namespace=SERVICE_NAMESPACE,
        num_cpus=0,
        max_restarts=0,
        max_concurrency=1,
        runtime_env=engines_runtime_env(),
    ).remote(
        config, engine_classes=engine_classes, placement_overrides=placement_overrides, start_timeout_s=start_timeout_s
    )
    from arctic_rl.progress import report, wait_with_heartbeat

    counts = {"training": config.training_gpus, "log_prob": config.log_prob_gpus, "sampling": config.sampling_gpus}
    units = "GPU" if config.resolved_device() == "cuda" else "CPU worker"
    report(
        "starting the engines ("
        + ", ".join(f"{role} x{count} {units}{'s' if count > 1 else ''}" for role, count in counts.items() if count)
        + "): each loads the model, DeepSpeed and vLLM set up (a minute or more on a small CPU)"
    )
    try:
        started = handle.start.remote()
        seconds = wait_with_heartbeat(
            lambda timeout_s: bool(ray.wait([started], timeout=timeout_s)[0]), "starting the engines"
        )
        ray.get(started)
        report(f"engines ready ({seconds:.0f} s)")
    except BaseException as error:
        ray.kill(handle, no_restart=True)
        from ray.exceptions import RayTaskError

        if isinstance(error, RayTaskError) and isinstance(error.cause, ArcticRLError):
            raise error.cause from None
        raise
    return handle


def attach_service(name: str = DEFAULT_SERVICE_NAME) -> Any:
    """The handle of a running service started by another process on the same Ray cluster."""
    import ray

    try:
        return ray.get_actor(name, namespace=SERVICE_NAMESPACE)
    except ValueError:
        raise EngineStateError(
            f"no arctic-rl service named {name!r} runs in Ray namespace {SERVICE_NAMESPACE!r}; start one with "
            "create_arctic_rl_client(config) first, on the same ray_address."
        ) from None
