"""The HTTP wire format: a nested message of JSON values and tensors <-> one safetensors blob (never pickle).

A message is a tree of dicts (string keys), lists, JSON scalars (None, bool, int, float, str) and tensors, e.g.
``{"batch": {"input_ids": <[B, S] int64>, ...}, "processing": {"loss_fn": "grpo"}}``. Encoding takes every tensor out
of the tree into a safetensors file (named ``t0``, ``t1``, ... in the order met) and stores the tree itself, with each
tensor replaced by ``{"__tensor__": name, "dtype": ..., "shape": [...]}``, as JSON in the file's ``__metadata__``.
The tree, dtypes and shapes are therefore readable from the header alone (:func:`read_message_metadata`), and
decoding runs no code named by the sender: safetensors holds only raw numbers and the tree only JSON.

Tensors travel as contiguous CPU copies of their data, in one of :data:`WIRE_DTYPES`; numpy arrays are sent as
tensors and numpy scalars as JSON numbers. Anything else (objects, sets, bytes, complex numbers, non-string keys) is
refused on encoding with a message naming where in the message it sits; bytes that are not a message of this format
are refused on decoding (``WireFormatError``), and both sides refuse a blob larger than ``max_bytes``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from arctic_rl.errors import WireFormatError

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_MAX_BYTES",
    "WIRE_DTYPES",
    "MessagePlan",
    "decode_message",
    "decode_message_view",
    "encode_message",
    "plan_message",
    "read_message_metadata",
]

CONTENT_TYPE = "application/vnd.arctic-rl.safetensors"
# Larger than any batch of a few thousand samples of a few thousand tokens; raise it on both sides for bigger ones.
DEFAULT_MAX_BYTES = 2 * 1024**3
WIRE_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)
_FORMAT_KEY = "arctic_rl.format"
_FORMAT_VERSION = "1"
_MESSAGE_KEY = "arctic_rl.message"
_TENSOR_TAG = "__tensor__"
# Deeper trees are refused: no operation's message nests more than a few levels, and the bound keeps recursion safe.
_MAX_DEPTH = 32
_DTYPE_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in WIRE_DTYPES}
# safetensors' names of the wire dtypes (its header's "dtype" field).
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
# One write call moves at most this much, so the kernel's per-call limit (~2 GiB) is never reached.
_WRITE_CHUNK_BYTES = 256 * 1024**2


def encode_message(message: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """``message`` (dicts, lists, JSON scalars, tensors, numpy arrays) as one safetensors blob; see the module doc.

    Raises ``WireFormatError`` naming the offending entry (e.g. ``message['batch']['advantages']``) for a value the
    format cannot carry, and when the blob would exceed ``max_bytes``.
    """
    from safetensors.torch import save

    tree, tensors = _split_message(message, max_bytes)
    data = save(tensors, metadata=_metadata(tree))
    _check_encoded_size(len(data), max_bytes)
    return data


@dataclass(frozen=True)
class MessagePlan:
    """The layout of a message's safetensors blob: ``header`` (the 8-byte length and the JSON header, padded so the
    data starts 8-byte aligned) then each tensor's bytes at ``header_size + offset``; ``size`` bytes in all."""

    header: bytes
    tensors: tuple[tuple[torch.Tensor, int], ...]
    size: int

    def write_to_file(self, fd: int) -> None:
        """Write the blob at the start of the open file ``fd`` (one copy of each tensor's bytes, no blob in memory)."""
        _write_all(fd, memoryview(self.header), 0)
        for tensor, offset in self.tensors:
            if tensor.numel():
                _write_all(fd, tensor.reshape(-1).view(torch.uint8).numpy().data, len(self.header) + offset)

    def to_bytes(self) -> bytes:
        """The blob as one ``bytes`` object (what :func:`decode_message` and safetensors read)."""
        blob = bytearray(self.size)
        blob[: len(self.header)] = self.header
        for tensor, offset in self.tensors:
            data = tensor.reshape(-1).view(torch.uint8).numpy().data
            start = len(self.header) + offset
            blob[start : start + len(data)] = data
        return bytes(blob)


def plan_message(message: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> MessagePlan:
    """The layout of ``message``'s blob without building it (same checks and errors as :func:`encode_message`).

    Tensors are laid out widest dtype first, so every tensor starts at a multiple of its element size.
    """
    tree, tensors = _split_message(message, max_bytes)
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    entries: dict[str, Any] = {"__metadata__": _metadata(tree)}
    placed: list[tuple[torch.Tensor, int]] = []
    offset = 0
    for name in order:
        tensor = tensors[name]
        end = offset + tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _SAFETENSORS_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        placed.append((tensor, offset))
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    header = struct.pack("<Q", len(text)) + text
    _check_encoded_size(len(header) + offset, max_bytes)
    return MessagePlan(header=header, tensors=tuple(placed), size=len(header) + offset)


def _split_message(message: Any, max_bytes: int) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    tree = _strip_tensors(message, tensors, "message", 0)
    estimate = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    if estimate > max_bytes:
        raise WireFormatError(
            f"the message's tensors hold {estimate} bytes, more than max_bytes={max_bytes}; split the batch or raise "
            "the limit on both sides (the server's --max-request-mb and the client's http.max_request_mb)."
        )
    return tree, tensors


def _metadata(tree: Any) -> dict[str, str]:
    return {_FORMAT_KEY: _FORMAT_VERSION, _MESSAGE_KEY: json.dumps(tree, allow_nan=True)}


def _check_encoded_size(size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise WireFormatError(
            f"the encoded message has {size} bytes, more than max_bytes={max_bytes}; split the batch or raise "
            "the limit on both sides."
        )


def _write_all(fd: int, data: memoryview, position: int) -> None:
    done = 0
    while done < len(data):
        written = os.pwrite(fd, data[done : done + _WRITE_CHUNK_BYTES], position + done)
        if written <= 0:
            raise OSError(f"writing the wire message stopped after {done} of {len(data)} bytes")
        done += written


def read_message_metadata(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """The message tree of a blob with tensor placeholders (name, dtype, shape), read from the header only."""
    tree, _ = _read_header(data, max_bytes)
    return tree


def decode_message(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """The message encoded by :func:`encode_message`: the same tree, tensors back in place (CPU, same dtypes).

    Raises ``WireFormatError`` saying what is wrong for bytes that are not such a message, or over ``max_bytes``.
    """
    from safetensors.torch import load

    tree, header = _read_header(data, max_bytes)
    try:
        tensors = load(bytes(data))
    except Exception as error:  # safetensors raises its own error type for every malformed body
        raise WireFormatError(f"the safetensors body is malformed: {error}") from None
    return _restore_message(tree, tensors, declared=set(header) - {"__metadata__"})


def decode_message_view(buffer: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """The message in ``buffer`` (a writable buffer, e.g. a private ``mmap``), its tensors views of the buffer.

    Checks what :func:`decode_message` checks, and that every header entry has a wire dtype, a shape of
    non-negative integers and offsets that hold exactly that many bytes, the entries tiling the data without gaps or
    overlaps; a tensor not aligned to its element size is copied. The tensors keep ``buffer`` alive; writing to them
    writes to it. Raises ``WireFormatError`` saying what is wrong.
    """
    view = memoryview(buffer).cast("B")
    tree, header = _read_header(view, max_bytes)
    (header_size,) = struct.unpack("<Q", bytes(view[:8]))
    start = 8 + header_size
    tensors: dict[str, torch.Tensor] = {}
    extents: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _check_entry(name, entry)
        extents.append((begin, end, name))
        if end > len(view) - start:
            raise WireFormatError(
                f"tensor {name!r} ends at byte {end} of the data, which has {len(view) - start}; the body is truncated."
            )
        tensors[name] = _tensor_view(buffer, dtype, shape, start + begin)
    position = 0
    for begin, end, name in sorted(extents):
        if begin != position:
            raise WireFormatError(
                f"tensor {name!r} starts at data byte {begin}, expected {position}: the tensors' bytes overlap or "
                "leave a gap; the body is not a wire message."
            )
        position = end
    if position != len(view) - start:
        raise WireFormatError(
            f"the tensors cover {position} data bytes, the body has {len(view) - start}; the body is truncated or "
            "has trailing bytes."
        )
    return _restore_message(tree, tensors, declared=set(tensors))


def _check_entry(name: str, entry: Any) -> tuple[torch.dtype, list[int], int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise WireFormatError(
            f"the header entry of tensor {name!r} must hold exactly dtype, shape and data_offsets; got {entry!r}."
        )
    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise WireFormatError(
            f"tensor {name!r} has dtype {entry['dtype']!r}; the wire format carries {sorted(_SAFETENSORS_DTYPES)}."
        )
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(type(size) is int and size >= 0 for size in shape):
        raise WireFormatError(f"tensor {name!r} has shape {shape!r}; a shape is a list of non-negative integers.")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(offset) is int for offset in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise WireFormatError(
            f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end] with 0 <= begin <= end."
        )
    numel = math.prod(shape)
    begin, end = offsets
    if end - begin != numel * dtype.itemsize:
        raise WireFormatError(
            f"tensor {name!r} of shape {shape} {entry['dtype']} needs {numel * dtype.itemsize} bytes, its offsets "
            f"hold {end - begin}; the header is inconsistent."
        )
    return dtype, shape, begin, end


def _tensor_view(buffer: Any, dtype: torch.dtype, shape: list[int], offset: int) -> torch.Tensor:
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if offset % dtype.itemsize:
        # An unaligned view would be an unaligned tensor: some kernels assume alignment, so this one is copied.
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=numel * dtype.itemsize, offset=offset).clone()
        return raw.view(dtype).reshape(shape)
    return torch.frombuffer(buffer, dtype=dtype, count=numel, offset=offset).reshape(shape)


def _strip_tensors(value: Any, tensors: dict[str, torch.Tensor], where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise WireFormatError(f"{where} nests deeper than {_MAX_DEPTH} levels; flatten the message.")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, np.generic) and not isinstance(value, (np.complexfloating, np.void, np.object_)):
        return _strip_tensors(value.item(), tensors, where, depth)
    if isinstance(value, np.ndarray):
        value = _array_to_tensor(value, where)
    if isinstance(value, torch.Tensor):
        return _put_tensor(value, tensors, where)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireFormatError(f"{where} has the key {key!r} ({type(key).__name__}); keys must be strings.")
            if key == _TENSOR_TAG:
                raise WireFormatError(f"{where} uses the reserved key {_TENSOR_TAG!r}; rename it.")
            out[key] = _strip_tensors(item, tensors, f"{where}[{key!r}]", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_strip_tensors(item, tensors, f"{where}[{index}]", depth + 1) for index, item in enumerate(value)]
    raise WireFormatError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which the wire format cannot carry; send "
        "tensors, numpy arrays, dicts with string keys, lists, strings, numbers, booleans or None."
    )


def _array_to_tensor(array: np.ndarray, where: str) -> torch.Tensor:
    try:
        return torch.from_numpy(np.ascontiguousarray(array))
    except TypeError:
        raise WireFormatError(
            f"{where} is a numpy array of dtype {array.dtype}, which has no tensor equivalent; convert it to a "
            "numeric dtype."
        ) from None


def _put_tensor(tensor: torch.Tensor, tensors: dict[str, torch.Tensor], where: str) -> dict[str, Any]:
    if tensor.dtype not in WIRE_DTYPES:
        names = sorted(_DTYPE_NAMES)
        raise WireFormatError(f"{where} has dtype {tensor.dtype}; the wire format carries {names}: convert it.")
    if tensor.layout != torch.strided:
        raise WireFormatError(f"{where} is a {tensor.layout} tensor; send it dense (tensor.to_dense()).")
    name = f"t{len(tensors)}"
    dense = tensor.detach().to("cpu").contiguous()
    # safetensors refuses tensors that share storage (row slices of one batch do): such a view travels as a copy.
    storage = dense.untyped_storage().data_ptr()
    if dense.numel() and any(
        other.numel() and other.untyped_storage().data_ptr() == storage for other in tensors.values()
    ):
        dense = dense.clone()
    tensors[name] = dense
    return {_TENSOR_TAG: name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}


def _read_header(data: bytes | bytearray | memoryview, max_bytes: int) -> tuple[Any, dict[str, Any]]:
    size = len(data)
    if size > max_bytes:
        raise WireFormatError(
            f"the message has {size} bytes, more than max_bytes={max_bytes}; split the batch or raise the limit."
        )
    if size < 8:
        raise WireFormatError(f"the body has {size} bytes; an arctic-rl wire message is a safetensors blob.")
    (header_size,) = struct.unpack("<Q", bytes(data[:8]))
    if header_size > size - 8:
        raise WireFormatError(
            f"the safetensors header claims {header_size} bytes but the body has {size - 8} after the length; the "
            "body is truncated or not safetensors."
        )
    try:
        header = json.loads(bytes(data[8 : 8 + header_size]))
    except (ValueError, RecursionError):
        raise WireFormatError("the safetensors header is not valid JSON; the body is not a wire message.") from None
    if not isinstance(header, dict):
        raise WireFormatError("the safetensors header is not a JSON object; the body is not a wire message.")
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or metadata.get(_FORMAT_KEY) != _FORMAT_VERSION:
        raise WireFormatError(
            f"the safetensors metadata lacks {_FORMAT_KEY}={_FORMAT_VERSION!r}; encode the body with "
            "arctic_rl.wire.encode_message (a plain safetensors file carries no message tree)."
        )
    text = metadata.get(_MESSAGE_KEY)
    if not isinstance(text, str):
        raise WireFormatError(f"the safetensors metadata lacks the message tree {_MESSAGE_KEY!r}.")
    try:
        tree = json.loads(text)
    except (ValueError, RecursionError):
        raise WireFormatError("the message tree in the metadata is not valid JSON.") from None
    return tree, header


def _restore_tensors(value: Any, tensors: Mapping[str, torch.Tensor], used: set[str], where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise WireFormatError(f"{where} nests deeper than {_MAX_DEPTH} levels.")
    if isinstance(value, list):
        return [
            _restore_tensors(item, tensors, used, f"{where}[{index}]", depth + 1) for index, item in enumerate(value)
        ]
    if not isinstance(value, dict):
        return value
    if _TENSOR_TAG not in value:
        return {
            key: _restore_tensors(item, tensors, used, f"{where}[{key!r}]", depth + 1) for key, item in value.items()
        }
    name = value[_TENSOR_TAG]
    if not isinstance(name, str) or name not in tensors:
        raise WireFormatError(f"{where} references tensor {name!r}, which the body does not hold.")
    if name in used:
        raise WireFormatError(f"{where} references tensor {name!r} a second time; every tensor is referenced once.")
    used.add(name)
    tensor = tensors[name]
    if tensor.dtype not in WIRE_DTYPES:
        raise WireFormatError(f"{where} has dtype {tensor.dtype}, which the wire format does not carry.")
    if value.get("dtype") != str(tensor.dtype).removeprefix("torch.") or value.get("shape") != list(tensor.shape):
        raise WireFormatError(
            f"{where}: the message says dtype {value.get('dtype')!r} shape {value.get('shape')!r}, the body holds "
            f"{tensor.dtype} {list(tensor.shape)}; the body was altered after encoding."
        )
    return tensor


def _restore_message(tree: Any, tensors: Mapping[str, torch.Tensor], *, declared: set[str]) -> Any:
    """The message ``tree`` with its tensors back in place; every tensor the body ``declared`` must be used once."""
    used: set[str] = set()
    message = _restore_tensors(tree, tensors, used, "message", 0)
    unused = sorted(declared - used)
    if unused:
        raise WireFormatError(f"the body holds tensors {unused} that the message does not reference.")
    return message
