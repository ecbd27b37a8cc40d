#!/bin/bash
# Simulated hosts on this machine for multi-host runs: each host is a Linux network namespace
# with loopback and one interface, eth0, whose veth peer sits on a bridge in the root
# namespace; the bridge holds the subnet's .1 address, so mpirun runs in the root namespace
# (the "head node") and reaches every host directly, and the hosts reach each other through
# the bridge. Nothing is routed beyond the subnet: the namespaces have no default route and
# the root namespace only gains the subnet's own route, so traffic stays on these hosts and
# loopback. Needs root (ip netns, ip link, tc).
#
#   launch/sim_hosts.sh run N [options] -- COMMAND [ARGS...]
#       makes N hosts, runs COMMAND with the environment below, and removes everything it
#       made when COMMAND ends or the script is interrupted (INT, TERM); exit status
#       COMMAND's (3 when the hosts cannot be made)
#   launch/sim_hosts.sh up N [options]     makes N hosts and leaves them (prints the env file)
#   launch/sim_hosts.sh down [--prefix=P]  removes everything `up` or `run` made: processes
#                                          left in the hosts, namespaces, veths, bridge, files;
#                                          idempotent (nothing there: nothing to do, exit 0)
#   launch/sim_hosts.sh link HOST down|up [--prefix=P]
#                                          cuts (or restores) HOST's link at the bridge
#   launch/sim_hosts.sh rate HOST RATE|none [--prefix=P]
#                                          sets (or removes) HOST's link's rate limit, both
#                                          directions
#
# Options:
#   --prefix=P     host names P0..P(N-1), bridge P-br, bridge-side veths P<i>v (default kvsim;
#                  lower-case letters and digits, at most 8, starting with a letter)
#   --subnet=A.B.C the hosts' /24 (default 10.77.0): bridge A.B.C.1, host i A.B.C.(11+i)
#   --rate=RATE    rate limit of every link, each direction (tc tbf; e.g. 1gbit, 10gbit,
#                  25gbit, 500mbit); default none
#   --slots=S      slots per host in the hostfile (default 1)
#   --hostfile=F   where to write the Open MPI hostfile (default: ./P.hosts for up; a
#                  temporary file for run); its environment goes to F.env
#
# The environment (F.env, and exported for run's COMMAND):
#   HOSTFILE                          the hostfile (launch/mpirun_xpyd.sh reads it)
#   SIM_HOSTS                         the host names, in hostfile order
#   SIM_HOSTS_SUBNET                  A.B.C
#   OMPI_MCA_plm_rsh_agent            launch/netns_rsh.sh: mpirun starts its orted on host H
#                                     with `ip netns exec H`, under the host name H
#   OMPI_MCA_oob_tcp_if_include       the subnet: the orteds dial mpirun back on the bridge's
#                                     address, the only one of its addresses they can reach
#   KVSTREAM_UCX_TLS=tcp (unless set) for launch/mpirun_xpyd.sh: the hosts share this
#                                     machine's memory, and UCX, seeing one machine, would
#                                     move KV through shared memory instead of the links
#
# A 2P2D run over four hosts (prefill ranks on the first two), with 10 Gbit/s links:
#   launch/sim_hosts.sh run 4 --rate=10gbit -- launch/mpirun_xpyd.sh 2 2
set -u
here=$(cd "$(dirname "$0")" && pwd)
me="sim_hosts.sh"

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
die() { echo "$me: $1" >&2; exit "${2:-1}"; }

prefix=kvsim
subnet=10.77.0
rate=""
slots=1
hostfile=""

parse_option() {  # parse_option ARG; returns 1 when ARG is no option
  case $1 in
    --prefix=*) prefix=${1#*=} ;;
    --subnet=*) subnet=${1#*=} ;;
    --rate=*) rate=${1#*=} ;;
    --slots=*) slots=${1#*=} ;;
    --hostfile=*) hostfile=${1#*=} ;;
    *) return 1 ;;
  esac
}

check_options() {
  [[ $prefix =~ ^[a-z][a-z0-9]{0,7}$ ]] ||
      die "--prefix=$prefix: lower-case letters and digits, at most 8, starting with a letter" 2
  [[ $subnet =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] ||
      die "--subnet=$subnet: give the /24's first three octets, e.g. 10.77.0" 2
  local o
  for o in "${BASH_REMATCH[@]:1}"; do [ "$o" -le 255 ] || die "--subnet=$subnet: octet $o" 2; done
  [[ $slots =~ ^[1-9][0-9]{0,2}$ ]] || die "--slots=$slots: a number of slots from 1 to 999" 2
  if [ -n "$rate" ]; then
    rate_bits >/dev/null || die "--rate=$rate: a rate such as 500mbit, 1gbit, 25gbit" 2
  fi
}

# The --rate in bits per second.
rate_bits() {
  [[ $rate =~ ^([1-9][0-9]{0,5})(kbit|mbit|gbit)$ ]] || return 1
  local n=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
  case $unit in
    kbit) echo $((n * 1000)) ;;
    mbit) echo $((n * 1000000)) ;;
    gbit) echo $((n * 1000000000)) ;;
  esac
}

# The namespaces of this prefix that exist now.
existing_hosts() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}[0-9]+$" | sort -V
}

state_file() { echo "/run/sim_hosts.$prefix"; }

# Removes everything of this prefix: processes left in its hosts, the namespaces (and with
# them both ends of their veths), the bridge, and the files the state file names. Safe to
# run any number of times, and on a half-made set.
down() {
  local ns pids pid left
  for ns in $(existing_hosts); do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    # shellcheck disable=SC2086
    [ -n "$pids" ] && kill -TERM $pids 2>/dev/null
  done
  # Up to 2 s for them to go, then SIGKILL.
  for _ in $(seq 1 20); do
    left=""
    for ns in $(existing_hosts); do left="$left$(ip netns pids "$ns" 2>/dev/null)"; done
    [ -z "$left" ] && break
    sleep 0.1
  done
  for ns in $(existing_hosts); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null || echo "$me: could not delete namespace $ns" >&2
  done
  # A veth whose namespace is gone is gone too; these only remain after a half-made up.
  local link
  for link in $(ip -o link show 2>/dev/null | sed -n "s/^[0-9]*: \(${prefix}[0-9]*v\)@.*/\1/p"); do
    ip link del "$link" 2>/dev/null
  done
  ip link show "${prefix}-br" >/dev/null 2>&1 && ip link del "${prefix}-br"
  local state
  state=$(state_file)
  if [ -f "$state" ]; then
    local f
    while IFS= read -r f; do [ -n "$f" ] && rm -f -- "$f"; done <"$state"
    rm -f -- "$state"
  fi
  local what
  what="$(existing_hosts)$(ip link show "${prefix}-br" 2>/dev/null)"
  [ -z "$what" ] || { echo "$me: could not remove everything of $prefix" >&2; return 1; }
  return 0
}

# tc tbf on DEV (in namespace NS, or the root namespace for NS empty) at --rate.
limit_link() {
  local ns=$1 dev=$2 bits burst
  bits=$(rate_bits)
  # A burst of 4 ms at the rate (the kernel needs at least one timer tick's worth), and at
  # least 256 KiB so that a 64 KiB GSO packet never waits on the bucket alone.
  burst=$((bits / 8 / 250))
  [ $burst -ge 262144 ] || burst=262144
  ip ${ns:+-n "$ns"} link set "$dev" txqueuelen 10000
  tc ${ns:+-n "$ns"} qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 50ms
}

# Whether ADDR answers a TCP connection from namespace NS (root namespace for NS empty):
# port 9 (discard) is closed on these hosts, so a reachable one refuses at once and an
# unreachable one times out.
answers() {  # answers NS ADDR
  local out
  out=$(${1:+ip netns exec "$1"} timeout 1 bash -c "exec 3<>/dev/tcp/$2/9" 2>&1) && return 0
  [[ $out == *"onnection refused"* ]]
}

# Waits (at most 10 s) until every host and the bridge reach each other both ways. A new
# link's qdisc and the bridge port start asynchronously, and an orted whose first dial to
# mpirun is lost gives up without mpirun hearing of it (mpirun would wait forever).
wait_reachable() {  # wait_reachable "NAMES"
  local ns i=0 deadline=$((SECONDS + 10))
  for ns in $1; do
    until answers "" "${subnet}.$((11 + i))" && answers "$ns" "${subnet}.1"; do
      [ $SECONDS -lt $deadline ] || { echo "$me: host $ns is unreachable over its link" >&2; return 1; }
      sleep 0.1
    done
    i=$((i + 1))
  done
}

up() {  # up N
  local n=$1 i ns peer addr
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)" 3
  command -v ip >/dev/null || die "needs ip (iproute2)" 3
  command -v unshare >/dev/null || die "needs unshare (util-linux) for the hosts' names" 3
  [ -z "$rate" ] || command -v tc >/dev/null || die "--rate needs tc (iproute2)" 3
  [ -z "$(existing_hosts)" ] && ! ip link show "${prefix}-br" >/dev/null 2>&1 ||
      die "hosts of prefix $prefix exist already ($(existing_hosts | tr '\n' ' ')); '$0 down --prefix=$prefix' removes them" 3
  if ip -4 route show | grep -q "^${subnet//./\\.}\.0/24"; then
    die "the root namespace routes ${subnet}.0/24 already; pick another --subnet" 3
  fi
  hostfile=${hostfile:-$PWD/$prefix.hosts}
  case $hostfile in /*) ;; *) hostfile=$PWD/$hostfile ;; esac
  # Record the files first: a failure below still has them removed by down.
  printf '%s\n%s\n' "$hostfile" "$hostfile.env" >"$(state_file)" || die "cannot write $(state_file)" 3
  ip link add "${prefix}-br" type bridge || return 3
  ip addr add "${subnet}.1/24" dev "${prefix}-br" || return 3
  ip link set "${prefix}-br" up || return 3
  : >"$hostfile" || return 3
  local names=""
  for i in $(seq 0 $((n - 1))); do
    ns="$prefix$i"; peer="${prefix}${i}v"; addr="${subnet}.$((11 + i))"
    ip netns add "$ns" || return 3
    ip link add "$peer" type veth peer name "${prefix}${i}h" || return 3
    ip link set "${prefix}${i}h" netns "$ns" || return 3
    ip -n "$ns" link set "${prefix}${i}h" name eth0 || return 3
    ip -n "$ns" addr add "$addr/24" dev eth0 || return 3
    ip -n "$ns" link set lo up || return 3
    ip -n "$ns" link set eth0 up || return 3
    ip link set "$peer" master "${prefix}-br" || return 3
    ip link set "$peer" up || return 3
    if [ -n "$rate" ]; then
      limit_link "$ns" eth0 || return 3     # host -> bridge
      limit_link "" "$peer" || return 3     # bridge -> host
    fi
    echo "$ns slots=$slots" >>"$hostfile"
    names="$names${names:+ }$ns"
  done
  wait_reachable "$names" || return 3
  cat >"$hostfile.env" <<EOF
export HOSTFILE='$hostfile'
export SIM_HOSTS='$names'
export SIM_HOSTS_SUBNET='$subnet'
export OMPI_MCA_plm_rsh_agent='$here/netns_rsh.sh'
export OMPI_MCA_oob_tcp_if_include='${subnet}.0/24'
: "\${KVSTREAM_UCX_TLS:=tcp}"; export KVSTREAM_UCX_TLS
EOF
  echo "$me: $n hosts ($names) on ${subnet}.0/24${rate:+, links limited to $rate}; hostfile $hostfile"
}

link() {  # link HOST down|up
  local host=$1 state=$2 i
  [[ $host =~ ^${prefix}([0-9]+)$ ]] || die "$host is no host of prefix $prefix" 2
  i=${BASH_REMATCH[1]}
  case $state in up|down) ;; *) die "link $host: say down or up, not '$state'" 2 ;; esac
  ip link set "${prefix}${i}v" "$state" || die "cannot set ${prefix}${i}v $state" 1
}

set_rate() {  # set_rate HOST RATE|none
  local host=$1 i
  [[ $host =~ ^${prefix}([0-9]+)$ ]] && [ -e "/run/netns/$host" ] ||
      die "$host is no host of prefix $prefix" 2
  i=${BASH_REMATCH[1]}
  if [ "$2" = none ]; then
    tc -n "$host" qdisc del dev eth0 root 2>/dev/null
    tc qdisc del dev "${prefix}${i}v" root 2>/dev/null
    return 0
  fi
  rate=$2
  rate_bits >/dev/null || die "rate $host: a rate such as 500mbit, 1gbit, 25gbit, or none" 2
  limit_link "$host" eth0 && limit_link "" "${prefix}${i}v"
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case $cmd in
  up|run)
    [ $# -ge 1 ] && [[ $1 =~ ^[1-9][0-9]{0,2}$ ]] && [ "$1" -le 200 ] ||
        die "$cmd: give the number of hosts first (1 to 200)" 2
    n=$1
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
      parse_option "$1" || die "$cmd: unknown option $1" 2
      shift
    done
    check_options
    if [ "$cmd" = up ]; then
      up "$n" || { rc=$?; down; exit "$rc"; }
      echo "$me: environment in $hostfile.env ('. $hostfile.env'); '$0 down --prefix=$prefix' removes everything"
      exit 0
    fi
    [ "${1:-}" = -- ] && [ $# -ge 2 ] || die "run: give the command after --" 2
    shift
    if [ -z "$hostfile" ]; then
      hostfile=$(mktemp "/tmp/$prefix.hosts.XXXXXX") || die "cannot make a temporary file" 3
      rm -f "$hostfile"  # up writes it, and records it for down
    fi
    child=""
    # On every way out: stop the command (if still running), then remove what was made.
    on_exit() {
      trap - EXIT INT TERM
      [ -n "$child" ] && kill -TERM "$child" 2>/dev/null && sleep 0.2 && kill -KILL "$child" 2>/dev/null
      down
    }
    trap on_exit EXIT
    trap 'echo "$me: interrupted, removing the hosts" >&2; exit 130' INT
    trap 'echo "$me: terminated, removing the hosts" >&2; exit 143' TERM
    up "$n" || exit 3
    # shellcheck disable=SC1090
    . "$hostfile.env"
    # In the background so that INT and TERM reach the traps at once, not after the command.
    "$@" &
    child=$!
    wait "$child"
    rc=$?
    child=""
    exit "$rc"
    ;;
  down)
    for a in "$@"; do parse_option "$a" || die "down: unknown option $a" 2; done
    check_options
    down
    ;;
  link)
    [ $# -ge 2 ] || die "link: give HOST and down or up" 2
    h=$1 s=$2
    shift 2
    for a in "$@"; do parse_option "$a" || die "link: unknown option $a" 2; done
    check_options
    link "$h" "$s"
    ;;
  rate)
    [ $# -ge 2 ] || die "rate: give HOST and a rate or none" 2
    h=$1 r=$2
    shift 2
    for a in "$@"; do parse_option "$a" || die "rate: unknown option $a" 2; done
    check_options
    set_rate "$h" "$r"
    ;;
  -h|--help|help) usage ;;
  *) die "unknown command $cmd (run, up, down, link, rate)" 2 ;;
esac
