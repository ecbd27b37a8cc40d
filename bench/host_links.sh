#!/bin/bash
# Per-link KV throughput between two simulated hosts (launch/sim_hosts.sh) at several tbf
# rates, beside a plain TCP stream over the same link, with the unlimited veth link (no
# tbf) in the same run as the ceiling. Prints a Markdown table (docs/scale-out.md).
#
#   bench/host_links.sh [--bin=PATH] [--rates="none 1gbit 10gbit 25gbit"] [--repeats=3]
#                       [--seconds=3] [-- kvstream_bench_link flags...]
#
# Host kvbl0 sends, kvbl1 receives (kvstream_bench_link: layers of scattered blocks through
# kvstream's UCX transport over TCP, then a plain TCP stream); each direction of each link
# is limited to the rate (tc tbf; "none": no qdisc). The rates are measured round-robin,
# `repeats` rounds, so that a change of load on the machine touches every rate alike; each
# cell is the median of the rounds with their minimum and maximum. Needs root; the hosts are
# removed on exit. Exit status 0, 1 when a run failed, 3 when the hosts cannot be made.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
bin=$root/build/bench/kvstream_bench_link
rates="none 1gbit 10gbit 25gbit"
repeats=3
seconds=3
while [ $# -gt 0 ]; do
  case $1 in
    --bin=*) bin=${1#*=} ;;
    --rates=*) rates=${1#*=} ;;
    --repeats=*) repeats=${1#*=} ;;
    --seconds=*) seconds=${1#*=} ;;
    --) shift; break ;;
    *) echo "host_links.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ -x "$bin" ] || { echo "host_links.sh: no $bin (ninja -C build kvstream_bench_link)" >&2; exit 2; }
prefix=kvbl
subnet=10.78.0
sim="$root/launch/sim_hosts.sh"
work=$(mktemp -d)
trap '"$sim" down --prefix=$prefix >/dev/null 2>&1; rm -rf "$work"' EXIT
"$sim" up 2 --prefix=$prefix --subnet=$subnet --hostfile="$work/hosts" >"$work/up.out" 2>&1 ||
    { cat "$work/up.out" >&2; exit 3; }

echo "machine: $(nproc) CPUs ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)), $(uname -r), UCX $(ucx_info -v 2>/dev/null | sed -n 's/^# Version //p')"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
port=5555
for round in $(seq 1 "$repeats"); do
  for rate in $rates; do
    for h in ${prefix}0 ${prefix}1; do "$sim" rate "$h" "$rate" --prefix=$prefix || exit 1; done
    port=$((port + 2))
    ip netns exec ${prefix}1 "$bin" receive --listen=$subnet.12:$port --net-devices=eth0 "$@" \
        2>"$work/recv.err" &
    rpid=$!
    line=$(ip netns exec ${prefix}0 timeout 120 "$bin" send --connect=$subnet.12:$port \
        --net-devices=eth0 --seconds="$seconds" --tcp-seconds="$seconds" "$@" 2>"$work/send.err")
    rc=$?
    wait $rpid
    if [ $rc -ne 0 ] || [ -z "$line" ]; then
      echo "host_links.sh: rate $rate round $round failed:" >&2
      cat "$work/send.err" "$work/recv.err" >&2
      exit 1
    fi
    echo "round $round rate $rate: $line"
    echo "$rate $line" >>"$work/results"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

# The table: per rate, median (min-max) of kv_gbps and tcp_gbps, and kv / rate.
echo
echo "| tbf rate | KV layers, Gbit/s (median, min-max of $repeats) | KV / rate | plain TCP, Gbit/s | KV / TCP |"
echo "|---|---|---|---|---|"
for rate in $rates; do
  awk -v rate="$rate" '
    function field(name,   i, kv) {
      for (i = 2; i <= NF; ++i) { split($i, kv, "="); if (kv[1] == name) return kv[2] }
    }
    function sort(a, n,   i, j, t) {
      for (i = 2; i <= n; ++i) for (j = i; j > 1 && a[j - 1] > a[j]; --j) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
    }
    $1 == rate { ++n; kv[n] = field("kv_gbps") + 0; tcp[n] = field("tcp_gbps") + 0 }
    END {
      if (n == 0) exit
      sort(kv, n); sort(tcp, n)
      mk = kv[int((n + 1) / 2)]; mt = tcp[int((n + 1) / 2)]
      bits = 0
      if (rate ~ /gbit$/) bits = substr(rate, 1, length(rate) - 4) + 0
      else if (rate ~ /mbit$/) bits = (substr(rate, 1, length(rate) - 4) + 0) / 1000
      ratio = bits > 0 ? sprintf("%.2f", mk / bits) : "-"
      printf "| %s | %.2f (%.2f-%.2f) | %s | %.2f (%.2f-%.2f) | %.2f |\n",
             rate == "none" ? "none (veth ceiling)" : rate, mk, kv[1], kv[n], ratio,
             mt, tcp[1], tcp[n], (mt > 0 ? mk / mt : 0)
    }' "$work/results"
done
