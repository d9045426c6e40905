"""Pack (deduplicate) and unpack (reconstruct) tensors along the token dimension, differentiably."""

from arctic_dedup.packing.api import pack, unpack
from arctic_dedup.packing.rows import gather_rows, segment_sum_rows

__all__ = ["gather_rows", "pack", "segment_sum_rows", "unpack"]
