"""Weight buckets, shared by every transfer path: a stream of ``(name, tensor)`` grouped into buckets of at most
``bucket_bytes``, and the flat buffer a bucket travels in over a collective (each tensor at an :data:`ALIGNMENT`-byte
offset, so its bytes can be viewed in its own dtype)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

__all__ = ["ALIGNMENT", "bucket_named_tensors", "bucket_spans", "pack_bucket", "unpack_bucket"]

ALIGNMENT = 64
"""Byte alignment of every tensor inside a bucket's flat buffer."""


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of ``(name, tensor)`` into lists of at most ``bucket_bytes`` (a larger tensor goes alone).

    Lazy: a generator that gathers parameters one by one (ZeRO-3) is consumed one bucket at a time.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"weights must be (str, torch.Tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__}); "
                "pass e.g. model.named_parameters() or TrainingEngine.iter_full_parameters()."
            )
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel * torch.empty((), dtype=dtype).element_size()


def bucket_spans(nbytes: Sequence[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of consecutive tensors of ``nbytes`` bytes, greedily filled up to
    ``bucket_bytes`` (a larger tensor goes alone): the same rule as ``bucket_named_tensors``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    spans: list[tuple[int, int]] = []
    start, size = 0, 0
    for index, count in enumerate(nbytes):
        if index > start and size + count > bucket_bytes:
            spans.append((start, index))
            start, size = index, 0
        size += count
    if start < len(nbytes):
        spans.append((start, len(nbytes)))
    return spans


def pack_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat CPU ``uint8`` buffer holding ``tensors`` back to back, each at an :data:`ALIGNMENT`-byte offset."""
    total = sum(_aligned(tensor.numel() * tensor.element_size()) for tensor in tensors)
    buffer = torch.empty(total, dtype=torch.uint8)
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + nbytes].copy_(flat)
        offset += _aligned(nbytes)
    return buffer


def unpack_bucket(
    buffer: torch.Tensor, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]
) -> list[torch.Tensor]:
    """The tensors :func:`pack_bucket` packed, as views of ``buffer`` (keep it alive while they are used)."""
    tensors = []
    offset = 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        nbytes = _nbytes(shape, dtype)
        tensors.append(buffer[offset : offset + nbytes].view(dtype).reshape(tuple(shape)))
        offset += _aligned(nbytes)
    if offset != buffer.numel():
        raise ValueError(f"a bucket of {buffer.numel()} bytes does not hold the {offset} bytes its metadata declares.")
    return tensors
