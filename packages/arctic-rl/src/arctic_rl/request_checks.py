"""Checks of the request values that reach vLLM: sampling parameters and prompts.

vLLM accepts some values it cannot serve (a ``seed`` of ``"x"`` or ``2**64`` fails after scheduling and leaves the
request stuck in the engine), and coerces others (``True`` as a token id). Every value a user sends is therefore
checked here first, with its type taken strictly, and refused with :class:`InvalidRequestError` naming the field and
the allowed range. Only the keys listed in :data:`SAMPLING_PARAM_KEYS` are accepted; vLLM's internal fields
(``output_kind``, ``extra_args``, ...) are not request values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from arctic_rl.errors import InvalidRequestError

__all__ = [
    "MAX_SEED",
    "SAMPLING_PARAM_KEYS",
    "check_prompt_token_ids",
    "check_prompts_shape",
    "check_sampling_params",
    "requested_samples",
]

MAX_SEED = 2**63 - 1
"""The largest ``seed`` accepted: vLLM seeds a ``torch.Generator`` per request, whose range ends at 2**64 - 1, and a
signed 64-bit value is what every layer between here and there carries."""

_LARGEST_PENALTY = 2.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _int_in(field: str, value: Any, low: int, high: int | None, meaning: str = "") -> None:
    upper = "" if high is None else f", {high}"
    bracket = "]" if high is not None else ")"
    if not _is_int(value) or value < low or (high is not None and value > high):
        rest = f" ({meaning})" if meaning else ""
        raise InvalidRequestError(
            f"sampling_params.{field}",
            f"must be an integer in [{low}{upper or ', inf'}{bracket}{rest}, got {value!r}.",
        )


def _number_in(field: str, value: Any, low: float, high: float, *, open_low: bool = False) -> None:
    inside = _is_number(value) and (value > low if open_low else value >= low) and value <= high
    if not inside:
        bracket = "(" if open_low else "["
        raise InvalidRequestError(
            f"sampling_params.{field}", f"must be a finite number in {bracket}{low}, {high}], got {value!r}."
        )


def _bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"sampling_params.{field}", f"must be true or false, got {value!r}.")


def _token_list(field: str, value: Any, vocab_size: int, *, allow_empty: bool) -> None:
    if not isinstance(value, (list, tuple)) or (not value and not allow_empty):
        need = "a list" if allow_empty else "a non-empty list"
        raise InvalidRequestError(
            f"sampling_params.{field}", f"must be {need} of token ids in [0, {vocab_size}), got {value!r}."
        )
    bad = [token for token in value if not _is_int(token) or not 0 <= token < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"sampling_params.{field}",
            f"token ids must be integers in [0, {vocab_size}) (the model's vocabulary), got {bad[:5]!r}.",
        )


def _strings(field: str, value: Any, *, single_allowed: bool) -> None:
    if single_allowed and isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) and item for item in value):
        form = "a non-empty string or a list of them" if single_allowed else "a list of non-empty strings"
        raise InvalidRequestError(f"sampling_params.{field}", f"must be {form}, got {value!r}.")


def _logit_bias(value: Any, vocab_size: int) -> None:
    field = "sampling_params.logit_bias"
    if not isinstance(value, Mapping):
        raise InvalidRequestError(field, f"must be a dict {{token id: bias}}, got {type(value).__name__}.")
    for token, bias in value.items():
        # JSON object keys are strings: "17" names token 17.
        token_id = int(token) if isinstance(token, str) and token.isdigit() and token.isascii() else token
        if not _is_int(token_id) or not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                field, f"keys must be token ids in [0, {vocab_size}) (the model's vocabulary), got {token!r}."
            )
        if not _is_number(bias) or abs(bias) > 100:
            raise InvalidRequestError(field, f"biases must be finite numbers in [-100, 100], got {bias!r}.")


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _structured_outputs(value: Any) -> None:
    field = "sampling_params.structured_outputs"
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            field, f"must be a dict with one of {list(_STRUCTURED_KEYS)}, got {type(value).__name__}."
        )
    options = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
    unknown = sorted(set(value) - {*_STRUCTURED_KEYS, *options})
    if unknown:
        raise InvalidRequestError(field, f"unknown keys {unknown}; use one of {list(_STRUCTURED_KEYS)}.")
    chosen = [key for key in _STRUCTURED_KEYS if value.get(key) is not None]
    if len(chosen) != 1:
        raise InvalidRequestError(field, f"must set exactly one of {list(_STRUCTURED_KEYS)}, got {chosen}.")
    key = chosen[0]
    constraint = value[key]
    if key in ("regex", "grammar", "structural_tag") and not (isinstance(constraint, str) and constraint):
        raise InvalidRequestError(f"{field}.{key}", f"must be a non-empty string, got {constraint!r}.")
    if key == "choice":
        _strings("structured_outputs.choice", constraint, single_allowed=False)
    if key == "json" and not isinstance(constraint, (str, Mapping)):
        raise InvalidRequestError(f"{field}.json", f"must be a JSON schema (dict or string), got {constraint!r}.")
    if key == "json_object":
        _bool("structured_outputs.json_object", constraint)
    for option in options[:2]:
        if option in value:
            _bool(f"structured_outputs.{option}", value[option])


def _check_n(value: Any) -> None:
    _int_in("n", value, 1, 1024, "completions per prompt")


def _check_seed(value: Any) -> None:
    if value is not None:
        _int_in("seed", value, 0, MAX_SEED)


def _optional(value: Any, check: Callable[[], None]) -> None:
    if value is not None:
        check()


def _penalty(field: str) -> Callable[[Any], None]:
    return lambda value: _number_in(field, value, -_LARGEST_PENALTY, _LARGEST_PENALTY)


_SIMPLE_CHECKS: dict[str, Callable[[Any], None]] = {
    "n": _check_n,
    "temperature": lambda value: _number_in("temperature", value, 0.0, 2.0),
    "top_p": lambda value: _number_in("top_p", value, 0.0, 1.0, open_low=True),
    "min_p": lambda value: _number_in("min_p", value, 0.0, 1.0),
    "seed": _check_seed,
    "presence_penalty": _penalty("presence_penalty"),
    "frequency_penalty": _penalty("frequency_penalty"),
    "repetition_penalty": lambda value: _number_in("repetition_penalty", value, 0.0, 2.0, open_low=True),
    "stop": lambda value: _optional(value, lambda: _strings("stop", value, single_allowed=True)),
    "bad_words": lambda value: _optional(value, lambda: _strings("bad_words", value, single_allowed=False)),
    "ignore_eos": lambda value: _bool("ignore_eos", value),
    "detokenize": lambda value: _bool("detokenize", value),
    "skip_special_tokens": lambda value: _bool("skip_special_tokens", value),
    "spaces_between_special_tokens": lambda value: _bool("spaces_between_special_tokens", value),
    "include_stop_str_in_output": lambda value: _bool("include_stop_str_in_output", value),
    "structured_outputs": lambda value: _optional(value, lambda: _structured_outputs(value)),
}

SAMPLING_PARAM_KEYS: tuple[str, ...] = (
    *_SIMPLE_CHECKS,
    "max_tokens",
    "min_tokens",
    "top_k",
    "logprobs",
    "prompt_logprobs",
    "stop_token_ids",
    "logit_bias",
    "allowed_token_ids",
)
"""The vLLM ``SamplingParams`` fields a request may set."""


def check_sampling_params(sampling_params: Any, *, vocab_size: int, max_model_len: int) -> dict[str, Any]:
    """``sampling_params`` checked (strict types, allowed ranges, token ids inside the vocabulary); returns a copy
    with ``logit_bias`` keys as ints, ready for ``vllm.SamplingParams(**values)``."""
    if not isinstance(sampling_params, Mapping):
        raise InvalidRequestError(
            "sampling_params",
            f"must be a dict of vLLM SamplingParams fields ({', '.join(SAMPLING_PARAM_KEYS[:4])}, ...), got "
            f"{type(sampling_params).__name__}.",
        )
    unknown = sorted(str(key) for key in set(sampling_params) - set(SAMPLING_PARAM_KEYS))
    if unknown:
        raise InvalidRequestError(
            f"sampling_params.{unknown[0]}",
            f"not an accepted sampling parameter; the accepted keys are {sorted(SAMPLING_PARAM_KEYS)}.",
        )
    values = dict(sampling_params)
    for key, check in _SIMPLE_CHECKS.items():
        if key in values:
            check(values[key])
    max_tokens = values.get("max_tokens", 16)
    if max_tokens is not None:
        _int_in("max_tokens", max_tokens, 1, max_model_len, "at most the model's max_model_len")
    if "min_tokens" in values:
        _int_in("min_tokens", values["min_tokens"], 0, max_tokens, "at most max_tokens")
    if "top_k" in values:
        # vLLM: 0 or -1 turn top-k off.
        _int_in("top_k", values["top_k"], -1, vocab_size, "-1 or 0: off")
    for key in ("logprobs", "prompt_logprobs"):
        if values.get(key) is not None:
            _int_in(key, values[key], -1, vocab_size, "alternatives per token; -1: the whole vocabulary")
    for key in ("stop_token_ids", "allowed_token_ids"):
        if values.get(key) is not None:
            _token_list(key, values[key], vocab_size, allow_empty=key == "stop_token_ids")
    if values.get("logit_bias") is not None:
        _logit_bias(values["logit_bias"], vocab_size)
        values["logit_bias"] = {int(token): float(bias) for token, bias in values["logit_bias"].items()}
    return values


def requested_samples(prompt_count: int, sampling_params: Mapping[str, Any]) -> int:
    """How many sequences a generate asks for (prompts x n); ``sampling_params`` already checked."""
    return prompt_count * int(sampling_params.get("n", 1))


def check_prompts_shape(prompts: Any) -> None:
    """A non-empty list of non-empty strings or of non-empty token-id lists (ints, not booleans), not mixed."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError(
            "prompts",
            "must be a non-empty list of strings or of token-id lists (wrap a single prompt in a list), got "
            f"{type(prompts).__name__}{' (empty)' if isinstance(prompts, Sequence) and not prompts else ''}.",
        )
    texts = [isinstance(prompt, str) for prompt in prompts]
    if any(texts) and not all(texts):
        raise InvalidRequestError("prompts", "mixes strings and token-id lists; send one kind per request.")
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"prompts[{index}]", "is an empty string; every prompt needs a token.")
            continue
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InvalidRequestError(
                f"prompts[{index}]", f"must be a non-empty string or list of token ids, got {prompt!r:.80}."
            )
        if not all(_is_int(token) for token in prompt):
            bad = next(token for token in prompt if not _is_int(token))
            raise InvalidRequestError(f"prompts[{index}]", f"token ids must be integers, got {bad!r}.")


def check_prompt_token_ids(index: int, token_ids: Sequence[int], *, vocab_size: int, max_model_len: int) -> None:
    """One prompt's token ids: inside the vocabulary, and short enough to leave room for one generated token."""
    bad = [token for token in token_ids if not 0 <= token < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompts[{index}]",
            f"token ids must be in [0, {vocab_size}) (the model's vocabulary), got {bad[:5]}.",
        )
    if len(token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompts[{index}]",
            f"is {len(token_ids)} tokens long; prompts must be shorter than the sampler's max_model_len "
            f"({max_model_len}) to leave room for a generated token.",
        )
