"""The RL client under the Arctic Platform import path: every public name of ``arctic_rl``, unchanged.

``from arctic_platform.rl import ArcticRLClientConfig, create_arctic_rl_client`` is the same as importing them from
``arctic_rl``.
"""

import arctic_rl
from arctic_rl import *  # noqa: F403

__all__ = list(arctic_rl.__all__)
