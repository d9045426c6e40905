"""What the service asks of each engine role: typed ``Protocol``s that the real engines (``TrainingEngine``,
``LogProbEngine``, ``SamplingEngine``) and the test fakes (``tests/fake_engines.py``) both satisfy, checked by mypy
(the assignments at the end of this module, and of the fakes' module).

The service reaches an engine through its Ray actor; it names the method by the protocol's function
(``TrainingEngineProtocol.step``), never by a string, so mypy checks the arguments and the result type of every
call (:mod:`arctic_rl.service.engine_calls`). Importable without Ray, DeepSpeed or vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from arctic_rl.engines.log_prob import LogProbEngine
    from arctic_rl.engines.sampling import SamplingEngine
    from arctic_rl.engines.training import TrainingEngine

__all__ = ["LogProbEngineProtocol", "SamplingEngineProtocol", "TrainingEngineProtocol"]


class LogProbEngineProtocol(Protocol):
    """A forward-only copy of the policy (old or reference log-probs); one per data-parallel rank."""

    vocab_size: int

    def fwd_no_grad(
        self, batch: Mapping[str, Any], *, calculate_entropy: bool = False, temperature: float = 1.0
    ) -> dict[str, torch.Tensor]: ...

    def weight_norm(self) -> float: ...

    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def empty_cache(self) -> None: ...

    def sleep(self, mode: str = "all") -> None: ...

    def wake(self) -> None: ...


class TrainingEngineProtocol(LogProbEngineProtocol, Protocol):
    """The trainer: log-probs, gradients, optimizer steps, checkpoints, and the sending side of weight sync."""

    step_count: int

    def fwd_bwd(
        self,
        batch: Mapping[str, Any],
        *,
        loss_name: str,
        loss_config: Mapping[str, Any],
        global_tokens: float,
        global_sequences: float,
        temperature: float = 1.0,
        old_log_probs_from_forward: bool = False,
    ) -> dict[str, Any]: ...

    def step(self) -> dict[str, float]: ...

    def save_checkpoint(
        self, path: str, step: int, *, keep_last: int | None = None, hf_export: bool = False
    ) -> str: ...

    def load_checkpoint(self, path: str, step: int | None = None) -> int: ...

    def transfer_setup(
        self,
        method: Any,
        samplers: Any,
        *,
        master_address: str | None = None,
        master_port: int | None = None,
        sampler_world_size: int | None = None,
    ) -> None: ...

    def send_weights(self) -> None: ...

    def transfer_shutdown(self) -> None: ...


class SamplingEngineProtocol(Protocol):
    """One vLLM replica: generation, scoring, and the receiving side of weight sync."""

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling_params: Mapping[str, Any]
    ) -> list[list[dict[str, Any]]]: ...

    def score(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        completion_token_ids: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
    ) -> list[list[float]]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def transfer_init(self, init_info: dict[str, Any]) -> None: ...

    def transfer_start(self) -> None: ...

    def transfer_update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    def transfer_finish(self) -> None: ...

    def transfer_shutdown(self) -> None: ...

    def weight_norm(self) -> float: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake(self, tags: Sequence[str] | None = None) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def fca_stats(self) -> dict[str, float]: ...


if TYPE_CHECKING:

    def _the_engines_satisfy_their_protocols(
        training: TrainingEngine, log_prob: LogProbEngine, sampling: SamplingEngine
    ) -> None:
        checked_training: TrainingEngineProtocol = training
        checked_log_prob: LogProbEngineProtocol = log_prob
        checked_sampling: SamplingEngineProtocol = sampling
        del checked_training, checked_log_prob, checked_sampling
