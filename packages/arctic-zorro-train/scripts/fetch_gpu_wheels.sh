#!/usr/bin/env bash
# Download the wheels arctic-zorro-train's GPU tests and benchmark need on the lent H200 (Python 3.12, no package
# index there): fla-core (flash-linear-attention's kernels, for the Gated DeltaNet families) and its one dependency.
# Usage (from the repository root):  packages/arctic-zorro-train/scripts/fetch_gpu_wheels.sh [.whl]
set -euo pipefail
DEST="${1:-.whl}"
mkdir -p "$DEST"
pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d "$DEST" \
    fla-core==0.6.0 einops==0.8.2
ls -l "$DEST"
