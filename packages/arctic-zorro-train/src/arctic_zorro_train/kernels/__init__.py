"""Fused Triton kernels for the layers ZoRRO Train runs on CUDA (model-specific, unlike arctic-dedup's kernels).

Each kernel equals the transformers code it replaces (forward and backward); the patch uses it on CUDA tensors
only, the torch code stays the path on CPU. Tests run the kernels through Triton's interpreter on CPU.
"""

# Submodules, imported where used (``norms``, ``causal_conv``, ``swiglu`` and ``logprobs`` import triton;
# ``reference`` is plain torch).
__all__ = ["causal_conv", "logprobs", "norms", "reference", "swiglu"]
