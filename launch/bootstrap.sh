#!/bin/sh
# Installs the Debian packages kvstream needs to build and test, skipping those already
# installed. Run as root (or with sudo available) on Debian 12 or a derivative.
#
#   launch/bootstrap.sh                   install what is missing
#   launch/bootstrap.sh --list            print the package list and exit
#   launch/bootstrap.sh --download DIR    download the .deb files into DIR without installing
#                                         (for offline hosts: carry DIR there, then dpkg -x)
#
# The CUDA toolkit (with NCCL) is not a Debian package: kvstream uses it when nvcc is found
# (/usr/local/cuda), and builds its CPU parts alone otherwise.
set -eu

# python3-venv and python3-dev: the Python package's tests in the main build (a virtual
# environment in the build folder, the extension compiled against Python's headers).
# clang and libclang-rt-14-dev: the fuzzers and the sanitized builds (tests/fuzz/,
# tests/sanitize/); libomp-dev: OpenMP for clang, so that the ASan build checks the CPU
# attention's multi-threaded path.
PACKAGES="build-essential cmake ninja-build pkg-config git ca-certificates
libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libcli11-dev
libucx-dev ucx-utils libssl-dev libxxhash-dev nlohmann-json3-dev libopenmpi-dev openmpi-bin
clang libclang-rt-14-dev libomp-dev python3-venv python3-dev"

if [ "${1:-}" = "--list" ]; then
  echo $PACKAGES
  exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "bootstrap: run as root, or install sudo" >&2; exit 1
  fi
fi

if [ "${1:-}" = "--download" ]; then
  dir=${2:?usage: bootstrap.sh --download DIR}
  mkdir -p "$dir"
  $SUDO apt-get update -qq
  (cd "$dir" && apt-get download $PACKAGES)
  echo "bootstrap: packages downloaded into $dir"
  exit 0
fi

missing=""
for p in $PACKAGES; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing="$missing $p"
  fi
done
if [ -z "$missing" ]; then
  echo "bootstrap: all packages present"
  exit 0
fi
echo "bootstrap: installing$missing"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $missing
echo "bootstrap: done"
