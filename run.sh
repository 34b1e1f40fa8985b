#!/usr/bin/env bash
# Train with every GPU this machine has (torchrun, one process per GPU), or as a single CPU
# process where there is none. Arguments are passed on to train_gpt.py, e.g.
#   ./run.sh --run_name myidea          ./run.sh --preset cpu --num_iterations 50
# The speedrun needs a number of processes that divides 8: with 3, 5, 6 or 7 GPUs the largest
# such number is used (say so with NPROC=... to choose yourself).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -eq 0 ]; then
    exec "$PYTHON" train_gpt.py "$@"
fi
nproc=${NPROC:-}
if [ -z "$nproc" ]; then
    for n in 8 4 2 1; do
        if [ "$n" -le "$gpus" ]; then nproc=$n; break; fi
    done
    if [ "$nproc" -ne "$gpus" ]; then
        echo "run.sh: $gpus GPUs found; using $nproc (the speedrun's 8 micro-batches need a divisor of 8)" >&2
    fi
fi
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$nproc" train_gpt.py "$@"
