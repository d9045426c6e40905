"""Tree attention: exact attention over a plan's prefix tree, forward and backward, several backends."""

from arctic_dedup.attention.api import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, auto_backends, tree_attention
from arctic_dedup.attention.auto import BACKENDS, ConcreteBackend, TreeAttentionBackend, choose_backend
from arctic_dedup.attention.metadata import TreeAttentionMetadata, prepare_tree_attention
from arctic_dedup.attention.reference import MAX_REFERENCE_SCORES, reference_mask, tree_attention_reference

__all__ = [
    "BACKENDS",
    "MAX_REFERENCE_SCORES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "ConcreteBackend",
    "TreeAttentionBackend",
    "TreeAttentionMetadata",
    "auto_backends",
    "choose_backend",
    "prepare_tree_attention",
    "reference_mask",
    "tree_attention",
    "tree_attention_reference",
]
