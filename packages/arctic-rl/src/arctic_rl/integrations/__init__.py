"""Plugins that let existing RL frameworks drive arctic-rl's engines through the thin client.

``arctic_rl.integrations.verl`` registers a training engine and a rollout replica with verl (load it with
``VERL_USE_EXTERNAL_MODULES=arctic_rl.integrations.verl``); ``arctic_rl.integrations.verl_mapping`` is its
verl-free part (batch layouts, loss and sampling settings, the connection), importable without verl.
"""

__all__: list[str] = []
