#!/usr/bin/env bash
# One call on the lent H200 (see ../shared/docs/gpu.md): install the carried wheels (scripts/fetch_gpu_wheels.sh),
# run `nox -s gpu_tests`, then the GPU benchmarks named as arguments (default: all), writing results to $OUT.
# Usage there: ARCTIC_COMMIT=<sha> bash scripts/gpu_run.sh [--quick] [pack_unpack tree_attention fca_decode zorro_train]
set -uo pipefail
out="${OUT:-benchmarks/results}"
mkdir -p "$out/run"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
quick=()
if [ "${1:-}" = "--quick" ]; then quick=(--quick); shift; fi
benchmarks=("$@")
[ ${#benchmarks[@]} -eq 0 ] && benchmarks=(pack_unpack tree_attention fca_decode zorro_train)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/run/device.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$out/run/device.txt"
status=0
if [ "${ARCTIC_SKIP_GPU_TESTS:-0}" != "1" ]; then
  OUT="$out/run" timeout 300 python3 -m nox -s gpu_tests 2>&1 | tee "$out/run/gpu_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
for name in "${benchmarks[@]}"; do
  PYTHONPATH="packages/arctic-dedup/src:packages/arctic-zorro-train/src:packages/arctic-fca/src:$PYTHONPATH" \
    timeout "${ARCTIC_BENCH_TIMEOUT:-240}" python3 "benchmarks/$name.py" --out "$out/run" "${quick[@]}" \
    > "$out/run/$name.log" 2>&1
  echo "== $name exit $? =="; tail -25 "$out/run/$name.log"
done
tar -czf "$out/results.tar.gz" -C "$out/run" .
exit $status
