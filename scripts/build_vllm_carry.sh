#!/usr/bin/env bash
# Build what a GPU box without a package index needs to run vLLM (and FCA inside it): vLLM 0.26.0's CUDA 13.0 wheel
# (it pins torch 2.11.0, the GPU image's torch), slimmed and recompressed, plus the small wheels its generate path
# imports that the image lacks, cut into parts that each fit one device call beside the working tree; and the
# project's own wheels (arctic-dedup, arctic-fca), which must be installed as wheels there: vLLM finds the FCA plugin
# through its entry point, which a PYTHONPATH checkout does not register.
#
# Run from the repo root, where PyPI is reachable:
#   bash scripts/build_vllm_carry.sh                 # everything (~4 min: download ~300 MB, LZMA repack)
#   bash scripts/build_vllm_carry.sh --wheels-only   # the project wheels alone (after every code change; seconds)
# Environment: CARRY_DIR (default .carry/vllm), PART_SIZE (default 50M: a part plus the ~6 MB tree stays under a
# call's 64 MiB), PYTHON (default python3), KEEP_MOE=1 (keep vLLM's MoE kernels, for MoE models).
# Output: $CARRY_DIR/calls/NN/ (part NN, SHA256SUMS, NPARTS: what device call NN carries) and .whl/*.whl (the
# project's wheels; scripts/gpu_round.sh installs whatever .whl holds). The procedure: docs/gpu.md.
set -euo pipefail
# shellcheck source=scripts/carry_parts.sh
source "$(dirname "$0")/carry_parts.sh"

carry_dir="${CARRY_DIR:-.carry/vllm}"
part_size="${PART_SIZE:-50M}"
python="${PYTHON:-python3}"
wheels_only=0
[[ "${1:-}" == "--wheels-only" ]] && wheels_only=1
[[ -f pyproject.toml && -d packages/arctic-fca ]] || { echo "run from the repo root" >&2; exit 2; }

build_project_wheels() {
  mkdir -p .whl
  rm -f .whl/arctic_dedup-*.whl .whl/arctic_fca-*.whl
  if command -v uv > /dev/null; then
    uv build --quiet --wheel --package arctic-dedup --out-dir .whl
    uv build --quiet --wheel --package arctic-fca --out-dir .whl
  else
    "$python" -m pip wheel --quiet --no-deps --wheel-dir .whl ./packages/arctic-dedup ./packages/arctic-fca
  fi
  ls -l .whl/arctic_*.whl | awk '{printf "  %8.2f MiB  %s\n", $5 / 1048576, $9}'
}

if [[ "$wheels_only" == 1 ]]; then
  build_project_wheels
  exit 0
fi

vllm_version=0.26.0
vllm_wheel="vllm-$vllm_version-cp38-abi3-manylinux_2_28_x86_64.whl"
# What `from vllm import LLM` and its CUDA generate path (both model runners, the FlashAttention 3 backend, start-up)
# import at module level, closed over their own requirements, less what the GPU image already has (torch 2.11.0,
# triton 3.6.0, transformers 5.17.0, numpy, tokenizers, ...). Exact versions: the set checked to work there.
dependencies=(
  annotated-types==0.8.0 apache-tvm-ffi==0.1.10 cachetools==8.0.3 cbor2==6.3.0 fastapi==0.136.3 httpcore2==2.17.0
  httpx2==2.17.0 jiter==0.19.0 llguidance==1.7.6 msgspec==0.23.0 openai==3.63.0 openai-harmony==0.0.8
  partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 pyzmq==27.3.0
  sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 typing-inspection==0.4.5 xgrammar==0.2.7
)
platforms=()
for tag in manylinux_2_35 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
  manylinux2014 manylinux1 manylinux_2_5; do
  platforms+=(--platform "${tag}_x86_64")
done

download="$carry_dir/download"
wheels="$carry_dir/wheels"
mkdir -p "$download"
rm -rf "$wheels" "$carry_dir/parts" "$carry_dir/calls"
mkdir -p "$wheels" "$carry_dir/parts"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --dest "$download" "vllm==$vllm_version" "${dependencies[@]}"
for requirement in "${dependencies[@]}"; do
  stem="$(echo "${requirement%%==*}" | tr '-' '_')-${requirement#*==}-"
  found=$(find "$download" -maxdepth 1 -iname "$stem*.whl" | head -1)
  [[ -n "$found" ]] || { echo "no wheel downloaded for $requirement" >&2; exit 1; }
  cp "$found" "$wheels/"
done

# Slim the vLLM wheel: drop what a dense model on Hopper never loads (vLLM imports each inside try/except
# ImportError): FlashAttention 2 (Hopper runs FA3), FlashMLA, the Rust frontend, deep_gemm builds for other Pythons,
# and the MoE kernels unless KEEP_MOE=1. Members over 4 KiB are recompressed with LZMA (zip method 14, which pip's
# zipfile reads): 290 MiB becomes 80 MiB. RECORD loses the dropped files' lines.
dropped=(
  'vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so'
  'vllm/vllm-rs'
  'vllm/_flashmla(_extension)?_C\.abi3\.so'
  'vllm/third_party/deep_gemm/_C\.cpython-3(10|11|13|14)-x86_64-linux-gnu\.so'
)
[[ "${KEEP_MOE:-0}" == 1 ]] || dropped+=('vllm/_moe_C_stable_libtorch\.abi3\.so')
PYTHON="$python" recompress_wheel "$download/$vllm_wheel" "$wheels/$vllm_wheel" "${dropped[@]}"
pack_into_calls vllm-carry "$wheels" "$carry_dir" "$part_size"
build_project_wheels
