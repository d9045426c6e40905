"""``LogProbEngine``: a forward-only copy of the policy (old or reference log-probs) on DeepSpeed.

It shares everything but the optimizer with ``TrainingEngine`` (``DeepSpeedModelEngine``): the same model loading,
ZoRRO patch, micro-batching and forward. Under ``training.zero_stage == 3`` it partitions the weights with ZeRO-3
inference (every rank gathers each layer when it runs); otherwise each rank holds the whole model. New weights
come from the trainer with ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from arctic_rl.engines.deepspeed_base import DeepSpeedModelEngine
from arctic_rl.errors import EngineError

if TYPE_CHECKING:
    from arctic_rl.config import ArcticRLClientConfig

__all__ = ["LogProbEngine"]


class LogProbEngine(DeepSpeedModelEngine):
    """Forward-only DeepSpeed engine: ``fwd_no_grad``, ``load_weights``, ``weight_norm``, ``iter_full_parameters``,
    ``sleep("weights" | "all")`` / ``wake()``. Under ZeRO-3 ``load_weights`` and ``weight_norm`` are collective."""

    def __init__(
        self,
        config: ArcticRLClientConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        role: str = "log_prob",
    ) -> None:
        super().__init__(
            config, rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, role=role
        )

    def _zero_stage(self) -> int:
        return 3 if self.config.training.zero_stage == 3 else 0

    def _initialize(self, model: nn.Module, ds_config: dict[str, Any]) -> Any:
        model.requires_grad_(False)
        model.eval()
        engine, *_ = self._deepspeed.initialize(model=model, config=ds_config)
        return engine

    def _sleep_modes(self) -> tuple[str, ...]:
        return ("all", "weights")

    def _move_weights(self, device: torch.device) -> None:
        for parameter in self.module.parameters():
            if hasattr(parameter, "ds_tensor"):
                partition: Any = parameter.ds_tensor
                partition.data = partition.data.to(device)
            else:
                parameter.data = parameter.data.to(device)

    def _offload(self, mode: str) -> None:
        self._move_weights(torch.device("cpu"))

    def _reload(self, mode: str) -> None:
        self._move_weights(self.device)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(Hugging Face name, full tensor)`` pairs (e.g. ``TrainingEngine.iter_full_parameters()``) into the
        model; tied names are accepted. Every rank must pass the same names in the same order under ZeRO-3. A name
        or shape that does not match raises ``EngineError`` before that tensor is copied (earlier ones stay copied).
        Returns the number of tensors copied."""
        self._require_awake("load_weights")
        parameters = dict(self.module.named_parameters(remove_duplicate=False))
        zero = self._deepspeed.zero
        copied = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                parameter = parameters.get(name)
                if parameter is None:
                    known = sorted(parameters)
                    raise EngineError(
                        self.name,
                        f"load_weights got {name!r}, which is no parameter of {self.config.model_name}; expected "
                        f"Hugging Face names such as {known[:3]} ({len(known)} in all).",
                    )
                shape = tuple(getattr(parameter, "ds_shape", parameter.shape))
                if tuple(tensor.shape) != shape:
                    raise EngineError(
                        self.name,
                        f"load_weights got {name!r} of shape {tuple(tensor.shape)}, but the parameter has shape "
                        f"{shape}; send the full (unpartitioned) tensor of the same architecture.",
                    )
                if hasattr(parameter, "ds_tensor"):
                    with zero.GatheredParameters([parameter], modifier_rank=0):
                        parameter.data.copy_(tensor.to(device=parameter.device, dtype=parameter.dtype))
                else:
                    parameter.data.copy_(tensor.to(device=parameter.device, dtype=parameter.dtype))
                copied += 1
        return copied
