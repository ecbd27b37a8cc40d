#!/bin/sh
# Runs one libFuzzer binary for a bounded time from its seed corpus (read only), with new
# inputs in a scratch folder and crash artifacts under it. Exit status: the fuzzer's (non-zero
# when it found a crash, a leak or a timeout). Usage: run_fuzz.sh FUZZER SEEDS WORK SECONDS
set -eu
fuzzer=$1 seeds=$2 work=$3 seconds=$4
mkdir -p "$work/corpus" "$work/artifacts"
exec "$fuzzer" "$work/corpus" "$seeds" -max_total_time="$seconds" -timeout=10 \
     -rss_limit_mb=2048 -artifact_prefix="$work/artifacts/" -print_final_stats=1
