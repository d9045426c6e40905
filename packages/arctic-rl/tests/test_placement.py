"""Placement planning without Ray: every layout's invariants, and the errors when a cluster is too small."""

from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arctic_rl.placement import (
    NodeResources,
    PlacementError,
    PlacementPlan,
    PlacementRequest,
    Role,
    WorkerSlot,
    plan_placement,
)


def workers_for(plan: PlacementPlan, role: Role) -> list[WorkerSlot]:
    """One engine's workers, by rank."""
    return sorted((w for w in plan.workers if w.role == role), key=lambda w: w.rank)


def nodes(count: int, gpus: int, cpus: float = 64.0) -> list[NodeResources]:
    return [
        NodeResources(node_id=f"{index:02d}" * 28, address="10.0.0.1", gpus=gpus, cpus=cpus) for index in range(count)
    ]


def check_invariants(request: PlacementRequest, cluster: list[NodeResources]) -> None:
    plan = plan_placement(request, cluster)
    by_id = {node.node_id: node for node in cluster}
    assert len({group.node_id for group in plan.groups}) == len(plan.groups), "one group per node"
    # Every worker of every engine exactly once, ranks 0..n-1.
    assert [w.rank for w in workers_for(plan, "training")] == list(range(request.training_devices))
    assert [w.rank for w in workers_for(plan, "log_prob")] == list(range(request.log_prob_devices))
    assert [w.rank for w in workers_for(plan, "sampling")] == list(range(request.sampling_replicas))
    resource = "GPU" if request.device == "cuda" else "CPU"
    claims: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: {"GPU": 0.0, "CPU": 0.0})
    for worker in plan.workers:
        group = plan.groups[worker.group_index]
        assert worker.node_id == group.node_id
        claims[(worker.group_index, worker.bundle_index)]["GPU"] += worker.num_gpus
        claims[(worker.group_index, worker.bundle_index)]["CPU"] += worker.num_cpus
        assert worker.num_gpus > 0 if request.device == "cuda" else worker.num_gpus == 0
        if worker.role == "sampling":
            # A tensor-parallel group stays in one node: in one bundle (split) or tp bundles of one group (colocated).
            if request.colocate:
                assert len(worker.bundle_indices) == request.tensor_parallel_size
            elif request.device == "cuda":
                assert group.bundles[worker.bundle_index]["GPU"] == request.tensor_parallel_size
    for (group_index, bundle_index), claimed in claims.items():
        bundle = plan.groups[group_index].bundles[bundle_index]
        assert claimed["GPU"] <= bundle.get("GPU", 0.0) + 1e-9
        assert claimed["CPU"] <= bundle.get("CPU", 0.0) + 1e-9
    for group in plan.groups:
        node = by_id[group.node_id]
        used = sum(bundle.get(resource, 0.0) for bundle in group.bundles)
        assert used <= (node.gpus if resource == "GPU" else node.cpus) + 1e-9
        assert sum(bundle.get("CPU", 0.0) for bundle in group.bundles) <= node.cpus + 1e-9
    if request.colocate:
        # Every device hosts training and sampling while their counts last; no device is used by one role twice.
        per_bundle = Counter((w.group_index, w.bundle_index, w.role) for w in plan.workers)
        assert max(per_bundle.values()) == 1
        assert sum(len(g.bundles) for g in plan.groups) == max(
            request.training_devices, request.sampling_devices, request.log_prob_devices
        )
    else:
        total = request.training_devices + request.log_prob_devices + request.sampling_replicas
        assert sum(len(g.bundles) for g in plan.groups) == total
        devices = sum(sum(b.get("GPU", 0.0) for b in g.bundles) for g in plan.groups)
        if request.device == "cuda":
            assert devices == request.training_devices + request.log_prob_devices + request.sampling_devices


@pytest.mark.parametrize("layout", [(1, 4), (2, 4), (2, 8)])
@pytest.mark.parametrize("colocate", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layouts_fill_the_cluster(layout: tuple[int, int], colocate: bool, tp: int) -> None:
    count, per_node = layout
    total = count * per_node
    if colocate:
        request = PlacementRequest(
            training_devices=total, sampling_devices=total, tensor_parallel_size=tp, colocate=True
        )
    else:
        sampling = max(tp, total // 2)
        if sampling == total:
            # 1x4 with TP 4: the sampler takes the node whole and a split trainer has nowhere to go.
            with pytest.raises(PlacementError, match="split layout needs 5 devices"):
                plan_placement(PlacementRequest(1, sampling, tensor_parallel_size=tp), nodes(count, per_node))
            return
        request = PlacementRequest(total - sampling, sampling, tensor_parallel_size=tp)
    check_invariants(request, nodes(count, per_node))


def test_split_keeps_training_ranks_together_and_tp_groups_inside_nodes() -> None:
    request = PlacementRequest(training_devices=8, sampling_devices=8, tensor_parallel_size=4)
    plan = plan_placement(request, nodes(2, 8))
    assert len({w.node_id for w in workers_for(plan, "training")}) == 1
    sampling = workers_for(plan, "sampling")
    assert len(sampling) == 2 and {w.num_gpus for w in sampling} == {4.0}


def test_colocated_shares_each_gpu_between_the_engines() -> None:
    request = PlacementRequest(training_devices=4, sampling_devices=4, log_prob_devices=4, colocate=True)
    plan = plan_placement(request, nodes(1, 4))
    assert len(plan.groups) == 1 and len(plan.groups[0].bundles) == 4
    for bundle_index in range(4):
        sharing = [w for w in plan.workers if w.bundle_index == bundle_index]
        assert sorted(w.role for w in sharing) == ["log_prob", "sampling", "training"]
        assert sum(w.num_gpus for w in sharing) <= 1.0
        assert all(w.num_gpus == pytest.approx(1 / 3, abs=1e-4) for w in sharing)


def test_cpu_machine_places_the_same_counts_as_small_cpu_claims() -> None:
    request = PlacementRequest(training_devices=2, sampling_devices=1, device="cpu", cpus_per_cpu_worker=0.25)
    plan = plan_placement(request, [NodeResources(node_id="a" * 56, address="127.0.0.1", gpus=0, cpus=2.0)])
    assert len(workers_for(plan, "training")) == 2 and len(workers_for(plan, "sampling")) == 1
    assert all(w.num_gpus == 0 and w.num_cpus == 0.25 for w in plan.workers)
    colocated = plan_placement(
        PlacementRequest(training_devices=2, sampling_devices=2, device="cpu", colocate=True),
        [NodeResources(node_id="a" * 56, address="127.0.0.1", gpus=0, cpus=2.0)],
    )
    assert sum(w.num_cpus for w in colocated.workers) <= 0.5


def test_errors_say_what_the_cluster_has_and_how_to_fix() -> None:
    with pytest.raises(PlacementError, match=r"split layout needs 9 devices.*colocate=True"):
        plan_placement(PlacementRequest(training_devices=5, sampling_devices=4), nodes(2, 4)[:1] + nodes(1, 4)[:0])
    with pytest.raises(PlacementError, match=r"needs 4 devices on one node"):
        plan_placement(PlacementRequest(training_devices=1, sampling_devices=4, tensor_parallel_size=4), nodes(2, 3))
    with pytest.raises(PlacementError, match=r"split a tensor-parallel group of 4 across nodes"):
        plan_placement(
            PlacementRequest(training_devices=6, sampling_devices=8, tensor_parallel_size=4, colocate=True), nodes(2, 6)
        )
    with pytest.raises(PlacementError, match=r"colocated layout needs 16 devices"):
        plan_placement(PlacementRequest(training_devices=16, sampling_devices=8, colocate=True), nodes(1, 8))
    with pytest.raises(PlacementError, match=r"multiple of tensor_parallel_size"):
        PlacementRequest(training_devices=1, sampling_devices=3, tensor_parallel_size=2)
    with pytest.raises(PlacementError, match=r"needs 1 devices on one node"):
        plan_placement(PlacementRequest(training_devices=1, sampling_devices=1), nodes(1, 0))


@settings(max_examples=150, deadline=None)
@given(
    node_gpus=st.lists(st.sampled_from([0, 1, 2, 4, 8]), min_size=1, max_size=4),
    training=st.integers(1, 12),
    replicas=st.integers(1, 6),
    tp=st.sampled_from([1, 2, 4]),
    log_prob=st.integers(0, 4),
    colocate=st.booleans(),
)
def test_any_plan_that_is_made_is_valid(
    node_gpus: list[int], training: int, replicas: int, tp: int, log_prob: int, colocate: bool
) -> None:
    cluster = [NodeResources(f"{i:02d}" * 28, "10.0.0.1", gpus, 64.0) for i, gpus in enumerate(node_gpus)]
    request = PlacementRequest(
        training_devices=training,
        sampling_devices=replicas * tp,
        log_prob_devices=log_prob,
        tensor_parallel_size=tp,
        colocate=colocate,
    )
    try:
        plan_placement(request, cluster)
    except PlacementError:
        # Refused requests must really not fit: more devices than the cluster has, or no room for a TP group.
        needed = max(training, replicas * tp, log_prob) if colocate else training + replicas * tp + log_prob
        assert needed > sum(node_gpus) or tp > max(node_gpus) or any(g % tp for g in node_gpus if g)
        return
    check_invariants(request, cluster)
