#!/usr/bin/env bash
# A real one-node Slurm cluster (munge + slurmctld + slurmd, all as root) whose config,
# state, logs and pid files live under one folder. Used by tests/slurm/conftest.py; also
# usable by hand:
#
#   bash tests/slurm/cluster.sh install              # apt-get slurm-wlm + munge if missing
#   bash tests/slurm/cluster.sh start /tmp/slurm     # prints SLURM_CONF=/tmp/slurm/slurm.conf
#   export SLURM_CONF=/tmp/slurm/slurm.conf; sinfo; sbatch ...
#   bash tests/slurm/cluster.sh stop /tmp/slurm      # by the pids in /tmp/slurm/*.pid
#
# Nothing outside the folder is touched: munged gets its own key and socket there (slurm
# finds it through AuthInfo=socket=...), the daemons listen on free ports picked at start,
# so two clusters (two test sessions) can run side by side on one machine. Settings from
# /work/shared/notes/local-slurm.md (Debian 12, Slurm 22.05): proctrack/linuxproc,
# task/none, select/cons_tres, CPUs from SLURM_TEST_CPUS (default: nproc).
set -euo pipefail

die() { echo "cluster.sh: $*" >&2; exit 1; }

have_slurm() {
    command -v sbatch >/dev/null && command -v slurmctld >/dev/null \
        && command -v slurmd >/dev/null && command -v munged >/dev/null
}

cmd_install() {
    have_slurm && return 0
    [[ $(id -u) == 0 ]] || die "slurm-wlm/munge are not installed and we are not root (apt-get needs root)"
    command -v apt-get >/dev/null || die "slurm-wlm/munge are not installed and there is no apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
    have_slurm || die "apt-get finished but sbatch/slurmctld/slurmd/munged are still missing"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_for() {  # wait_for <seconds> <command...>: until the command succeeds
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

cmd_start() {
    local dir=${1:?usage: cluster.sh start DIR}
    have_slurm || die "slurm is not installed (run: bash tests/slurm/cluster.sh install)"
    [[ $(id -u) == 0 ]] || die "the test cluster runs its daemons as root"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    local host cpus mem
    host=$(hostname -s)
    # jobs rendezvous at the node's name (MASTER_ADDR) and the RM server advertises it
    getent hosts "$host" >/dev/null || die "host name $host does not resolve (add it to /etc/hosts)"
    cpus=${SLURM_TEST_CPUS:-$(nproc)}
    # RealMemory above the machine's would drain the node: 90% of it, at most 20000 MB
    mem=$(awk '/^MemTotal:/ {m = int($2 / 1024 * 0.9); print (m < 20000 ? m : 20000)}' /proc/meminfo)
    mem=${SLURM_TEST_MEMORY_MB:-$mem}
    mkdir -p "$dir"/{munge,state,spool,log}
    chmod 700 "$dir/munge"

    # munge: own key and socket under $dir
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    wait_for 20 bash -c "munge -n -S '$dir/munge/munge.socket' | unmunge -S '$dir/munge/munge.socket'" \
        || die "munged did not answer; see $dir/log/munged.log"

    cat >"$dir/slurm.conf" <<EOF
# one-node test cluster written by tests/slurm/cluster.sh
ClusterName=nemotest
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
# never ping nodes: the GPU partition below is never started and must stay IDLE for --test-only
SlurmdTimeout=0
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
GresTypes=gpu
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
# the shape of conf/cluster/example.yaml, configured IDLE but never started (no slurmd):
# for sbatch --test-only of the README's multi-node commands (up to 8 nodes of 8 GPUs)
NodeName=gpu-[1-8] NodeAddr=127.0.0.2 CPUs=128 RealMemory=1000000 Gres=gpu:8 State=IDLE
PartitionName=batch Nodes=gpu-[1-8] MaxTime=INFINITE State=UP
EOF
    echo "NodeName=gpu-[1-8] Name=gpu Count=8" >"$dir/gres.conf"
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -f "$SLURM_CONF" || die "slurmctld did not start; see $dir/log/slurmctld.log"
    wait_for 30 scontrol ping || die "slurmctld does not answer; see $dir/log/slurmctld.log"
    slurmd -f "$SLURM_CONF" || die "slurmd did not start; see $dir/log/slurmd.log"
    wait_for 60 bash -c "sinfo -h -N -o %t | grep -qx idle" \
        || { sinfo -N -l >&2 || true; die "the node is not idle; see $dir/log/slurmd.log"; }
    echo "SLURM_CONF=$SLURM_CONF"
}

stop_pidfile() {  # TERM the pid in $1, then KILL it after $2 seconds
    local file=$1 grace=$2 pid
    [[ -s $file ]] || return 0
    pid=$(<"$file")
    [[ $pid =~ ^[0-9]+$ ]] || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    local deadline=$((SECONDS + grace))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
}

cmd_stop() {
    local dir=${1:?usage: cluster.sh stop DIR}
    # cancel what is left so that no job step outlives the cluster
    if [[ -f $dir/slurm.conf ]] && command -v scancel >/dev/null; then
        SLURM_CONF=$dir/slurm.conf timeout 10 scancel --full --user=root 2>/dev/null || true
    fi
    stop_pidfile "$dir/slurmd.pid" 15
    stop_pidfile "$dir/slurmctld.pid" 15
    stop_pidfile "$dir/munged.pid" 5
}

case ${1:-} in
    install) cmd_install ;;
    start) cmd_start "${2:-}" ;;
    stop) cmd_stop "${2:-}" ;;
    *) die "usage: cluster.sh install | start DIR | stop DIR" ;;
esac
