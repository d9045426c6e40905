"""SamplingEngine: one vLLM replica (``vllm.LLM`` in this process) behind the sampler operations of arctic-rl."""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from arctic_rl.config import ArcticRLClientConfig
from arctic_rl.engines.environment import engine_environment
from arctic_rl.engines.weight_sync import (
    bucket_named_tensors,
    register_gloo_engines,
    register_in_process_engine,
    vllm_transfer_backend,
    worker_sum_of_squares,
)
from arctic_rl.errors import ConfigError, EngineError, EngineStateError, InvalidRequestError, import_optional
from arctic_rl.request_checks import check_prompt_token_ids, check_prompts_shape, check_sampling_params

__all__ = ["SLEEP_TAGS", "SamplingEngine", "vllm_engine_arguments"]

SLEEP_TAGS = ("weights", "kv_cache")
"""vLLM's memory tags: ``wake(["weights"])`` brings the weights back first (to update them before the KV cache)."""

# Engine arguments the SamplingEngine owns: it reads the sampler's log-probs, loads weights and places the worker.
_RESERVED_ENGINE_ARGS = ("logprobs_mode", "weight_transfer_config", "distributed_executor_backend")


def vllm_engine_arguments(config: ArcticRLClientConfig) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` of a sampling replica: ``config.sampling`` fields, then ``sampling.engine_args``.

    ``logprobs_mode="processed_logprobs"`` makes the log-prob of each sampled token the one of the distribution it was
    drawn from, i.e. after temperature (``log_softmax(logits / T)``), the quantity the trainer's ``fwd_no_grad``
    computes at the same temperature. vLLM's default (raw) log-probs ignore the temperature.
    """
    sampling = config.sampling
    on_cpu = config.resolved_device() == "cpu"
    for key in _RESERVED_ENGINE_ARGS:
        if key in sampling.engine_args:
            raise ConfigError(
                f"sampling.engine_args[{key!r}] is set by the sampling engine itself (log-probs at the sampling "
                "temperature, weight sync, in-process worker); remove the key."
            )
    arguments: dict[str, Any] = {
        "model": config.model_name,
        "tokenizer": config.resolved_tokenizer_name(),
        "dtype": config.resolved_sampling_dtype(),
        "seed": config.seed,
        "tensor_parallel_size": sampling.tensor_parallel_size,
        # The CPU build has no CUDA graphs; eager also skips a long warm-up there.
        "enforce_eager": True if on_cpu else sampling.enforce_eager,
        "logprobs_mode": "processed_logprobs",
        "weight_transfer_config": {"backend": vllm_transfer_backend(config.resolved_weight_sync())},
        # score() at a temperature other than 1 reads the whole vocabulary's prompt log-probs.
        "max_logprobs": -1,
    }
    if sampling.tensor_parallel_size == 1:
        # One worker in this process: collective_rpc hands it our tensors by reference (object_store sync).
        arguments["distributed_executor_backend"] = "uni"
    if not on_cpu:
        arguments["gpu_memory_utilization"] = sampling.gpu_memory_utilization
        if config.fca.enable:
            # On CUDA vLLM runs FCA only when its backend is named: CUSTOM wraps FlashAttention (bfloat16);
            # TRITON_ATTN (FCA registers over it) runs float32. On the CPU FCA registers over vLLM's default.
            dtype = arguments["dtype"]
            arguments["attention_config"] = {"backend": "CUSTOM" if dtype == "bfloat16" else "TRITON_ATTN"}
        # vLLM refuses sleep mode on the CPU platform; on GPUs colocated engines time-share memory through it.
        arguments["enable_sleep_mode"] = config.colocate
    if sampling.max_model_len is not None:
        arguments["max_model_len"] = sampling.max_model_len
    if sampling.max_num_seqs is not None:
        arguments["max_num_seqs"] = sampling.max_num_seqs
    arguments.update(sampling.engine_args)
    return arguments


def _prepare_environment(config: ArcticRLClientConfig) -> None:
    """vLLM and arctic-fca read these when the engine starts (vLLM's env module caches some at first import)."""
    os.environ.update(engine_environment(config, "sampling"))


class SamplingEngine:
    """One vLLM sampling replica, in this process.

    vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the ``uni`` executor when ``tensor_parallel_size``
    is 1), so weight updates pass tensors by reference and :meth:`fca_stats` reads the counters of the process that
    runs attention. With ``config.fca.enable`` the arctic-fca backend is registered (with the configured knobs)
    before the engine builds its attention layers.

    Weight sync (:meth:`update_weights`) goes through vLLM's RL weight-transfer API, with our in-process transfer
    engine for ``object_store`` (see :mod:`arctic_rl.engines.weight_sync`); the ``transfer_*`` methods are the
    receiver side of vLLM's ``nccl`` / ``ipc`` engines on GPUs.

    Memory states: ``sleep(level)`` puts both tags (weights, KV cache) to sleep; ``wake(tags)`` wakes the given tags
    (all when None). On GPUs these call vLLM's ``sleep`` / ``wake_up`` (needs ``colocate=True``, which turns on vLLM's
    sleep mode). vLLM refuses sleep mode on the CPU platform, so on the CPU they only keep the state machine and its
    checks and free no memory. Checks: generating or scoring needs every tag awake; updating weights and
    :meth:`weight_norm` need the weights awake; ``sleep`` while anything sleeps raises :class:`EngineStateError`;
    waking tags that are already awake is a no-op (a retried wake is harmless). After ``sleep(2)`` the weights are
    discarded, so they must be updated before the next generate.
    """

    def __init__(self, config: ArcticRLClientConfig, *, replica: int = 0) -> None:
        self.config = config
        self.replica = replica
        self.name = f"sampling[{replica}]"
        self.device = config.resolved_device()
        self.weight_sync = config.resolved_weight_sync()
        if self.weight_sync in ("object_store", "gloo") and config.sampling.tensor_parallel_size != 1:
            # Our transfer engines are registered in this process; tensor-parallel workers run in their own.
            raise ConfigError(
                f"weight_sync.method={self.weight_sync!r} loads weights into a single in-process vLLM worker, but "
                f"sampling.tensor_parallel_size={config.sampling.tensor_parallel_size}; use 'nccl' or 'cuda_ipc' "
                "(or 'auto') with tensor parallelism."
            )
        arguments = vllm_engine_arguments(config)
        _prepare_environment(config)
        vllm = import_optional("vllm", extra="vllm", purpose="by the sampling engine")
        import arctic_fca

        if config.fca.enable:
            # The plugin entry point only runs when arctic-fca is installed as a distribution; registering here also
            # covers source checkouts (register() is idempotent).
            arctic_fca.register()
        # An FCA backend registered earlier in this process stays registered: pause it when this engine has FCA off.
        arctic_fca.set_active(config.fca.enable)
        if self.weight_sync == "object_store":
            register_in_process_engine()
        elif self.weight_sync == "gloo":
            register_gloo_engines()
        try:
            self._llm = vllm.LLM(**arguments)
        except Exception as error:
            raise EngineError(self.name, f"vLLM failed to start {config.model_name!r}: {error}") from error
        self._sleeping: set[str] = set()
        self._weights_discarded = False
        self._transfer_ready = self.weight_sync == "object_store"
        if self._transfer_ready:
            self._llm.init_weight_transfer_engine({"init_info": {}})
        self.vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        self._warm_up()

    def _warm_up(self) -> None:
        """Serve one short seeded request at start-up, so the first ``generate`` pays none of vLLM's one-time set-up.

        vLLM's sampler compiles its log-prob rank op (``torch.compile``) at the first request that asks for log-probs,
        which every request here does: 3-5 s on the 2-core CPU machine, most of the main job's first step. torch's
        global generator (unseeded requests draw from it) is put back as it was, and the prefix cache and arctic-fca's
        counters are reset, so later calls find an engine that has served nothing.
        """
        import arctic_fca

        generator_state = torch.get_rng_state()
        params = self._sampling_params({"n": 2, "max_tokens": 2, "temperature": 1.0, "seed": 0})
        self._run_requests([{"prompt_token_ids": [0, 1]}], params)
        torch.set_rng_state(generator_state)
        self.reset_prefix_cache()
        arctic_fca.reset_stats()

    # ----------------------------------------------------------------------------------------------------------
    # state
    # ----------------------------------------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return bool(self._sleeping)

    def _require_awake(self, operation: str) -> None:
        if self._sleeping:
            raise EngineStateError(
                f"cannot {operation} while {sorted(self._sleeping)} sleep; call wake() first.", engine=self.name
            )
        if self._weights_discarded:
            raise EngineStateError(
                f"cannot {operation}: sleep(level=2) discarded the weights; call update_weights() (sync_weights) "
                "first.",
                engine=self.name,
            )

    def _require_weights_awake(self, operation: str) -> None:
        if "weights" in self._sleeping:
            raise EngineStateError(
                f"cannot {operation} while the weights sleep; call wake(['weights']) (or wake()) first.",
                engine=self.name,
            )

    def sleep(self, level: int = 1) -> None:
        """Level 1: offload the weights to host memory and drop the KV cache; level 2: drop both (GPUs only)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard weights), got {level}.")
        if self._sleeping:
            raise EngineStateError(
                f"sleep(level={level}) while {sorted(self._sleeping)} already sleep; call wake() first.",
                engine=self.name,
            )
        if self.device == "cuda":
            if not self._llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
                raise EngineStateError(
                    "sleep needs vLLM's sleep mode, which the sampling engine turns on only when colocated; set "
                    "colocate=True (or sampling.engine_args={'enable_sleep_mode': True}).",
                    engine=self.name,
                )
            self._llm.sleep(level=level)
        self._sleeping = set(SLEEP_TAGS)
        if level == 2:
            self._weights_discarded = True

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Wake ``tags`` (``"weights"``, ``"kv_cache"``; None: all). Tags already awake are left as they are."""
        wanted = set(SLEEP_TAGS if tags is None else tags)
        unknown = wanted - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake tags must be among {list(SLEEP_TAGS)}, got {sorted(unknown)}.")
        to_wake = wanted & self._sleeping
        if not to_wake:
            return
        if self.device == "cuda":
            self._llm.wake_up(tags=sorted(to_wake))
        self._sleeping -= to_wake

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (its KV was computed with the weights before the last update)."""
        if not self._llm.reset_prefix_cache():
            raise EngineStateError(
                "vLLM refused to reset the prefix cache because requests are running; wait for them to finish.",
                engine=self.name,
            )

    # ----------------------------------------------------------------------------------------------------------
    # sampling
    # ----------------------------------------------------------------------------------------------------------

    def _sampling_params(self, sampling_params: Mapping[str, Any]) -> Any:
        """vLLM ``SamplingParams`` from a request's values, checked first (:mod:`arctic_rl.request_checks`), then
        by vLLM's own request validation (structured-output grammars, ...) before anything is scheduled."""
        from vllm import SamplingParams

        values = check_sampling_params(sampling_params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        # Log-probs of the sampled tokens are always returned; a request for top-k alternatives is kept as asked.
        if values.get("logprobs") is None:
            values["logprobs"] = 0
        if isinstance(values.get("structured_outputs"), Mapping):
            from vllm.sampling_params import StructuredOutputsParams

            values["structured_outputs"] = StructuredOutputsParams(**values["structured_outputs"])
        try:
            params = SamplingParams(**values)
            engine = self._llm.llm_engine
            # verify() may fill in resolved fields: run it on a copy, the request keeps its own.
            engine.input_processor._validate_params(params.clone(), engine.get_supported_tasks())
        except Exception as error:  # vLLM's validation errors are not all ValueErrors (VLLMValidationError, ...)
            raise InvalidRequestError(
                "sampling_params", f"refused by vLLM's request validation: {_first_line(error)}"
            ) from None
        return params

    def _prompts(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[Any]:
        """vLLM inputs of ``prompts``: every prompt non-empty, inside the vocabulary and shorter than
        ``max_model_len`` (text prompts counted with the tokenizer vLLM applies to them)."""
        check_prompts_shape(prompts)
        inputs: list[Any] = []
        prompt: Any
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                token_ids = list(self._llm.get_tokenizer().encode(prompt))
                check_prompt_token_ids(index, token_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
                inputs.append(prompt)
                continue
            token_ids = list(prompt)
            check_prompt_token_ids(index, token_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
            inputs.append({"prompt_token_ids": token_ids})
        return inputs

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling_params: Mapping[str, Any]
    ) -> list[list[dict[str, Any]]]:
        """Sample ``n`` completions per prompt.

        Returns, per prompt, ``n`` dicts: ``text``, ``token_ids`` (generated tokens only), ``logprobs`` (one float
        per generated token: its log-prob under the distribution it was sampled from, i.e. ``log_softmax(logits /
        temperature)``; with ``top_k`` / ``top_p`` / ``min_p`` or penalties set, that distribution is the truncated,
        renormalised one, which the trainer's plain temperature log-probs do not reproduce), ``finish_reason``
        (``"stop"`` or ``"length"``), and ``top_logprobs`` (per token ``{token_id: logprob}``) when ``logprobs``
        asked for alternatives.

        Every value is checked before vLLM sees it (``InvalidRequestError`` naming the field); a generate that fails
        inside vLLM anyway aborts its requests, so the engine is left idle and serves the next call.
        """
        self._require_awake("generate")
        params = self._sampling_params(sampling_params)
        inputs = self._prompts(prompts)
        outputs = self._run_requests(inputs, params)
        return [[self._sample(completion, params.logprobs) for completion in output.outputs] for output in outputs]

    def _run_requests(self, inputs: list[Any], params: Any) -> list[Any]:
        try:
            return list(self._llm.generate(inputs, params, use_tqdm=False))
        except Exception as error:
            stuck = self.abort_unfinished()
            raise EngineError(
                self.name, f"vLLM failed during generate ({_first_line(error)}); its {stuck} request(s) were aborted."
            ) from None

    def abort_unfinished(self) -> int:
        """Abort every request vLLM still holds (a failed generate's); returns how many there were."""
        engine = self._llm.llm_engine
        request_ids = list(engine.output_processor.request_states)
        if request_ids:
            engine.abort_request(request_ids, internal=True)
        return len(request_ids)

    @staticmethod
    def _sample(completion: Any, top: int) -> dict[str, Any]:
        token_ids = [int(token) for token in completion.token_ids]
        steps = completion.logprobs or []
        sample: dict[str, Any] = {
            "text": completion.text,
            "token_ids": token_ids,
            "logprobs": [float(step[token].logprob) for token, step in zip(token_ids, steps, strict=True)],
            "finish_reason": completion.finish_reason,
        }
        if top:
            sample["top_logprobs"] = [{int(k): float(v.logprob) for k, v in step.items()} for step in steps]
        return sample

    def score(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        completion_token_ids: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
    ) -> list[list[float]]:
        """Log-probs of each completion token given its prompt and the completion before it, at ``temperature``.

        Uses vLLM's prompt log-probs of ``prompt + completion``. vLLM computes those without temperature, so at a
        temperature other than 1 the engine asks for the whole vocabulary's log-probs and renormalises in fp64:
        ``log_softmax(z / T) = log_softmax(log_softmax(z) / T)`` (exact; slower, a vocabulary-sized dict per token).
        """
        self._require_awake("score")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        if len(prompt_token_ids) != len(completion_token_ids):
            raise ValueError(
                f"score needs one completion per prompt, got {len(prompt_token_ids)} prompts and "
                f"{len(completion_token_ids)} completions."
            )
        rows = [
            list(map(int, prompt)) + list(map(int, completion))
            for prompt, completion in zip(prompt_token_ids, completion_token_ids, strict=True)
        ]
        inputs = self._prompts(rows)
        for index, prompt in enumerate(prompt_token_ids):
            if not prompt:
                raise ValueError(f"prompt_token_ids[{index}] is empty; the first completion token needs a context.")
        scored = [index for index, completion in enumerate(completion_token_ids) if completion]
        results: list[list[float]] = [[] for _ in rows]
        if not scored:
            return results
        from vllm import SamplingParams

        whole_vocabulary = temperature != 1.0
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1 if whole_vocabulary else 0, detokenize=False)
        outputs = self._run_requests([inputs[index] for index in scored], params)
        for index, output in zip(scored, outputs, strict=True):
            start = len(prompt_token_ids[index])
            row = rows[index]
            values = []
            for position in range(start, len(row)):
                step = output.prompt_logprobs[position]
                target = float(step[row[position]].logprob)
                if whole_vocabulary:
                    logprobs = torch.tensor([item.logprob for item in step.values()], dtype=torch.float64)
                    target = target / temperature - float(torch.logsumexp(logprobs / temperature, dim=0))
                values.append(target)
            results[index] = values
        return results

    # ----------------------------------------------------------------------------------------------------------
    # weights
    # ----------------------------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(Hugging Face name, tensor)`` pairs in place, then reset the prefix cache.

        ``object_store`` sync: the pairs are loaded through vLLM's ``start_weight_update`` / ``update_weights`` /
        ``finish_weight_update`` with our in-process transfer engine, ``weight_sync.bucket_mb`` per call (a
        generator is consumed bucket by bucket). Send every part of a fused vLLM parameter in the same update (q, k
        and v; gate and up); in practice, the full model. With ``nccl`` / ``cuda_ipc`` / ``gloo`` the trainer drives
        the ``transfer_*`` methods instead.
        """
        if self.weight_sync != "object_store":
            raise EngineStateError(
                f"update_weights passes tensors in-process (weight_sync 'object_store'), but this engine uses "
                f"{self.weight_sync!r}: sync through create_trainer_transfer(...).send_weights().",
                engine=self.name,
            )
        self._require_weights_awake("update weights")
        bucket_bytes = self.config.weight_sync.bucket_mb * 1024 * 1024
        self._llm.start_weight_update()
        try:
            for bucket in bucket_named_tensors(named_tensors, bucket_bytes):
                self._llm.update_weights({"update_info": {"named_tensors": bucket}})
        except Exception as error:
            # vLLM ends the update session itself when a chunk fails; the layers loaded so far keep the new values.
            raise EngineError(
                self.name,
                f"weight update failed ({error}); the sampler's weights may be partly updated: send the full model "
                "again.",
            ) from error
        self._finish_update()

    def _finish_update(self) -> None:
        self._llm.finish_weight_update()
        self._weights_discarded = False
        self.reset_prefix_cache()

    def transfer_init(self, init_info: dict[str, Any]) -> None:
        """Receiver side of the cross-process engines (nccl, ipc, gloo): join the trainer's transfer group (blocks
        until every member has joined). Called once; the group serves every later sync until
        :meth:`transfer_shutdown`.

        Each replica is its own ``vllm.LLM`` whose workers number their ranks from 0, so a rendezvous that places the
        workers after the trainer (``rank_offset``) is shifted by this replica's ``replica x tensor_parallel_size``.
        """
        if self._transfer_ready:
            raise EngineStateError(
                f"the weight transfer ({self.weight_sync!r}) is already initialised; it serves every sync until "
                "transfer_shutdown().",
                engine=self.name,
            )
        info = dict(init_info)
        if "rank_offset" in info:
            info["rank_offset"] = int(info["rank_offset"]) + self.replica * self.config.sampling.tensor_parallel_size
        try:
            self._llm.init_weight_transfer_engine({"init_info": info})
        except Exception as error:
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                where = f" at {info['master_address']}:{info['master_port']}" if "master_address" in info else ""
                raise EngineError(
                    self.name,
                    f"the trainer (rank 0 of the {self.weight_sync!r} weight-transfer group{where}) did not let this "
                    f"sampler join: {error}. The trainer or another sampler did not join in time; check their logs, "
                    "or raise weight_sync.timeout_s.",
                ) from error
            raise
        self._transfer_ready = True

    def transfer_start(self) -> None:
        self._require_weights_awake("receive weights")
        if not self._transfer_ready:
            raise EngineStateError(
                "the weight transfer was not initialised; the trainer must call create_trainer_transfer first.",
                engine=self.name,
            )
        self._llm.start_weight_update()

    def transfer_update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        try:
            self._llm.update_weights({"update_info": update_info})
        except Exception as error:
            # vLLM ends the update session itself when a chunk fails; the layers loaded so far keep the new values.
            raise EngineError(
                self.name,
                f"receiving weights ({self.weight_sync!r}) failed: {error}; the sampler's weights may be partly "
                "updated: sync again once the cause is fixed.",
            ) from error

    def transfer_finish(self) -> None:
        self._finish_update()

    def transfer_shutdown(self) -> None:
        """Leave the transfer group (the trainer's side is shut down by ``TrainingEngine.transfer_shutdown``)."""
        if self.weight_sync == "object_store" or not self._transfer_ready:
            return
        self._transfer_ready = False
        # vLLM 0.26 (the GPU machines' build) has no such call: its IPC receiver holds nothing to release.
        shutdown = getattr(self._llm, "shutdown_weight_transfer_engine", None)
        if shutdown is not None:
            shutdown()

    def weight_norm(self) -> float:
        """fp64 ``sqrt(sum of squares)`` over every vLLM parameter (shards summed, replicated parameters once).

        Equals the Hugging Face model's norm for the same weights: fused ``qkv_proj`` / ``gate_up_proj`` hold exactly
        the squares of their parts, a tied ``lm_head`` is counted once as on the Hugging Face side, and vocabulary
        padding rows are zero. On the CPU build the packed linear weights are read back through their GEMM.
        """
        self._require_weights_awake("compute the weight norm")
        if self._weights_discarded:
            raise EngineStateError(
                "sleep(level=2) discarded the weights; update them before asking for their norm.", engine=self.name
            )
        per_worker = self._llm.collective_rpc(worker_sum_of_squares)
        sharded = sum(item[0] for item in per_worker)
        replicated = per_worker[0][1]
        return math.sqrt(sharded + replicated)

    def fca_stats(self) -> dict[str, float]:
        """arctic-fca's running totals in this process, the steps GPU planners still hold on the device included
        (``enabled`` is 0.0 and nothing else is reported without FCA)."""
        if not self.config.fca.enable:
            return {"enabled": 0.0}
        import arctic_fca

        arctic_fca.flush_stats()
        stats = arctic_fca.get_stats()
        return {"enabled": 1.0, **{name: float(value) for name, value in vars(stats).items()}}

    def shutdown(self) -> None:
        """Leave the weight-transfer group and release vLLM's engine (the process keeps running)."""
        if hasattr(self, "_llm"):
            self.transfer_shutdown()
            del self._llm
            # A request that failed inside vLLM leaves a traceback whose frames reference the engine in a reference
            # cycle; collect it now rather than at some later point, where an in-process engine's teardown would
            # destroy this process's torch.distributed group under whatever runs then (a DeepSpeed engine).
            gc.collect()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
