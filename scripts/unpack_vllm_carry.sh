#!/usr/bin/env bash
# The GPU box's side of scripts/build_vllm_carry.sh: gather the carried parts across device calls and, once all are
# there, install vLLM and its wheels into $SITE with no index and no dependency resolution.
#
#   bash scripts/unpack_vllm_carry.sh .carry/vllm/calls/00     # call 1: keeps the part, exit 3 (parts missing)
#   bash scripts/unpack_vllm_carry.sh .carry/vllm/calls/01     # call 2, right after: installs, exit 0
#   export PYTHONPATH=$SITE:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
#
# Parts wait in $PARTS_DIR (default /tmp/vllm-parts), outside the copy of the tree, so they survive from one call to
# the next while the machine stays warm; each is checked against SHA256SUMS when it arrives. Once installed, later
# calls on the same machine find $SITE/.vllm-carry (the tar's checksum) and install nothing.
# Exit status: 0 installed (or already), 3 parts still missing, 4 a part or the tar is corrupt (send it again),
# 2 usage, 5 this Python cannot read LZMA zips.
set -euo pipefail

site="${SITE:-/tmp/site}"
parts_dir="${PARTS_DIR:-/tmp/vllm-parts}"
python="${PYTHON:-python3}"
[[ $# -gt 0 ]] || { echo "usage: $0 FOLDER... (folders holding vllm-carry.tar.part-NN, SHA256SUMS, NPARTS)" >&2; exit 2; }
mkdir -p "$parts_dir" "$site"
for folder in "$@"; do
  for file in "$folder"/vllm-carry.tar.part-* "$folder/SHA256SUMS" "$folder/NPARTS"; do
    if [[ -e "$file" ]]; then cp -f "$file" "$parts_dir/"; fi
  done
done
cd "$parts_dir"
[[ -f SHA256SUMS && -f NPARTS ]] || { echo "unpack: no SHA256SUMS/NPARTS in $*: carry a calls/NN folder" >&2; exit 2; }
expected_tar="$(awk '$2 == "vllm-carry.tar" {print $1}' SHA256SUMS)"
if [[ -f "$site/.vllm-carry" && "$(cat "$site/.vllm-carry")" == "$expected_tar" ]]; then
  echo "unpack: already installed in $site"
  exit 0
fi
while read -r sum name; do
  [[ "$name" == vllm-carry.tar.part-* && -f "$name" ]] || continue
  if ! echo "$sum  $name" | sha256sum --check --quiet -; then
    rm -f "$name"
    echo "unpack: $name is corrupt and was removed; carry it again" >&2
    exit 4
  fi
done < SHA256SUMS
needed="$(cat NPARTS)"
present="$(find . -maxdepth 1 -name 'vllm-carry.tar.part-*' | wc -l)"
if [[ "$present" -lt "$needed" ]]; then
  echo "unpack: $present of $needed parts in $parts_dir; carry the next calls/NN folder"
  exit 3
fi
"$python" -c 'import lzma, zipfile' || { echo "unpack: $python has no lzma module" >&2; exit 5; }
cat vllm-carry.tar.part-* > vllm-carry.tar
if ! echo "$expected_tar  vllm-carry.tar" | sha256sum --check --quiet -; then
  echo "unpack: the joined tar is corrupt; carry every part again" >&2
  rm -f vllm-carry.tar vllm-carry.tar.part-*
  exit 4
fi
rm -rf wheels
mkdir wheels
tar -xf vllm-carry.tar -C wheels
rm -f vllm-carry.tar
"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" wheels/*.whl
echo "$expected_tar" > "$site/.vllm-carry"
echo "unpack: installed $(find wheels -name '*.whl' | wc -l) wheels into $site"
