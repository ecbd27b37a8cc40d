#!/bin/bash
# Fault timings between two simulated hosts (launch/sim_hosts.sh): a prefill worker on
# kvbf0, a decode worker on kvbf1 running four waves of requests (--waves, --wave-gate), and
# between the waves the faults of docs/scale-out.md, each timed from the worker's own output
# lines (stamped on arrival with bash's EPOCHREALTIME):
#
#   wave 0  kvbf0's link limited to 2 Mbit/s; once 64 KiB of the stream crossed it, the link
#           is cut (ip link set down): cut -> first load error (the layer deadline,
#           load_timeout_ms), and cut -> wave 0 done (recomputed)
#   wave 1  the link still down, new requests to the silent host: wave start -> first and
#           last load error (refused at once while the producer is down and its reconnect
#           backoff runs; with --silent-attempt the backoff is waited out first, so the first
#           request makes one connection attempt, bounded by handshake_timeout_ms, and the
#           others are refused at once)
#   wave 2  the link restored, the prefill worker killed (SIGKILL): wave start -> load errors
#           (nothing listens: refused at once)
#   wave 3  a new prefill worker started on kvbf0 (new port, published in the rendezvous):
#           start -> listening, and start -> the first token of a wave-3 request served
#           with its KV (wave start + that request's time to first token)
#
#   bench/host_faults.sh [--bin=PATH] [--timeout-ms=1000] [--silent-attempt]
#                                                               (KEEP=1: keep the outputs)
#
# Late writes (docs/scale-out.md, "Late writes after a connection reset"): the prefill
# worker's writes still queued in its socket may arrive once the link is back. Over UCX's
# emulated puts UCX 1.13 aborted the decode worker then (fixed: writes over TCP are
# kvstream's own active messages), and the decode worker fences a producer it gave up off
# (Transport::Disconnect) before it reuses the blocks: such writes landing in reused blocks
# would show as "OUTPUTS DIFFER" (exit 1).
#
# --timeout-ms sets load_timeout_ms, send_timeout_ms and handshake_timeout_ms alike. Needs
# root; the hosts are removed on exit. Exit status 0, 1 when a step failed.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
bin=$root/build/launch/kvstream
timeout_ms=1000
silent_attempt=""
for a in "$@"; do
  case $a in
    --silent-attempt) silent_attempt=1 ;;
    --bin=*) bin=${a#*=} ;;
    --timeout-ms=*) timeout_ms=${a#*=} ;;
    *) echo "host_faults.sh: unknown option $a" >&2; exit 2 ;;
  esac
done
prefix=kvbf
subnet=10.79.0
sim="$root/launch/sim_hosts.sh"
work=$(mktemp -d)
pids=""
cleanup() {
  for p in $pids; do kill -KILL "$p" 2>/dev/null; done
  "$sim" down --prefix=$prefix >/dev/null 2>&1
  if [ -n "${KEEP:-}" ]; then echo "outputs kept in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
"$sim" up 2 --prefix=$prefix --subnet=$subnet --hostfile="$work/hosts" >"$work/up.out" 2>&1 ||
    { cat "$work/up.out" >&2; exit 1; }
h0=${prefix}0 h1=${prefix}1
model="--layers=4 --heads=4 --kv-heads=2 --head-size=16 --block-size=16 --num-blocks=256"
prompts="--prompts=500,400,300,200 --decode-steps=4"
cfg="{\"engine_id\": \"faults\", \"kv_ip\": \"0.0.0.0\", \"kv_port\": 0, \"kv_connector_extra_config\": {\"ucx_tls\": \"tcp\", \"load_timeout_ms\": $timeout_ms, \"send_timeout_ms\": $timeout_ms, \"handshake_timeout_ms\": $timeout_ms}}"
gate=$work/gate
addr=$work/addr

stamp() { while IFS= read -r line; do echo "$EPOCHREALTIME $line"; done; }
now() { echo "$EPOCHREALTIME"; }
die() { echo "host_faults.sh: $*" >&2; grep -h "Fatal" "$work"/*.out >&2; for f in prefill.out prefill2.out decode.out; do [ -e "$work/$f" ] && { echo "--- $f"; cat "$work/$f"; } >&2; done; exit 1; }
wait_for() {  # wait_for FILE [PATTERN]: up to 60 s
  for _ in $(seq 1 600); do
    if [ -n "${2:-}" ]; then grep -q -- "$2" "$1" 2>/dev/null && return 0; else [ -e "$1" ] && return 0; fi
    sleep 0.05
  done
  die "waited in vain for ${2:-$1}${2:+ in $1}"
}
# The stamp of the first line of FILE after time T matching PATTERN (and the last: LAST=1).
first_after() {  # first_after FILE T PATTERN
  awk -v t="$2" -v p="$3" -v last="${LAST:-0}" '$1 >= t && index($0, p) { s = $1; if (!last) { print s; exit } } END { if (last && s) print s }' "$1"
}
# The text of the first load error after time T, shortened.
why_after() {  # why_after T
  awk -v t="$1" '$1 >= t && /load error: / { sub(/.*load error: /, ""); print substr($0, 1, 110); exit }' "$work/decode.out" |
      sed 's/|/\\|/g'
}
ms() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "") print "?"; else printf "%.0f", (b - a) * 1000 }'; }

start_prefill() {  # start_prefill OUTFILE
  ip netns exec $h0 "$bin" worker --role=prefill $model --address-file="$addr" \
      --idle-timeout=60 --kv-transfer-config="$cfg" > >(stamp >"$work/$1") 2>&1 &
  ppid=$!
  pids="$pids $ppid"
}
"$sim" rate $h0 2mbit --prefix=$prefix || die "cannot limit $h0's link"
start_prefill prefill.out
ip netns exec $h1 "$bin" worker --role=decode $model $prompts --waves=4 --wave-gate="$gate" \
    --address-file="$addr" --json="$work/decode.json" --run-timeout=300 \
    --kv-transfer-config="$cfg" > >(stamp >"$work/decode.out") 2>&1 &
dpid=$!
pids="$pids $dpid"

# Wave 0: cut the link mid-stream.
tx() { ip netns exec $h0 cat /sys/class/net/eth0/statistics/tx_bytes; }
for _ in $(seq 1 600); do [ "$(tx)" -ge 65536 ] && break; sleep 0.05; done
t_cut=$(now)
"$sim" link $h0 down --prefix=$prefix || die "cannot cut $h0's link"
wait_for "$gate.d0.w0.done"
t_err0=$(first_after "$work/decode.out" "$t_cut" "load error")
why0=$(why_after "$t_cut")
t_w0=$(first_after "$work/decode.out" "$t_cut" "wave 0 done")

# Wave N whose requests fail: opens its gate, waits for it, and sets t_gN (its start),
# t_errNa and t_errNb (its first and last load error), n_errN (their number) and whyN.
failing_wave() {
  local n=$1 t
  t=$(now)
  : >"$gate.w$n"
  wait_for "$gate.d0.w$n.done"
  printf -v "t_g$n" %s "$t"
  printf -v "t_err${n}a" %s "$(first_after "$work/decode.out" "$t" "load error")"
  printf -v "t_err${n}b" %s "$(LAST=1 first_after "$work/decode.out" "$t" "load error")"
  printf -v "n_err$n" %s "$(awk -v t="$t" '$1 >= t && /load error/' "$work/decode.out" | wc -l)"
  printf -v "why$n" %s "$(why_after "$t")"
}

# Wave 1: the host is silent. The decode worker closed its link when the prefill worker
# did not confirm the aborts of wave 0 (send_timeout_ms); with --silent-attempt, waiting out
# the first reconnect backoff (200 ms) makes wave 1's first request try to reach it.
[ -n "$silent_attempt" ] && sleep 0.3
failing_wave 1

# Wave 2: link back, prefill worker killed.
"$sim" link $h0 up --prefix=$prefix
"$sim" rate $h0 none --prefix=$prefix
# Until the host answers again (a refused connection to its discard port).
for _ in $(seq 1 100); do
  out=$(ip netns exec $h1 timeout 1 bash -c "exec 3<>/dev/tcp/$subnet.11/9" 2>&1)
  [[ $out == *"onnection refused"* ]] && break
  sleep 0.05
done
{ kill -KILL $ppid; wait $ppid; } 2>/dev/null
failing_wave 2

# Wave 3: a new prefill worker on the same host.
old=$(cat "$addr")
rm -f "$addr"
t_restart=$(now)
start_prefill prefill2.out
wait_for "$work/prefill2.out" "listening on"
t_listen=$(first_after "$work/prefill2.out" "$t_restart" "listening on")
for _ in $(seq 1 600); do [ -s "$addr" ] && break; sleep 0.02; done
t_g3=$(now)
: >"$gate.w3"
wait $dpid
drc=$?
[ $drc -eq 0 ] || die "the decode worker exited $drc"
grep -q "blocks free; outputs bit-identical to the colocated run" "$work/decode.out" ||
    die "the decode worker's outputs differ from the colocated run or blocks leaked"
# The fastest wave-3 request's time to first token (ms after the wave started).
ttft3=$(awk '/"id": "w3-req-/ { w3 = 1 } w3 && /"ttft_ms":/ { gsub(/[^0-9.]/, ""); if (min == "" || $0 < min) min = $0; w3 = 0 } END { print min }' "$work/decode.json")
recomputed3=$(grep -c "w3-req-.*recomputed" "$work/decode.out")
[ "$recomputed3" -eq 0 ] || die "$recomputed3 wave-3 requests were recomputed"

echo "machine: $(nproc) CPUs ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)), $(uname -r); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "timeouts (load, send, handshake): $timeout_ms ms; reconnect backoff: defaults (200 ms, doubling to 5 s)"
echo "| fault | from | to | ms | first error |"
echo "|---|---|---|---|---|"
echo "| link cut mid-stream (wave 0) | cut | first load error | $(ms "$t_cut" "$t_err0") | $why0 |"
echo "| | cut | wave 0 done (recomputed) | $(ms "$t_cut" "$t_w0") | |"
echo "| host silent, new requests (wave 1: $n_err1 load errors) | wave start | first load error | $(ms "$t_g1" "$t_err1a") | $why1 |"
echo "| | wave start | last load error | $(ms "$t_g1" "$t_err1b") | |"
echo "| prefill worker killed (wave 2: $n_err2 load errors) | wave start | first load error | $(ms "$t_g2" "$t_err2a") | $why2 |"
echo "| | wave start | last load error | $(ms "$t_g2" "$t_err2b") | |"
echo "| prefill worker restarted (wave 3) | start | listening | $(ms "$t_restart" "$t_listen") | |"
echo "| | start | rendezvous updated, wave 3 starts | $(ms "$t_restart" "$t_g3") | |"
echo "| | wave start | first token served with its KV | ${ttft3%.*} | |"
echo "| | start | first token served with its KV | $(awk -v a="$(ms "$t_restart" "$t_g3")" -v b="$ttft3" 'BEGIN { printf "%.0f", a + b }') | |"
echo "(old address $old, new $(cat "$addr"))"
