"""The root README's loop snippet (``<!-- snippet: readme-loop -->``) on one GPU with a real-shaped random model.

The snippet runs as a user's script, in an empty directory, with this interpreter. Its text is the README's with the
edits a one-GPU machine without a model hub needs, each matched exactly once (a README change that breaks one stops
the run with the line it looked for) and recorded in the JSON:

- the model: a random-init Qwen3 of the chosen layer shape (bf16, the byte tokenizer), built in code, for the
  snippet's tiny model (the README names ``Qwen/Qwen3-4B`` as the real one);
- the placement: ``colocate=True`` (the split layout gives each engine a GPU of its own; colocated, the trainer and
  the sampler share the one GPU, the sampler at 0.3 of its memory, as the main job does on one GPU) and the sampler's
  CPU-only KV-cache size dropped.

At the Qwen3-4B layer shape the trainer holds about 72 GB (bf16 weights, fp32 master weights and AdamW moments)
beside the sampler's 0.3 of the card: an H200 (141 GB), not an 80 GB H100; ``--model 1.7b`` fits an H100.

    python benchmarks/readme_loop_gpu.py [--model 4b] [--out DIR]     # on the GPU machine
    python benchmarks/readme_loop_gpu.py --print-snippet               # the edited snippet (any machine)

Writes ``readme_loop_gpu.json``: the edits, the three step lines (loss, grad norm, ZoRRO's savings, generate time),
the wall time and the output's tail.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from common import default_out_dir, run_metadata

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- snippet: readme-loop -->"
NAME = "readme_loop_gpu"
MODEL_LINE = 'model_dir = str(save_tiny_qwen3(tempfile.mkdtemp(prefix="tiny-qwen3-")))  # or "Qwen/Qwen3-4B"'
# (what the README says, what one GPU needs)
PLACEMENT_EDITS: tuple[tuple[str, str], ...] = (
    ("    colocate=False,\n", "    colocate=True,\n"),
    (
        '    sampling={"max_model_len": 512, "kv_cache_space_gib": 1},  # CPU: keep vLLM\'s KV cache small\n',
        '    sampling={"max_model_len": 512, "gpu_memory_utilization": 0.3},\n',
    ),
)
STEP_LINE = re.compile(
    r"^step (\d+): loss (-?[\d.]+), grad norm ([\d.]+), dedup saved (\d+)% of the tokens, generate ([\d.]+) s$", re.M
)


def readme_loop_snippet(readme: str) -> str:
    match = re.search(re.escape(MARKER) + r"\s*```python\n(.*?)```", readme, flags=re.DOTALL)
    if match is None:
        raise SystemExit(f"README.md has no python block right after {MARKER}")
    return match.group(1)


def _replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(
            f"the README's loop snippet holds {text.count(old)} copies of {old.strip()!r} (expected one): update "
            "benchmarks/readme_loop_gpu.py's edits to the snippet as it reads now."
        )
    return text.replace(old, new)


def one_gpu_snippet(snippet: str, model_dir: str) -> tuple[str, list[dict[str, str]]]:
    """The snippet with the one-GPU edits (module docstring) and the list of them, as ``{"from", "to"}``."""
    edits = [(MODEL_LINE, f"model_dir = {model_dir!r}  # a random-init model of the benchmark's shape")]
    edits += list(PLACEMENT_EDITS)  # whole lines, newline included
    for old, new in edits:
        snippet = _replace_once(snippet, old, new)
    return snippet, [{"from": old.strip(), "to": new.strip()} for old, new in edits]


def parse_steps(stdout: str) -> list[dict[str, float]]:
    return [
        {
            "step": int(step),
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "zorro_savings": int(saved) / 100,
            "generate_seconds": float(generate),
        }
        for step, loss, grad_norm, saved, generate in STEP_LINE.findall(stdout)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["4b", "1.7b"], default="4b", help="the layer shape (rl_step_gpu's)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timeout-s", type=float, default=1500.0)
    parser.add_argument("--print-snippet", action="store_true", help="print the edited snippet and exit")
    args = parser.parse_args(argv)
    snippet = readme_loop_snippet((REPO / "README.md").read_text())
    if args.print_snippet:
        print(one_gpu_snippet(snippet, "MODEL_DIR")[0])
        return 0

    import torch
    from rl_step_gpu import build_model_dir, gpu_shape

    if not torch.cuda.is_available():
        parser.error("no GPU is visible: the CPU run of the snippet as written is recipes/tests/test_readme_loop.py.")
    shape = gpu_shape(args.model)
    result: dict[str, Any] = {"meta": run_metadata(), "model": args.model, "model_shape": shape.model}
    with tempfile.TemporaryDirectory(prefix="readme-loop-gpu-") as scratch:
        model_dir = Path(scratch) / "model"
        print(f"readme_loop_gpu: building the random {args.model} model", flush=True)
        build_model_dir(model_dir, shape, cuda=True)
        edited, result["edits"] = one_gpu_snippet(snippet, str(model_dir))
        script = Path(scratch) / "loop.py"
        script.write_text(edited)
        user_directory = Path(scratch) / "user"
        user_directory.mkdir()
        began = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, str(script)],
                cwd=user_directory,
                capture_output=True,
                text=True,
                timeout=args.timeout_s,
                check=False,
            )
            returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as expired:
            returncode, stdout, stderr = None, str(expired.stdout or ""), str(expired.stderr or "")
        result["seconds"] = time.perf_counter() - began
    result["returncode"] = returncode
    result["steps"] = parse_steps(stdout)
    result["ran_as_written"] = returncode == 0 and [step["step"] for step in result["steps"]] == [0, 1, 2]
    result["stdout_tail"] = stdout[-4000:]
    result["stderr_tail"] = stderr[-4000:]
    out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    for step in result["steps"]:
        print(step)
    print(
        f"readme_loop_gpu: {'ran' if result['ran_as_written'] else 'FAILED'} in {result['seconds']:.0f} s; wrote "
        f"{out / (NAME + '.json')}"
    )
    if not result["ran_as_written"]:
        print(stderr[-4000:], file=sys.stderr)
    return 0 if result["ran_as_written"] else 1


if __name__ == "__main__":
    sys.exit(main())
