"""The same-host fast path's parts without a server: a planned blob is the safetensors blob that both decoders read
back bitwise; the in-place decoder refuses what the body decoder refuses and every inconsistent header entry; a slot
round-trips a message, is used once, refuses wrong names, nonces, sizes, writable mappings and expired uploads, and
leaves no file descriptor and no file behind; the client writes only into the slot it was announced."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from slot_helpers import memfd_slots, shm_files
from test_wire import assert_same, grpo_batch, safetensors_blob

from arctic_rl.errors import WireFormatError
from arctic_rl.wire import WIRE_DTYPES, decode_message, decode_message_view, encode_message, plan_message
from arctic_rl.wire_slots import SlotRegistry, SlotUnavailable, SlotUnusable, write_to_slot

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="shared-memory slots need memfd_create")

LIMIT = 1 << 20


def awkward_message() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    tensors = {
        str(dtype): (torch.randn(3, 5, generator=generator) * 50).to(dtype)
        for dtype in sorted(WIRE_DTYPES, key=str)
        if dtype.is_floating_point
    }
    tensors.update(
        int8=torch.randint(-128, 127, (7,), dtype=torch.int8, generator=generator),
        uint8=torch.randint(0, 255, (1, 3), dtype=torch.uint8, generator=generator),
        int16=torch.arange(-3, 2, dtype=torch.int16),
        int32=torch.arange(11, dtype=torch.int32).reshape(11, 1),
        bool=torch.tensor([True, False, True]),
        empty=torch.zeros(0, 4),
        scalar=torch.tensor(-1.5, dtype=torch.bfloat16),
        nan=torch.tensor([float("nan"), float("inf"), -0.0]),
    )
    return {"batch": grpo_batch(), "outputs": tensors, "meta": [1, "two", None, {"x": 2.5}]}


def test_a_planned_blob_is_read_back_bitwise_by_both_decoders() -> None:
    message = awkward_message()
    blob = plan_message(message).to_bytes()
    assert_same(decode_message(blob), message)
    assert_same(decode_message_view(bytearray(blob)), message)
    # The in-place decoder reads what safetensors itself wrote, too (another tensor order).
    assert_same(decode_message_view(bytearray(encode_message(message))), message)


def test_the_plan_aligns_every_tensor_and_refuses_what_encode_refuses() -> None:
    plan = plan_message(awkward_message())
    assert len(plan.header) % 8 == 0
    assert all(offset % tensor.element_size() == 0 for tensor, offset in plan.tensors)
    with pytest.raises(WireFormatError, match="more than max_bytes=1000"):
        plan_message({"x": torch.zeros(1000)}, max_bytes=1000)
    with pytest.raises(WireFormatError, match=r"message\['x'\]"):
        plan_message({"x": object()})


def test_decoded_views_are_writable_without_touching_the_sender() -> None:
    message = {"x": torch.arange(6, dtype=torch.float32)}
    blob = bytearray(plan_message(message).to_bytes())
    decoded = decode_message_view(blob)
    decoded["x"][0] = 99.0
    assert message["x"][0] == 0.0 and decoded["x"][0] == 99.0


def test_an_unaligned_tensor_is_copied_aligned() -> None:
    header = {
        "__metadata__": {"arctic_rl.format": "1", "arctic_rl.message": '{"x": {"__tensor__": "t0", "dtype": '
                         '"float32", "shape": [2]}, "y": {"__tensor__": "t1", "dtype": "uint8", "shape": [1]}}'},
        "t1": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "t0": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
    }  # fmt: skip
    values = struct.pack("<2f", 1.5, -2.0)
    text = json.dumps(header).encode()
    text += b" " * (-(len(text) + 8) % 8)
    blob = struct.pack("<Q", len(text)) + text + b"\x07" + values
    decoded = decode_message_view(bytearray(blob))
    assert decoded["x"].tolist() == [1.5, -2.0] and decoded["y"].tolist() == [7]
    assert decoded["x"].data_ptr() % 4 == 0


def entry_blob(entries: dict[str, Any], data: bytes, tree: str = '{"x": {"__tensor__": "t0"}}') -> bytearray:
    return bytearray(
        safetensors_blob({"__metadata__": {"arctic_rl.format": "1", "arctic_rl.message": tree}, **entries}, data)
    )


@pytest.mark.parametrize(
    ("entries", "data", "match"),
    [
        ({"t0": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "exactly dtype, shape and data_offsets"),
        ({"t0": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, "has dtype 'C64'"),
        ({"t0": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "non-negative integers"),
        ({"t0": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4, "non-negative integers"),
        ({"t0": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "0 <= begin <= end"),
        ({"t0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8 bytes"),
        ({"t0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
        ({"t0": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap"),
        ({"t0": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, "trailing bytes"),
        (
            {
                "t0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "t1": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
            "overlap",
        ),
        ({"t0": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "altered"),
        ({"t9": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "does not hold"),
    ],
)
def test_inconsistent_header_entries_are_refused_in_place(entries: dict[str, Any], data: bytes, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        decode_message_view(entry_blob(entries, data))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "an arctic-rl wire message is a safetensors blob"),
        (struct.pack("<Q", 99) + b"{}", "header claims"),
        (struct.pack("<Q", 4) + b"{{{{", "not valid JSON"),
        (safetensors_blob({}), "lacks arctic_rl.format"),
        (safetensors_blob({"__metadata__": {"arctic_rl.format": "1"}}), "lacks the message tree"),
    ],
)
def test_the_body_decoders_refusals_hold_in_place(data: bytes, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        decode_message_view(bytearray(data))
    with pytest.raises(WireFormatError, match="more than max_bytes=10"):
        decode_message_view(bytearray(plan_message({"x": torch.zeros(4)}).to_bytes()), max_bytes=10)


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 299), st.binary(min_size=1, max_size=8))
def test_corrupted_blobs_never_escape_as_another_error(noise: bytes, position: int, patch: bytes) -> None:
    blob = bytearray(plan_message({"x": torch.arange(5.0), "y": [torch.ones(2, dtype=torch.int8)]}).to_bytes())
    blob[position : position + len(patch)] = patch
    for data in (blob, bytearray(noise)):
        with contextlib.suppress(WireFormatError):
            decode_message_view(data)


def upload(registry: SlotRegistry, message: Any) -> tuple[dict[str, Any], bytes]:
    plan = plan_message(message)
    answer = registry.create(plan.size)
    return answer, write_to_slot(answer, plan).encode()


def test_a_slot_round_trips_once_and_leaves_nothing_behind() -> None:
    before_fds, before_files = memfd_slots(), shm_files()
    registry = SlotRegistry(LIMIT)
    message = awkward_message()
    answer, reference = upload(registry, message)
    assert registry.snapshot() == {"open": 1, "created": 1, "used": 0}
    assert shm_files() == before_files, "a slot must not be a named file"
    assert_same(registry.take_message(reference, LIMIT), message)
    assert registry.snapshot() == {"open": 0, "created": 1, "used": 1}
    with pytest.raises(WireFormatError, match="no open slot named"):
        registry.take_message(reference, LIMIT)
    assert memfd_slots() == before_fds and answer["size"] == plan_message(message).size


@pytest.mark.parametrize(
    "change",
    [
        {"slot": "../../etc/passwd"},
        {"slot": "/dev/shm/arctic-rl-slot-" + "0" * 32},
        {"slot": "arctic-rl-slot-" + "0" * 32},
        {"nonce": "00" * 16},
        {"nonce": ""},
        {"nonce": "\u00e9" * 32},
        {"nonce": "AB" * 16},
        {"size": 1},
        {"size": "12"},
        {"extra": 1},
    ],
)
def test_a_wrong_reference_is_refused_and_uses_nothing(change: dict[str, Any]) -> None:
    registry = SlotRegistry(LIMIT)
    message = {"x": torch.arange(4.0)}
    _, reference = upload(registry, message)
    bad = {**json.loads(reference), **change}
    with pytest.raises(WireFormatError, match=r"slot|nonce|JSON object"):
        registry.take_message(json.dumps(bad).encode(), LIMIT)
    if change.get("nonce") != "00" * 16 and change.get("size") != 1:
        # Malformed (or naming another slot): refused before the slot was looked up, so the real upload still works.
        assert_same(registry.take_message(reference, LIMIT), message)
    assert registry.snapshot()["open"] == 0
    registry.close()


@pytest.mark.parametrize("body", [b"", b"[]", b"{", b'{"slot": 1, "nonce": "", "size": 8}', b"\xff" * 9])
def test_malformed_references_are_refused(body: bytes) -> None:
    with pytest.raises(WireFormatError, match="JSON object"):
        SlotRegistry(LIMIT).take_message(body, LIMIT)


def test_slot_sizes_outside_the_limits_are_refused() -> None:
    registry = SlotRegistry(LIMIT, max_open_bytes=LIMIT + 100)
    for size, status in [(LIMIT + 1, 413), (3, 400), (-5, 400), (2.5, 400), ("64", 400), (True, 400)]:
        with pytest.raises(SlotUnavailable) as refused:
            registry.create(size)
        assert refused.value.status == status and len(refused.value.message) > 20
    registry.create(LIMIT)
    with pytest.raises(SlotUnavailable) as busy:
        registry.create(200)
    assert busy.value.status == 429
    registry.close()
    assert registry.snapshot()["open"] == 0 and not memfd_slots()


def test_open_slots_are_bounded_per_client_and_in_total_and_freed_on_use_and_expiry() -> None:
    registry = SlotRegistry(LIMIT, lifetime_s=0.3, max_open_slots=5, max_slots_per_client=3)
    for _ in range(3):
        registry.create(16, "127.0.0.1")
    with pytest.raises(SlotUnavailable, match="this client has 3 unused slots") as per_client:
        registry.create(16, "127.0.0.1")
    assert per_client.value.status == 429 and 0 < per_client.value.retry_after_s <= 0.3
    _, reference = upload_as(registry, {"x": torch.ones(2)}, "127.0.0.2")
    registry.create(16, "127.0.0.3")
    with pytest.raises(SlotUnavailable, match="5 slots are open") as total:
        registry.create(16, "127.0.0.4")
    assert total.value.status == 429 and total.value.retry_after_s is not None
    assert registry.snapshot()["open"] == 5 and len(memfd_slots()) == 5
    # A used slot is freed at once: another client may open one.
    registry.take_message(reference, LIMIT)
    registry.create(16, "127.0.0.4")
    # Expired slots are freed too (create() expires before it counts).
    time.sleep(0.35)
    for _ in range(3):
        registry.create(16, "127.0.0.1")
    assert registry.snapshot()["open"] == 3
    registry.close()
    assert not memfd_slots()


def upload_as(registry: SlotRegistry, message: Any, client: str) -> tuple[dict[str, Any], bytes]:
    plan = plan_message(message)
    answer = registry.create(plan.size, client)
    return answer, write_to_slot(answer, plan).encode()


def test_an_expired_slot_is_closed_and_refused() -> None:
    registry = SlotRegistry(LIMIT, lifetime_s=0.05)
    _, reference = upload(registry, {"x": torch.ones(3)})
    time.sleep(0.1)
    assert registry.expire() == 1 and not memfd_slots()
    with pytest.raises(WireFormatError, match="expired"):
        registry.take_message(reference, LIMIT)


def test_a_slot_still_mapped_writable_is_refused() -> None:
    registry = SlotRegistry(LIMIT)
    plan = plan_message({"x": torch.ones(3)})
    answer = registry.create(plan.size)
    reference = write_to_slot(answer, plan).encode()
    fd = os.open(answer["path"], os.O_RDWR)
    mapping = mmap.mmap(fd, plan.size)
    try:
        with pytest.raises(WireFormatError, match="still mapped writable"):
            registry.take_message(reference, LIMIT)
    finally:
        mapping.close()
        os.close(fd)
    assert registry.snapshot()["open"] == 0 and not memfd_slots()


def test_the_bytes_the_server_checked_cannot_change_after_the_request() -> None:
    registry = SlotRegistry(LIMIT)
    plan = plan_message({"x": torch.ones(3)})
    answer = registry.create(plan.size)
    reference = write_to_slot(answer, plan).encode()
    fd = os.open(answer["path"], os.O_RDWR)
    try:
        decoded = registry.take_message(reference, LIMIT)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\xff" * plan.size, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 8)
    finally:
        os.close(fd)
    assert decoded["x"].tolist() == [1.0, 1.0, 1.0]


def test_the_client_writes_only_into_the_announced_slot(tmp_path: Path) -> None:
    registry = SlotRegistry(LIMIT)
    plan = plan_message({"x": torch.ones(3)})
    answer = registry.create(plan.size)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep" * plan.size)
    with open(victim, "rb") as held:
        other = {**answer, "path": f"/proc/{os.getpid()}/fd/{held.fileno()}"}
        for bad in [
            other,
            {**answer, "path": str(victim)},
            {**answer, "path": "/proc/self/fd/../../../etc/passwd"},
            {**answer, "slot": "arctic-rl-slot-" + "f" * 32},
            {**answer, "slot": "../x"},
            {**answer, "size": plan.size + 1},
            [answer],
        ]:
            with pytest.raises(SlotUnusable):
                write_to_slot(bad, plan)
    assert victim.read_bytes() == b"keep" * plan.size
    registry.close()
