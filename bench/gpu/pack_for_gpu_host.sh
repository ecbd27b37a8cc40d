#!/usr/bin/env bash
# Packs programs built on this machine for a GPU host that lacks some of the libraries they
# load (no Abseil, another Google Benchmark, UCX without headers): every FILE goes to
# DEST/bin, every shared library it loads goes to DEST/lib except the base system's (glibc,
# the GCC runtime) and the GPU host's own (driver, NCCL, the CUDA toolkit's math libraries;
# the CUDA runtime is packed), UCX's transport modules go with UCX when it is packed, and
# DEST/env.sh puts DEST/lib first on the library path, the host's toolkit after it. The pack
# is then checked: each packed program must resolve every library it packed inside it.
# Build with the GPU host's CUDA toolkit version (nvcc -V on both), so that the packed
# CUDA runtime and the host's math libraries match, and for its architecture
# (-DCMAKE_CUDA_ARCHITECTURES).
#
#   bench/gpu/pack_for_gpu_host.sh DEST FILE...
#
# On the GPU host:  source DEST/env.sh && DEST/bin/PROGRAM ...
# Exit status: non-zero when a FILE is missing or not a dynamic ELF file, or when a library
# it loads is not found here.
set -u -o pipefail
usage="usage: pack_for_gpu_host.sh DEST FILE..."
dest=${1:?$usage}
shift
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
# Loaded from the GPU host itself: glibc, the GCC runtime, the driver, NCCL, the toolkit's
# math libraries (hundreds of MiB).
base='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libutil|libresolv|libgcc_s|libstdc\+\+|libcuda|libnvidia-[a-z0-9-]+|libnccl|libcublas|libcublasLt|libcufft|libcurand|libcusparse|libcusolver|libnvrtc|libnvJitLink)\.so'

# "name path" of each library in ldd's listing $1 that is neither the base system's nor the
# host's.
packable() {
  local name arrow path rest
  while read -r name arrow path rest; do
    [ "$arrow" = "=>" ] || continue
    [[ $name =~ $base ]] && continue
    echo "$name $path"
  done <<< "$1"
}

# Copies every packable library that ELF file $1 loads (ldd's closure) into $dest/lib, under
# the name it is loaded by, and prints "name path" of each.
pack_libraries() {
  local listing name path
  if ! listing=$(ldd "$1" 2>&1) || ! grep -q "=>" <<< "$listing"; then
    echo "pack_for_gpu_host: $1 is not a dynamic ELF file: $listing" >&2
    return 1
  fi
  if grep -q "not found" <<< "$listing"; then
    echo "pack_for_gpu_host: libraries of $1 not found here:" >&2
    grep "not found" <<< "$listing" >&2
    return 1
  fi
  while read -r name path; do
    [ -n "$name" ] || continue
    cp -L "$path" "$dest/lib/$name" || return 1
    echo "$name $path"
  done < <(packable "$listing")
}

mkdir -p "$dest/bin" "$dest/lib" || exit 1
for file in "$@"; do
  [ -f "$file" ] || { echo "pack_for_gpu_host: no such file: $file" >&2; exit 1; }
  cp -L "$file" "$dest/bin/" || exit 1
  packed=$(pack_libraries "$file") || exit 1
  # UCX finds its transports (shared memory, TCP, ...) as modules in ucx/ beside libucs.
  ucs=$(awk '$1 ~ /^libucs\.so/ {print $2}' <<< "$packed")
  if [ -n "$ucs" ] && [ ! -d "$dest/lib/ucx" ]; then
    modules=$(dirname "$(readlink -f "$ucs")")/ucx
    mkdir -p "$dest/lib/ucx"
    for module in "$modules"/*.so*; do
      [ -e "$module" ] || continue
      cp -P "$module" "$dest/lib/ucx/" || exit 1  # the versions' links stay links
      [ -L "$module" ] || pack_libraries "$module" > /dev/null || exit 1
    done
  fi
done
cat > "$dest/env.sh" << 'EOF'
# Sourced on the GPU host: the libraries packed with the programs come first.
kvstream_pack=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
kvstream_toolkit=${CUDA_HOME:-/usr/local/cuda}
export LD_LIBRARY_PATH="$kvstream_pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:$kvstream_toolkit/lib64:$kvstream_toolkit/lib"
EOF

# The check: with only DEST/lib on the path, every library a packed program loads that is
# neither the base system's nor the host's resolves inside DEST/lib.
lib_dir=$(cd "$dest/lib" && pwd)
status=0
for program in "$dest"/bin/*; do
  while read -r name path; do
    [ -n "$name" ] || continue
    if [ "$(dirname "$path")" != "$lib_dir" ]; then
      echo "pack_for_gpu_host: $(basename "$program") loads $name from $path, not from the pack" >&2
      status=1
    fi
  done < <(packable "$(LD_LIBRARY_PATH=$lib_dir ldd "$program")")
done
[ "$status" = 0 ] || exit 1
echo "pack_for_gpu_host: $# program(s), $(find "$dest/lib" -name '*.so*' | wc -l) libraries in $dest ($(du -sh "$dest" | cut -f1))"
