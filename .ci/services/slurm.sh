#!/usr/bin/env bash
# A real two-node SLURM cluster on loopback for the daemon tests: munged, slurmctld and two slurmd
# (nodes n1 and n2, both 127.0.0.1 with their own ports) in one partition.
#
#   slurm.sh install   apt-get the packages if their binaries are missing
#   slurm.sh start     install, write the config under $ORCH_CI_STATE/slurm, start the daemons and
#                      wait until both nodes are idle (idempotent: a running cluster is left alone)
#   slurm.sh status    exit 0 when all four daemons run
#   slurm.sh stop      cancel every job, stop the daemons by the PIDs they recorded
#   slurm.sh env       print `export` lines (also in $ORCH_CI_STATE/slurm/env.json for the tests)
#
# No systemd and no cgroups on CI machines: proctrack/linuxproc, task/none and jobacct_gather/none
# keep slurmd away from cgroups. Each node claims 2 CPUs although both share the same cores, so a
# two-node job can run 2 processes per node on a 2-core machine. Four fake GPUs per node (character
# devices cloned from /dev/null) let `sbatch --test-only` accept GPU scripts.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

DIR="$ORCH_CI_STATE/slurm"
MUNGE_DIR="$ORCH_CI_STATE/munge"
CTLD_PORT="${ORCH_SLURMCTLD_PORT:-16817}"
NODE_PORTS=("${ORCH_SLURMD_PORT_N1:-16818}" "${ORCH_SLURMD_PORT_N2:-16819}")
NODES=(n1 n2)
PARTITION=ci
GPUS_PER_NODE=4
CPUS_PER_NODE=2
export SLURM_CONF="$DIR/slurm.conf"

install() {
    apt_install_missing slurmctld slurmctld slurmd slurmd sbatch slurm-client munged munge
}

write_config() {
    local host mem i
    host=$(hostname -s)
    # RealMemory from the machine itself; every node claims it (they share it, like the cores).
    mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    mkdir -p "$DIR/ctld" "$DIR/dev"
    for i in 0 1; do mkdir -p "$DIR/spool-${NODES[$i]}"; done
    for i in $(seq 0 $((GPUS_PER_NODE - 1))); do
        [ -c "$DIR/dev/gpu$i" ] || mknod -m 666 "$DIR/dev/gpu$i" c 1 3   # a /dev/null clone
    done
    cat > "$DIR/slurm.conf" <<EOF
# Written by .ci/services/slurm.sh for the daemon tests; not for production.
ClusterName=orchci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$MUNGE_DIR/munge.socket,cred_expire=5
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
GresTypes=gpu
# Short grace periods keep cancelled and signalled test jobs fast; finished jobs stay visible to
# scontrol show job for MinJobAge seconds.
KillWait=5
MinJobAge=600
SlurmdTimeout=300
SlurmctldTimeout=300
InactiveLimit=0
MessageTimeout=10
NodeName=${NODES[0]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORTS[0]} CPUs=$CPUS_PER_NODE RealMemory=$mem Gres=gpu:$GPUS_PER_NODE State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORTS[1]} CPUs=$CPUS_PER_NODE RealMemory=$mem Gres=gpu:$GPUS_PER_NODE State=UNKNOWN
PartitionName=$PARTITION Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
    echo "Name=gpu File=$DIR/dev/gpu[0-$((GPUS_PER_NODE - 1))]" > "$DIR/gres.conf"
}

start_munge() {
    pid_alive "$MUNGE_DIR/munged.pid" munged && return 0
    # munged refuses key files and sockets in directories others can write to.
    mkdir -p "$MUNGE_DIR"
    chown munge:munge "$MUNGE_DIR"
    chmod 711 "$MUNGE_DIR"   # the socket needs execute permission for all
    if [ ! -s "$MUNGE_DIR/munge.key" ]; then
        dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
        chown munge:munge "$MUNGE_DIR/munge.key"
        chmod 400 "$MUNGE_DIR/munge.key"
    fi
    rm -f "$MUNGE_DIR/munge.socket" "$MUNGE_DIR/munge.socket.lock"
    su -s /bin/sh munge -c "munged --socket=$MUNGE_DIR/munge.socket --key-file=$MUNGE_DIR/munge.key \
        --pid-file=$MUNGE_DIR/munged.pid --log-file=$MUNGE_DIR/munged.log --seed-file=$MUNGE_DIR/munged.seed"
    wait_for 10 munge --socket="$MUNGE_DIR/munge.socket" -n || die "munged did not start; see $MUNGE_DIR/munged.log"
    log "munged running (pid $(cat "$MUNGE_DIR/munged.pid"))"
}

running() {
    pid_alive "$DIR/slurmctld.pid" slurmctld && pid_alive "$DIR/slurmd-${NODES[0]}.pid" slurmd \
        && pid_alive "$DIR/slurmd-${NODES[1]}.pid" slurmd && pid_alive "$MUNGE_DIR/munged.pid" munged
}

nodes_idle() {
    local states
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    [ "$(grep -c ' idle$' <<<"$states")" -eq ${#NODES[@]} ]
}

start() {
    install
    need_root
    if running; then
        log "already running"
    else
        stop_daemons
        write_config
        start_munge
        # -c: a fresh cluster every start (no jobs from an earlier run).
        slurmctld -c -f "$SLURM_CONF" || die "slurmctld failed; see $DIR/slurmctld.log"
        for node in "${NODES[@]}"; do
            slurmd -N "$node" -f "$SLURM_CONF" || die "slurmd $node failed; see $DIR/slurmd-$node.log"
        done
    fi
    # A node registering after a restart may come back DOWN; ReturnToService=2 lifts that, and an
    # explicit resume covers the rest.
    if ! wait_for 10 nodes_idle; then
        scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME 2>/dev/null || true
        wait_for 20 nodes_idle || die "nodes not idle: $(sinfo -N 2>&1); see $DIR/*.log"
    fi
    write_env
    log "cluster up: $(sinfo -h -N -o '%N:%T' | tr '\n' ' ')"
}

stop_daemons() {
    if pid_alive "$DIR/slurmctld.pid" slurmctld; then
        # Jobs first, so no slurmstepd outlives its slurmd.
        scancel --full --quiet --partition="$PARTITION" 2>/dev/null || true
        wait_for 10 sh -c '[ -z "$(squeue -h -t running,completing)" ]' || true
    fi
    stop_pids slurmd="$DIR/slurmd-${NODES[0]}.pid" slurmd="$DIR/slurmd-${NODES[1]}.pid" \
        slurmctld="$DIR/slurmctld.pid"
    stop_pids munged="$MUNGE_DIR/munged.pid"
}

write_env() {
    json_env "$DIR/env.json" SLURM_CONF "$DIR/slurm.conf" ORCH_SLURM_PARTITION "$PARTITION" \
        ORCH_SLURM_NODES "$(IFS=,; echo "${NODES[*]}")" ORCH_SLURM_GPUS_PER_NODE "$GPUS_PER_NODE" \
        ORCH_SLURM_CPUS_PER_NODE "$CPUS_PER_NODE" \
        ORCH_SLURM_PIDS "$DIR/slurmctld.pid $DIR/slurmd-n1.pid $DIR/slurmd-n2.pid $MUNGE_DIR/munged.pid"
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    status) running ;;
    stop) stop_daemons; rm -f "$DIR/env.json" ;;
    env) [ -f "$DIR/slurm.conf" ] || die "not started"; echo "export SLURM_CONF=$DIR/slurm.conf" ;;
    *) echo "usage: $0 {install|start|status|stop|env}" >&2; exit 2 ;;
esac
