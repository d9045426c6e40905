"""Arctic Platform: fast, exact RL post-training for LLMs.

The full-stack install. Its parts are the packages ``arctic_dedup``, ``arctic_zorro_train``, ``arctic_fca`` and
``arctic_rl``; ``arctic_platform.rl`` is the RL client's import path (a re-export of ``arctic_rl``).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
