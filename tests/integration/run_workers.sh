#!/bin/bash
# Starts a prefill and a decode worker as two real processes (or under mpirun) and checks
# what the scenario expects. Usage: run_workers.sh KVSTREAM_BINARY SCENARIO
#   shm | tcp          1P1D over UCX shared memory / TCP on loopback, outputs bit-identical
#   mpirun             the same under mpirun -np 2 (rank 0 prefill, rank 1 decode)
#   mpirun-1p2d        mpirun -np 3: one prefill worker serving two decode workers
#   mpirun-2p1d        mpirun -np 3: two prefill workers serving one decode worker
#   mismatch           different block sizes: rejected at handshake, requests fail clearly
#   kill-producer      the prefill worker dies mid-stream: load errors, recompute, correct
#                      output, no block leaked on the decode worker
#   kill-consumer      the decode worker dies mid-stream: the prefill worker frees its blocks
#   metrics            the prefill worker's Prometheus endpoint is scraped after a run
set -u
bin=$1
scenario=$2
work=$(mktemp -d)
trap 'kill $ppid 2>/dev/null; rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
model="--layers=4 --heads=4 --kv-heads=2 --head-size=16 --block-size=16 --num-blocks=128 ${KVSTREAM_TEST_BACKEND:+--backend=$KVSTREAM_TEST_BACKEND}"
prompts="--prompts=37,120,9,64 --decode-steps=6"
tls=shm; extra=""
[ "$scenario" = tcp ] && { tls=tcp; extra=', "ucx_net_devices": "lo"'; }
policy=recompute
port=0
cfg() {  # cfg ROLE [extra json]
  echo "{\"kv_connector\": \"LayerwiseConnector\", \"kv_port\": $port, \"engine_id\": \"$1\", \"kv_load_failure_policy\": \"$policy\", \"kv_connector_extra_config\": {\"ucx_tls\": \"$tls\", \"load_timeout_ms\": 5000, \"send_timeout_ms\": 3000$extra ${2:-}}}"
}
addr="$work/address"
ppid=""

start_prefill() {  # start_prefill [flags...]
  "$bin" worker --role=prefill --kv-transfer-config="$(cfg prefill)" $model $prompts \
      --address-file="$addr" --idle-timeout=60 "$@" >"$work/prefill.out" 2>&1 &
  ppid=$!
}
run_decode() {  # run_decode [flags...]; sets drc
  "$bin" worker --role=decode --kv-transfer-config="$(cfg decode)" $model $prompts \
      --address-file="$addr" "$@" >"$work/decode.out" 2>&1
  drc=$?
}
# The tcp scenario passes the address explicitly instead: the port the prefill worker
# printed goes into the decode worker's kv_transfer_config.
run_decode_explicit() {
  for _ in $(seq 1 300); do
    grep -q "listening on" "$work/prefill.out" 2>/dev/null && break; sleep 0.1
  done
  port=$(sed -n 's/.*listening on .*:\([0-9]*\)$/\1/p' "$work/prefill.out" | head -1)
  [ -n "$port" ] || fail "the prefill worker printed no address"
  "$bin" worker --role=decode --kv-transfer-config="$(cfg decode)" $model $prompts \
      "$@" >"$work/decode.out" 2>&1
  drc=$?
}
show() { echo "--- prefill"; cat "$work/prefill.out"; echo "--- decode"; cat "$work/decode.out" 2>/dev/null; }
fail() { show; echo "FAIL: $*"; exit 1; }

case "$scenario" in
  shm|tcp)
    start_prefill --serve=4
    if [ "$scenario" = tcp ]; then run_decode_explicit --json="$work/report.json"
    else run_decode --json="$work/report.json"; fi
    wait $ppid; prc=$?
    [ $drc -eq 0 ] || fail "decode worker exited $drc"
    [ $prc -eq 0 ] || fail "prefill worker exited $prc"
    grep -q "outputs bit-identical to the colocated run" "$work/decode.out" || fail "no match line"
    grep -q '"tokens_match": true' "$work/report.json" || fail "report says tokens differ"
    grep -q "served 4 requests" "$work/prefill.out" || fail "prefill did not serve 4 requests"
    ;;
  mpirun)
    mpirun -np 2 --oversubscribe --bind-to none "$bin" worker --mpi \
        --kv-transfer-config="$(cfg mpi)" $model $prompts --address-file="$addr" \
        >"$work/decode.out" 2>&1
    rc=$?
    [ $rc -eq 0 ] || fail "mpirun exited $rc"
    grep -q "outputs bit-identical to the colocated run" "$work/decode.out" || fail "no match line"
    grep -q "served 4 requests" "$work/decode.out" || fail "prefill rank did not serve 4 requests"
    ;;
  mpirun-1p2d|mpirun-2p1d)
    np=3; pw=1; [ "$scenario" = mpirun-2p1d ] && pw=2
    mpirun -np $np --oversubscribe --bind-to none "$bin" worker --mpi --prefill-workers=$pw \
        --kv-transfer-config="$(cfg mpi)" $model $prompts --address-file="$addr" \
        >"$work/decode.out" 2>&1
    rc=$?
    [ $rc -eq 0 ] || fail "mpirun exited $rc"
    want_decode=$((np - pw))
    got=$(grep -c "outputs bit-identical to the colocated run" "$work/decode.out")
    [ "$got" -eq "$want_decode" ] || fail "$got of $want_decode decode workers matched"
    if [ $pw -eq 1 ]; then
      grep -q "served 8 requests" "$work/decode.out" || fail "the prefill worker did not serve 8"
    else
      [ "$(grep -c "served 2 requests" "$work/decode.out")" -eq 2 ] || fail "prefill workers did not serve 2 each"
    fi
    ;;
  metrics)
    start_prefill --metrics-port=0 --idle-timeout=4
    run_decode --json="$work/report.json"
    [ $drc -eq 0 ] || fail "decode worker exited $drc"
    mport=$(sed -n 's|^metrics on http://0.0.0.0:\([0-9]*\)/metrics$|\1|p' "$work/prefill.out")
    [ -n "$mport" ] || fail "no metrics port printed"
    exec 3<>"/dev/tcp/127.0.0.1/$mport" || fail "cannot connect to the metrics port"
    printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
    cat <&3 >"$work/metrics.txt"; exec 3<&-
    cat "$work/metrics.txt"
    grep -q "^HTTP/1.0 200" "$work/metrics.txt" || fail "no 200 answer"
    sent=$(sed -n 's/^kvstream_transfer_bytes_total{.*direction="sent"} \([0-9]*\)\r*$/\1/p' "$work/metrics.txt")
    [ -n "$sent" ] && [ "$sent" -gt 0 ] || fail "no bytes sent in the metrics"
    grep -q 'kvstream_layers_transferred_total{role="kv_producer".*direction="sent"} 16' "$work/metrics.txt" || fail "expected 16 layer transfers (4 requests x 4 layers)"
    grep -q 'kvstream_layer_transfer_latency_seconds_count{.*} 16' "$work/metrics.txt" || fail "latency histogram count"
    grep -q '"bytes_received": '"$sent" "$work/report.json" || fail "the decode JSON disagrees with the producer's bytes"
    wait $ppid
    ;;
  mismatch)
    policy=fail
    start_prefill --idle-timeout=5
    model="${model/--block-size=16/--block-size=32}"
    run_decode
    [ $drc -eq 3 ] || fail "decode worker exited $drc, expected 3 (requests failed)"
    grep -q "compatibility mismatch" "$work/decode.out" || fail "no compatibility error"
    ;;
  kill-producer)
    start_prefill --crash-after-layer=1
    run_decode --json="$work/report.json"
    wait $ppid; prc=$?
    [ $prc -eq 137 ] || fail "prefill worker should have been killed (exit $prc)"
    [ $drc -eq 0 ] || fail "decode worker exited $drc"
    grep -q "recomputed after a load error" "$work/decode.out" || fail "nothing was recomputed"
    grep -q "outputs bit-identical to the colocated run" "$work/decode.out" || fail "outputs differ"
    grep -q '"blocks_leaked": false' "$work/report.json" || fail "blocks leaked"
    ;;
  kill-consumer)
    start_prefill --serve=4 --idle-timeout=20
    run_decode --crash-after-layer=1
    [ $drc -eq 137 ] || fail "decode worker should have been killed (exit $drc)"
    wait $ppid; prc=$?
    [ $prc -eq 0 ] || fail "prefill worker exited $prc (4 = blocks leaked)"
    grep -q "blocks free" "$work/prefill.out" || fail "no block report"
    ;;
  *) echo "unknown scenario $scenario"; exit 2 ;;
esac
show
echo "PASS: $scenario"
