"""The sampling engines' operations: ``generate`` (prompts in contiguous chunks over the replicas), ``log_probs`` of
text pairs, and ``reset_prefix_cache``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from arctic_rl.engines.protocols import SamplingEngineProtocol
from arctic_rl.errors import ConfigError, InvalidRequestError
from arctic_rl.request_checks import check_prompts_shape, check_sampling_params, requested_samples
from arctic_rl.service.base import ServiceBase
from arctic_rl.service.dispatch import contiguous_chunks
from arctic_rl.service.requests import check_temperature

__all__ = ["GenerationOperations"]


class GenerationOperations(ServiceBase):
    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling_params: Mapping[str, Any]
    ) -> list[list[dict[str, Any]]]:
        self._require_open()
        check_prompts_shape(prompts)
        sampling_params = self._checked_sampling_params(len(prompts), sampling_params)
        self.states.require_awake("sampling", "generate()")
        replicas = self.engines.sampling
        chunks = [(replicas[part], prompts[chunk]) for part, chunk in contiguous_chunks(len(prompts), len(replicas))]
        self.calls.require_alive([handle for handle, _ in chunks])
        with self.metrics.timer.phase("generate"):
            results = self.calls.gather(
                [
                    self.calls.start(handle, SamplingEngineProtocol.generate, chunk, dict(sampling_params))
                    for handle, chunk in chunks
                ]
            )
        outputs = [samples for chunk in results for samples in chunk]
        tokens = sum(len(sample["token_ids"]) for samples in outputs for sample in samples)
        self.metrics.add({"tokens/generated": tokens})
        return outputs

    def _checked_sampling_params(self, prompts: int, sampling_params: Mapping[str, Any]) -> Mapping[str, Any]:
        limits = self.engines.sampler_limits
        if limits is None:  # engines that report no limits (test fakes)
            if not isinstance(sampling_params, Mapping):
                raise InvalidRequestError(
                    "sampling_params",
                    f"must be a dict of vLLM SamplingParams fields, got {type(sampling_params).__name__}.",
                )
            return sampling_params
        checked = check_sampling_params(sampling_params, **limits)
        limit = self.config.sampling.max_sequences_per_request
        requested = requested_samples(prompts, checked)
        if requested > limit:
            raise InvalidRequestError(
                "sampling_params.n",
                f"{prompts} prompts x n = {requested} sequences; one generate may ask for at most {limit} "
                "(sampling.max_sequences_per_request). Split the request.",
            )
        return checked

    def log_probs(
        self, prompts: Sequence[str], completions: Sequence[str], *, temperature: float = 1.0
    ) -> list[list[float]]:
        """Per-token log-probs of each completion after its prompt (text pairs), from the sampling engine, at
        ``temperature``."""
        self._require_open()
        check_temperature(temperature)
        for field, texts in (("prompts", prompts), ("completions", completions)):
            if not isinstance(texts, Sequence) or isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError(field, "must be a list of strings.")
        if len(prompts) != len(completions):
            raise ConfigError(
                "log_probs takes two lists of strings of the same length (prompts[i] is scored with "
                f"completions[i]), got {type(prompts).__name__} of {len(prompts)} and "
                f"{type(completions).__name__} of {len(completions)}."
            )
        self.states.require_awake("sampling", "log_probs()")
        tokenizer = self._tokenizer()
        prompt_ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in prompts]
        completion_ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in completions]
        return list(
            self.calls.call(
                self.engines.sampling[0],
                SamplingEngineProtocol.score,
                prompt_ids,
                completion_ids,
                temperature=float(temperature),
            )
        )

    def _tokenizer(self) -> Any:
        if not hasattr(self, "_cached_tokenizer"):
            from arctic_rl.errors import import_optional

            transformers = import_optional("transformers", extra="engines", purpose="to tokenize log_probs() text")
            self._cached_tokenizer = transformers.AutoTokenizer.from_pretrained(self.config.resolved_tokenizer_name())
        return self._cached_tokenizer

    def reset_prefix_cache(self) -> None:
        self._require_open()
        self.states.require_awake("sampling", "reset_prefix_cache()")
        self.calls.call_all(self.engines.sampling, SamplingEngineProtocol.reset_prefix_cache)
