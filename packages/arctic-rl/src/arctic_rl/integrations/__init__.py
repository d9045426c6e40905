"""Plugins that let existing RL frameworks drive arctic-rl's engines through the thin client.

``arctic_rl.integrations.verl`` registers a training engine and a rollout replica with verl (load it with
``VERL_USE_EXTERNAL_MODULES=arctic_rl.integrations.verl``); ``arctic_rl.integrations.verl_weights`` holds what
verl's ``main_ppo`` trainer needs around them (the weight-update manager, the hybrid worker's rollout) and
``arctic_rl.integrations.verl_platform`` a CPU platform for verl's processes (``VERL_PLATFORM=arctic_cpu``);
``arctic_rl.integrations.verl_mapping`` is the verl-free part (batch layouts, loss and sampling settings, the
connection), importable without verl.
"""

__all__: list[str] = []
