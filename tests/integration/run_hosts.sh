#!/bin/bash
# Prefill and decode workers on simulated hosts (launch/sim_hosts.sh: network namespaces on
# a bridge) under launch/mpirun_xpyd.sh. Usage: run_hosts.sh KVSTREAM_BINARY SCENARIO
#   hosts-2p2d   four hosts, one rank each: prefill workers on hosts 0 and 1, decode workers
#                on 2 and 3, UCX over TCP across the links. Each decode worker's outputs are
#                bit-identical to the colocated run, each prefill worker served its 4
#                requests, every prefill host sent and every decode host received at least
#                the KV bytes of its requests over its own link (so they crossed the links,
#                not shared memory or loopback), and nothing of the hosts is left behind.
#   hosts-link-cut  the same hosts, prefill host 0's link limited to 2 Mbit/s and longer
#                prompts, so that its stream (about 700 KB) takes seconds: once it has sent
#                64 KiB over its link (in practice ~270 KB: tbf's 256 KiB burst passes at
#                once), the link is cut (ip link set down at the bridge) until both decode workers are done.
#                The requests prefill worker 0 was streaming become load errors on the decode
#                workers (load_timeout_ms 3000) and are recomputed, bit-identical to the
#                colocated run; prefill worker 1's stream to both decode workers continues
#                (its requests load, none recomputed); no block leaks on any worker (each
#                exits 0, and prints every block free); prefill worker 0 cancels its stalled
#                sends (send_timeout_ms 3000) and exits once the link is back.
#   hosts-restart  the same hosts; the decode workers run three waves of the prompts
#                (--waves=3, --wave-gate: the test acts between waves), under mpirun
#                --enable-recovery so that the job outlives a rank. After wave 0 the
#                prefill worker on host 0 is killed (SIGKILL); wave 1's requests to it are
#                load errors naming its address (the connector fails them at once: nothing
#                listens there) and are recomputed; then a new prefill worker 0 is started on
#                host 0, outside the job (as a service manager would), and publishes its
#                new port in the rendezvous; wave 2 is served by it: none recomputed. The
#                decode workers, never restarted, handshook prefill worker 0 twice (its
#                engine id, in their JSON reports), every output of every wave is
#                bit-identical to the colocated run, and no block leaked on any worker.
#   hosts-restart-same-port  the same, but the new prefill worker 0 listens on the port
#                the killed one had (kv_port fixed), so the decode workers find it at the
#                address they knew, and reconnect to it there (reconnect_backoff_ms 0: every
#                load to a down producer tries it again).
# Needs root; prints SKIPPED where it is not root or namespaces cannot be made.
set -u
bin=$1
scenario=$2
here=$(cd "$(dirname "$0")" && pwd)
launch=$(cd "$here/../../launch" && pwd)
prefix=kvsimt      # this test's hosts: kvsimt0..3, bridge kvsimt-br
subnet=10.77.0
model="--layers=4 --heads=4 --kv-heads=2 --head-size=16 --block-size=16 --num-blocks=128"
prompts="--prompts=37,120,9,64 --decode-steps=6"
# KV bytes one worker moves: request i of decode worker d goes to prefill worker (i + d) mod
# 2, so each prefill worker serves the prompts of 37 and 9 tokens of one decode worker and 120
# and 64 of the other, and each decode worker loads all four: 226 remote tokens x 4 layers x
# (K + V) x 2 KV heads x 16 x 4 bytes (float32 cache), either way.
kv_bytes=$(( (36 + 119 + 8 + 63) * 4 * 2 * 2 * 16 * 4 ))

tx_bytes() { ip netns exec "$1" cat /sys/class/net/eth0/statistics/tx_bytes; }
# Hosts with an established connection to prefill worker 0's control port, seen on host $1.
control_peers() {
  local addr
  addr=$(cat "$work/rendezvous/prefill.addr.0" 2>/dev/null) || { echo 0; return; }
  ip netns exec "$1" ss -Htn state established "( sport = :${addr##*:} )" |
    awk '{ sub(/:[0-9]+$/, "", $4); print $4 }' | sort -u | wc -l
}
# The link-cut run: long prompts, short deadlines, no idle exit before the link is back.
cut_model="--layers=4 --heads=4 --kv-heads=2 --head-size=16 --block-size=16 --num-blocks=256"
cut_prompts="--prompts=500,400,300,200 --decode-steps=4 --idle-timeout=10"
cut_config='{"kv_ip": "0.0.0.0", "kv_port": 0, "kv_connector_extra_config": {"ucx_tls": "tcp", "load_timeout_ms": 3000, "send_timeout_ms": 3000}}'
cut_after=65536
# The restart run: fixed engine ids ("hosts-prefill0" for both of prefill worker 0's lives).
restart_config='{"engine_id": "hosts", "kv_ip": "0.0.0.0", "kv_port": 0, "kv_connector_extra_config": {"ucx_tls": "tcp"}}'

# Waits up to 60 s for every file named; fails the run otherwise.
wait_files() {
  local f
  for f in "$@"; do
    for _ in $(seq 1 600); do [ -e "$f" ] && break; sleep 0.1; done
    [ -e "$f" ] || { echo "no $f after 60 s" >>"$work/restart"; return 1; }
  done
}

# Inside the hosts (sim_hosts.sh run's command): the xPyD run, then each host's link
# counters. Usage: run_hosts.sh KVSTREAM inside WORKDIR SCENARIO
if [ "$scenario" = inside ]; then
  work=$3
  : >"$work/started"
  # Every wait of the workers has its own deadline; this one bounds a launch that hangs.
  if [ "$4" = hosts-2p2d ]; then
    KVSTREAM="$bin" RENDEZVOUS="$work/rendezvous" timeout -k 5 120 sh \
        "$launch/mpirun_xpyd.sh" 2 2 $model $prompts >"$work/mpirun.out" 2>&1
    echo $? >"$work/mpirun.rc"
  elif [ "$4" = hosts-restart ] || [ "$4" = hosts-restart-same-port ]; then
    h0=${SIM_HOSTS%% *}
    config=$restart_config
    [ "$4" = hosts-restart-same-port ] && config=${restart_config/\"tcp\"/\"tcp\", \"reconnect_backoff_ms\": 0, \"reconnect_backoff_max_ms\": 0}
    gate=$work/gate
    addr0=$work/rendezvous/prefill.addr.0
    MPIRUN_FLAGS=--enable-recovery KVSTREAM="$bin" RENDEZVOUS="$work/rendezvous" \
        timeout -k 5 150 sh "$launch/mpirun_xpyd.sh" 2 2 $model $prompts --waves=3 \
        --wave-gate="$gate" --json="$work/report.json" --kv-transfer-config="$config" \
        >"$work/mpirun.out" 2>&1 &
    mpid=$!
    : >"$work/restart"
    if wait_files "$gate.d0.w0.done" "$gate.d1.w0.done"; then
      # Prefill worker 0 is the one kvstream process on host 0 (beside its orted).
      for pid in $(ip netns pids "$h0"); do
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = kvstream ] && kill -KILL "$pid" &&
            echo "killed prefill worker 0 (pid $pid) on $h0 after wave 0" >>"$work/restart"
      done
      old=$(cat "$addr0")
      echo "$old" >"$work/old_addr"
      : >"$gate.w1"
      if wait_files "$gate.d0.w1.done" "$gate.d1.w1.done"; then
        # The new prefill worker 0: same host, index and rendezvous; not a rank of the job.
        rconfig=$config
        [ "$4" = hosts-restart-same-port ] && rconfig=${config/\"kv_port\": 0/\"kv_port\": ${old##*:}}
        rm -f "$addr0"
        "$launch/netns_rsh.sh" "$h0" "$bin worker --role=prefill --index=0 --prefill-workers=2 --serve=4 --idle-timeout=60 --address-file=$work/rendezvous/prefill.addr --kv-transfer-config='$rconfig' $model $prompts" \
            >"$work/restarted.out" 2>&1 &
        rpid=$!
        for _ in $(seq 1 600); do [ -s "$addr0" ] && break; sleep 0.1; done
        echo "restarted prefill worker 0 on $h0: $(cat "$addr0") (was $old)" >>"$work/restart"
        : >"$gate.w2"
        wait $rpid
        echo $? >"$work/restarted.rc"
      fi
    fi
    wait $mpid
    echo $? >"$work/mpirun.rc"
  else
    h0=${SIM_HOSTS%% *}
    "$launch/sim_hosts.sh" rate "$h0" 2mbit --prefix=$prefix || exit 1
    KVSTREAM="$bin" RENDEZVOUS="$work/rendezvous" timeout -k 5 150 sh \
        "$launch/mpirun_xpyd.sh" 2 2 $cut_model $cut_prompts --kv-transfer-config="$cut_config" \
        >"$work/mpirun.out" 2>&1 &
    mpid=$!
    # Cut prefill host 0's link once part of its stream has crossed it and both decode
    # workers hold a control connection to it (a slow start could otherwise leave one of
    # them still dialing: cut then, it never meets prefill worker 0 and gives up its run).
    for _ in $(seq 1 600); do
      [ "$(tx_bytes "$h0")" -ge $cut_after ] && [ "$(control_peers "$h0")" -ge 2 ] && break
      kill -0 $mpid 2>/dev/null || break
      sleep 0.05
    done
    "$launch/sim_hosts.sh" link "$h0" down --prefix=$prefix
    echo "cut $h0 at $(tx_bytes "$h0") bytes sent, $(control_peers "$h0") decode hosts connected" >"$work/cut"
    # Restore it when both decode workers have finished (their hosts' links are up, so
    # their reports reach mpirun), or after 60 s.
    for _ in $(seq 1 600); do
      [ "$(grep -c "^decode worker: " "$work/mpirun.out")" -ge 2 ] && break
      kill -0 $mpid 2>/dev/null || break
      sleep 0.1
    done
    echo "restored after $(grep -c "^decode worker: " "$work/mpirun.out") decode workers finished" >>"$work/cut"
    "$launch/sim_hosts.sh" link "$h0" up --prefix=$prefix
    wait $mpid
    echo $? >"$work/mpirun.rc"
  fi
  for h in $SIM_HOSTS; do
    echo "$h $(ip netns exec "$h" cat /sys/class/net/eth0/statistics/tx_bytes) $(ip netns exec "$h" cat /sys/class/net/eth0/statistics/rx_bytes)"
  done >"$work/counters"
  exit 0
fi

work=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
leftovers() {  # what of this test's hosts exists now
  { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}[0-9]+$"
    ip -o link show 2>/dev/null | grep -oE "^[0-9]+: ${prefix}[^:@]*"; } | tr '\n' ' '
}
# Pass or fail, nothing stays: the hosts are removed by sim_hosts.sh itself; this is for a
# run killed before it could.
trap '"$launch/sim_hosts.sh" down --prefix=$prefix >/dev/null 2>&1; rm -rf "$work"' EXIT
show() {
  for f in sim_hosts.out mpirun.out cut restart restarted.out counters; do
    [ -e "$work/$f" ] && { echo "--- $f"; cat "$work/$f"; }
  done
}
fail() { show; echo "FAIL: $*"; exit 1; }
skip() { echo "SKIPPED: $scenario: $*"; exit 0; }

[ "$(id -u)" = 0 ] || skip "needs root to make network namespaces"
command -v ip >/dev/null || skip "no ip (iproute2)"
command -v mpirun >/dev/null || skip "no mpirun"
ip netns add "${prefix}probe" 2>"$work/probe.err" || skip "cannot make a network namespace: $(cat "$work/probe.err")"
ip netns del "${prefix}probe"
# A run of this test killed outright (ctest's timeout) leaves its hosts: remove them.
"$launch/sim_hosts.sh" down --prefix=$prefix >/dev/null 2>&1

case "$scenario" in
  hosts-2p2d|hosts-link-cut|hosts-restart|hosts-restart-same-port)
    timeout -k 10 240 "$launch/sim_hosts.sh" run 4 --prefix=$prefix --subnet=$subnet -- \
        "$0" "$bin" inside "$work" "$scenario" >"$work/sim_hosts.out" 2>&1
    src=$?
    if [ ! -e "$work/started" ] && [ $src -eq 3 ]; then
      skip "the hosts cannot be made here: $(grep -v '^sim_hosts.sh: [0-9]* hosts' "$work/sim_hosts.out" | head -3 | tr '\n' ' ')"
    fi
    [ $src -eq 0 ] || fail "sim_hosts.sh run exited $src"
    left=$(leftovers)
    [ -z "$left" ] || fail "left behind: $left"
    rc=$(cat "$work/mpirun.rc" 2>/dev/null)
    [ "$rc" = 0 ] || fail "mpirun_xpyd.sh 2 2 exited ${rc:-nothing} (4: blocks leaked)"
    ;;
esac
case "$scenario" in
  hosts-link-cut)
    grep -q "^cut ${prefix}0 at" "$work/cut" || fail "the link was not cut"
    got=$(grep -c "256/256 blocks free; outputs bit-identical to the colocated run" "$work/mpirun.out")
    [ "$got" -eq 2 ] || fail "$got of 2 decode workers matched the colocated run with every block free"
    [ "$(grep -c "^prefill worker: served .* 256/256 blocks free" "$work/mpirun.out")" -eq 2 ] ||
        fail "a prefill worker did not free every block"
    # Request i of decode worker d came from prefill worker (i + d) mod 2: worker 0 served
    # d0-req-0, d0-req-2, d1-req-1 and d1-req-3, worker 1 the others.
    for r in d0-req-0 d0-req-2 d1-req-1 d1-req-3; do
      grep -q "^  $r: .*recomputed after a load error" "$work/mpirun.out" ||
          fail "$r (from the cut prefill host) was not recomputed after a load error"
    done
    for r in d0-req-1 d0-req-3 d1-req-0 d1-req-2; do
      grep "^  $r: " "$work/mpirun.out" | grep -q "recomputed" &&
          fail "$r (from the prefill host whose link stayed up) was recomputed"
      grep -q "^  $r: .*== colocated" "$work/mpirun.out" || fail "$r did not match"
    done
    ;;
  hosts-restart|hosts-restart-same-port)
    got=$(grep -c "128/128 blocks free; outputs bit-identical to the colocated run" "$work/mpirun.out")
    [ "$got" -eq 2 ] || fail "$got of 2 decode workers matched the colocated run with every block free"
    grep -q "^killed prefill worker 0" "$work/restart" || fail "prefill worker 0 was not killed"
    [ "$(cat "$work/restarted.rc" 2>/dev/null)" = 0 ] || fail "the restarted prefill worker 0 exited $(cat "$work/restarted.rc" 2>/dev/null)"
    grep -q "^prefill worker: served 4 requests.*128/128 blocks free" "$work/restarted.out" ||
        fail "the restarted prefill worker 0 did not serve wave 2's 4 requests with every block free"
    [ "$(grep -c "^prefill worker: served 12 requests.*128/128 blocks free" "$work/mpirun.out")" -eq 1 ] ||
        fail "prefill worker 1 did not serve its 12 requests (3 waves) with every block free"
    old=$(cat "$work/old_addr")
    new=$(cat "$work/rendezvous/prefill.addr.0")
    if [ "$scenario" = hosts-restart ]; then
      [[ $new == "${subnet}.11:"* && $new != "$old" ]] ||
          fail "the restarted prefill worker 0 published '$new' (before: '$old'), not a new port of host 0"
    else
      [ "$new" = "$old" ] || fail "the restarted prefill worker 0 published '$new', not its old address '$old'"
    fi
    # Request i of decode worker d comes from prefill worker (i + d) mod 2 in every wave.
    for w in 0 1 2; do
      for r in d0-w$w-req-0 d0-w$w-req-2 d1-w$w-req-1 d1-w$w-req-3 \
               d0-w$w-req-1 d0-w$w-req-3 d1-w$w-req-0 d1-w$w-req-2; do
        line=$(grep "^  $r: " "$work/mpirun.out")
        [[ $line == *"== colocated"* ]] || fail "$r did not match the colocated run: $line"
        case "$w:$r" in
          1:d0-w1-req-0|1:d0-w1-req-2|1:d1-w1-req-1|1:d1-w1-req-3)
            [[ $line == *"recomputed after a load error"* ]] ||
                fail "$r (to prefill worker 0 while it was down) was not recomputed: $line" ;;
          *)
            [[ $line == *"recomputed"* ]] && fail "$r was recomputed: $line" ;;
        esac
      done
    done
    # Each of those four failed with an error naming the dead worker's address.
    errors=$(grep -c "load error: UNAVAILABLE: .*$old" "$work/mpirun.out")
    [ "$errors" -eq 4 ] || fail "$errors load errors name prefill worker 0's old address $old, not 4"
    # Each decode worker handshook prefill worker 0 twice (before and after its restart) and
    # prefill worker 1 once.
    for d in 0 1; do
      for p in 0:2 1:1; do
        n=$(awk -v peer="\"hosts-prefill${p%%:*}\": {" '
              index($0, peer) { inside = 1 }
              inside && /"handshakes":/ { gsub(/[^0-9]/, ""); print; exit }' \
            "$work/report.json.d$d")
        [ "$n" = "${p##*:}" ] ||
            fail "decode worker $d handshook prefill worker ${p%%:*} ${n:-no} times, not ${p##*:}"
      done
    done
    ;;
  hosts-2p2d)
    got=$(grep -c "128/128 blocks free; outputs bit-identical to the colocated run" "$work/mpirun.out")
    [ "$got" -eq 2 ] || fail "$got of 2 decode workers matched the colocated run with every block free"
    [ "$(grep -c "served 4 requests.*128/128 blocks free" "$work/mpirun.out")" -eq 2 ] ||
        fail "the prefill workers did not serve 4 requests each and free every block"
    # The prefill workers published their own host's address, not loopback's.
    for i in 0 1; do
      a=$(cat "$work/rendezvous/prefill.addr.$i" 2>/dev/null)
      [[ $a == "${subnet}.$((11 + i)):"* ]] || fail "prefill worker $i published '$a', not host $i's address"
    done
    # Prefill hosts (0, 1) sent, decode hosts (2, 3) received, the KV over their links.
    while read -r h tx rx; do
      case $h in
        "${prefix}0"|"${prefix}1") [ "$tx" -ge $kv_bytes ] || fail "$h sent $tx bytes over its link, less than the $kv_bytes bytes of KV it served" ;;
        "${prefix}2"|"${prefix}3") [ "$rx" -ge $kv_bytes ] || fail "$h received $rx bytes over its link, less than the $kv_bytes bytes of KV it loaded" ;;
        *) fail "unexpected host $h" ;;
      esac
    done <"$work/counters"
    [ "$(wc -l <"$work/counters")" -eq 4 ] || fail "not four hosts' counters"
    ;;
  *) echo "unknown scenario $scenario"; exit 2 ;;
esac
show
cat "$work/cut" 2>/dev/null
[ "$scenario" = hosts-2p2d ] && echo "KV bytes per worker: $kv_bytes"
echo "link bytes (host tx rx): $(tr '\n' ';' <"$work/counters")"
echo "PASS: $scenario"
