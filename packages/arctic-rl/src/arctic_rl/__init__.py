"""arctic-rl: the Ray-orchestrated RL client (DeepSpeed training and log-prob engines, vLLM sampling engine).

This package is a skeleton until its issue lands: it pins the stack's versions and dependencies so the workspace
installs and locks as one.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
