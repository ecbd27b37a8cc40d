#!/bin/sh
# Builds the kvstream Python package into a virtual environment (pip install ./python, its
# build requirements from PyPI) and runs its tests with pytest.
#
#   python/run_tests.sh                 venv in build/python-pip-venv of the repository root
#   KVSTREAM_PYTHON_VENV=/tmp/v python/run_tests.sh -k stream     (extra args go to pytest)
#
# The package's C++ build folder (python/build/) is kept between runs, so a second run only
# rebuilds what changed; ccache is used where installed. CMAKE_BUILD_PARALLEL_LEVEL (default
# 2) bounds the compile jobs.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
venv=${KVSTREAM_PYTHON_VENV:-$here/../build/python-pip-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q numpy pytest
launcher=""
if command -v ccache >/dev/null 2>&1; then
  launcher="-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache -C cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache"
fi
# shellcheck disable=SC2086  # $launcher is a list of arguments
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} "$venv/bin/pip" install -q $launcher "$here"
# From the repository root, so that python/kvstream (the sources, without the extension)
# does not shadow the installed package.
cd "$here/.."
exec "$venv/bin/python" -m pytest -q "$here/tests" "$@"
