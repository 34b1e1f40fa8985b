"""Where the time of `train_gpt.py --sample` goes: the trunk over the context, the head on the
last position (what generation runs) and the head over every position (what it would run
without that restriction), then 200 generated tokens, for the model in a checkpoint.

Usage: python bench/sample_speed.py CHECKPOINT.pt [--threads N] [--context 200]
Runs on the CPU, like --sample on a machine without a GPU.
"""

import os
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import train_gpt  # noqa: E402
from harness import checkpoints as ckpt, sample as sampling  # noqa: E402
from data.cli_util import OneLineArgumentParser, positive_int  # noqa: E402


def milliseconds(fn, repeats=5):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1000 * (time.perf_counter() - start) / repeats


def main():
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--context", type=positive_int, default=200)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    try:
        checkpoint = ckpt.read_checkpoint(options.checkpoint, "checkpoint")
    except train_gpt.ConfigError as e:  # no such file, or not a checkpoint: the message names it
        # as an option (--checkpoint=...); here it is the positional argument, named as argparse names it
        parser.error(str(e).replace(f"--checkpoint={options.checkpoint!r}", f"checkpoint {options.checkpoint!r}", 1))
    args = train_gpt.Hyperparameters(**checkpoint["config"])
    hw = train_gpt.Hardware(torch.device("cpu"), torch.float32, "sdpa", False, "torch", "gloo")
    model = train_gpt.GPT(args, hw).eval()
    model.load_state_dict(checkpoint["model"])
    window = torch.tensor(train_gpt.long_window_blocks_at(args.num_iterations, args))
    tokens = torch.randint(0, train_gpt.BOS_TOKEN, (options.context,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.trunk(tokens, window)
        trunk = milliseconds(lambda: model.trunk(tokens, window))
        last = milliseconds(lambda: model.head(hidden[:, -1:]))
        every = milliseconds(lambda: model.head(hidden))
    start = time.perf_counter()
    new = sampling.generate(model, args, [464], 200, seed=0)
    seconds = time.perf_counter() - start
    print(f"threads {options.threads}, context {options.context} tokens: trunk {trunk:.1f} ms, "
          f"head on the last position {last:.1f} ms, head on every position {every:.1f} ms")
    print(f"generated {len(new)} tokens in {seconds:.2f} s ({1000 * seconds / max(len(new), 1):.1f} ms per token; "
          "generation stops early where the model ends the document)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("sample_speed.py: interrupted", file=sys.stderr)
        sys.exit(130)
