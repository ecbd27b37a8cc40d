#!/bin/sh
# Runs a sanitized sub-build's tests with the sanitizers' options and this folder's
# suppressions. Usage: run_suite.sh BUILD_DIR address,undefined|thread [ctest arguments...]
# The options reach every process a test starts (workers, mpirun's ranks, peers).
set -eu
dir=$1 kind=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
case $kind in
  address,undefined)
    export ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1:abort_on_error=0"
    export LSAN_OPTIONS="suppressions=$here/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
    # Idle OpenMP threads sleep instead of spinning: the CPU attention's parallel regions are
    # short and tests run side by side, where a spinning team takes the cores the other
    # test's threads need (what is computed and checked is the same).
    export OMP_WAIT_POLICY=passive
    ;;
  thread)
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$here/tsan.supp:print_suppressions=0"
    ;;
  *) echo "run_suite.sh: unknown sanitizer kind $kind" >&2; exit 2 ;;
esac
exec ctest --test-dir "$dir" --output-on-failure --no-tests=error "$@"
