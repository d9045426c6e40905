#!/usr/bin/env bash
# On the H200: put the parts of scripts/fetch_triton_parts.sh back together (see its header).
#   bash scripts/gpu_triton.sh stash      copy the carried .tri/*/part-* to /tmp/triton-parts (first call)
#   bash scripts/gpu_triton.sh assemble   join the stashed and the carried parts, unpack to /tmp/triton371 and
#                                         check that `import triton` there gives the new version (second call)
set -euo pipefail
parts=/tmp/triton-parts
target="${ARCTIC_TRITON:-/tmp/triton371}"
case "${1:-}" in
  stash)
    mkdir -p "$parts"
    cp .tri/*/part-* "$parts"/
    ls -la "$parts"
    ;;
  assemble)
    mkdir -p "$parts"
    if compgen -G ".tri/*/part-*" > /dev/null; then cp .tri/*/part-* "$parts"/; fi
    rm -rf "$target"
    mkdir -p "$target"
    # Python's tarfile reads xz itself (the image may lack the xz tool).
    cat "$parts"/part-* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1])" "$target"
    PYTHONPATH="$target" python3 -c "import triton, sys; print('triton', triton.__version__, 'from', triton.__file__)"
    ;;
  *)
    echo "usage: $0 stash|assemble" >&2
    exit 2
    ;;
esac
