"""Loss effect of the orthogonalizer: train the cpu preset once per ns_method and print the
validation losses, so the choice is measured rather than assumed.

Each run uses the same seed, data and schedule; only --ns_method differs (and, with --normuon,
NorMuon is switched on for all of them). On CPU the PyTorch twin computes in fp32.

Usage: python bench/ns_loss.py [--steps 120] [--methods aol polar_express newton_schulz] [-- extra trainer options]
About 2.5 minutes per method on a 2-core CPU at the default 120 steps.
"""

import os
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import train_gpt  # noqa: E402
from harness import config as cfg  # noqa: E402
from data.cli_util import OneLineArgumentParser, positive_int  # noqa: E402


def main():
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=120)
    parser.add_argument("--methods", nargs="+", default=list(train_gpt.NS_METHODS), choices=train_gpt.NS_METHODS)
    parser.add_argument("extra", nargs="*", help="more trainer options, e.g. --normuon true (after --)")
    args = parser.parse_args()
    os.chdir(REPO_ROOT)
    try:  # every method's configuration is checked before the first run
        configs = [cfg.parse_config(["--preset", "cpu", f"--num_iterations={args.steps}",
                                           f"--ns_method={method}", *args.extra], {}, 1, torch.cuda.is_available())
                   for method in args.methods]
    except train_gpt.ConfigError as e:
        parser.error(str(e))
    except cfg.HelpRequested as e:
        print(e)
        return
    train_gpt.keep_freed_memory_on_cpu()
    torch.set_num_threads(train_gpt.usable_cpus())
    rows = []
    for method, config in zip(args.methods, configs):
        try:
            hw = train_gpt.Hardware.detect(config)
        except train_gpt.ConfigError as e:
            parser.error(str(e))
        started = time.time()
        result = train_gpt.train(config, train_gpt.Ranks(), hw, lambda *a, **k: None)
        curve = " ".join(f"{step}:{loss:.4f}" for step, loss in result.val_losses)
        rows.append((method, result.val_losses[-1][1], result.train_time_ms / result.steps_done, curve))
        print(f"{method:>14}: final val_loss {rows[-1][1]:.4f}  ({time.time() - started:.0f} s)  curve {curve}",
              flush=True)
    print(f"\n{'ns_method':>14} {'final val_loss':>14} {'ms/step':>8}")
    for method, loss, ms, _ in rows:
        print(f"{method:>14} {loss:14.4f} {ms:8.0f}")


if __name__ == "__main__":
    try:
        main()
    except train_gpt.DataError as e:  # the data files: one line naming them
        sys.exit(f"ns_loss.py: error: {e}")
    except KeyboardInterrupt:  # the runs are in this process: nothing is left running
        print("ns_loss.py: interrupted", file=sys.stderr)
        sys.exit(130)
