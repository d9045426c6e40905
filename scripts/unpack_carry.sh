#!/usr/bin/env bash
# The GPU box's side of scripts/build_vllm_carry.sh and scripts/build_rl_carry.sh: gather a carry's parts across
# device calls and, once all are there, install its wheels into $SITE with no index and no dependency resolution.
#
#   bash scripts/unpack_carry.sh .carry/vllm/calls/00     # call 1: keeps the part, exit 3 (parts missing)
#   bash scripts/unpack_carry.sh .carry/vllm/calls/01     # call 2, right after: installs, exit 0
#   bash scripts/unpack_carry.sh .carry/rl/calls/00       # call 3 (the RL stack: Ray, DeepSpeed, TRL): installs
#   export PYTHONPATH=$SITE:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
#
# A carry is named by its tar (NAME.tar in SHA256SUMS: vllm-carry, rl-carry). Its parts wait in
# $PARTS_ROOT/NAME (default /tmp/carry-parts), outside the copy of the tree, so they survive from one call to the
# next while the machine stays warm; each is checked against SHA256SUMS when it arrives. Once installed, later calls
# on the same machine find $SITE/.NAME (the tar's checksum) and install nothing.
# Exit status: 0 installed (or already), 3 parts still missing, 4 a part or the tar is corrupt (send it again),
# 2 usage, 5 this Python cannot read LZMA zips.
set -euo pipefail

site="${SITE:-/tmp/site}"
parts_root="${PARTS_ROOT:-/tmp/carry-parts}"
python="${PYTHON:-python3}"
[[ $# -gt 0 ]] || { echo "usage: $0 FOLDER... (calls/NN folders of one carry: NAME.tar.part-NN, SHA256SUMS, NPARTS)" >&2; exit 2; }
name=""
for folder in "$@"; do
  [[ -f "$folder/SHA256SUMS" && -f "$folder/NPARTS" ]] || { echo "unpack: no SHA256SUMS/NPARTS in $folder: carry a calls/NN folder" >&2; exit 2; }
  name="$(awk '$2 ~ /\.tar$/ {sub(/\.tar$/, "", $2); print $2}' "$folder/SHA256SUMS")"
  [[ -n "$name" ]] || { echo "unpack: $folder/SHA256SUMS names no .tar" >&2; exit 2; }
  parts_dir="$parts_root/$name"
  mkdir -p "$parts_dir" "$site"
  for file in "$folder/$name".tar.part-* "$folder/SHA256SUMS" "$folder/NPARTS"; do
    if [[ -e "$file" ]]; then cp -f "$file" "$parts_dir/"; fi
  done
done
cd "$parts_dir"
expected_tar="$(awk -v tar="$name.tar" '$2 == tar {print $1}' SHA256SUMS)"
if [[ -f "$site/.$name" && "$(cat "$site/.$name")" == "$expected_tar" ]]; then
  echo "unpack: $name already installed in $site"
  exit 0
fi
while read -r sum file; do
  [[ "$file" == "$name".tar.part-* && -f "$file" ]] || continue
  if ! echo "$sum  $file" | sha256sum --check --quiet -; then
    rm -f "$file"
    echo "unpack: $file is corrupt and was removed; carry it again" >&2
    exit 4
  fi
done < SHA256SUMS
needed="$(cat NPARTS)"
present="$(find . -maxdepth 1 -name "$name.tar.part-*" | wc -l)"
if [[ "$present" -lt "$needed" ]]; then
  echo "unpack: $present of $needed parts in $parts_dir; carry the next calls/NN folder"
  exit 3
fi
"$python" -c 'import lzma, zipfile' || { echo "unpack: $python has no lzma module" >&2; exit 5; }
cat "$name".tar.part-* > "$name".tar
if ! echo "$expected_tar  $name.tar" | sha256sum --check --quiet -; then
  echo "unpack: the joined tar is corrupt; carry every part again" >&2
  rm -f "$name".tar "$name".tar.part-*
  exit 4
fi
rm -rf wheels
mkdir wheels
tar -xf "$name".tar -C wheels
rm -f "$name".tar
"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" wheels/*.whl
echo "$expected_tar" > "$site/.$name"
echo "unpack: $name: installed $(find wheels -name '*.whl' | wc -l) wheels into $site"
