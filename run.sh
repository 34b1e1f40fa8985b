#!/usr/bin/env bash
# Train with every GPU this machine has (torchrun, one process per GPU), or as a single CPU
# process where there is none. Arguments are passed on to train_gpt.py, e.g.
#   ./run.sh --run_name myidea          ./run.sh --run_name myidea --num_iterations 50
# With --device cpu (or DEVICE=cpu) it runs as without GPUs (one process unless NPROC says more).
# The speedrun needs a number of processes that divides 8: with 3, 5, 6 or 7 GPUs the largest
# such number is used (say so with NPROC=... to choose yourself). On CPU, NPROC=N starts N gloo
# processes, and each step takes one micro-batch per process (--micro_batches=N unless given by
# an option or MICRO_BATCHES, or the checkpoint's with --resume or RESUME).
# Several machines: run the same command on each, with NNODES (the number of machines),
# NODE_RANK (0 on the machine at MASTER_ADDR, which hosts the rendezvous; 1, 2, ... on the
# others), MASTER_ADDR and optionally MASTER_PORT (default 29500). A machine waits
# DIST_TIMEOUT_S seconds (default 900) for the others to join, then gives up.
# Run from anywhere: paths you pass are relative to your folder, as with `python train_gpt.py`
# (the default data folders are this repository's, wherever you start from). PYTHON (default
# python3) is the interpreter that runs torchrun and the trainer. LOGLEVEL=INFO shows torchrun's
# own log lines, which are otherwise kept off the console.
set -euo pipefail
trainer="$(CDPATH= cd -- "$(dirname -- "$0")" >/dev/null && pwd)/train_gpt.py"
PYTHON=${PYTHON:-python3}
fail() { echo "run.sh: $*" >&2; exit 2; }
help=0  # --help: this header (its variables), then the trainer's fields, once (not once per process)
device=${DEVICE:-}  # the trainer's device (the last --device, else DEVICE): with cpu, GPUs are not counted
prev=
for arg in "$@"; do
    case $arg in -h|--help) help=1;; --device=*) device=${arg#--device=};; esac
    if [ "$prev" = --device ]; then device=$arg; fi
    prev=$arg
done
on_cpu=$([ "$device" = cpu ] && echo 1 || echo 0)
show_help() { sed -n '2,/^set /s/^# \{0,1\}//p' "$0"; echo; exec "$PYTHON" "$trainer" "$@"; }
for name in NPROC NNODES NODE_RANK MASTER_PORT DIST_TIMEOUT_S; do
    case ${!name:-0} in ''|*[!0-9]*) fail "$name=${!name}: expected a non-negative integer";; esac
done
nnodes=${NNODES:-1}
nproc=${NPROC:-}
[ "${nproc:-1}" -ge 1 ] && [ "$nnodes" -ge 1 ] || fail "NPROC and NNODES must be at least 1"
# (Ctrl-C while torch loads: the default action, no traceback)
gpus=0
[ "$on_cpu" -eq 1 ] || gpus=$("$PYTHON" -c "import signal; signal.signal(signal.SIGINT, signal.SIG_DFL)
import torch; print(torch.cuda.device_count())")
if [ "$gpus" -eq 0 ]; then
    nproc=${nproc:-1}
    if [ "$nproc" -eq 1 ] && [ "$nnodes" -eq 1 ]; then
        [ "$help" -eq 0 ] || show_help "$@"
        exec "$PYTHON" "$trainer" "$@"
    fi
    # The cpu preset takes one micro-batch per step, which cannot be split over processes; a
    # resumed run keeps its checkpoint's (the trainer refuses one the processes cannot split).
    # Passed as an option, not the environment: the trainer names only the user's variables.
    given=${RESUME:-}${MICRO_BATCHES:-}
    for arg in "$@"; do case $arg in --resume|--resume=?*|--micro[_-]batches|--micro[_-]batches=*) given=1;; esac; done
    [ -n "$given" ] || set -- "$@" "--micro_batches=$((nnodes * nproc))"
elif [ -z "$nproc" ]; then
    for n in 8 4 2 1; do
        if [ "$n" -le "$gpus" ]; then nproc=$n; break; fi
    done
    if [ "$nproc" -ne "$gpus" ]; then
        echo "run.sh: $gpus GPUs found; using $nproc (the speedrun's 8 micro-batches need a divisor of 8)" >&2
    fi
fi
[ "$help" -eq 0 ] || show_help "$@"  # with the MICRO_BATCHES a launch here gives
if [ "$nnodes" -eq 1 ]; then
    launch=(--standalone --nproc_per_node="$nproc")
    meeting="the $nproc processes did not meet on this machine"
else
    [ -n "${NODE_RANK:-}" ] && [ -n "${MASTER_ADDR:-}" ] || fail "NNODES=$nnodes needs NODE_RANK and MASTER_ADDR too"
    [ "$NODE_RANK" -lt "$nnodes" ] || fail "NODE_RANK=$NODE_RANK must be below NNODES=$nnodes"
    # The c10d rendezvous numbers the machines itself (torchrun ignores --node_rank with it), so
    # NODE_RANK only says which machine hosts the rendezvous.
    wait_s=${DIST_TIMEOUT_S:-900}
    is_host=$([ "$NODE_RANK" -eq 0 ] && echo 1 || echo 0)
    launch=(--nnodes="$nnodes" --nproc_per_node="$nproc" --rdzv_backend=c10d
            --rdzv_endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
            --rdzv_conf="is_host=$is_host,join_timeout=$wait_s,read_timeout=$wait_s")
    meeting="not all NNODES=$nnodes machines met at $MASTER_ADDR:${MASTER_PORT:-29500} within DIST_TIMEOUT_S=$wait_s s"
    if [ "$is_host" -eq 0 ]; then  # the others' rendezvous lives on the host: it closes when the host stops
        left="the machines met, then the rendezvous at $MASTER_ADDR:${MASTER_PORT:-29500} closed: its machine"
        left+=" (NODE_RANK=0) stopped, and its output says why"
    fi
fi
if [ "$nproc" -gt 1 ]; then  # torchrun's default for several processes, without its five-line notice
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
# torchrun, except that its own log lines are kept off the console (each process says what went
# wrong in one line of its own), a failed rendezvous ends in one line instead of a traceback (one
# that says whether the machines had met: a host that stops later closes it under the others), a
# failed process in its exit status, and Ctrl-C or a SIGTERM in 128 + the signal's number after
# the processes have stopped, as a single process would.
exec "$PYTHON" -c '
import logging
import os
import signal
import sys
signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C while torch loads: no traceback (torchrun sets its own)
user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = user_level or "FATAL"  # this process: no C++ trace of a store timeout
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.run import main
if user_level is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]  # the training processes log as usual
if not os.environ.get("LOGLEVEL"):  # torchrun honours LOGLEVEL=INFO etc. for debugging
    for handler in logging.getLogger("torch.distributed").handlers + logging.getLogger("torch").handlers:
        handler.addFilter(lambda record: not record.name.startswith("torch.distributed.elastic"))
meeting, left = sys.argv.pop(1), sys.argv.pop(1)
met = []  # the rendezvous completed: the processes of this machine were set up
initialize = getattr(SimpleElasticAgent, "_initialize_workers", None)  # (a torch without it: no note)
def initialize_and_note(*args, **kwargs):
    initialize(*args, **kwargs)
    met.append(True)
if initialize is not None:
    SimpleElasticAgent._initialize_workers = initialize_and_note
try:
    main()
except RendezvousError as e:
    reason = ": ".join([type(e).__name__] + str(e.__cause__ or e).strip().splitlines()[:1])
    sys.exit(f"run.sh: {left} ({reason})" if met and left else f"run.sh: {meeting} ({reason}); start run.sh "
             "on every machine with the same NNODES, MASTER_ADDR and MASTER_PORT")
except ChildFailedError as e:
    rank, failure = e.get_first_failure()
    if failure.exitcode < 0:  # killed by a signal: the process could not say why itself
        hint = " (out of memory?)" if failure.exitcode == -signal.SIGKILL else ""
        print(f"run.sh: rank {rank} was killed by {failure.signal_name()}{hint}", file=sys.stderr)
        sys.exit(128 - failure.exitcode)  # as a shell reports a process killed by a signal
    sys.exit(failure.exitcode % 256)
except SignalException as e:
    sys.exit(128 + signal.Signals(e.sigval).value)
' "$meeting" "${left:-}" "${launch[@]}" "$trainer" "$@"
