#!/usr/bin/env bash
# Fetch the wheels `nox -s gpu_tests` needs on an offline GPU box whose image already has torch, triton,
# transformers, numpy, pytest and hypothesis (the lent H200: Python 3.12). Run where PyPI is reachable, carry the
# folder over, then there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/.whl/site
#   python3 -m nox -s gpu_tests
# DeepSpeed (for arctic-rl's GPU tests and benchmarks/rl_engine.py) has no wheel on PyPI; it is pure Python when
# installed with DS_BUILD_OPS=0, so the installed package is copied from a local environment into "$dest/site"
# (set ARCTIC_DEEPSPEED_PYTHON to a Python that has deepspeed 0.19.8; skipped when unset).
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
  # arctic-rl's config (pydantic) and DeepSpeed's config parser (hjson)
  "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" "hjson==3.1.0"
)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${wheels[@]}"
ls -la "$dest"
if [[ -n "${ARCTIC_DEEPSPEED_PYTHON:-}" ]]; then
  source_dir=$("$ARCTIC_DEEPSPEED_PYTHON" -c "import deepspeed, os; print(os.path.dirname(deepspeed.__file__))")
  mkdir -p "$dest/site"
  cp -r "$source_dir" "$dest/site/"
  find "$dest/site" -name __pycache__ -type d -prune -exec rm -rf {} +
fi
