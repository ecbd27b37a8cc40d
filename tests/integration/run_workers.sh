#!/bin/bash
# Starts a prefill and a decode worker as two real processes (or under mpirun) and checks
# what the scenario expects. Usage: run_workers.sh KVSTREAM_BINARY SCENARIO
#   shm | tcp          1P1D over UCX shared memory / TCP on loopback, outputs bit-identical
#   one-at-a-time      shm with --one-at-a-time: each request starts after the one before it
#                      finished, so the decode worker runs 4 x 6 steps instead of 6, and
#                      the outputs are still bit-identical
#   shm-copy           shm with two copy threads on each worker (ucx_copy_threads): the
#                      prefill worker's writes into the decode worker's cache are copies
#   mpirun             the same under mpirun -np 2 (rank 0 prefill, rank 1 decode)
#   mpirun-1p2d        mpirun -np 3: one prefill worker serving two decode workers
#   mpirun-2p1d        mpirun -np 3: two prefill workers serving one decode worker
#   mpirun-1p2d-pp     mpirun -np 3: one prefill worker and one decode worker split into two
#                      pipeline stages (layers 0 and 1-3): bit-identical outputs, and each
#                      stage received exactly its layers' bytes
#   mismatch           different block sizes: rejected at handshake, requests fail clearly
#   not-disaggregated  the decode worker has the wrong shared secret, under the recompute
#                      policy: every request is recomputed correctly, but the worker says that
#                      no KV came from a prefill worker and exits 5
#   mismatch-pp        two pipeline stages of one decode worker built with different model
#                      seeds: they refuse each other at the stage hello and both exit non-zero
#   kill-producer      the prefill worker dies mid-stream: load errors, recompute, correct
#                      output, no block leaked on the decode worker
#   kill-producer-pp   the same with a decode worker of two pipeline stages: the prefill worker
#                      dies after sending stage 0's layers, so stage 1 sees load errors; both
#                      stages recompute the same requests and the outputs stay bit-identical
#   kill-consumer      the decode worker dies mid-stream: the prefill worker frees its blocks
#   kill-consumer-copy the same with copy threads
#   metrics            the prefill worker's Prometheus endpoint is scraped after a run; then
#                      SIGTERM stops the worker cleanly (exit 0, every block free)
#   metrics-pp         the same with a decode worker of two pipeline stages: one peer label
#                      per stage, each with its own layers' transfers; SIGINT stops the worker
#   cuda               1P1D with --device=cuda: the CUDA model on GPU 0 in both processes,
#                      device caches streamed over cuda_ipc, outputs bit-identical to a
#                      colocated run on the same GPU (SKIPPED where no GPU can be used)
#   demo-cuda          `kvstream demo --device=cuda` (small): exit 0, tokens equal to the
#                      colocated run, no block leaked, the decode worker on GPU 1 where two
#                      are visible (SKIPPED where no GPU can be used)
#   mpirun-cuda        launch/mpirun_xpyd.sh 1 1 --device=cuda: the cuda scenario's workers
#                      as mpirun's two ranks, one GPU each where two are visible (SKIPPED
#                      where no GPU can be used)
set -u
bin=$1
scenario=$2
work=$(mktemp -d)
trap 'kill $ppid 2>/dev/null; rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
model="--layers=4 --heads=4 --kv-heads=2 --head-size=16 --block-size=16 --num-blocks=128 ${KVSTREAM_TEST_BACKEND:+--backend=$KVSTREAM_TEST_BACKEND}"
prompts="--prompts=37,120,9,64 --decode-steps=6"
# The GPU scenarios' model: head size 128 for the CUDA attention kernels; bf16 caches.
cuda_model="--layers=4 --heads=8 --kv-heads=2 --head-size=128 --intermediate=1024 --vocab=1000 --block-size=16 --num-blocks=256"
# KV bytes of one layer of these prompts: 226 remote tokens x (K + V) x 2 KV heads x 16 x 4
# bytes (float32 cache).
layer_bytes=$(( (36 + 119 + 8 + 63) * 2 * 2 * 16 * 4 ))
tls=shm; extra=""
[ "$scenario" = tcp ] && { tls=tcp; extra=', "ucx_net_devices": "lo"'; }
case "$scenario" in *-copy) extra=', "ucx_copy_threads": 2' ;; esac
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
# GPU scenarios: exit 0 with a SKIPPED line when the worker said it could not use a GPU.
skip_without_gpu() {
  if grep -q "no usable CUDA device\|built without CUDA" "$work/decode.out"; then
    echo "SKIPPED: $scenario: $(grep -o 'no usable CUDA device.*\|built without CUDA.*' "$work/decode.out" | head -1)"
    exit 0
  fi
}

case "$scenario" in
  shm|shm-copy|tcp)
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
  cuda)
    model=$cuda_model
    start_prefill --serve=4 --device=cuda
    run_decode --device=cuda --json="$work/report.json"
    skip_without_gpu
    wait $ppid; prc=$?
    [ $drc -eq 0 ] || fail "decode worker exited $drc"
    [ $prc -eq 0 ] || fail "prefill worker exited $prc"
    grep -q "outputs bit-identical to the colocated run" "$work/decode.out" || fail "no match line"
    grep -q '"tokens_match": true' "$work/report.json" || fail "report says tokens differ"
    grep -q "served 4 requests" "$work/prefill.out" || fail "prefill did not serve 4 requests"
    # A GPU past the last one is an error naming it, before anything connects.
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    "$bin" worker --role=decode --device=cuda --gpu="$n" $model \
        --address-file="$work/none.addr" >"$work/bad-gpu.out" 2>&1
    rc=$?
    [ $rc -eq 1 ] || fail "--gpu=$n (of $n GPUs) exited $rc, not 1"
    grep -q "cudaSetDevice($n)" "$work/bad-gpu.out" || fail "--gpu=$n: the error does not name GPU $n"
    ;;
  mpirun-cuda)
    model=$cuda_model
    KVSTREAM="$bin" RENDEZVOUS="$work/rendezvous" \
        sh "$(dirname "$0")/../../launch/mpirun_xpyd.sh" 1 1 --device=cuda $model $prompts \
        >"$work/decode.out" 2>&1
    rc=$?
    skip_without_gpu
    [ $rc -eq 0 ] || fail "mpirun_xpyd.sh 1 1 --device=cuda exited $rc"
    grep -q "outputs bit-identical to the colocated run" "$work/decode.out" || fail "no match line"
    grep -q "served 4 requests" "$work/decode.out" || fail "the prefill rank did not serve 4 requests"
    # One GPU each where there are two (the ranks' local ranks), else both on GPU 0.
    gpu=0; [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ] && gpu=1
    grep -q "prefill worker 0 on GPU 0" "$work/decode.out" || fail "the prefill rank is not on GPU 0"
    grep -q "decode worker 0 on GPU $gpu" "$work/decode.out" || fail "the decode rank is not on GPU $gpu"
    ;;
  demo-cuda)
    "$bin" demo --device=cuda --requests=4 --decode-steps=8 --num-blocks=512 \
        --json="$work/report.json" >"$work/decode.out" 2>&1
    rc=$?
    skip_without_gpu
    [ $rc -eq 0 ] || fail "kvstream demo --device=cuda exited $rc"
    grep -q '"tokens_match": *true' "$work/report.json" || fail "report says tokens differ"
    grep -q '"blocks_leaked": *false' "$work/report.json" || fail "report says blocks leaked"
    grep -q '"transport": *"cuda_ipc"' "$work/report.json" || fail "report names another transport"
    # One GPU: both workers on it, loading asynchronously; two or more: the decode worker on
    # GPU 1, layer by layer.
    if [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ]; then gpu=1 async=false; else gpu=0 async=true; fi
    grep -q "\"decode_gpu\": *$gpu" "$work/report.json" || fail "decode worker not on GPU $gpu"
    grep -q "\"load_async\": *$async" "$work/report.json" || fail "load_async is not $async"
    ;;
  one-at-a-time)
    start_prefill --serve=4
    run_decode --one-at-a-time --json="$work/report.json"
    wait $ppid; prc=$?
    [ $drc -eq 0 ] || fail "decode worker exited $drc"
    [ $prc -eq 0 ] || fail "prefill worker exited $prc"
    grep -q "outputs bit-identical to the colocated run" "$work/decode.out" || fail "no match line"
    grep -q "4 requests in .* ms, 24 steps" "$work/decode.out" || fail "not 24 steps (one request at a time)"
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
  metrics|metrics-pp)
    # No idle exit: the worker must still serve the scrape however long the decode side
    # took; SIGTERM ends it below.
    start_prefill --metrics-port=0
    if [ "$scenario" = metrics ]; then
      run_decode --json="$work/report.json"
      [ $drc -eq 0 ] || fail "decode worker exited $drc"
      peers="decode-decode0:16"
    else
      # Two pipeline stages of one decode worker: stage 0 owns layer 0, stage 1 layers 1-3.
      "$bin" worker --role=decode --kv-transfer-config="$(cfg decode)" $model $prompts \
          --address-file="$addr" --pp-layers=0,1-3 --pp-rank=0 --json="$work/report.json" \
          >"$work/decode0.out" 2>&1 &
      d0pid=$!
      run_decode --pp-layers=0,1-3 --pp-rank=1 --json="$work/report.json"
      wait $d0pid; d0rc=$?
      cat "$work/decode0.out" >>"$work/decode.out"
      [ $drc -eq 0 ] && [ $d0rc -eq 0 ] || fail "decode stages exited $d0rc and $drc"
      peers="decode-decode0-pp0:4 decode-decode0-pp1:12"
    fi
    mport=$(sed -n 's|^metrics on http://0.0.0.0:\([0-9]*\)/metrics$|\1|p' "$work/prefill.out")
    [ -n "$mport" ] || fail "no metrics port printed"
    # The producer's exact counters per peer, one metrics line each: bytes and layer
    # transfers sent, and the latency histogram's count and +Inf bucket.
    want_samples() {
      for p in $peers; do
        peer=${p%%:*}; layers=${p##*:}
        l="role=\"kv_producer\",engine=\"prefill-prefill0\",peer=\"$peer\""
        echo "bytes sent to $peer|kvstream_transfer_bytes_total{$l,direction=\"sent\"} $((layers * layer_bytes / 4))"
        echo "expected $layers layer transfers to $peer|kvstream_layers_transferred_total{$l,direction=\"sent\"} $layers"
        echo "latency histogram count for $peer|kvstream_layer_transfer_latency_seconds_count{$l} $layers"
        echo "latency histogram +Inf bucket for $peer|kvstream_layer_transfer_latency_seconds_bucket{$l,le=\"+Inf\"} $layers"
      done
    }
    # The first wanted sample missing from the last scrape ("" when all are there).
    missing_sample() {
      want_samples | while IFS='|' read -r what line; do
        grep -qxF "$line" "$work/metrics.txt" || { echo "$what"; break; }
      done
    }
    # The producer counts a layer as sent when its transport reports the transfer complete,
    # on its progress thread, which can lag the consumer's arrival (and the decode worker's
    # exit) by a pass of that thread: scrape until every wanted sample is there, for at most
    # 5 s, then check that scrape. The counters only grow, so waiting cannot hide a wrong
    # value: one still short at the deadline fails, and one past the mark never matches.
    settle_by=$(( $(date +%s%N) + 5000000000 ))
    scrapes=0
    while :; do
      scrapes=$((scrapes + 1))
      exec 3<>"/dev/tcp/127.0.0.1/$mport" || fail "cannot connect to the metrics port"
      printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
      cat <&3 >"$work/metrics.txt"; exec 3<&-
      [ -z "$(missing_sample)" ] && break
      [ "$(date +%s%N)" -lt "$settle_by" ] || break
      sleep 0.1
    done
    cat "$work/metrics.txt"
    echo "metrics: $scrapes scrape(s)"
    grep -q "^HTTP/1.0 200" "$work/metrics.txt" || fail "no 200 answer"
    # Every sample carries the producer's role and engine and the consumer it went to.
    what=$(missing_sample)
    [ -z "$what" ] || fail "$what (not in the metrics after $scrapes scrapes over 5 s)"
    for p in $peers; do
      peer=${p%%:*}
      l="role=\"kv_producer\",engine=\"prefill-prefill0\",peer=\"$peer\""
      for m in kvstream_exposed_transfer_seconds_total kvstream_load_errors_total kvstream_blocks_in_flight kvstream_send_failures_total; do
        grep -q "^$m{$l} " "$work/metrics.txt" || fail "$m has no sample for $peer"
      done
    done
    [ "$(grep -c '^kvstream_layers_transferred_total{.*direction="sent"}' "$work/metrics.txt")" -eq "$(echo $peers | wc -w)" ] || fail "unexpected peers"
    # The decode side's JSON report has the same counters, by producer.
    if [ "$scenario" = metrics ]; then reports="$work/report.json:16"; else reports="$work/report.json.pp0:4 $work/report.json.pp1:12"; fi
    for r in $reports; do
      f=${r%%:*}; layers=${r##*:}
      tr -d ' \n' <"$f" >"$work/flat.json"
      grep -q "\"peers\":{\"prefill-prefill0\":{[^}]*\"bytes_received\":$((layers * layer_bytes / 4))," "$work/flat.json" || fail "$f: bytes received from the prefill worker"
      grep -q "\"layer_latency_count\":$layers," "$work/flat.json" || fail "$f: latency count"
    done
    # Asked to stop (SIGTERM, or SIGINT in the pipeline scenario), the prefill worker
    # finishes, checks its blocks and exits 0.
    sig=TERM; [ "$scenario" = metrics-pp ] && sig=INT
    kill -$sig $ppid
    wait $ppid; prc=$?
    [ $prc -eq 0 ] || fail "prefill worker exited $prc after SIG$sig"
    grep -q "prefill worker: SIG$sig, exiting" "$work/prefill.out" || fail "no SIG$sig line"
    grep -q "128/128 blocks free" "$work/prefill.out" || fail "prefill worker did not free every block"
    ;;
  mpirun-1p2d-pp)
    mpirun -np 3 --oversubscribe --bind-to none "$bin" worker --mpi --prefill-workers=1 \
        --pp-layers=0,1-3 --kv-transfer-config="$(cfg mpi)" $model $prompts \
        --address-file="$addr" --json="$work/report.json" >"$work/decode.out" 2>&1
    rc=$?
    [ $rc -eq 0 ] || fail "mpirun exited $rc"
    grep -q "served 4 requests" "$work/decode.out" || fail "the prefill worker did not serve the 4 requests once"
    [ "$(grep -c "outputs bit-identical to the colocated run" "$work/decode.out")" -eq 1 ] || fail "the last stage did not match the colocated run"
    grep -q "outputs checked by the last pipeline stage" "$work/decode.out" || fail "no first stage"
    for stage in 0:1 1:3; do
      s=${stage%%:*}; layers=${stage##*:}
      f="$work/report.json.pp$s"
      [ -f "$f" ] || fail "no report from stage $s"
      tr -d ' \n' <"$f" >"$work/flat.json"
      grep -q "\"pipeline_rank\":$s," "$work/flat.json" || fail "$f is not stage $s"
      grep -q '"tokens_match":true' "$work/flat.json" || fail "stage $s: outputs differ"
      grep -q '"blocks_leaked":false' "$work/flat.json" || fail "stage $s leaked blocks"
      # Only the stage's own layers arrived: 4 requests x its layers, and their bytes.
      grep -q "\"connector\":{\"blocks_in_flight\":0,\"bytes_received\":$((layers * layer_bytes))," "$work/flat.json" || fail "stage $s received other than its layers' $((layers * layer_bytes)) bytes"
      grep -q "\"layers_received\":$((4 * layers))," "$work/flat.json" || fail "stage $s did not receive $((4 * layers)) layer transfers"
    done
    ;;
  not-disaggregated)
    "$bin" worker --role=prefill --kv-transfer-config="$(cfg prefill ', "secret": "right"')" \
        $model $prompts --address-file="$addr" --idle-timeout=5 >"$work/prefill.out" 2>&1 &
    ppid=$!
    "$bin" worker --role=decode --kv-transfer-config="$(cfg decode ', "secret": "wrong"')" $model $prompts \
        --address-file="$addr" >"$work/decode.out" 2>&1
    drc=$?
    [ $drc -eq 5 ] || fail "decode worker exited $drc, expected 5 (not disaggregated)"
    grep -q "no KV came from any prefill worker" "$work/decode.out" || fail "no not-disaggregated error"
    grep -q "outputs bit-identical to the colocated run" "$work/decode.out" || fail "recompute wrong"
    ;;
  mismatch)
    policy=fail
    start_prefill --idle-timeout=5
    model="${model/--block-size=16/--block-size=32}"
    run_decode
    [ $drc -eq 3 ] || fail "decode worker exited $drc, expected 3 (requests failed)"
    grep -q "compatibility mismatch" "$work/decode.out" || fail "no compatibility error"
    ;;
  mismatch-pp)
    start_prefill --idle-timeout=5
    "$bin" worker --role=decode --kv-transfer-config="$(cfg decode)" $model $prompts \
        --address-file="$addr" --pp-layers=0,1-3 --pp-rank=0 --seed=2 \
        >"$work/decode0.out" 2>&1 &
    d0pid=$!
    run_decode --pp-layers=0,1-3 --pp-rank=1
    wait $d0pid; d0rc=$?
    cat "$work/decode0.out" >>"$work/decode.out"
    [ $drc -ne 0 ] && [ $d0rc -ne 0 ] || fail "stages of different models ran (exit $d0rc and $drc)"
    grep -q "belongs to group" "$work/decode.out" || fail "no group key error"
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
  kill-producer-pp)
    start_prefill --crash-after-layer=2
    "$bin" worker --role=decode --kv-transfer-config="$(cfg decode)" $model $prompts \
        --address-file="$addr" --pp-layers=0-1,2-3 --pp-rank=0 --json="$work/report.json" \
        >"$work/decode0.out" 2>&1 &
    d0pid=$!
    run_decode --pp-layers=0-1,2-3 --pp-rank=1 --json="$work/report.json"
    wait $d0pid; d0rc=$?
    wait $ppid; prc=$?
    cat "$work/decode0.out" >>"$work/decode.out"
    [ $prc -eq 137 ] || fail "prefill worker should have been killed (exit $prc)"
    [ $drc -eq 0 ] && [ $d0rc -eq 0 ] || fail "decode stages exited $d0rc and $drc"
    grep -q "outputs bit-identical to the colocated run" "$work/decode.out" || fail "outputs differ"
    # Stage 0's layers were sent before the crash: when all 8 (4 requests x 2 layers) arrived
    # it had no load error of its own and recomputes only because stage 1 told it.
    [ "$(grep -c "recomputed after a load error" "$work/decode0.out")" -eq 4 ] || fail "stage 0 did not recompute the requests stage 1 failed to load"
    tr -d ' \n' <"$work/report.json.pp0" >"$work/flat0.json"
    if grep -q '"layers_received":8,' "$work/flat0.json"; then
      grep -q "W\] load error:" "$work/decode0.out" && fail "stage 0 got all its layers yet reported load errors"
    else
      echo "note: some of stage 0's layers were still in flight at the crash"
    fi
    for s in 0 1; do
      grep -q '"blocks_leaked": false' "$work/report.json.pp$s" || fail "stage $s leaked blocks"
    done
    ;;
  kill-consumer|kill-consumer-copy)
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
