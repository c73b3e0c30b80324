#!/usr/bin/env bash
# Launch lmforge on THIS node under torchrun with the c10d rendezvous. Run it once per node
# (by hand, by srun in scripts/slurm/lmforge.slurm, or by any scheduler); all nodes meet at
# RDZV_ENDPOINT. Everything after the script name is an lmforge command line:
#
#   scripts/lmforge-torchrun.sh train --config configs/pretrain_adamw.yaml
#   scripts/lmforge-torchrun.sh env                  # what every rank sees (lmforge env)
#
# Environment (defaults run one node):
#   NNODES          nodes, or MIN:MAX for an elastic range             (1)
#   NPROC_PER_NODE  processes per node: a number, gpu, cpu or auto     (auto: one per GPU, else 1 ... see torchrun)
#   RDZV_ENDPOINT   host:port every node can reach (the first node)    (127.0.0.1:29500)
#   RDZV_ID         the job's id, the same on every node               (lmforge; SLURM_JOB_ID under SLURM)
#   MAX_RESTARTS    elastic restarts after a worker fails              (3)
#   PYTHON          the Python that has lmforge installed             (python)
#   TORCHRUN_ARGS   more torchrun options, e.g. "--rdzv-conf join_timeout=900"
#
# A restart resumes from the newest complete checkpoint in checkpoint.save_path on its own
# (checkpoint.auto_resume, docs/training.md). SIGTERM or SIGINT to this script (scancel, a SLURM
# time limit with --signal) is passed to the training processes only, not to torchrun: every rank
# saves a checkpoint at the end of the same step and stops, and the script exits 0. (Sent to
# torchrun itself, the signal would make torchrun stop the workers and exit 1.) If this script and
# torchrun are killed (kill -9 of the process group), the workers notice that torchrun died and
# stop the same way (docs/guide.md, "When the launcher dies").
set -euo pipefail

if [[ $# -eq 0 ]]; then
    sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi

NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-auto}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-127.0.0.1:29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-lmforge}}
MAX_RESTARTS=${MAX_RESTARTS:-3}
PYTHON=${PYTHON:-python}

# shellcheck disable=SC2206  # TORCHRUN_ARGS is a list of words on purpose
cmd=("$PYTHON" -m torch.distributed.run
    --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID"
    --max-restarts "$MAX_RESTARTS" ${TORCHRUN_ARGS:-}
    -m lmforge "$@")

if [[ -n "${LMFORGE_PRINT_ONLY:-}" ]]; then  # show the torchrun line instead of running it
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi

# A received signal is passed to each of torchrun's children (the training processes) once, as soon
# as that process handles SIGTERM itself (lmforge does from the start of `train`): sent earlier, in
# its first seconds, it would kill the worker (torchrun counts a failure and restarts it), and sent
# before torchrun started the workers it would reach nobody. Workers of a later restart get it too.
# A worker that does not handle SIGTERM within 60 s gets it anyway. Without /proc: sent at once.
pending=""
declare -A sent=()
since=0

handles_term() {  # SigCgt: the signals the process catches; bit 14 is SIGTERM (15)
    local mask
    [[ -r /proc/$1/status ]] || return 0
    mask=$(sed -n 's/^SigCgt:[[:space:]]*//p' "/proc/$1/status" 2>/dev/null)
    [[ -n $mask ]] && (((16#$mask >> 14) & 1))
}

deliver() {
    local pid
    [[ -n $torchrun_pid ]] || return 0  # not started yet: the loop below delivers it
    for pid in $(pgrep -P "$torchrun_pid" || true); do
        [[ -n ${sent[$pid]:-} ]] && continue
        if handles_term "$pid" || ((SECONDS - since > 60)); then
            kill "-$pending" "$pid" 2>/dev/null && sent[$pid]=1
        fi
    done
}

forward() {
    echo "lmforge-torchrun.sh: SIG$1 received: the workers save a checkpoint at the end of this step and stop" >&2
    pending=$1
    since=$SECONDS
    sent=()  # a second signal goes to every worker again (a second SIGINT stops at once)
    deliver
}
# The traps are set before torchrun starts: a signal from the first moment on is held, not lost.
torchrun_pid=""
trap 'forward TERM' TERM
trap 'forward INT' INT

"${cmd[@]}" &
torchrun_pid=$!

status=0
while true; do
    if [[ -n $pending ]] && kill -0 "$torchrun_pid" 2>/dev/null; then
        sleep 0.2  # a signal is waiting for workers that do not handle it yet
        deliver
        continue
    fi
    wait "$torchrun_pid" && status=0 || status=$?
    kill -0 "$torchrun_pid" 2>/dev/null || break  # a trapped signal interrupts wait; torchrun still runs
done
exit "$status"
