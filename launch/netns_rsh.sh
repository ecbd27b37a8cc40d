#!/bin/sh
# Open MPI's rsh agent for the simulated hosts of launch/sim_hosts.sh: mpirun calls it the way
# it calls ssh,
#
#   netns_rsh.sh [ssh options] HOST COMMAND...
#
# where COMMAND is one shell command line (Open MPI quotes the orted arguments for a remote
# shell, so the words are joined and handed to sh -c, as sshd would). It runs that command
# inside the network namespace named HOST; sim_hosts.sh names each namespace after the host
# it lists in the hostfile. Needs root (ip netns exec). Exit status: the command's, or 255
# (ssh's "could not connect") when HOST is no simulated host.
#
#   OMPI_MCA_plm_rsh_agent=launch/netns_rsh.sh mpirun --hostfile hosts ...
#
# sim_hosts.sh sets this and the other Open MPI settings in the environment it writes.
# Options ssh would take are skipped: Open MPI passes none by default, but plm_rsh_args may.
while [ $# -gt 0 ]; do
  case $1 in
    -b|-c|-e|-F|-i|-l|-o|-p) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "usage: $0 [ssh options] HOST COMMAND..." >&2; exit 255; }
host=$1
shift
case $host in
  *[!A-Za-z0-9_.-]*|'') echo "netns_rsh.sh: '$host' is not a simulated host name" >&2; exit 255 ;;
esac
if [ ! -e "/run/netns/$host" ]; then
  echo "netns_rsh.sh: no simulated host $host (no network namespace of that name;" \
       "launch/sim_hosts.sh up makes them)" >&2
  exit 255
fi
# Each host also gets its own host name (a UTS namespace, fresh per call: everything one
# orted starts shares it). Open MPI names its session directory after the host name
# (/tmp/ompi.HOSTNAME.UID/...): orteds of hosts that all had this machine's name shared one
# directory, and one removing it while another made its own failed that orted's start.
exec ip netns exec "$host" unshare --uts /bin/sh -c \
    'echo "$1" >/proc/sys/kernel/hostname && shift && exec /bin/sh -c "$*"' sh "$host" "$@"
