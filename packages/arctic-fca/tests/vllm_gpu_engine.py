"""One vLLM engine for ``test_vllm_gpu.py``, run as a script in its own process (vLLM reads ``ARCTIC_FCA`` when it
loads plugins, once per process): greedy tokens, then teacher-forced logprobs of fixed continuations, as JSON.

    python vllm_gpu_engine.py MODEL_DIR DTYPE OUT_JSON     (ARCTIC_FCA=1 in the environment: FCA)

FCA in bfloat16 is ``CUSTOM`` (around FlashAttention), in float32 ``TRITON_ATTN`` (around Triton attention, which
vLLM also picks by default for float32); without FCA no backend is named (vLLM's default for the dtype).

This folder must be on ``PYTHONPATH``: vLLM's engine process imports the forcing logits processor and the worker
extension by name.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from arctic_fca import FcaWorkerExtension

PROMPTS = 4
COPIES = 4
# Prompts asked once beside the copies: requests no group takes (FCA's CUSTOM backend leaves them to FlashAttention).
SINGLES = 2
PROMPT_TOKENS = 300
TOKENS = 24
VOCAB = 1024
FORCED_KEY = "forced_tokens"


def write_model(directory: str) -> None:
    """A random-init Qwen3 with the 4B model's attention layout per layer (head_dim 128, 4 query heads per KV head),
    2 layers, bf16 weights (transformers' init, seed 0): both dtypes load the same values."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        # Peaked enough that greedy decoding picks varied tokens, clear of near ties (at the default 0.02 this model
        # repeats one token).
        initializer_range=0.1,
        # Token 0 is the end-of-text; the prompts and forced tokens use ids 3 and up.
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)


class EngineInfo(FcaWorkerExtension):
    """FCA's counters plus what vLLM settled on in the worker (vLLM mixes these methods into its worker)."""

    def engine_info(self) -> dict[str, Any]:
        worker: Any = self
        compilation = worker.vllm_config.compilation_config
        layers = compilation.static_forward_context.values()
        classes = {layer.attn_backend for layer in layers if hasattr(layer, "attn_backend")}
        mode = compilation.cudagraph_mode
        return {
            "cudagraph_mode": getattr(mode, "name", str(mode)),
            "attention_backends": sorted(backend.get_name() for backend in classes),
            "attention_classes": sorted(f"{backend.__module__}.{backend.__qualname__}" for backend in classes),
        }


class ForcedTokens(AdapterLogitsProcessor):
    """A request with ``extra_args[FORCED_KEY]`` emits those tokens; its logprobs stay the model's own (vLLM computes
    them from the raw logits)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        tokens = (params.extra_args or {}).get(FORCED_KEY)
        if not tokens:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if len(output_ids) < len(tokens):
                target = tokens[len(output_ids)]
                logits.fill_(float("-inf"))
                logits[target] = 0.0
            return logits

        return force


def _tokens(seed: int, count: int, vocab: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, vocab) for _ in range(count)]


def main(model_dir: str, dtype: str, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import arctic_fca

    fca = os.environ.get("ARCTIC_FCA") == "1"
    fca_backend = "TRITON_ATTN" if dtype == "float32" else "CUSTOM"
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=0,
        enable_prefix_caching=True,
        max_model_len=PROMPT_TOKENS + TOKENS + 32,
        max_num_seqs=PROMPTS * COPIES + SINGLES,
        gpu_memory_utilization=0.3,
        logits_processors=["vllm_gpu_engine:ForcedTokens"],
        # The forcing reads each request's output list, where async scheduling leaves placeholders.
        async_scheduling=False,
        worker_extension_cls="vllm_gpu_engine.EngineInfo",
        **({"attention_config": {"backend": fca_backend}} if fca else {}),
    )
    prompts = [_tokens(index, PROMPT_TOKENS, VOCAB) for index in range(PROMPTS)]
    # Prefill each prompt once so its copies share its KV blocks (what FCA groups).
    llm.generate(
        [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts],
        SamplingParams(max_tokens=1, detokenize=False),
        use_tqdm=False,
    )
    singles = [_tokens(500 + index, PROMPT_TOKENS, VOCAB) for index in range(SINGLES)]
    requests = [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts for _ in range(COPIES)]
    requests += [TokensPrompt(prompt_token_ids=prompt) for prompt in singles]

    def params(**extra: Any) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS, ignore_eos=True, detokenize=False, **extra
        )

    greedy = llm.generate(requests, params(), use_tqdm=False)
    continuations = [_tokens(1000 + index, TOKENS, VOCAB) for index in range(len(requests))]
    forced = llm.generate(
        requests, [params(logprobs=1, extra_args={FORCED_KEY: tokens}) for tokens in continuations], use_tqdm=False
    )
    (info,) = llm.collective_rpc("engine_info")
    result = {
        "greedy": [list(output.outputs[0].token_ids) for output in greedy],
        "followed": [list(output.outputs[0].token_ids) == tokens for output, tokens in zip(forced, continuations)],
        "forced_logprobs": [
            [step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens)]
            for output, tokens in zip(forced, continuations)
        ],
        "stats": vars(arctic_fca.collect_stats(llm)) if fca else None,
        **info,
    }
    with open(out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.stdout.flush()
    # vLLM's shutdown can hang at interpreter exit; the result is written.
    os._exit(0)
