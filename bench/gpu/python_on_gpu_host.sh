#!/usr/bin/env bash
# On a GPU host with no package registry: builds kvstream's Python extension (CUDA on) for
# the host's python3 (the one with torch), and runs the Python tests with it, the GPU ones
# (python/tests/test_gpu_stream.py: torch CUDA tensors streamed over cuda_ipc between two
# processes) required to run, not skip. Every log goes to OUT_DIR.
#
#   bench/gpu/python_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]
#
# Nothing is downloaded: nanobind, pytest and pytest's dependencies come from wheels carried
# in the checkout (WHEELS, default .deps/wheels, git-ignored), made once on a machine with
# a registry:
#
#   pip download nanobind==2.15.0 --no-deps -d .deps/wheels
#   pip download pytest --python-version 3.12 --only-binary=:all: -d .deps/wheels
#
# They go into BUILD_DIR/python-deps (pip --target, or unzipped where the interpreter has no
# pip; they are pure Python), which the build puts on PYTHONPATH
# (KVSTREAM_PYTHON_INTERPRETER / KVSTREAM_PYTHON_PATH, python/tests/CMakeLists.txt). Only
# the extension's targets are built. The tests' numpy and torch are the interpreter's own.
#
# PYTHON: the interpreter (default: python3 on PATH). REQUIRE_GPU=0: go on without torch or
# a GPU (the GPU tests then skip; for a dry run elsewhere). JOBS: compile jobs (default
# nproc). PYTEST_ARGS: more pytest arguments
# (e.g. "-k gpu_stream" for the GPU tests alone). CTEST=1: afterwards also ctest's
# python_package (the same tests through the build's test definition). Exit status 0 only
# when the build and every test passed (the GPU tests ran: KVSTREAM_REQUIRE_GPU=1 turns
# their skips into failures).
set -eu -o pipefail
usage="usage: python_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]"
build=${1:?$usage}
out=${2:?$usage}
shift 2
src=$(cd "$(dirname "$0")/../.." && pwd)
wheels=${WHEELS:-$src/.deps/wheels}
python=$(command -v "${PYTHON:-python3}" || true)
mkdir -p "$out" "$build"
build=$(cd "$build" && pwd)
out=$(cd "$out" && pwd)
deps=$build/python-deps
require_gpu=${REQUIRE_GPU:-1}

fail() {
  echo "python_on_gpu_host: $*" | tee -a "$out/summary.txt" >&2
  exit 1
}
step() { echo "== $* ($(date +%T))" | tee -a "$out/summary.txt"; }

: > "$out/summary.txt"
[ -n "$python" ] || fail "no interpreter '${PYTHON:-python3}' on PATH"
step "interpreter $python"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
# What the host has, in one file: the interpreter, its headers, numpy, torch and its GPU.
"$python" - > "$out/python-env.txt" 2>&1 <<'EOF' || { cat "$out/python-env.txt" >&2; fail "the interpreter's probe failed (python-env.txt)"; }
import os, sys, sysconfig
include = sysconfig.get_paths()["include"]
print("python", sys.version.split()[0], sys.executable)
print("include", include, "Python.h:", os.path.exists(os.path.join(include, "Python.h")))
import numpy
print("numpy", numpy.__version__)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("gpu", torch.cuda.get_device_name(0))
        # kvstream's module binds to the libnccl.so.2 that torch loaded (conftest.py).
        print("torch nccl", torch.cuda.nccl.version())
except ImportError as e:
    print("torch missing:", e)
EOF
cat "$out/python-env.txt"
grep -q "Python.h: True" "$out/python-env.txt" ||
  fail "no Python.h for $python (python-env.txt): the extension cannot be built (Ubuntu: python3.12-dev)"
if [ "$require_gpu" = 1 ]; then
  grep -q "^torch .* available True" "$out/python-env.txt" ||
    fail "torch with a usable GPU is not importable by $python (python-env.txt; REQUIRE_GPU=0 goes on)"
fi

# pytest only where the interpreter has none (what is put on PYTHONPATH shadows its own).
wanted=nanobind
"$python" -c "import pytest" > /dev/null 2>&1 || wanted="nanobind pytest"
step "$wanted from $wheels into $deps"
for w in $wanted; do
  ls "$wheels"/"$w"-*.whl > /dev/null 2>&1 ||
    fail "no $w wheel in $wheels (make them on a machine with a registry: see the top of $0)"
done
rm -rf "$deps"
if "$python" -m pip --version > /dev/null 2>&1; then
  # shellcheck disable=SC2086  # $wanted is a list of names
  "$python" -m pip install --disable-pip-version-check --no-index --find-links "$wheels" \
    --target "$deps" $wanted > "$out/install.log" 2>&1 ||
    { tail -20 "$out/install.log" >&2; fail "pip could not install the wheels (install.log)"; }
else
  # No pip: the wheels are pure Python, unpacked they import as installed.
  for w in "$wheels"/*.whl; do
    "$python" -m zipfile -e "$w" "$deps" >> "$out/install.log" 2>&1 || fail "cannot unpack $w"
  done
fi
PYTHONPATH=$deps "$python" -c "import nanobind, pytest; print('nanobind', nanobind.__version__, 'pytest', pytest.__version__)" \
  | tee -a "$out/summary.txt" || fail "nanobind or pytest do not import from $deps (install.log)"

step "configure $build"
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSTREAM_CUDA=ON \
  -DKVSTREAM_SANITIZER_BUILDS=OFF -DKVSTREAM_FUZZ=OFF -DKVSTREAM_PYTHON_TESTS=ON \
  -DKVSTREAM_PYTHON_INTERPRETER="$python" -DKVSTREAM_PYTHON_PATH="$deps" "$@" \
  > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log" >&2; fail "cmake configure failed (configure.log)"; }
if grep -q "Python tests skipped" "$out/configure.log"; then
  grep "Python tests skipped" "$out/configure.log" >&2
  fail "the build leaves the Python extension out (configure.log)"
fi

step "build the extension"
cmake --build "$build" --target kvstream_python_extension kvstream_python_sources -j "${JOBS:-$(nproc)}" \
  > "$out/build.log" 2>&1 ||
  { grep -E "error|Error" -A3 "$out/build.log" | head -60 >&2; fail "the build failed (build.log)"; }
printf '%s\n' "$build"/python/kvstream/_kvstream*.so | tee -a "$out/summary.txt"

step "pytest python/tests"
status=0
# From the build folder: the source folder's kvstream/ (no extension) must not shadow it.
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
(cd "$build" && PYTHONPATH="$build/python:$deps" PYTHONDONTWRITEBYTECODE=1 KVSTREAM_REQUIRE_GPU=$require_gpu \
   timeout "${PYTEST_TIMEOUT:-600}" "$python" -m pytest -v -rs -p no:cacheprovider \
   --junitxml="$out/pytest.xml" "$src/python/tests" ${PYTEST_ARGS:-}) > "$out/pytest.log" 2>&1 || status=1
grep -E "test_gpu_stream.py::" "$out/pytest.log" | sed 's/ *\[ *[0-9]*%\]$//' | tee -a "$out/summary.txt" || true
tail -1 "$out/pytest.log" | tee -a "$out/summary.txt"
if [ $status != 0 ]; then
  grep -E -A40 "^(=+ FAILURES|_+ test_)" "$out/pytest.log" | head -120 >&2 || true
  echo "python_on_gpu_host: pytest failed (pytest.log)" | tee -a "$out/summary.txt" >&2
fi

if [ "${CTEST:-0}" = 1 ]; then
  step "ctest -R python_package"
  KVSTREAM_REQUIRE_GPU=$require_gpu ctest --test-dir "$build" -R python_package --output-on-failure \
    > "$out/ctest.log" 2>&1 || { status=1; tail -40 "$out/ctest.log" >&2; }
  tail -3 "$out/ctest.log" | tee -a "$out/summary.txt"
fi
step "done, status $status"
exit $status
