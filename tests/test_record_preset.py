"""The `speedrun` preset is the public record of 2025-08-23 ("SparseAttnGate", record #28: 1695
steps, val loss 3.2787 over 14 runs). Every literal below is read from that record's train_gpt.py
(../shared/peers/modded-nanogpt_9d9dc969_train_gpt.py); the comment beside it quotes its line.
The model is built on the meta device, so no memory is spent on its 275M parameters."""

import math

import pytest
import torch

import train_gpt

ARGS = train_gpt.Hyperparameters()  # the speedrun preset: the dataclass defaults


def speedrun_model():
    hw = train_gpt.Hardware(torch.device("meta"), torch.bfloat16, "flex", False, "triton", "nccl")
    with torch.device("meta"):
        model = train_gpt.GPT(ARGS, hw)
    return model, {s.name: s for s in train_gpt.param_specs(model, ARGS)}


def test_training_configuration_rows():
    assert train_gpt.PRESETS["speedrun"] == {}
    a = ARGS
    assert a.num_iterations == 1695                        # num_iterations = 1695
    assert a.cooldown_frac == 0.45                         # cooldown_frac = 0.45
    assert a.final_lr_frac == 0.1                          # return w * 1.0 + (1 - w) * 0.1
    assert a.val_every == 125                              # val_loss_every = 125
    assert a.val_tokens == 10485760                        # val_tokens = 10485760
    assert a.train_seq_len == 48 * 1024                    # train_seq_len = 48*1024
    assert a.val_seq_len == 4 * 64 * 1024                  # val_seq_len = 4*64*1024
    assert a.micro_batches == 8                            # grad_accum_steps = 8 // world_size
    assert a.warmup_steps == 10                            # warmup_steps = 10
    # DistAdam(..., lr=0.008, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    assert (a.adam_lr, a.adam_beta1, a.adam_beta2, a.adam_eps) == (0.008, 0.8, 0.95, 1e-10)
    # Muon(hidden_matrix_params, lr=0.05, momentum=0.95, weight_decay=0.0)
    assert (a.muon_lr, a.weight_decay) == (0.05, 0.0)
    # frac = min(step / 300, 1); group["momentum"] = (1 - frac) * 0.85 + frac * 0.95
    assert (a.muon_momentum_start, a.muon_momentum_end, a.muon_momentum_warmup_steps) == (0.85, 0.95, 300)
    assert train_gpt.muon_momentum_at(150, a) == pytest.approx(0.9)
    # a, b, c = (3.4445, -4.7750, 2.0315); for _ in range(5)
    assert a.ns_method == "newton_schulz"
    assert train_gpt.NEWTON_SCHULZ_COEFFS == [(3.4445, -4.7750, 2.0315)] * 5
    # X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    assert train_gpt.FROBENIUS_SAFETY["newton_schulz"] == 1.0 and train_gpt.FROBENIUS_OFFSET["newton_schulz"] == 1e-7
    assert not a.normuon and not a.cautious_wd            # later records' ideas: opt-in flags here
    # the record's learning-rate schedule at its boundaries
    assert train_gpt.lr_factor_at(932, a) == 1.0          # 932/1695 < 0.55
    assert train_gpt.lr_factor_at(1694, a) == pytest.approx((1 / 1695) / 0.45 + (1 - (1 / 1695) / 0.45) * 0.1)


def test_model_configuration_rows():
    a = ARGS
    # GPT(vocab_size=50257, num_layers=12, num_heads=6, model_dim=768, ...); vocab padded to 128
    assert (a.vocab_size, a.num_layers, a.num_heads, a.model_dim, a.head_dim) == (50304, 12, 6, 768, 128)
    assert a.mlp_ratio == 4                                # hdim = 4 * dim
    assert a.attention_free_layers == "7"                  # ... if layer_idx != 7 else None
    assert a.num_value_embeds == 3                         # ve = [ve[0], ve[1], ve[2]] + [None] * ... + [ve[0], ve[1], ve[2]]
    assert a.attn_scale == 0.12                            # self.attn_scale = 0.12
    assert train_gpt.ATTN_GATE_DIMS == 12                  # self.attn_gate_dim = 12
    assert a.rotary_base == 1024.0                         # (1 / 1024) ** torch.linspace(0, 1, steps=dim//4)
    assert 2 * a.logit_softcap == 30 and a.logit_softcap / 2 == 7.5  # 30 * torch.sigmoid(logits / 7.5)
    # block_masks = [long_bm, short_bm, short_bm, short_bm, long_bm, short_bm, short_bm, long_bm, ...]
    assert a.window_pattern == "LSSSLSSLSSSL" and a.attn_block_size == 128
    assert a.window_growth_tokens == 1728                  # next_multiple_of_n(1728 * x, n=128)
    # x_s=(model_dim**0.5)/448, w_s=2**-9, grad_s=1/448
    assert train_gpt.fp8_head_scales(768) == (768 ** 0.5 / 448, 2 ** -9, 1 / 448)
    assert a.fp8_head and a.bf16_embeds                    # if isinstance(m, nn.Embedding): m.bfloat16()
    # embed 75, value_embeds 75, lm_head 1.0, scalars 5.0 (param.lr_mul = ...)
    assert (a.embed_lr_mult, a.head_lr_mult, a.scalar_lr_mult) == (75.0, 1.0, 5.0)


# name pattern -> (shape, optimizer, learning rate, Muon lr shape factor), from the record:
#   Muon: eff_lr = group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5 * getattr(p, "lr_mul", 1.0)
#   self.qkvo_w = nn.Parameter(torch.empty(4, hdim, dim))
#   self.attn_gate = CastedLinear(self.attn_gate_dim, num_heads)      -> weight (6, 12), in blocks: Muon
#   self.c_fc = nn.Parameter(torch.empty(dim, hdim)); self.c_proj = nn.Parameter(torch.empty(dim, hdim))
#   self.embed = nn.Embedding(vocab_size, model_dim); 3 value embeddings likewise  -> Adam, lr_mul 75
#   self.lm_head = CastedLinear(model_dim, vocab_size, ...)           -> Adam, lr_mul 1
MATRICES = {
    "attn.qkvo_w": ((4, 768, 768), "muon", 0.05, 1.0),
    "attn.gate_w": ((6, 12), "muon", 0.05, 1.0),
    "mlp.fc_w": ((768, 3072), "muon", 0.05, 1.0),
    "mlp.proj_w": ((768, 3072), "muon", 0.05, 1.0),
}
TABLES = {
    "embed.weight": ((50304, 768), "adam", 0.008 * 75),
    "value_embeds.0.weight": ((50304, 768), "adam", 0.008 * 75),
    "value_embeds.1.weight": ((50304, 768), "adam", 0.008 * 75),
    "value_embeds.2.weight": ((50304, 768), "adam", 0.008 * 75),
    "lm_head_w": ((50304, 768), "adam", 0.008),
}


def effective_lr(spec):
    if spec.optimizer == "muon":
        return ARGS.muon_lr * spec.lr_mult
    return ARGS.adam_lr * spec.lr_mult


def test_every_parameter_matches_the_record():
    model, specs = speedrun_model()
    seen = set()
    for name, (shape, optimizer, lr) in TABLES.items():
        spec = specs[name]
        assert (tuple(spec.param.shape), spec.optimizer) == (shape, optimizer), name
        assert effective_lr(spec) == pytest.approx(lr), name
        seen.add(name)
    for i in range(12):
        for suffix, (shape, optimizer, lr, factor) in MATRICES.items():
            name = f"blocks.{i}.{suffix}"
            if i == 7 and suffix.startswith("attn."):
                assert name not in specs  # block 7 has no attention
                continue
            spec = specs[name]
            assert (tuple(spec.param.shape), spec.optimizer) == (shape, optimizer), name
            slot = train_gpt.MatrixSlot(spec, None, False)
            assert slot.lr_scale == pytest.approx(factor), name  # max(1, rows/cols)^0.5 on the stored shape
            assert effective_lr(spec) * slot.lr_scale == pytest.approx(lr * factor), name
            seen.add(name)
    # The record's scalars vector, Adam at lr 0.008 x 5, holds per block (x = l0*x + l1*x0) (1, 0),
    # per attention block (v = l0*v [+ l1*ve]) (0.5, 0.5), and the U-net skip weights (ones).
    scalars = {name: spec for name, spec in specs.items() if name not in seen}
    assert all(s.optimizer == "adam" and effective_lr(s) == pytest.approx(0.04) for s in scalars.values())
    assert {n: s.param.numel() for n, s in scalars.items() if n.endswith(("resid_lambda", "x0_lambda"))} == \
        {f"blocks.{i}.{name}": 1 for i in range(12) for name in ("resid_lambda", "x0_lambda")}
    value_embed_blocks = {0, 1, 2, 9, 10, 11}
    assert {n: s.param.numel() for n, s in scalars.items() if n.endswith("v_lambdas")} == \
        {f"blocks.{i}.attn.v_lambdas": 2 if i in value_embed_blocks else 1 for i in range(12) if i != 7}
    assert scalars["skip_weights"].param.numel() == 6      # skip_weights[i - n] for i >= n = 6
    assert len(scalars) == 2 * 12 + 11 + 1


def test_parameter_count_and_dtypes():
    model, specs = speedrun_model()
    total = sum(p.numel() for p in model.parameters())
    # The record: 4 x 50304 x 768 embeddings + head 50304 x 768, 11 x (4 x 768^2 + 6 x 12)
    # attention, 12 x 2 x 768 x 3072 MLP, and 5 x 12 = 60 scalars: 275,743,572 (+ padding to a
    # multiple of the world size). 13 of its scalars are never read (the 6 unused skip weights,
    # block 7's two attention lambdas, l1 of the 5 attention blocks without a value embedding);
    # here they do not exist.
    record = 5 * 50304 * 768 + 11 * (4 * 768 * 768 + 6 * 12) + 12 * 2 * 768 * 3072 + 60
    assert record == 275_743_572
    assert total == record - 13
    for name, spec in specs.items():
        expected = torch.bfloat16 if "embed" in name else torch.float32
        assert spec.param.dtype == expected, name


def test_bf16_embeddings_keep_bf16_adam_moments():
    """Adam's moments take the parameter's dtype, as the record's zeros_like(p_slice) does."""
    from conftest import TINY
    args = train_gpt.Hyperparameters(**dict(TINY, adam_shard_min_numel=1))
    train_gpt.check_config(args, 1, False)
    hw = train_gpt.Hardware.detect(args)
    model = train_gpt.GPT(args, hw)
    optimizer = train_gpt.ShardedMuonAdam(train_gpt.param_specs(model, args), args, train_gpt.Ranks(), hw)
    by_name = {shard.spec.name: shard for shard in optimizer.adam_shards}
    assert by_name["embed.weight"].exp_avg.dtype == torch.bfloat16
    assert by_name["lm_head_w"].exp_avg.dtype == torch.float32


def test_gradients_are_the_records_eight_gpu_gradients_at_any_accumulation():
    """The record backpropagates each micro-batch's summed loss and averages over 8 ranks: the
    gradient is the mean over micro-batches of the per-micro-batch sums. With 8 micro-batches on
    one rank the optimizer sees the same gradient (backward sums, the optimizer divides)."""
    from conftest import perturbed_tiny_model
    args, hw, model = perturbed_tiny_model(0.05, micro_batches=4, bf16_embeds=False)
    specs = train_gpt.param_specs(model, args)
    optimizer = train_gpt.ShardedMuonAdam(specs, args, train_gpt.Ranks(), hw)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, train_gpt.BOS_TOKEN, (args.train_seq_len + 1,), generator=g) for _ in range(4)]
    window = torch.tensor(2)
    per_batch = []
    for tokens in batches:
        model.zero_grad()
        model(tokens[:-1], tokens[1:], window).backward()
        per_batch.append(model.lm_head_w.grad.clone())
    model.zero_grad()
    for tokens in batches:
        model(tokens[:-1], tokens[1:], window).backward()
    torch.testing.assert_close(optimizer._unaccumulate(model.lm_head_w.grad), torch.stack(per_batch).mean(0))
    assert math.isclose(optimizer.grad_scale, 1 / 4)
