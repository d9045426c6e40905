#!/usr/bin/env bash
# Triton >= 3.7.1 for the offline H200, in parts that fit the device tool's 64 MiB carry.
#
# Why: flash-linear-attention (the Gated DeltaNet kernels of the hybrid models) refuses its gated backward on
# Hopper with Triton >= 3.4 and < 3.7.1 (fla issue #640: Triton miscompiles it), and the H200 image has Triton 3.6.
# The Triton 3.7.1 wheel is 189 MB, so this keeps what `import triton` and the NVIDIA backend need (the compiler
# library, ptxas, libdevice, the CUDA headers, the Python package), drops debugging and profiling tools (cuobjdump,
# nvdisasm, the Blackwell ptxas, CUPTI, proton, instrumentation, FileCheck, pass plugins), packs it as one tar.xz
# and splits it into parts under the carry limit.
#
#   here:   bash scripts/fetch_triton_parts.sh     -> .tri/1/part-aa, .tri/2/part-ab (git-ignored; ~44 MiB each)
#   there:  call 1 carries .snap and .tri/1:        bash .snap/scripts/gpu_triton.sh stash
#           call 2 carries .snap, .whl and .tri/2:  bash .snap/scripts/gpu_triton.sh assemble && cd .snap &&
#               ARCTIC_TRITON=/tmp/triton371 bash scripts/gpu_round.sh hybrid-tests zorro-hybrid
#           Call 2 must start within the idle window (the stash lives in the warm machine's /tmp).
set -euo pipefail
version="${ARCTIC_TRITON_VERSION:-3.7.1}"
dest="${1:-.tri}"
part_mib="${ARCTIC_TRITON_PART_MIB:-44}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$work" "triton==$version"
python3 - "$work" <<'EOF'
import pathlib, sys, zipfile
work = pathlib.Path(sys.argv[1])
wheel = next(work.glob("triton-*.whl"))
zipfile.ZipFile(wheel).extractall(work / "site")
EOF
site="$work/site/triton"
rm -rf "$site/backends/nvidia/bin/cuobjdump" "$site/backends/nvidia/bin/nvdisasm" \
  "$site/backends/nvidia/bin/ptxas-blackwell" "$site/backends/nvidia/lib/cupti" "$site/_C/libproton.so" \
  "$site/instrumentation" "$site/FileCheck" "$site/plugins" "$site/profiler"
chmod +x "$site/backends/nvidia/bin/ptxas"
rm -rf "$dest"
mkdir -p "$dest"
tar -C "$work/site" -cf - triton "$(basename "$(ls -d "$work"/site/triton-*.dist-info)")" | xz -9 -T2 -c \
  | split -b "${part_mib}M" - "$dest/part-"
index=1
for part in "$dest"/part-*; do
  mkdir -p "$dest/$index"
  mv "$part" "$dest/$index/"
  index=$((index + 1))
done
ls -laR "$dest"
