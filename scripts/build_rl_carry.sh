#!/usr/bin/env bash
# Build what a GPU box without a package index needs, beyond vLLM (scripts/build_vllm_carry.sh), to run the RL stack
# (benchmarks/rl_step_gpu.py, the main job on the GPU): Ray 2.60 (its Java jars and dashboard build dropped, the rest
# recompressed), DeepSpeed 0.19.8 built as a pure-Python wheel (DS_BUILD_OPS=0), jsonschema and hjson, TRL 1.16 with
# datasets (for the side-by-side against TRL), and the project's four packages as wheels. The image already has
# accelerate, pandas, pyarrow, psutil, py-cpuinfo, msgpack, ninja, protobuf, pyyaml, requests, click and filelock;
# vLLM's carry brings pydantic and fastapi.
#
# Run from the repo root, where PyPI is reachable (needs a Python with torch and setuptools to build DeepSpeed's
# wheel: DS_PYTHON, default the active python3):
#   bash scripts/build_rl_carry.sh                   # ~1 min: download ~85 MB, LZMA repack
# Environment: CARRY_DIR (default .carry/rl), PART_SIZE (default 50M), PYTHON (default python3), DS_PYTHON.
# Output: $CARRY_DIR/calls/NN/ (part NN, SHA256SUMS, NPARTS). On the GPU box, in the calls right after vLLM's:
#   bash scripts/unpack_carry.sh .carry/rl/calls/00  (and 01 if there is one; it installs into /tmp/site)
set -euo pipefail
# shellcheck source=scripts/carry_parts.sh
source "$(dirname "$0")/carry_parts.sh"

carry_dir="${CARRY_DIR:-.carry/rl}"
part_size="${PART_SIZE:-50M}"
python="${PYTHON:-python3}"
ds_python="${DS_PYTHON:-python3}"
[[ -f pyproject.toml && -d packages/arctic-rl ]] || { echo "run from the repo root" >&2; exit 2; }

dependencies=(
  ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  hjson==3.1.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
platforms=()
for tag in manylinux_2_28 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_x86_64")
done
download="$carry_dir/download"
wheels="$carry_dir/wheels"
rm -rf "$wheels"
mkdir -p "$download" "$wheels"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --dest "$download" "${dependencies[@]}"
for requirement in "${dependencies[@]}"; do
  stem="$(echo "${requirement%%==*}" | tr '-' '_')-${requirement#*==}-"
  found=$(find "$download" -maxdepth 1 -iname "$stem*.whl" | head -1)
  [[ -n "$found" ]] || { echo "no wheel downloaded for $requirement" >&2; exit 1; }
  [[ "$requirement" == ray==* ]] || cp "$found" "$wheels/"
done

# Ray without what a local, dashboard-less cluster never loads: the Java worker's jar and the dashboard's web build.
# Its three large binaries (gcs_server, raylet, _raylet.so) compress about 4x with LZMA.
PYTHON="$python" recompress_wheel "$(find "$download" -maxdepth 1 -name 'ray-2.60.0-*.whl' | head -1)" \
  "$wheels/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl" 'ray/jars/.*' 'ray/dashboard/client/build/.*'

# DeepSpeed publishes no wheel; with DS_BUILD_OPS=0 its sdist builds a pure-Python one (ops compile at first use).
"$python" -m pip download --quiet --no-deps --no-binary=:all: --dest "$download" deepspeed==0.19.8
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda uv build --quiet --wheel --no-build-isolation --python "$ds_python" \
  "$download/deepspeed-0.19.8.tar.gz" --out-dir "$wheels"

for package in arctic-dedup arctic-zorro-train arctic-fca arctic-rl; do
  uv build --quiet --wheel --package "$package" --out-dir "$wheels"
done
pack_into_calls rl-carry "$wheels" "$carry_dir" "$part_size"
