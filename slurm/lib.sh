# Shared functions of the sbatch templates in slurm/ (sourced after `cd "$REPO_DIR"`;
# bash only). The templates keep their job's Hydra overrides in the global array ARGS.
#
# Conventions (see slurm/README.md):
#   rendezvous   MASTER_ADDR = first host of `scontrol show hostnames` of the ranks' nodes,
#                MASTER_PORT = 20000 + SLURM_JOB_ID % 10000 (launch_env.port_from_job_id);
#                an RM server step of the same job uses 30000 + SLURM_JOB_ID % 10000.
#   requeue      a step that exits with REQUEUE_EXIT_CODE (42: the PPO trainer saved after
#                SIGUSR1/SIGTERM or trainer.max_time_per_run) -> `scontrol requeue`,
#                at most MAX_REQUEUES times per job (SLURM_RESTART_COUNT).
#   signals      USR1 (from `#SBATCH --signal=B:USR1@<s>` or `scancel --signal=USR1 --batch`)
#                reaching the batch shell goes to the main step's srun, which forwards it
#                to every task; TERM goes to the step's tasks through `scancel --signal`
#                (an srun that gets TERM kills its tasks instead of forwarding it).

REQUEUE_EXIT_CODE=42
# one thread per allocated CPU (torch would otherwise start one per core of the node)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

nemo_log() {
    printf '[slurm-job %s %s] %s\n' "${SLURM_JOB_ID:-?}" "$(date +%H:%M:%S)" "$*" >&2
}

nemo_die() {
    nemo_log "error: $*"
    exit 1
}

# nemo_arg_value KEY: print the value of the last KEY=... in ARGS (return 1 if absent).
nemo_arg_value() {
    local key=$1 found=1 value="" a
    for a in "${ARGS[@]}"; do
        if [[ $a == "$key="* || $a == "+$key="* || $a == "++$key="* ]]; then
            value=${a#*=}
            found=0
        fi
    done
    ((found == 0)) && printf '%s\n' "$value"
    return $found
}

# nemo_drop_arg KEY: remove every KEY=... from ARGS.
nemo_drop_arg() {
    local key=$1 a kept=()
    for a in "${ARGS[@]}"; do
        [[ $a == "$key="* || $a == "+$key="* || $a == "++$key="* ]] || kept+=("$a")
    done
    ARGS=("${kept[@]}")
}

# nemo_apply_sweep: in a job array rendered by `launchers.slurm --sweep`, append this task's
# overrides (SWEEP_TASKS[SLURM_ARRAY_TASK_ID], shell-quoted words) to ARGS and give the
# task its own experiment folder, EXP_DIR/SWEEP_NAMES[SLURM_ARRAY_TASK_ID].
nemo_apply_sweep() {
    ((${#SWEEP_TASKS[@]} > 0)) || return 0
    local i=${SLURM_ARRAY_TASK_ID:-}
    [[ -n $i ]] || nemo_die "SWEEP_TASKS is set but this is not a job array task (no SLURM_ARRAY_TASK_ID)"
    ((i < ${#SWEEP_TASKS[@]})) || nemo_die "array task $i has no sweep entry (${#SWEEP_TASKS[@]} entries)"
    local words=()
    eval "words=(${SWEEP_TASKS[$i]})"
    ARGS+=("${words[@]}")
    EXP_DIR=$EXP_DIR/${SWEEP_NAMES[$i]}
    nemo_log "sweep task $i: ${words[*]}"
}

# nemo_hydra_value STRING: STRING as a Hydra override value: as is when plain, else
# single-quoted (a path with '=', ',' or spaces would not parse unquoted).
nemo_hydra_value() {
    local s=$1 q="'"
    if [[ $s =~ ^[A-Za-z0-9_./+-]+$ ]]; then
        printf '%s' "$s"
    else
        printf "'%s'" "${s//$q/\\$q}"
    fi
}

# nemo_setup_exp_dir KEY: EXP_DIR from ARGS' KEY=... (else EXP_DIR as set), the sweep
# applied, made absolute and created; KEY=EXP_DIR is then passed explicitly to the job.
nemo_setup_exp_dir() {
    local key=$1 given
    if given=$(nemo_arg_value "$key"); then
        EXP_DIR=$given
        nemo_drop_arg "$key"
    fi
    nemo_apply_sweep
    EXP_DIR=$(realpath -m -- "$EXP_DIR")
    mkdir -p -- "$EXP_DIR"
    [[ -z $key ]] || ARGS+=("$key=$(nemo_hydra_value "$EXP_DIR")")
}

# nemo_container_args: CONTAINER_ARGS for srun (pyxis/enroot), empty without CONTAINER_IMAGE.
nemo_container_args() {
    CONTAINER_ARGS=()
    [[ -n ${CONTAINER_IMAGE:-} ]] || return 0
    CONTAINER_ARGS=("--container-image=$CONTAINER_IMAGE" "--container-workdir=$REPO_DIR")
    [[ -z ${CONTAINER_MOUNTS:-} ]] || CONTAINER_ARGS+=("--container-mounts=$CONTAINER_MOUNTS")
}

# nemo_words STRING: split a shell-quoted string (RM_OVERRIDES, SRUN_ARGS) into WORDS.
nemo_words() {
    # shellcheck disable=SC2034  # WORDS is the result
    WORDS=()
    eval "WORDS=($1)"
}

# nemo_hosts: HOSTS = the job's hosts, in Slurm's order.
nemo_hosts() {
    mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ((${#HOSTS[@]} > 0)) || nemo_die "no hosts in SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-}"
}

# nemo_rendezvous HOST: export MASTER_ADDR=HOST and MASTER_PORT from the job id.
nemo_rendezvous() {
    export MASTER_ADDR=$1
    export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
}

# nemo_signal_step NAME SIG: SIG to the tasks of this job's step(s) named NAME (srun
# --job-name), through slurmd. (`kill -TERM` of an srun would make it kill its tasks.)
nemo_signal_step() {
    local name=$1 sig=$2 ids
    ids=$(squeue --steps --noheader --jobs="$SLURM_JOB_ID" --format="%i %j" 2>/dev/null \
        | awk -v n="$name" '$2 == n {print $1}')
    [[ -n $ids ]] || return 1
    # shellcheck disable=SC2086
    scancel --signal="$sig" $ids 2>/dev/null
}

# Signal forwarding to the main step (MAIN_PID = its srun, MAIN_STEP = its step name).
# USR1 goes through srun (it forwards it to every task); TERM through slurmd. GOT_SIGNAL
# keeps the first signal; one that arrives before the step started is delivered then.
GOT_SIGNAL=""
MAIN_PID=""
MAIN_STEP=""
nemo_forward() {
    local sig=$1
    [[ -n $GOT_SIGNAL ]] || GOT_SIGNAL=$sig
    if [[ -n $MAIN_PID ]] && kill -0 "$MAIN_PID" 2>/dev/null; then
        nemo_log "SIG$sig: forwarding it to the $MAIN_STEP step"
        nemo_deliver "$sig"
    elif [[ -n $MAIN_PID ]]; then
        nemo_log "SIG$sig after the $MAIN_STEP step ended"
    else
        nemo_log "SIG$sig before the $MAIN_STEP step runs; it is delivered when the step starts"
    fi
}

nemo_deliver() {
    if [[ $1 == USR1 ]]; then
        kill -s USR1 "$MAIN_PID" 2>/dev/null || true
    else
        nemo_signal_step "$MAIN_STEP" "$1" || nemo_log "no $MAIN_STEP step to signal (yet)"
    fi
}

# nemo_trap_signals SIG...: forward these (USR1, TERM) to the main step; USR1 if not listed
# is logged and ignored (a trainer without a USR1 handler would die of it).
nemo_trap_signals() {
    trap 'nemo_log "SIGUSR1 ignored: this job does not save on a signal"' USR1
    local sig
    for sig in "$@"; do
        # shellcheck disable=SC2064
        trap "nemo_forward $sig" "$sig"
    done
}

# nemo_started PID NAME: record the main step's srun pid and step name; deliver a signal
# that came early.
nemo_started() {
    MAIN_PID=$1
    MAIN_STEP=$2
    if [[ -n $GOT_SIGNAL ]]; then
        sleep 5  # srun creates the step and installs its handlers first
        nemo_deliver "$GOT_SIGNAL"
    fi
}

# nemo_wait PID: wait until PID has exited (trapped signals interrupt `wait`), set RC.
# shellcheck disable=SC2034  # RC is the result
nemo_wait() {
    local pid=$1
    while kill -0 "$pid" 2>/dev/null; do
        wait "$pid" 2>/dev/null || true
    done
    RC=0
    wait "$pid" 2>/dev/null || RC=$?
}

# nemo_stop PID NAME [GRACE_S]: TERM to the tasks of step NAME (srun pid PID), KILL of the
# srun after GRACE_S (Slurm then ends the step).
nemo_stop() {
    local pid=$1 name=$2 grace=${3:-30} deadline
    kill -0 "$pid" 2>/dev/null || return 0
    nemo_signal_step "$name" TERM || kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + grace))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# nemo_finish RC: exit with RC, or requeue the job when RC is REQUEUE_EXIT_CODE (not after
# SIGTERM: a cancelled job stays cancelled, a preempted one is requeued by Slurm itself).
nemo_finish() {
    local rc=$1 restarts=${SLURM_RESTART_COUNT:-0}
    if ((rc == 0)); then
        nemo_log "main step finished"
        exit 0
    fi
    if ((rc != REQUEUE_EXIT_CODE)); then
        nemo_log "main step failed with exit code $rc"
        exit "$rc"
    fi
    if [[ $GOT_SIGNAL == TERM ]]; then
        nemo_log "main step saved after SIGTERM (exit code $rc); not requeueing a cancelled/preempted job"
        exit "$rc"
    fi
    if ((restarts >= MAX_REQUEUES)); then
        nemo_log "main step asked for a requeue, but the job was requeued $restarts times (MAX_REQUEUES=$MAX_REQUEUES)"
        exit 1
    fi
    nemo_log "main step saved and asked to be requeued (exit code $rc); scontrol requeue $SLURM_JOB_ID (restart $((restarts + 1)))"
    scontrol requeue "$SLURM_JOB_ID" || nemo_die "scontrol requeue $SLURM_JOB_ID failed"
    # Slurm ends this batch shell now; should it not, leave without error.
    sleep 30
    exit 0
}
