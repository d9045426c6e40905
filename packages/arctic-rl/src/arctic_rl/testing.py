"""Helpers for tests and examples: a tiny random-init Qwen3 with a byte-level tokenizer built in code, saved as a
Hugging Face directory that transformers, DeepSpeed and vLLM's CPU build all load (``head_dim`` 32: vLLM's CPU
attention needs at least 32). Needs the engines' extra (transformers, tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_QWEN3", "build_byte_tokenizer", "save_tiny_qwen3"]

# The model's shape: small enough for 2 CPU cores, large enough that every kind of parameter matters.
TINY_QWEN3: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}

_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer without merges (one token per byte, ids 0-255) plus ``<|endoftext|>`` (256, pad
    and eos), ``<|im_start|>`` (257) and ``<|im_end|>`` (258), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = sorted(alphabet, key=lambda char: _byte_of(char))
    vocab = {char: index for index, char in enumerate(byte_to_char)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def _byte_of(char: str) -> int:
    # GPT-2's byte-to-unicode map: printable bytes map to themselves, the others to 256 + their rank.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code = ord(char)
    if code in printable:
        return code
    others = [byte for byte in range(256) if byte not in printable]
    return others[code - 256]


def save_tiny_qwen3(directory: str | os.PathLike[str], *, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-init fp32 Qwen3 (``TINY_QWEN3`` updated by ``overrides``) and the byte tokenizer to
    ``directory``; returns it. The same seed gives the same weights."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    target = Path(directory)
    tokenizer = build_byte_tokenizer()
    config = Qwen3Config(
        **{**TINY_QWEN3, **overrides},
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Norm weights start at exactly 1; perturbing them makes their gradients (and bugs that drop them) visible.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
