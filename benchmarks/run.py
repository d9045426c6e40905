"""The benchmark harness: runs every benchmark this machine can run and prints each one's headline numbers.

    python benchmarks/run.py [--quick] [--only NAME ...] [--out DIR]

GPU benchmarks need CUDA and are skipped (with a note) on CPU machines. Each benchmark writes
``<out>/<name>.json`` (``{"meta", "summary", "rows"}``) and a PNG plot.

``--quick`` reruns the headline numbers of the README's results table in about 8 minutes on one H200: pack/unpack
(full sweep, ~1 min), tree attention's correctness section and first shape (~3 min), forest decode's main cases
without the tuning sweep (~1.5 min), ZoRRO Train's dense rows (~2 min; other sections' rows are kept from the
committed zorro_train.json) and the fused kernels (~1 min). Without it every benchmark runs in full (~25 min).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import default_out_dir


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    needs_cuda: bool
    # The arguments of the headline rerun (``--quick``): what reproduces the README's rows within the time budget.
    quick_args: tuple[str, ...] = ("--quick",)


BENCHMARKS = [
    # The pack/unpack sweep already takes about a minute in full, and its full rows are the ones the README cites.
    Benchmark("pack_unpack", "pack_unpack.py", needs_cuda=True, quick_args=()),
    Benchmark("tree_attention", "tree_attention.py", needs_cuda=True, quick_args=("--quick", "--budget-s", "170")),
    Benchmark("fca_decode", "fca_decode.py", needs_cuda=True),
    Benchmark(
        "zorro_train",
        "zorro_train.py",
        needs_cuda=True,
        quick_args=("--quick", "--sections", "dense", "--dedup-backends", "sdpa", "flex", "--baselines", "hf_sdpa"),
    ),
    Benchmark("fused_kernels", "fused_kernels.py", needs_cuda=True, quick_args=()),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out_dir())
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=None, help="benchmark names to run")
    args = parser.parse_args()
    has_cuda = torch.cuda.is_available()
    failures = 0
    for benchmark in BENCHMARKS:
        if args.only and benchmark.name not in args.only:
            continue
        script = Path(__file__).parent / benchmark.script
        if benchmark.needs_cuda and not has_cuda:
            print(f"[skip] {benchmark.name}: needs a CUDA GPU")
            continue
        if not script.exists():
            print(f"[skip] {benchmark.name}: {script.name} not present")
            continue
        command = [sys.executable, str(script), "--out", str(args.out), *(benchmark.quick_args if args.quick else ())]
        print(f"[run] {' '.join(command)}", flush=True)
        if subprocess.run(command, check=False).returncode != 0:
            failures += 1
            print(f"[fail] {benchmark.name}")
            continue
        result = args.out / f"{benchmark.name}.json"
        if result.exists():
            print(f"[done] {benchmark.name}: {json.dumps(json.loads(result.read_text())['summary'])[:400]}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
