#!/usr/bin/env bash
# Shared by the build_*_carry.sh scripts (sourced): cut a folder of wheels into parts that each fit one device call.
#
#   pack_into_calls NAME WHEELS_DIR CARRY_DIR PART_SIZE
#
# writes CARRY_DIR/calls/NN/ holding NAME.tar.part-NN, SHA256SUMS (the whole tar's and every part's) and NPARTS;
# scripts/unpack_carry.sh joins the parts on the GPU box and installs the wheels.
pack_into_calls() {
  local name=$1 wheels=$2 carry_dir=$3 part_size=$4
  rm -rf "$carry_dir/parts" "$carry_dir/calls"
  mkdir -p "$carry_dir/parts"
  (cd "$wheels" && tar -cf "../parts/$name.tar" ./*.whl)
  (
    cd "$carry_dir/parts"
    sha256sum "$name.tar" > SHA256SUMS
    split --bytes "$part_size" --numeric-suffixes --suffix-length 2 "$name.tar" "$name.tar.part-"
    rm "$name.tar"
    sha256sum "$name".tar.part-* >> SHA256SUMS
    find . -name "$name.tar.part-*" | wc -l > NPARTS
  )
  local part call
  for part in "$carry_dir/parts/$name".tar.part-*; do
    call="$carry_dir/calls/${part##*part-}"
    mkdir -p "$call"
    cp "$part" "$carry_dir/parts/SHA256SUMS" "$carry_dir/parts/NPARTS" "$call/"
  done
  rm -rf "$carry_dir/parts"
  echo "$(du -cb "$wheels"/*.whl | tail -1 | awk '{printf "%.1f MiB", $1 / 1048576}') of wheels in" \
    "$(cat "$carry_dir"/calls/00/NPARTS) part(s):"
  find "$carry_dir/calls" -name "$name.tar.part-*" -printf '  %s %p\n' | sort -k2 \
    | awk '{printf "  %8.2f MiB  %s\n", $1 / 1048576, $2}'
}

# recompress_wheel SOURCE TARGET [REGEX...]: copy a wheel without the members matching any REGEX (full match), its
# large members LZMA-compressed (pip installs LZMA zips), its RECORD without the dropped files.
recompress_wheel() {
  "${PYTHON:-python3}" - "$@" << 'PY'
import re
import sys
import zipfile

source, target, *dropped = sys.argv[1:]
patterns = [re.compile(pattern) for pattern in dropped]


def is_dropped(name: str) -> bool:
    return any(pattern.fullmatch(name) for pattern in patterns)


dropped_bytes = dropped_files = 0
with zipfile.ZipFile(source) as original, zipfile.ZipFile(target, "w") as slim:
    for member in original.infolist():
        if is_dropped(member.filename):
            dropped_bytes += member.file_size
            dropped_files += 1
            continue
        data = original.read(member)
        if member.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not is_dropped(line.split(",")[0])).encode()
        large = len(data) > 4096
        method = zipfile.ZIP_LZMA if large else zipfile.ZIP_DEFLATED
        slim.writestr(member, data, compress_type=method, compresslevel=None if large else 6)
print(f"  {target}: dropped {dropped_files} files ({dropped_bytes / 2**20:.1f} MiB)")
PY
}
