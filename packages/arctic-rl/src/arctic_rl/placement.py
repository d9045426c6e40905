"""Where the engines run: a pure plan from the request and the cluster's node list, then Ray placement groups.

Two layouts:

- split: every training rank, log-prob rank and sampling replica gets devices of its own;
- colocated: the engines share devices and time-share their memory through sleep/wake; every device hosts a training
  rank, a sampling worker and a log-prob rank as far as their counts go, each claiming a fraction of it.

Either way the cluster gets one ``STRICT_PACK`` placement group per node it uses, pinned to that node, with one
bundle per device (split: one bundle per worker, a sampling replica's bundle holds its whole tensor-parallel group).
A tensor-parallel group never spans nodes. Without CUDA a "device" is a small CPU claim (``cpus_per_cpu_worker``),
so the counts that place GPU workers place as many CPU workers and a 2-core machine can host a whole small run.

:func:`plan_placement` is pure (tested without Ray); :func:`place` reads ``ray.nodes()``, plans, and creates the groups.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from arctic_rl.errors import ConfigError

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from arctic_rl.config import ArcticRLClientConfig

__all__ = [
    "GroupPlan",
    "NodeResources",
    "Placement",
    "PlacementError",
    "PlacementPlan",
    "PlacementRequest",
    "Role",
    "WorkerSlot",
    "place",
    "plan_placement",
]

Role = Literal["training", "log_prob", "sampling"]
ROLES: tuple[Role, ...] = ("training", "log_prob", "sampling")
# Ray accounts resources in units of 1e-4; claims are rounded down to it so fractions on one device never exceed 1.
_RESOURCE_QUANTUM = 10_000
_NODE_ID_LABEL = "ray.io/node-id"


class PlacementError(ConfigError):
    """The cluster cannot hold the requested engines, or its placement groups did not become ready."""


def _floor_quantum(value: float) -> float:
    return math.floor(value * _RESOURCE_QUANTUM + 1e-9) / _RESOURCE_QUANTUM


@dataclass(frozen=True)
class NodeResources:
    """One alive node of the cluster and what it declares (``ray.nodes()``)."""

    node_id: str
    address: str
    gpus: int
    cpus: float

    @staticmethod
    def from_ray_nodes(nodes: Iterable[Mapping[str, Any]]) -> list[NodeResources]:
        """The alive nodes of a ``ray.nodes()`` listing, in its order."""
        result = []
        for node in nodes:
            if not node.get("Alive", False):
                continue
            resources = node.get("Resources", {})
            result.append(
                NodeResources(
                    node_id=str(node["NodeID"]),
                    address=str(node.get("NodeManagerAddress", "")),
                    gpus=int(resources.get("GPU", 0)),
                    cpus=float(resources.get("CPU", 0.0)),
                )
            )
        return result


@dataclass(frozen=True)
class PlacementRequest:
    """How many workers of each engine, and how they share devices.

    ``sampling_devices`` counts devices (GPUs, or CPU worker slots); a sampling replica takes
    ``tensor_parallel_size`` of them on one node. ``cpus_per_gpu_worker`` is the CPU share of each GPU bundle;
    ``cpus_per_cpu_worker`` the CPU claim that stands for one device on a machine without CUDA.
    """

    training_devices: int
    sampling_devices: int
    log_prob_devices: int = 0
    tensor_parallel_size: int = 1
    colocate: bool = False
    device: Literal["cuda", "cpu"] = "cuda"
    cpus_per_gpu_worker: float = 1.0
    cpus_per_cpu_worker: float = 0.25

    def __post_init__(self) -> None:
        problems = []
        if self.training_devices < 1:
            problems.append(f"training_devices must be >= 1, got {self.training_devices}")
        if self.sampling_devices < 1:
            problems.append(f"sampling_devices must be >= 1, got {self.sampling_devices}")
        if self.log_prob_devices < 0:
            problems.append(f"log_prob_devices must be >= 0, got {self.log_prob_devices}")
        if self.tensor_parallel_size < 1:
            problems.append(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        elif self.sampling_devices % self.tensor_parallel_size:
            problems.append(
                f"sampling_devices ({self.sampling_devices}) must be a multiple of tensor_parallel_size "
                f"({self.tensor_parallel_size}): each sampling replica takes a whole tensor-parallel group"
            )
        if self.cpus_per_cpu_worker <= 0 or self.cpus_per_gpu_worker < 0:
            problems.append("cpus_per_cpu_worker must be > 0 and cpus_per_gpu_worker >= 0")
        if problems:
            raise PlacementError("invalid placement request: " + "; ".join(problems) + ".")

    @staticmethod
    def from_config(config: ArcticRLClientConfig, **overrides: Any) -> PlacementRequest:
        """The request a client config makes (``overrides`` set the CPU claims, e.g. in tests)."""
        fields: dict[str, Any] = {
            "training_devices": config.training_gpus,
            "sampling_devices": config.sampling_gpus,
            "log_prob_devices": config.log_prob_gpus,
            "tensor_parallel_size": config.sampling.tensor_parallel_size,
            "colocate": config.colocate,
            "device": config.resolved_device(),
        }
        fields.update(overrides)
        return PlacementRequest(**fields)

    @property
    def sampling_replicas(self) -> int:
        return self.sampling_devices // self.tensor_parallel_size


@dataclass(frozen=True)
class WorkerSlot:
    """Where one worker runs: its placement group, bundle(s) and the resources its actor claims.

    ``bundle_indices`` lists the bundles of the worker's devices inside its group (a sampling replica in a colocated
    layout spans ``tensor_parallel_size`` bundles; its actor claims from the first one).
    """

    role: Role
    rank: int
    node_id: str
    group_index: int
    bundle_indices: tuple[int, ...]
    num_gpus: float
    num_cpus: float

    @property
    def bundle_index(self) -> int:
        return self.bundle_indices[0]


@dataclass(frozen=True)
class GroupPlan:
    """One ``STRICT_PACK`` placement group, pinned to ``node_id``."""

    node_id: str
    bundles: tuple[dict[str, float], ...]


@dataclass(frozen=True)
class PlacementPlan:
    request: PlacementRequest
    groups: tuple[GroupPlan, ...]
    workers: tuple[WorkerSlot, ...]


@dataclass
class _NodeFill:
    node: NodeResources
    capacity: int
    used: int = 0
    # (role, rank, device offsets on this node) in placement order
    assignments: list[tuple[Role, int, tuple[int, ...]]] = field(default_factory=list)

    @property
    def free(self) -> int:
        return self.capacity - self.used


def _capacities(request: PlacementRequest, nodes: Sequence[NodeResources]) -> list[_NodeFill]:
    fills = []
    for node in nodes:
        if request.device == "cuda":
            capacity = node.gpus
            if request.cpus_per_gpu_worker > 0:
                capacity = min(capacity, int(node.cpus // request.cpus_per_gpu_worker + 1e-9))
        else:
            capacity = int(node.cpus // request.cpus_per_cpu_worker + 1e-9)
        fills.append(_NodeFill(node=node, capacity=max(0, capacity)))
    return fills


def _describe(request: PlacementRequest, fills: Sequence[_NodeFill]) -> str:
    unit = "GPU" if request.device == "cuda" else f"CPU worker slot ({request.cpus_per_cpu_worker} CPU)"
    listing = ", ".join(f"{fill.node.node_id[:8]}: {fill.capacity}" for fill in fills) or "no alive node"
    return f"{unit} per node [{listing}]"


def _plan_split(request: PlacementRequest, fills: list[_NodeFill]) -> None:
    tp = request.tensor_parallel_size
    # Tensor-parallel groups first (they need tp devices on one node), best fit so big holes stay for later groups;
    # then training ranks packed onto the fewest nodes (their gradient all-reduce), then log-prob ranks.
    for replica in range(request.sampling_replicas):
        candidates = [fill for fill in fills if fill.free >= tp]
        if not candidates:
            raise PlacementError(
                f"sampling replica {replica} needs {tp} devices on one node (tensor_parallel_size={tp}) and no node "
                f"has them left after {replica} replicas; the cluster has {_describe(request, fills)}. "
                "Lower sampling_gpus or tensor_parallel_size, or add nodes."
            )
        target = min(candidates, key=lambda fill: fill.free)
        target.assignments.append(("sampling", replica, tuple(range(target.used, target.used + tp))))
        target.used += tp
    for role, count in (("training", request.training_devices), ("log_prob", request.log_prob_devices)):
        for rank in range(count):
            candidates = [fill for fill in fills if fill.free >= 1]
            if not candidates:
                needed = request.training_devices + request.log_prob_devices + request.sampling_devices
                raise PlacementError(
                    f"a split layout needs {needed} devices (training {request.training_devices} + sampling "
                    f"{request.sampling_devices} + log-prob {request.log_prob_devices}) and the cluster has "
                    f"{_describe(request, fills)}. Use colocate=True to share devices, lower the counts, or add nodes."
                )
            # Keep ranks of one engine together: continue on the node already used by this engine when it has room.
            target = max(candidates, key=lambda fill: (any(a[0] == role for a in fill.assignments), fill.free))
            target.assignments.append((role, rank, (target.used,)))  # type: ignore[arg-type]
            target.used += 1


def _plan_colocated(request: PlacementRequest, fills: list[_NodeFill]) -> None:
    tp = request.tensor_parallel_size
    devices = max(request.training_devices, request.sampling_devices, request.log_prob_devices)
    remaining = devices
    sampling_left = request.sampling_devices
    counters = dict.fromkeys(ROLES, 0)
    totals: dict[Role, int] = {
        "training": request.training_devices,
        "log_prob": request.log_prob_devices,
        "sampling": request.sampling_replicas,
    }
    for fill in fills:
        if remaining == 0:
            break
        take = min(remaining, fill.capacity)
        sampling_here = min(sampling_left, take)
        if take == 0:
            continue
        if sampling_here % tp:
            raise PlacementError(
                f"a colocated layout puts {sampling_here} sampling devices on node {fill.node.node_id[:8]}, which "
                f"would split a tensor-parallel group of {tp} across nodes (the cluster has "
                f"{_describe(request, fills)}). "
                "Pick a tensor_parallel_size that divides the devices per node, or sampling_gpus that fill whole nodes."
            )
        for offset in range(take):
            for role in ("training", "log_prob"):
                if counters[role] < totals[role]:  # type: ignore[index]
                    fill.assignments.append((role, counters[role], (offset,)))  # type: ignore[arg-type, index]
                    counters[role] += 1  # type: ignore[index]
        for first in range(0, sampling_here, tp):
            fill.assignments.append(("sampling", counters["sampling"], tuple(range(first, first + tp))))
            counters["sampling"] += 1
        fill.used = take
        remaining -= take
        sampling_left -= sampling_here
    if remaining or sampling_left:
        raise PlacementError(
            f"a colocated layout needs {devices} devices with every tensor-parallel group (size {tp}) inside one node, "
            f"and the cluster has {_describe(request, fills)}. Lower the counts, pick a tensor_parallel_size that "
            "divides the devices per node, or add nodes."
        )


def plan_placement(request: PlacementRequest, nodes: Sequence[NodeResources]) -> PlacementPlan:
    """Decide which node, group and bundle every worker gets, and what each actor claims. Pure: no Ray calls."""
    fills = _capacities(request, nodes)
    if request.colocate:
        _plan_colocated(request, fills)
    else:
        _plan_split(request, fills)

    gpu_mode = request.device == "cuda"
    groups: list[GroupPlan] = []
    workers: list[WorkerSlot] = []
    for fill in fills:
        if not fill.assignments:
            continue
        group_index = len(groups)
        # Device offset -> bundle index, and which workers share each bundle.
        device_offsets = sorted({offset for _, _, offsets in fill.assignments for offset in offsets})
        if request.colocate:
            bundle_of = {offset: index for index, offset in enumerate(device_offsets)}
            bundle_sizes = [1] * len(device_offsets)
        else:
            bundle_of = {offsets[0]: index for index, (_, _, offsets) in enumerate(fill.assignments)}
            bundle_sizes = [len(offsets) for _, _, offsets in fill.assignments]
        bundles: list[dict[str, float]] = []
        for size in bundle_sizes:
            if gpu_mode:
                bundle = {"GPU": float(size)}
                if request.cpus_per_gpu_worker > 0:
                    bundle["CPU"] = request.cpus_per_gpu_worker * size
            else:
                bundle = {"CPU": _floor_quantum(request.cpus_per_cpu_worker * size)}
            bundles.append(bundle)
        sharers = [0] * len(bundles)
        for _, _, offsets in fill.assignments:
            sharers[bundle_of[offsets[0]]] += 1
        for role, rank, offsets in fill.assignments:
            first = bundle_of[offsets[0]]
            indices = tuple(bundle_of[o] for o in offsets) if request.colocate else (first,)
            share = 1.0 / sharers[first]
            bundle = bundles[first]
            workers.append(
                WorkerSlot(
                    role=role,
                    rank=rank,
                    node_id=fill.node.node_id,
                    group_index=group_index,
                    bundle_indices=indices,
                    num_gpus=_floor_quantum(bundle.get("GPU", 0.0) * share),
                    num_cpus=_floor_quantum(bundle.get("CPU", 0.0) * share),
                )
            )
        groups.append(GroupPlan(node_id=fill.node.node_id, bundles=tuple(bundles)))
    workers.sort(key=lambda w: (ROLES.index(w.role), w.rank))
    return PlacementPlan(request=request, groups=tuple(groups), workers=tuple(workers))


class Placement:
    """The placement groups of a plan, created in Ray; gives each worker's actor options; removes them."""

    def __init__(self, plan: PlacementPlan, placement_groups: Sequence[PlacementGroup]) -> None:
        self.plan = plan
        self.placement_groups = list(placement_groups)

    def actor_options(self, slot: WorkerSlot) -> dict[str, Any]:
        """``ActorClass.options(**...)`` for the worker: its claims and its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_gpus": slot.num_gpus,
            "num_cpus": slot.num_cpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_groups[slot.group_index],
                placement_group_bundle_index=slot.bundle_index,
                placement_group_capture_child_tasks=True,
            ),
        }

    def remove(self) -> None:
        """Remove every placement group (idempotent)."""
        from ray.util.placement_group import remove_placement_group

        groups, self.placement_groups = self.placement_groups, []
        for group in groups:
            remove_placement_group(group)


def place(request: PlacementRequest, *, timeout_s: float = 120.0, name_prefix: str = "arctic_rl") -> Placement:
    """Plan against the live cluster (``ray.nodes()``) and create the pinned placement groups; wait until ready."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    plan = plan_placement(request, NodeResources.from_ray_nodes(ray.nodes()))
    created: list[PlacementGroup] = []
    try:
        for index, group in enumerate(plan.groups):
            created.append(
                placement_group(
                    [dict(bundle) for bundle in group.bundles],
                    strategy="STRICT_PACK",
                    name=f"{name_prefix}_{index}",
                    bundle_label_selector=[{_NODE_ID_LABEL: group.node_id} for _ in group.bundles],
                )
            )
        _, pending = ray.wait([pg.ready() for pg in created], num_returns=len(created), timeout=timeout_s)
        if pending:
            raise PlacementError(
                f"{len(pending)} of {len(created)} placement groups were not ready after {timeout_s:.0f} s "
                f"(plan: {[g.bundles for g in plan.groups]}); another job may hold the resources. Free them or "
                "lower the requested counts."
            )
    except BaseException:
        for group in created:
            remove_placement_group(group)
        raise
    return Placement(plan, created)
