"""Small stand-ins for the engines, with the engines' method names, so the cluster layer (placement, actors,
service, client) is tested without DeepSpeed or vLLM.

The "model" is a bigram table ``weights [V, V]`` (fp64): the log-prob of token t after token p is
``log_softmax(weights[p] / temperature)[t]``. The training engine is a real data-parallel rank: gradients are summed
over ranks with a gloo all-reduce through the rendezvous address the service hands out, so the service's batch split
and loss denominators are checked against a single-process computation.

Cross-process weight sync (nccl / cuda_ipc / gloo) is mimicked with the same service path: the training fakes get the
sampler fan-out and drive the samplers' ``transfer_*`` methods through ``SamplerWeightSyncClient``, as vLLM's trainer
engines do (the weights ride in the update call instead of a broadcast). Every transfer call is appended to the
named Ray actor :data:`EVENT_LOG` when a test created it, so tests can check the order of calls across actors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from arctic_rl.errors import EngineStateError

VOCAB = 16
EVENT_LOG = "transfer_events"
EVENT_NAMESPACE = "arctic_rl_test_events"


class EventLog:
    """A Ray actor tests create under :data:`EVENT_LOG`: the transfer calls of every fake, in arrival order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def append(self, engine: str, event: str) -> None:
        self.events.append((engine, event))

    def read(self) -> list[tuple[str, str]]:
        return list(self.events)


def record(engine: str, event: str) -> None:
    import ray

    try:
        log = ray.get_actor(EVENT_LOG, namespace=EVENT_NAMESPACE)
    except ValueError:
        return
    ray.get(log.append.remote(engine, event))


def initial_weights(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=generator, dtype=torch.float64)


def response_log_probs(
    weights: torch.Tensor, batch: Mapping[str, torch.Tensor], temperature: float = 1.0
) -> torch.Tensor:
    """[B, R] log-probs of the responses (0 where response_mask is 0): each token after the one before it."""
    responses = batch["responses"].long()
    width = responses.shape[1]
    previous = batch["input_ids"][:, -width - 1 : -1].long()
    table = torch.log_softmax(weights / temperature, dim=-1)
    values = table[previous, responses]
    return values * batch["response_mask"].to(values.dtype)


class FakeTrainingEngine:
    def __init__(
        self,
        config: Any,
        *,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        role: str = "training",
    ) -> None:
        self.rank, self.world_size, self.name = rank, world_size, f"{role}[{rank}]"
        self.vocab_size = VOCAB
        self.step_count = 0
        self.is_sleeping = False
        self.lr = config.training.lr
        self.weights = initial_weights(config.seed).requires_grad_(True)
        self.batches_seen: list[int] = []
        self.transfer: Any = None
        if world_size > 1:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size
            )

    def _awake(self, operation: str) -> None:
        if self.is_sleeping:
            raise EngineStateError(f"{operation} while sleeping; call wake() first.", engine=self.name)

    def fwd_no_grad(
        self, batch: Mapping[str, torch.Tensor], *, calculate_entropy: bool = False, temperature: float = 1.0
    ) -> dict[str, torch.Tensor]:
        self._awake("fwd_no_grad")
        with torch.no_grad():
            return {"logprobs": response_log_probs(self.weights, batch, temperature)}

    def fwd_bwd(
        self,
        batch: Mapping[str, torch.Tensor],
        *,
        loss_name: str,
        loss_config: Mapping[str, Any],
        global_tokens: float,
        global_sequences: float,
        temperature: float = 1.0,
        old_log_probs_from_forward: bool = False,
    ) -> dict[str, Any]:
        self._awake("fwd_bwd")
        if old_log_probs_from_forward == ("old_log_probs" in batch):
            raise AssertionError("the service sends old_log_probs or old_log_probs_from_forward=True, one of the two")
        self.batches_seen.append(int(batch["input_ids"].shape[0]))
        log_probs = response_log_probs(self.weights, batch, temperature)
        advantages = batch["advantages"].to(torch.float64)
        if advantages.dim() == 1:
            advantages = advantages[:, None]
        mask = batch["response_mask"].to(torch.float64)
        loss = -(advantages * log_probs * mask).sum() / global_tokens
        loss.backward()
        tokens = float(mask.sum())
        result = {"loss": float(loss), "metrics": {"tokens_share": tokens / global_tokens}, "tokens": tokens}
        if old_log_probs_from_forward:
            result["logprobs"] = log_probs.detach().float()
        return result

    def step(self) -> dict[str, float]:
        self._awake("step")
        grad = self.weights.grad if self.weights.grad is not None else torch.zeros_like(self.weights)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(grad)
        with torch.no_grad():
            self.weights -= self.lr * grad
        norm = float(grad.norm())
        self.weights.grad = None
        self.step_count += 1
        return {"grad_norm": norm, "lr": self.lr}

    def weight_norm(self) -> float:
        return float(self.weights.detach().norm())

    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "weights", self.weights.detach().clone()

    def transfer_setup(self, method: str, samplers: Any, **rendezvous: Any) -> None:
        from arctic_rl.engines.weight_sync import SamplerWeightSyncClient

        if self.transfer is not None:
            raise EngineStateError("transfer already set up", engine=self.name)
        record(self.name, "transfer_setup")
        self.transfer = SamplerWeightSyncClient(samplers)
        if self.rank == 0:
            # As vLLM's trainer engines: only the sender makes the samplers join.
            self.transfer.init_weight_transfer_engine({"method": method, "rank_offset": 1, **rendezvous})

    def send_weights(self) -> None:
        if self.transfer is None:
            raise EngineStateError("send_weights before transfer_setup", engine=self.name)
        record(self.name, "send_weights")
        if self.world_size > 1:
            import torch.distributed as dist

            # Stands for the collective ZeRO-3 gathers every rank takes part in.
            dist.barrier()
        if self.rank == 0:
            self.transfer.start_weight_update()
            self.transfer.update_weights({"weights": self.weights.detach().clone()})
            self.transfer.finish_weight_update()

    def transfer_shutdown(self) -> None:
        if self.transfer is not None:
            record(self.name, "transfer_shutdown")
        self.transfer = None

    def shutdown(self) -> None:
        self.transfer_shutdown()

    def sleep(self, mode: str = "all") -> None:
        self.is_sleeping = True

    def wake(self) -> None:
        self.is_sleeping = False

    def empty_cache(self) -> None:
        return None

    def save_checkpoint(self, path: str, step: int, *, keep_last: int | None = None, hf_export: bool = False) -> str:
        os.makedirs(path, exist_ok=True)
        target = os.path.join(path, f"step_{step}_rank_{self.rank}.pt")
        torch.save({"weights": self.weights.detach().clone(), "step": step}, target)
        with open(os.path.join(path, "latest"), "w") as latest:
            latest.write(str(step))
        return target

    def load_checkpoint(self, path: str, step: int | None = None) -> int:
        if step is None:
            with open(os.path.join(path, "latest")) as latest:
                step = int(latest.read())
        state = torch.load(os.path.join(path, f"step_{step}_rank_{self.rank}.pt"))
        with torch.no_grad():
            self.weights.copy_(state["weights"])
        self.step_count = int(state["step"])
        return self.step_count

    def pid(self) -> int:
        return os.getpid()


class FakeSamplingEngine:
    def __init__(self, config: Any, *, replica: int = 0) -> None:
        self.weights = initial_weights(config.seed)
        self.replica = replica
        self.is_sleeping = False
        self.prefix_resets = 0
        self.name = f"sampling[{replica}]"
        self.transfer_info: dict[str, Any] | None = None
        self.environment = {key: os.environ.get(key) for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "DS_ACCELERATOR")}

    def generate(
        self, prompts: Sequence[Sequence[int]] | Sequence[str], sampling_params: Mapping[str, Any]
    ) -> list[list[dict[str, Any]]]:
        if self.is_sleeping:
            raise EngineStateError("generate while sleeping", engine=f"sampling[{self.replica}]")
        # A stuck engine, for the call time limit: the fakes' request values reach them unchecked.
        time.sleep(float(sampling_params.get("fake_hang_s", 0.0)))
        n, max_tokens = int(sampling_params.get("n", 1)), int(sampling_params.get("max_tokens", 4))
        temperature = float(sampling_params.get("temperature", 1.0))
        generator = torch.Generator().manual_seed(int(sampling_params.get("seed", 0)))
        table = torch.log_softmax(self.weights / temperature, dim=-1)
        outputs = []
        for prompt in prompts:
            ids = [ord(c) % VOCAB for c in prompt] if isinstance(prompt, str) else list(prompt)
            samples = []
            for _ in range(n):
                previous, tokens, log_probs = ids[-1], [], []
                for _ in range(max_tokens):
                    token = int(torch.multinomial(table[previous].exp(), 1, generator=generator))
                    tokens.append(token)
                    log_probs.append(float(table[previous, token]))
                    previous = token
                samples.append({"text": "", "token_ids": tokens, "logprobs": log_probs, "finish_reason": "length"})
            outputs.append(samples)
        return outputs

    def score(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        completion_token_ids: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
    ) -> list[list[float]]:
        table = torch.log_softmax(self.weights / temperature, dim=-1)
        scores = []
        for prompt, completion in zip(prompt_token_ids, completion_token_ids, strict=True):
            sequence = [*prompt, *completion]
            scores.append([float(table[sequence[len(prompt) + i - 1], t]) for i, t in enumerate(completion)])
        return scores

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            assert name == "weights"
            self.weights = tensor.clone()
        self.reset_prefix_cache()

    def transfer_init(self, init_info: dict[str, Any]) -> None:
        if self.transfer_info is not None:
            raise EngineStateError("transfer already initialised", engine=self.name)
        self.transfer_info = dict(init_info, rank_offset=init_info["rank_offset"] + self.replica)
        record(self.name, f"transfer_init rank_offset={self.transfer_info['rank_offset']}")

    def transfer_start(self) -> None:
        if self.transfer_info is None:
            raise EngineStateError("transfer_start before transfer_init", engine=self.name)
        record(self.name, "transfer_start")

    def transfer_update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        record(self.name, "transfer_update")
        assert isinstance(update_info, dict), "the fake trainer sends one update of the whole weights"
        self.weights = update_info["weights"].clone()

    def transfer_finish(self) -> None:
        record(self.name, "transfer_finish")
        self.reset_prefix_cache()

    def transfer_shutdown(self) -> None:
        if self.transfer_info is not None:
            record(self.name, "transfer_shutdown")
        self.transfer_info = None

    def shutdown(self) -> None:
        self.transfer_shutdown()

    def weight_norm(self) -> float:
        return float(self.weights.norm())

    def sleep(self, level: int = 1) -> None:
        self.is_sleeping = True

    def wake(self, tags: Sequence[str] | None = None) -> None:
        self.is_sleeping = False

    def reset_prefix_cache(self) -> None:
        self.prefix_resets += 1
        if self.transfer_info is not None:
            record(self.name, "reset_prefix_cache")

    def fca_stats(self) -> dict[str, float]:
        return {"reads_saved": 3.0}


class EngineThatFailsToStart:
    def __init__(self, config: Any, **kwargs: Any) -> None:
        raise RuntimeError("cannot load the model: no such directory 'missing-model'")


if TYPE_CHECKING:
    from arctic_rl.engines.protocols import LogProbEngineProtocol, SamplingEngineProtocol, TrainingEngineProtocol

    def _the_fakes_satisfy_the_engine_protocols(training: FakeTrainingEngine, sampling: FakeSamplingEngine) -> None:
        # The fakes stand in for both DeepSpeed roles and for vLLM: mypy checks them against what the service calls.
        checked_training: TrainingEngineProtocol = training
        checked_log_prob: LogProbEngineProtocol = training
        checked_sampling: SamplingEngineProtocol = sampling
        del checked_training, checked_log_prob, checked_sampling
