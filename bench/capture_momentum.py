"""Capture real Muon inputs (Nesterov momentum updates) from a short CPU training run.

The orthogonalization benchmark and the AOL coefficient derivation need matrices whose spectra
look like what Muon really orthogonalizes, not Gaussian ones. This script trains a 4-block model
with the speedrun's matrix shapes (dim 768, MLP 3072) on the embedded sample for a few dozen
steps on CPU, records what the optimizer passes to train_gpt.orthogonalize in the last step,
and saves a few of those matrices (bf16, ~7 MB) to bench/momentum_samples.pt as
{name: tensor (B, m, n)}, in the wide orientation Muon stacks them in (768x768 attention,
768x3072 MLP). Each step sees 8 x 1024 tokens: a gradient is a sum of one outer product per
token, so with fewer tokens than 3072 per step the MLP gradients would be rank-deficient and
their spectra unlike the speedrun's (8 x 48k tokens per step).

Usage: python bench/capture_momentum.py [--steps 40] [--out bench/momentum_samples.pt]
Takes about 15 minutes on a 2-core CPU.
"""

import os
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import train_gpt  # noqa: E402
from data.cli_util import OneLineArgumentParser, positive_int  # noqa: E402

CAPTURE_MODEL = dict(
    preset="cpu", num_layers=4, model_dim=768, num_heads=6, head_dim=128, window_pattern="LSSL",
    attention_free_layers="", num_value_embeds=2, attn_block_size=128, train_seq_len=1024, val_seq_len=1024,
    window_growth_tokens=512, val_tokens=1024, micro_batches=8, val_every=0,
    warmup_steps=0, compile=False, ns_method="polar_express",
)


def main():
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=40, help="training steps; capture at the last")
    parser.add_argument("--keep", type=positive_int, nargs=2, default=(2, 1), metavar=("SQUARE", "WIDE"),
                        help="matrices kept of the 768x768 and of the 768x3072 stack")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "momentum_samples.pt"))
    args = parser.parse_args()
    os.chdir(REPO_ROOT)  # the cpu preset's sample paths are relative to the repository
    train_gpt.keep_freed_memory_on_cpu()
    torch.set_num_threads(os.cpu_count() or 1)
    config = train_gpt.Hyperparameters(**dict(CAPTURE_MODEL, num_iterations=args.steps))
    train_gpt.check_config(config, 1, False)
    hw = train_gpt.Hardware.detect(config)

    captured = {}
    state = {"step": 0}
    original = train_gpt.orthogonalize

    def recording_orthogonalize(G, method="newton_schulz", backend="torch", coeffs=None):
        m, n = G.shape[-2:]
        if state["step"] == args.steps - 1 and m >= 128:  # the last step's block matrices (not the 6x12 gates)
            keep = args.keep[0] if m == n else args.keep[1]
            captured[f"{m}x{n}"] = G[:keep].detach().to(torch.bfloat16).clone()
        return original(G, method, backend, coeffs)

    def on_step(step, model, optimizer):
        state["step"] = step
        print(f"step {step}/{args.steps} ({time.time() - started:.0f} s)", flush=True)

    train_gpt.orthogonalize = recording_orthogonalize
    started = time.time()
    try:
        train_gpt.train(config, train_gpt.Ranks(), hw, lambda *a, **k: None, on_step=on_step)
    finally:
        train_gpt.orthogonalize = original
    torch.save(captured, args.out)
    for name, stack in captured.items():
        print(f"{name}: {tuple(stack.shape)} {stack.dtype}")
    print(f"saved {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB) in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
