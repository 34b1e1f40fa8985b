"""Capture real Muon inputs (Nesterov momentum updates) at several points of a CPU training run.

The orthogonalization benchmark and the AOL schedule search need matrices whose spectra look
like what Muon really orthogonalizes, not Gaussian ones. This script trains a model with the
speedrun's matrix shapes (width 768, MLP 3072; 2 blocks by default) on the embedded sample for a
few hundred steps on CPU, records what the optimizer passes to train_gpt.orthogonalize at the
steps named by --at, and saves some of those matrices (bf16) as {"s<step>/<m>x<n>": tensor
(B, m, n)}, in the wide orientation Muon stacks them in (768x768 attention, 768x3072 MLP).
Captures from different steps (and layers) let a table be fitted on some and scored on others.

Usage: python bench/capture_momentum.py [--steps 300] [--at 50 150 300] [--out PATH]
Defaults: 2 blocks, 512 tokens per step (momentum, averaging ~20 steps, still has full rank), about
15 minutes alone on the 2-core VM (34 minutes beside two A/B runs, 2026-11-25), 21 MB.
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

# bench/momentum_samples.pt was captured (2026-11-25) under the 2025-08-23 record's defaults: these
# are their values where the defaults are now the 2026 record's, so that the capture repeats.
DEFAULTS_2025 = dict(
    init="2025", yarn=False, value_gates=False, key_offset=False, token_windows=False, paired_head_layers="",
    skip_layers="", backout_layer=-1, bigram_vocab_size=0, smear=False, value_embed_layers="", mtp=False,
    resid_lambda_init=1.0, attn_scale=0.12, logit_cap_height=0.0, logit_cap_shift=0.0, bf16_weights=False,
    train_max_doc_len=0, train_seq_len_schedule="", window_schedule="", window_final_blocks=0,
    window_validate_final_blocks=0, extension_steps=0, lr_plateaus="1", cooldown_frac=0.45, adam_table="2025",
    adam_weight_decay=0.0, adam_every=1, embed_split_frac=0.0, muon_lr=0.05, muon_momentum_cooldown_steps=0,
    muon_update_scale="2025", mlp_proj_lr_mult=1.0, normuon=False, weight_decay=0.0, muon_decay="lr",
    cautious_wd=False, warmup_at_transitions=False,
)
CAPTURE_MODEL = dict(
    DEFAULTS_2025, preset="cpu", model_dim=768, num_heads=6, head_dim=128, window_pattern="LSSL",
    attention_free_layers="", num_value_embeds=1, attn_block_size=128, val_seq_len=1024,
    window_growth_tokens=512, val_tokens=1024, val_every=0, warmup_steps=0, compile=False,
    muon_momentum_warmup_steps=300,
)


def main():
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=300, help="training steps")
    parser.add_argument("--at", type=positive_int, nargs="+", default=(50, 150, 300), help="steps to capture at")
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--seq-len", type=positive_int, default=512, help="tokens per step (one sequence)")
    parser.add_argument("--keep", type=positive_int, nargs=2, default=(2, 1), metavar=("SQUARE", "WIDE"),
                        help="matrices kept per step of the 768x768 and of the 768x3072 stack")
    parser.add_argument("--ns-method", default="newton_schulz", choices=train_gpt.NS_METHODS,
                        help="the orthogonalizer the captured run trains with")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "momentum_samples.pt"))
    args = parser.parse_args()
    if max(args.at) > args.steps:
        parser.error(f"--at {max(args.at)} is after the last step {args.steps}")
    os.chdir(REPO_ROOT)  # the cpu preset's sample paths are relative to the repository
    train_gpt.keep_freed_memory_on_cpu()
    torch.set_num_threads(train_gpt.usable_cpus())
    config = train_gpt.Hyperparameters(**dict(
        CAPTURE_MODEL, num_iterations=args.steps, num_layers=args.layers, micro_batches=1, train_seq_len=args.seq_len,
        window_pattern="LSSL"[:args.layers] if args.layers <= 4 else "LSSL", ns_method=args.ns_method))
    cfg.check_config(config, 1, False)
    hw = train_gpt.Hardware.detect(config)

    captured = {}
    state = {"step": 0}  # optimizer steps done so far; the step being taken is state["step"] + 1
    original = train_gpt.orthogonalize

    def recording_orthogonalize(G, method="newton_schulz", backend="torch", coeffs=None):
        m, n = G.shape[-2:]
        step = state["step"] + 1
        if step in args.at and min(m, n) >= 128:  # block matrices, not the gates
            keep = args.keep[0] if m == n else args.keep[1]
            # Spread the kept ones over the stack (layers and kinds), not its first few.
            index = torch.linspace(0, G.size(0) - 1, keep).round().long().unique()
            captured[f"s{step}/{m}x{n}"] = G[index].detach().to(torch.bfloat16).clone()
        return original(G, method, backend, coeffs)

    def on_step(step, model, optimizer):
        state["step"] = step
        if step % 10 == 0 or step <= 3:
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
