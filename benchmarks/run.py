"""The benchmark harness: runs every benchmark this machine can run and prints each one's headline numbers.

    python benchmarks/run.py [--quick] [--only NAME ...] [--out DIR]

GPU benchmarks need CUDA and are skipped (with a note) on CPU machines. Each benchmark writes
``<out>/<name>.json`` (``{"meta", "summary", "rows"}``) and a PNG plot.
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


BENCHMARKS = [
    Benchmark("pack_unpack", "pack_unpack.py", needs_cuda=True),
    Benchmark("tree_attention", "tree_attention.py", needs_cuda=True),
    Benchmark("fca_decode", "fca_decode.py", needs_cuda=True),
    Benchmark("zorro_train", "zorro_train.py", needs_cuda=True),
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
        command = [sys.executable, str(script), "--out", str(args.out), *(["--quick"] if args.quick else [])]
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
