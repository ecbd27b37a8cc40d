#!/usr/bin/env bash
# bench/gpu/pack_for_gpu_host.sh on the kvstream command (which loads Abseil and UCX in the
# default build): the pack holds them and UCX's modules, the packed command loads every
# packed library from the pack and passes its self-test with the pack's env.sh; a missing
# file and a file that is not a dynamic ELF program are refused with a message.
#
#   pack_for_gpu_host_check.sh SCRIPT PROGRAM WORK_DIR
set -u -o pipefail
script=$1
program=$2
work=$3
name=$(basename "$program")
fail() {
  echo "pack_for_gpu_host_check: FAILED: $*"
  exit 1
}
rm -rf "$work"
mkdir -p "$work" || fail "cannot make $work"

"$script" "$work/pack" "$program" || fail "packing $program"
pack_lib=$(cd "$work/pack/lib" && pwd)
loads=$(ldd "$program")
# Abseil and UCX are shared libraries in the default build (a sanitizer build links them in).
if grep -q '^\s*libabsl_' <<< "$loads"; then
  compgen -G "$pack_lib/libabsl_*.so.*" > /dev/null || fail "no Abseil library in the pack"
fi
if grep -q '^\s*libucs\.so' <<< "$loads"; then
  compgen -G "$pack_lib/ucx/libuct_*.so*" > /dev/null || fail "UCX packed without its modules"
fi
# With the pack first on the path, every packed library the program loads comes from the pack.
compgen -G "$pack_lib/*.so*" > /dev/null || fail "nothing packed"
while read -r lib arrow path rest; do
  if [ "$arrow" != "=>" ] || [ ! -e "$pack_lib/$lib" ]; then continue; fi
  [ "$(dirname "$path")" = "$pack_lib" ] || fail "$lib loaded from '$path', not from the pack"
done < <(LD_LIBRARY_PATH=$pack_lib ldd "$work/pack/bin/$name")
# shellcheck disable=SC1091  # written by the pack above
out=$(unset LD_LIBRARY_PATH; source "$work/pack/env.sh" &&
  "$work/pack/bin/$name" selftest --layers=1 --decode-steps=1 2>&1) ||
  fail "the packed $name: $out"
grep -q "kvstream selftest: OK" <<< "$out" || fail "the packed $name's self-test: $out"

out=$("$script" "$work/missing" "$work/no-such-program" 2>&1) && fail "a missing file was packed"
grep -q "no such file: $work/no-such-program" <<< "$out" || fail "missing file: $out"
echo "not a program" > "$work/text"
out=$("$script" "$work/text-pack" "$work/text" 2>&1) && fail "a text file was packed"
grep -q "is not a dynamic ELF file" <<< "$out" || fail "text file: $out"
echo "pack_for_gpu_host_check: ok"
