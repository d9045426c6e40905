"""The HTTP wire format: every batch field's dtype round-trips bitwise, nested outputs and empty tensors survive, the
tree is readable from the header alone, and anything that is not a message (or cannot be one) is refused by name."""

from __future__ import annotations

import contextlib
import json
import pickle
import struct
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arctic_rl.batch import build_grpo_batch
from arctic_rl.errors import WireFormatError
from arctic_rl.wire import WIRE_DTYPES, decode_message, encode_message, read_message_metadata


def assert_same(left: Any, right: Any) -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor)
        assert left.dtype == right.dtype and left.shape == right.shape
        assert torch.equal(left.flatten().view(torch.uint8), right.flatten().view(torch.uint8))
        return
    assert type(left) is type(right), (left, right)
    if isinstance(left, dict):
        assert list(left) == list(right)
        for key in left:
            assert_same(left[key], right[key])
    elif isinstance(left, list):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            assert_same(a, b)
    else:
        assert left == right


def grpo_batch() -> dict[str, torch.Tensor]:
    samples = [
        [{"token_ids": [5, 6, 7], "logprobs": [-0.5, -1.25, -2.0]}, {"token_ids": [8], "logprobs": [-0.1]}],
        [{"token_ids": [9, 10], "logprobs": [-3.0, -0.75]}],
    ]
    return build_grpo_batch([[1, 2], [3]], samples, [[1.0, 0.0], [0.5]], pad_token_id=0)


def test_every_batch_field_round_trips_bitwise() -> None:
    batch = grpo_batch()
    batch["ref_log_prob"] = torch.randn(batch["old_log_probs"].shape, dtype=torch.float64)
    message = {"batch": batch, "processing": {"loss_fn": "grpo", "config": {"clip_ratio_low": 0.2}}}
    decoded = decode_message(encode_message(message))
    assert_same(decoded, message)


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES, key=str))
def test_every_wire_dtype_round_trips_bitwise(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        tensor = torch.rand(3, 5, generator=generator) > 0.5
    elif dtype.is_floating_point:
        tensor = torch.randn(3, 5, generator=generator).to(dtype)
        tensor[0, 0], tensor[0, 1], tensor[0, 2] = float("nan"), float("inf"), -0.0
    else:
        info = torch.iinfo(dtype)
        tensor = torch.randint(info.min, info.max, (3, 5), generator=generator, dtype=torch.int64).to(dtype)
    decoded = decode_message(encode_message({"x": tensor}))["x"]
    assert decoded.dtype == dtype
    assert decoded.view(torch.uint8).tolist() == tensor.view(torch.uint8).tolist()


def test_nested_outputs_empty_tensors_views_and_numpy() -> None:
    base = torch.arange(12, dtype=torch.int64).view(3, 4)
    message = {
        "samples": [[{"token_ids": [1, 2], "logprobs": [-0.5, -0.25], "text": "é\n"}], []],
        "empty": torch.zeros(0, 7),
        "empty_int": torch.zeros(2, 0, dtype=torch.int32),
        "scalar": torch.tensor(3.5),
        # Views of one storage (safetensors refuses shared storage), one of them strided: each travels on its own.
        "whole": base,
        "column": base[:, 1],
        "rows": base[1:],
        "metrics": {"loss": 0.125, "nan": float("nan"), "steps": 3, "flag": True, "none": None},
    }
    decoded = decode_message(encode_message(message))
    assert torch.equal(decoded["column"], base[:, 1]) and torch.equal(decoded["rows"], base[1:])
    assert torch.equal(decoded["whole"], base)
    assert decoded["empty"].shape == (0, 7) and decoded["empty_int"].dtype == torch.int32
    assert decoded["scalar"].shape == () and float(decoded["scalar"]) == 3.5
    assert decoded["samples"] == message["samples"]
    assert np.isnan(decoded["metrics"].pop("nan"))
    message["metrics"].pop("nan")
    assert decoded["metrics"] == message["metrics"]
    from_numpy = decode_message(encode_message({"a": np.arange(4, dtype=np.int32), "b": np.float32(1.5)}))
    assert from_numpy["a"].dtype == torch.int32 and from_numpy["a"].tolist() == [0, 1, 2, 3]
    assert from_numpy["b"] == 1.5


def test_the_tree_is_readable_from_the_header_alone() -> None:
    data = encode_message({"batch": {"ids": torch.zeros(2, 3, dtype=torch.int64)}, "flag": False})
    # Cut the tensor bytes off: the header still says what the message holds.
    (header_size,) = struct.unpack("<Q", data[:8])
    tree = read_message_metadata(data[: 8 + header_size])
    assert tree == {"batch": {"ids": {"__tensor__": "t0", "dtype": "int64", "shape": [2, 3]}}, "flag": False}


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "where", "fix"),
    [
        (Opaque(), "message['x']", "cannot carry"),
        ({1, 2}, "message['x']", "cannot carry"),
        (b"raw", "message['x']", "cannot carry"),
        (1 + 2j, "message['x']", "cannot carry"),
        ({3: "a"}, "message['x']", "keys must be strings"),
        ({"__tensor__": "t0"}, "message['x']", "reserved key"),
        (torch.zeros(2, dtype=torch.complex64), "message['x']", "convert it"),
        (torch.zeros(2, dtype=torch.uint16), "message['x']", "convert it"),
        (torch.eye(2).to_sparse(), "message['x']", "to_dense"),
        (np.array([object()]), "message['x']", "numeric dtype"),
    ],
)
def test_values_the_format_cannot_carry_are_refused_by_name(value: Any, where: str, fix: str) -> None:
    with pytest.raises(WireFormatError) as raised:
        encode_message({"x": value})
    assert where in str(raised.value) and fix in str(raised.value)


def test_too_deep_a_tree_is_refused() -> None:
    deep: Any = 0
    for _ in range(40):
        deep = [deep]
    with pytest.raises(WireFormatError, match="nests deeper"):
        encode_message(deep)


def test_the_size_limit_is_kept_on_both_sides() -> None:
    message = {"x": torch.zeros(1000)}
    with pytest.raises(WireFormatError, match="more than max_bytes=1000"):
        encode_message(message, max_bytes=1000)
    data = encode_message(message)
    with pytest.raises(WireFormatError, match="more than max_bytes=4000"):
        decode_message(data, max_bytes=4000)
    assert decode_message(data, max_bytes=len(data))["x"].shape == (1000,)


def safetensors_blob(header: dict[str, Any], body: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "an arctic-rl wire message is a safetensors blob"),
        (pickle.dumps({"x": 1}), "header claims"),
        (struct.pack("<Q", 4) + b"{{{{", "not valid JSON"),
        (safetensors_blob([]), "not a JSON object"),  # type: ignore[arg-type]
        (safetensors_blob({}), "lacks arctic_rl.format"),
        (safetensors_blob({"__metadata__": {"arctic_rl.format": "1"}}), "lacks the message tree"),
        (safetensors_blob({"__metadata__": {"arctic_rl.format": "1", "arctic_rl.message": "{"}}), "not valid JSON"),
        (
            safetensors_blob(
                {"__metadata__": {"arctic_rl.format": "1", "arctic_rl.message": '{"x": {"__tensor__": "t9"}}'}}
            ),
            "does not hold",
        ),
        (
            safetensors_blob(
                {
                    "__metadata__": {"arctic_rl.format": "1", "arctic_rl.message": "{}"},
                    "t0": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                },
                b"\0" * 8,
            ),
            "malformed",
        ),
    ],
)
def test_bytes_that_are_not_a_message_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        decode_message(data)


def test_altered_and_unreferenced_tensors_are_refused() -> None:
    data = encode_message({"x": torch.zeros(2, 2), "y": torch.ones(3)})
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_size])
    tree = json.loads(header["__metadata__"]["arctic_rl.message"])

    def with_tree(new_tree: Any) -> bytes:
        header["__metadata__"]["arctic_rl.message"] = json.dumps(new_tree)
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data[8 + header_size :]

    with pytest.raises(WireFormatError, match="does not reference"):
        decode_message(with_tree({"x": tree["x"]}))
    with pytest.raises(WireFormatError, match="a second time"):
        decode_message(with_tree({"x": tree["x"], "y": tree["x"]}))
    with pytest.raises(WireFormatError, match="altered"):
        decode_message(with_tree({"x": {**tree["x"], "shape": [4]}, "y": tree["y"]}))


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_another_error(data: bytes) -> None:
    with contextlib.suppress(WireFormatError):
        decode_message(data)
