#!/usr/bin/env bash
# Fetch the wheels `nox -s gpu_tests` needs on an offline GPU box whose image already has torch, triton,
# transformers, numpy, pytest and hypothesis (the lent H200: Python 3.12). Run where PyPI is reachable, carry the
# folder over, then there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 -m nox -s gpu_tests
set -euo pipefail
dest="${1:-.whl}"
python_version="${ARCTIC_GPU_PYTHON:-3.12}"
mkdir -p "$dest"
wheels=(
  # nox and what it needs beyond the image (attrs, packaging, platformdirs, filelock, humanize are there)
  "nox==2026.10.20" "argcomplete==3.7.2" "colorlog==6.12.0" "dependency-groups==1.3.2"
  "python-discovery==1.9.6" "virtualenv==21.15.11" "distlib==0.4.4"
  # Gated DeltaNet kernels for the hybrid models (einops is in the image)
  "flash-linear-attention==0.6.0" "fla-core==0.6.0"
)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${wheels[@]}"
ls -la "$dest"
