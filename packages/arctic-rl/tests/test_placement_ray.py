"""Placement on a simulated multi-node Ray cluster (local nodes declaring GPUs): groups are created on the planned
nodes and every worker lands on its node and bundle, for 1x4, 2x4 and 2x8 layouts, split and colocated, TP 1/2/4."""

from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray_helpers import retry_start  # noqa: E402

from arctic_rl.placement import Placement, PlacementError, PlacementRequest, WorkerSlot, place  # noqa: E402

pytestmark = pytest.mark.slow

# Tiny CPU claims: the simulated nodes declare one CPU each, so nothing here can run more than a handful of workers.
CPU_CLAIM = 0.01


class SimulatedCluster:
    def __init__(self) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
        self.workers: list[Any] = []
        self.layout: tuple[int, int] | None = None
        ray.init(address=self.cluster.address, include_dashboard=False)

    def use_layout(self, count: int, gpus_per_node: int) -> None:
        if self.layout == (count, gpus_per_node):
            return
        self.layout = (count, gpus_per_node)
        for node in self.workers:
            self.cluster.remove_node(node)
        self.workers = [self.cluster.add_node(num_cpus=1, num_gpus=gpus_per_node) for _ in range(count)]
        self.cluster.wait_for_nodes()
        # Dead nodes linger in ray.nodes() as not alive; placement reads only alive ones.
        alive_gpus = sorted(int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"])
        assert alive_gpus == [0] + [gpus_per_node] * count

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimulatedCluster]:
    # A raylet that declares GPUs refuses to start when CUDA_VISIBLE_DEVICES names fewer (CPU test runs set it empty).
    with pytest.MonkeyPatch.context() as environment:
        environment.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        simulated = retry_start(SimulatedCluster)
        try:
            yield simulated
        finally:
            simulated.shutdown()


@ray.remote
def where_am_i() -> tuple[str, list[int]]:
    return ray.get_runtime_context().get_node_id(), [int(i) for i in ray.get_gpu_ids()]


@ray.remote
class Dummy:
    def __init__(self, role: str, rank: int) -> None:
        self.identity = (role, rank)

    def report(self) -> tuple[tuple[str, int], str, str | None, list[int]]:
        context = ray.get_runtime_context()
        return (
            self.identity,
            context.get_node_id(),
            context.get_placement_group_id(),
            [int(i) for i in ray.get_gpu_ids()],
        )


def check_landing(placement: Placement, reports: dict[WorkerSlot, tuple[str, list[int]]]) -> None:
    plan = placement.plan
    gpus_of_bundle: dict[tuple[int, int], set[int]] = {}
    for slot, (node_id, gpu_ids) in reports.items():
        assert node_id == slot.node_id, f"{slot.role} {slot.rank} landed on the wrong node"
        assert len(gpu_ids) == max(1, int(slot.num_gpus))
        gpus_of_bundle.setdefault((slot.group_index, slot.bundle_index), set()).update(gpu_ids)
    # Every bundle's workers see the bundle's own GPUs (shared when colocated), and no two bundles of a node overlap.
    for group_index, group in enumerate(plan.groups):
        seen: set[int] = set()
        for bundle_index, bundle in enumerate(group.bundles):
            gpu_ids = gpus_of_bundle.get((group_index, bundle_index))
            if gpu_ids is None:
                continue
            assert len(gpu_ids) == int(bundle["GPU"]), f"bundle {bundle_index} workers see GPUs {gpu_ids}"
            assert not gpu_ids & seen
            seen |= gpu_ids


def run_layout(cluster: SimulatedCluster, count: int, per_node: int, colocate: bool, tp: int) -> None:
    cluster.use_layout(count, per_node)
    total = count * per_node
    if colocate:
        request = PlacementRequest(total, total, tensor_parallel_size=tp, colocate=True, cpus_per_gpu_worker=CPU_CLAIM)
    else:
        sampling = max(tp, total // 2)
        if sampling == total:
            with pytest.raises(PlacementError, match="split layout needs"):
                place(PlacementRequest(1, sampling, tensor_parallel_size=tp, cpus_per_gpu_worker=CPU_CLAIM))
            return
        request = PlacementRequest(total - sampling, sampling, tensor_parallel_size=tp, cpus_per_gpu_worker=CPU_CLAIM)
    placement = place(request, timeout_s=60)
    try:
        table = ray.util.placement_group_table()
        for group_plan, group in zip(placement.plan.groups, placement.placement_groups, strict=True):
            entry = table[group.id.hex()]
            assert entry["state"] == "CREATED" and entry["strategy"] == "STRICT_PACK"
            assert set(entry["bundles_to_node_id"].values()) == {group_plan.node_id}
        slots = list(placement.plan.workers)
        results = ray.get([where_am_i.options(**placement.actor_options(slot)).remote() for slot in slots])
        check_landing(placement, dict(zip(slots, results, strict=True)))
    finally:
        placement.remove()
    assert all(entry["state"] == "REMOVED" for entry in ray.util.placement_group_table().values())


@pytest.mark.parametrize("colocate", [False, True])
def test_dummy_actors_report_their_node_bundle_and_gpus(cluster: SimulatedCluster, colocate: bool) -> None:
    cluster.use_layout(2, 4)
    request = PlacementRequest(2, 4, tensor_parallel_size=2, colocate=colocate, cpus_per_gpu_worker=CPU_CLAIM)
    placement = place(request, timeout_s=60)
    actors = []
    try:
        slots = list(placement.plan.workers)
        actors = [Dummy.options(**placement.actor_options(s)).remote(s.role, s.rank) for s in slots]
        reports = ray.get([actor.report.remote() for actor in actors])
        for slot, (identity, _, group_id, _) in zip(slots, reports, strict=True):
            assert identity == (slot.role, slot.rank)
            assert group_id == placement.placement_groups[slot.group_index].id.hex()
        check_landing(placement, {s: (r[1], r[3]) for s, r in zip(slots, reports, strict=True)})
        if colocate:
            # Training rank r and the sampling replica whose TP group starts at device r share that GPU.
            training = {s.bundle_index: r[3] for s, r in zip(slots, reports, strict=True) if s.role == "training"}
            for slot, report in zip(slots, reports, strict=True):
                if slot.role == "sampling" and slot.bundle_index in training:
                    assert report[3] == training[slot.bundle_index]
    finally:
        for actor in actors:
            ray.kill(actor)
        placement.remove()


def test_too_small_cluster_is_refused_before_anything_is_created(cluster: SimulatedCluster) -> None:
    cluster.use_layout(2, 4)
    before = len(ray.util.placement_group_table())
    with pytest.raises(PlacementError, match=r"split layout needs 10 devices"):
        place(PlacementRequest(6, 4, cpus_per_gpu_worker=CPU_CLAIM))
    assert len(ray.util.placement_group_table()) == before


# Layout outermost so the simulated cluster changes its nodes only twice.
CASES = [
    (count, per_node, colocate, tp)
    for count, per_node in [(1, 4), (2, 4), (2, 8)]
    for colocate in (False, True)
    for tp in (1, 2, 4)
]


@pytest.mark.parametrize("count,per_node,colocate,tp", CASES)
def test_workers_land_on_their_planned_node_and_bundle(
    cluster: SimulatedCluster, count: int, per_node: int, colocate: bool, tp: int
) -> None:
    run_layout(cluster, count, per_node, colocate, tp)
