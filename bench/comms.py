"""Communication benchmark of the sharded optimizer on CPU (gloo).

For world sizes 2 and 4 (processes on this machine), trains the cpu preset's model for a few
steps and prints, per rank and step:
- the bytes sent through the collectives next to the ring lower bound 2(W-1)/W x parameter bytes
  (reduce-scatter + all-gather of every sharded parameter, all-reduce of the small ones), and
  the padding overhead;
- the optimizer step's wall time and the part of it spent blocked waiting for communication,
  with the reduce-scatters launched from backward hooks (overlap on) and after backward (off).

On one CPU the ranks share cores, so overlap can only hide communication behind computation
that the same cores must also do; the GPU figure is what matters and is not measured here.

Usage: python bench/comms.py [--world-sizes 2 4] [--steps 6]
"""

import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import train_gpt  # noqa: E402
from harness import config as cfg  # noqa: E402
from data.cli_util import OneLineArgumentParser, positive_int  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world_size, port, steps, overlap, out_path):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(REPO_ROOT)
    torch.set_num_threads(max(1, train_gpt.usable_cpus() // world_size))
    argv = ["--preset", "cpu", f"--num_iterations={steps}", "--val_every=0", "--warmup_steps=1",
            f"--micro_batches={world_size}", "--train_seq_len=512", "--val_seq_len=512", "--val_tokens=512",
            f"--overlap_comms={overlap}"]
    args = cfg.parse_config(argv, {}, world_size, False)
    ranks = train_gpt.Ranks.from_env(os.environ)
    hw = train_gpt.Hardware.detect(args)
    train_gpt.init_process_group(args, ranks, hw)
    comm = train_gpt.Collectives(world_size)
    timings = []
    original_step = train_gpt.ShardedMuonAdam.step

    def timed_step(self):
        waited = comm.wait_seconds
        start = time.perf_counter()
        original_step(self)
        timings.append((time.perf_counter() - start, comm.wait_seconds - waited))

    train_gpt.ShardedMuonAdam.step = timed_step
    record = {}

    def on_step(step, model, optimizer):
        if step == 1:  # the first timed step: everything is allocated, counters start here
            record["bytes_before"] = comm.sent_bytes
        record["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        record["padding_bytes"] = optimizer.padding_bytes()

    train_gpt.train(args, ranks, hw, lambda *a, **k: None, collectives=comm, on_step=on_step)
    record["bytes_per_step"] = (comm.sent_bytes - record["bytes_before"]) / (steps - 1)
    record["timings"] = timings[2:]  # skip the warmup step and the first timed step
    if rank == 0:
        torch.save(record, out_path)
    torch.distributed.destroy_process_group()


def run(world_size, steps, overlap):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record.pt")
        mp.start_processes(worker, args=(world_size, free_port(), steps, overlap, out), nprocs=world_size,
                           join=True, start_method="spawn")
        return torch.load(out)


def main():
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=positive_int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=positive_int, default=6)
    args = parser.parse_args()
    if args.steps < 4:
        parser.error(f"--steps {args.steps}: need at least 4 (a warmup step and a first step are not timed)")
    print(f"{'W':>2} {'overlap':>7} {'MB sent/step':>12} {'lower bound':>11} {'padding':>8} "
          f"{'opt step ms':>11} {'waiting ms':>10} {'waiting %':>9}")
    for world_size in args.world_sizes:
        for overlap in (True, False):
            rec = run(world_size, args.steps, overlap)
            W = world_size
            bound = 2 * (W - 1) / W * rec["param_bytes"]
            padding = 2 * (W - 1) / W * rec["padding_bytes"]
            step_s = sum(t for t, _ in rec["timings"]) / len(rec["timings"])
            wait_s = sum(w for _, w in rec["timings"]) / len(rec["timings"])
            print(f"{W:>2} {str(overlap):>7} {rec['bytes_per_step'] / 1e6:12.3f} {bound / 1e6:11.3f} "
                  f"{padding / 1e6:8.3f} {1000 * step_s:11.1f} {1000 * wait_s:10.1f} {100 * wait_s / step_s:8.1f}%",
                  flush=True)
    print("MB sent/step equals the lower bound plus the padding of stacks whose size does not divide by W.")


if __name__ == "__main__":
    main()
