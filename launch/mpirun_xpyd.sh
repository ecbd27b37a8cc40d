#!/bin/sh
# Runs P prefill and D decode workers under Open MPI (xPyD): ranks 0..P-1 prefill, the rest
# decode; decode worker d sends request i to prefill worker (i + d) mod P. Each decode worker
# checks its outputs bit for bit against a colocated run; the exit status is mpirun's.
#
#   launch/mpirun_xpyd.sh 1 1                      # 1P1D on this host
#   launch/mpirun_xpyd.sh 1 2 --prompts=100,300    # 1P2D, extra flags go to every worker
#   launch/mpirun_xpyd.sh 2 1
#   launch/mpirun_xpyd.sh 1 2 --pp-size=2          # 1 prefill, 1 decode worker of 2 pipeline
#                                                  # stages (D counts ranks: D / pp workers)
#   launch/mpirun_xpyd.sh 1 4 --pp-layers=0,1-3    # 2 decode workers of 2 stages each
#   HOSTFILE=hosts RENDEZVOUS=/shared/kvs launch/mpirun_xpyd.sh 2 2 \
#       --kv-transfer-config='{"kv_ip": "0.0.0.0", "kv_port": 0,
#                              "kv_connector_extra_config": {"ucx_tls": "tcp"}}'
#
# Across hosts: RENDEZVOUS must be a directory every host sees (the prefill workers write
# their control address there), the prefill workers listen on 0.0.0.0 and publish their
# host's first non-loopback address, and UCX must use a transport that crosses hosts (tcp).
# With HOSTFILE set, that is the default configuration: kv_ip 0.0.0.0 and ucx_tls
# $KVSTREAM_UCX_TLS (default tcp,sm,self: TCP between hosts, shared memory within one); a
# --kv-transfer-config given here replaces it whole. mpirun fills each host's slots in
# hostfile order, so the prefill ranks take the first slots (OMPI_MCA_rmaps_base_mapping_policy
# =node deals the ranks round-robin over the hosts instead).
# Simulated hosts on this machine (network namespaces, whose environment sets
# KVSTREAM_UCX_TLS=tcp: they share memory, and UCX would take it between them):
#   launch/sim_hosts.sh run 4 -- launch/mpirun_xpyd.sh 2 2
# Prefill workers that may be restarted: mpirun ends the whole job when one rank dies,
# unless MPIRUN_FLAGS=--enable-recovery; the restarted worker is then started outside the
# job (ssh, a service manager) with the same --index, --prefill-workers and rendezvous, and
# the decode workers, which read the rendezvous again before each --waves wave, use it.
# With --device=cuda every rank takes the GPU of its local rank modulo the GPUs visible (one
# each where there are enough, all on GPU 0 where it is the only one; --gpu=N overrides).
# Environment: KVSTREAM (the binary; default build/launch/kvstream), HOSTFILE, RENDEZVOUS,
# KVSTREAM_UCX_TLS, MPIRUN_FLAGS (more mpirun flags, split on spaces).
set -eu
[ $# -ge 2 ] || { echo "usage: $0 PREFILL DECODE [worker flags...]" >&2; exit 2; }
p=$1; d=$2; shift 2
bin=${KVSTREAM:-build/launch/kvstream}
dir=${RENDEZVOUS:-$(mktemp -d)}
mkdir -p "$dir"
rm -f "$dir"/prefill.addr*
hostfile=""
config='{"kv_port": 0}'
if [ -n "${HOSTFILE:-}" ]; then
  hostfile="--hostfile $HOSTFILE"
  config="{\"kv_ip\": \"0.0.0.0\", \"kv_port\": 0, \"kv_connector_extra_config\": {\"ucx_tls\": \"${KVSTREAM_UCX_TLS:-tcp,sm,self}\"}}"
fi
root=""
[ "$(id -u)" = 0 ] && root="--allow-run-as-root"
exec mpirun $root $hostfile ${MPIRUN_FLAGS:-} -np $((p + d)) --oversubscribe --bind-to none \
    "$bin" worker --mpi --prefill-workers="$p" --address-file="$dir/prefill.addr" \
    --kv-transfer-config="$config" "$@"
