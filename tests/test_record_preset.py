"""The `speedrun` preset is the public record of 2026-01-19 ("Bigram Hash Embedding": 1600 steps,
val loss 3.2776 over 6 runs in 98.43 s). Every literal below is read from that record's train_gpt.py
(../shared/peers/modded-nanogpt_93f0e6b9/train_gpt.py, "P"); the comment beside it quotes the line
(P n). The record's code needs CUDA at import, so its parameters are restated here, not imported.
The model is built on the meta device, so no memory is spent on its 462M parameters. The preset of
the 2025-08-23 record that this file held before: `git show e14a18c:tests/test_record_preset.py`."""

import math

import pytest
import torch

import train_gpt

ARGS = train_gpt.Hyperparameters()  # the speedrun preset: the dataclass defaults
SCHEDULED = 1560                    # num_scheduled_iterations: int = 1560 (P 1731)


def test_the_speedrun_preset_is_the_defaults_at_every_world_size_the_record_allows():
    assert train_gpt.PRESETS["speedrun"] == {}
    config = train_gpt.harness("config")
    for world_size in (1, 2, 4, 8):  # assert 8 % world_size == 0, "world_size must be a divisor of 8" (P 1757)
        parsed = config.parse_config(["--preset=speedrun"], {}, world_size=world_size, cuda_available=True)
        assert parsed == ARGS, world_size


def test_training_configuration_rows():
    a = ARGS
    # num_scheduled_iterations: int = 1560; num_extension_iterations: int = 40;
    # num_iterations: int = num_scheduled_iterations + num_extension_iterations (P 1731-1733)
    assert (a.num_iterations, a.extension_steps) == (1560 + 40, 40)
    assert a.micro_batches == 8                            # grad_accum_steps = 8 // world_size (P 1758)
    # train_bs_schedule: tuple = (8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8) (P 1726), tokens per step over
    # all ranks: per micro-batch of 8 (num_tokens // grad_accum_steps // world_size per rank, P 1426, 1442)
    per_micro_batch = train_gpt._numbers(a.train_seq_len_schedule, int)
    assert [a.micro_batches * n for n in per_micro_batch] == [8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8]
    assert a.micro_batches * a.train_seq_len == 24 * 2048 * 8  # train_bs_extension: int = 24 * 2048 * 8 (P 1727)
    assert a.train_max_doc_len == 128 * 16                # train_max_seq_len: int = 128 * 16 (P 1728)
    # val_batch_size: int = 4 * 64 * 1024 * 8 (P 1729); each forward: val_batch_size // (grad_accum_steps *
    # world_size) tokens (P 960), the same at every world size
    assert a.val_seq_len == 4 * 64 * 1024 * 8 // 8
    assert a.val_tokens == 10485760                        # val_tokens: int = 10485760 (P 1724)
    assert a.val_every == 250                              # val_loss_every: int = 250 (P 1738)
    assert a.cooldown_frac == 0.55                         # cooldown_frac: float = 0.55 (P 1734)
    assert a.final_lr_frac == 0.1                          # lr = lr_max * w + (1 - w) * 0.1 (P 1530)
    assert train_gpt._numbers(a.lr_plateaus) == [1.0, 1.52, 1.73]  # lr_max = 1.0; = 1.52; = 1.73 (P 1522-1527)
    # get_muon_momentum(step, muon_warmup_steps=300, muon_cooldown_steps=50, momentum_min=0.85, momentum_max=0.95) (P 1534)
    assert (a.muon_momentum_start, a.muon_momentum_end) == (0.85, 0.95)
    assert (a.muon_momentum_warmup_steps, a.muon_momentum_cooldown_steps) == (300, 50)
    # adam_defaults = dict(lr=0.008, eps=1e-10, weight_decay=0.005) (P 1601-1605); the per-kind table: ADAM_2026
    assert (a.adam_lr, a.adam_eps, a.adam_weight_decay, a.adam_table) == (0.008, 1e-10, 0.005, "2026")
    # normuon_defaults = dict(lr=0.023, momentum=0.95, beta2=0.95, weight_decay=1.2) (P 1607-1612)
    assert (a.muon_lr, a.normuon, a.normuon_beta2, a.weight_decay) == (0.023, True, 0.95, 1.2)
    # the decay: p_precise * mask * wd_factor * lr_factor with wd_factor = wd_mul * weight_decay * lr and
    # lr_factor = lr_mul * lr (P 728-729, 758); mask = (grad * p_precise) >= 0 (P 757)
    assert (a.muon_decay, a.cautious_wd, a.matrix_optimizer) == ("lr2", True, "muon")
    # shape_mult = max(1.0, chunk_shape[-2] / chunk_shape[-1]) ** 0.5 on the record's (3072, 768) MLP (P 355);
    # per_matrix_lr_mul.append(2.0 if is_c_proj else 1.0) (P 367)
    assert (a.muon_update_scale, a.mlp_proj_lr_mult) == ("aspect", 2.0)
    # polar_express_coeffs (P 143-149), after X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6) (P 162)
    assert a.ns_method == "polar_express" and not a.ns_coeffs
    assert train_gpt.POLAR_EXPRESS_COEFFS == [
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]
    assert (train_gpt.FROBENIUS_SAFETY["polar_express"], train_gpt.FROBENIUS_OFFSET["polar_express"]) == (1 + 2e-2, 1e-6)
    assert a.attn_block_size == 128                        # block_size: int = 128 (P 1741)
    assert a.window_schedule == "3,7,11"                   # ws_schedule: tuple = (3, 7, 11) (P 1742)
    assert a.window_final_blocks == 13                     # ws_final: int = 13 (P 1743)
    assert a.window_validate_final_blocks == 20            # ws_validate_post_yarn_ext: int = 20 (P 1744)
    assert a.token_windows                                 # window_size=(bm_size, 0), bm_size = ws * block_size (P 965, 1222)
    assert a.embed_split_frac == 2 / 3                     # split_embed_frac: float = 2/3 (P 1735)
    # self.split_step = math.ceil(args.split_embed_frac * args.num_scheduled_iterations) | 1 (P 1624)
    assert train_gpt.embed_split_step(a) == math.ceil(2 / 3 * SCHEDULED) | 1 == 1041
    assert a.adam_every == 2                               # return step % 2 == 1 (P 1655): Adam on odd steps
    assert [train_gpt.adam_steps_at(s, a) for s in range(6)] == [s % 2 == 1 for s in range(6)]
    assert a.mtp                                           # FusedSoftcappedCrossEntropy.apply(..., mtp_weights) (P 1295)
    assert a.ce_backend == "auto"                          # the fused kernels where CUDA and Triton are (Hardware.detect)
    assert a.warmup_at_transitions and a.warmup_steps > 0  # warmup_steps = sorted({0, 1, 2} | ...) (P 1827)
    assert a.compile and a.compile_scope == "model"        # torch.compile(model, dynamic=False, fullgraph=True) (P 1812)
    assert a.compile_adam                                  # @torch.compile(dynamic=False, fullgraph=True) (P 682-683)


def test_schedules_at_their_boundaries():
    """The defaults at the steps where the record's schedules turn (every step, against the record's
    functions restated: tests/test_record_2026_schedules.py)."""
    a = ARGS
    lr = lambda step: train_gpt.lr_factor_at(step, a)  # noqa: E731
    # get_lr (P 1519-1532): if x > 1/3: lr_max = 1.52 (520 / 1560 == 1/3 exactly: still 1.0); cooldown from
    # x >= 1 - 0.55 (step 702, w = 1); lr_max 1.73 from x > 2/3 inside it; step > 1560: return 0.1
    assert (lr(0), lr(520), lr(521), lr(702)) == (1.0, 1.0, 1.52, 1.52)
    w = (1 - 1041 / SCHEDULED) / 0.55
    assert lr(1041) == pytest.approx(1.73 * w + (1 - w) * 0.1)
    assert lr(1560) == pytest.approx(0.1) and lr(1561) == lr(1600) == 0.1
    mu = lambda step: train_gpt.muon_momentum_at(step, a)  # noqa: E731
    # momentum = momentum_min + frac * (momentum_max - momentum_min) below 300 (P 1540); from step > 1600 - 50
    # momentum_max - frac * (momentum_max - momentum_min) (P 1543)
    assert (mu(0), mu(150), mu(300), mu(1550)) == (0.85, pytest.approx(0.9), 0.95, 0.95)
    assert mu(1575) == pytest.approx(0.9) and mu(1600) == pytest.approx(0.85)
    # get_ws (P 1508-1516): ws_schedule[int(3 * x)], ws_final from step 1560; short = long // 2
    longs = {s: train_gpt.long_window_blocks_at(s, a) for s in (0, 519, 520, 1039, 1040, 1559, 1560, 1600)}
    assert longs == {0: 3, 519: 3, 520: 7, 1039: 7, 1040: 11, 1559: 11, 1560: 13, 1600: 13}
    # get_bs (P 1501-1506), per micro-batch
    assert [train_gpt.train_seq_len_at(s, a) for s in (0, 519, 520, 1040, 1560, 1599)] == \
        [16384, 16384, 32768, 49152, 49152, 49152]
    # _build_mtp_schedule (P 1628-1641): [1.0, 0.5, 0.25 * (1 - 3*x)], then [1.0, 0.5 * (1 - (3*x - 1))], then [1.0]
    assert train_gpt.mtp_weights_at(0, a) == [1.0, 0.5, 0.25]
    assert train_gpt.mtp_weights_at(260, a) == [1.0, 0.5, pytest.approx(0.25 * (1 - 3 * 260 / SCHEDULED))]
    assert train_gpt.mtp_weights_at(520, a) == [1.0, 0.5] and train_gpt.mtp_weights_at(1040, a) == [1.0]
    # every log of the record: "Sampling steps [0, 1, 2, 519, 520, 521, 1039, 1040, 1041, 1559, 1560, 1561] for warmup"
    assert train_gpt.warmup_steps_at_transitions(a) == [0, 1, 2, 519, 520, 521, 1039, 1040, 1041, 1559, 1560, 1561]


def test_model_configuration_rows():
    a = ARGS
    # GPT(vocab_size=50257, num_layers=11, num_heads=6, head_dim=128, model_dim=768) (P 1794-1799), the
    # vocabulary padded: next_multiple_of_n(vocab_size, n=128) (P 1077); mlp_hdim = 4 * model_dim (P 1111)
    assert a.vocab_size == -(-50257 // 128) * 128
    assert (a.num_layers, a.num_heads, a.head_dim, a.model_dim, a.mlp_ratio) == (11, 6, 128, 768, 4)
    assert a.attention_free_layers == "6"                  # [i for i in range(num_layers) if i != 6] (P 1106)
    assert a.paired_head_layers == "0,2,5,9"               # self.paired_head_layers = [0, 2, 5, 9] (P 1151)
    # bm_sizes = [short_bm, short_bm, short_bm, long_bm, short_bm, short_bm, None, short_bm, short_bm, short_bm,
    # long_bm] (P 1224); key_offset = [b==long_bm for b in bm_sizes] (P 1226). Block 6 has no attention.
    assert a.window_pattern == "SSSLSSSSSSL" and a.key_offset
    # ve = [ve[1], ve[2]] + [None] * (self.num_layers - 5) + [ve[0], ve[1], ve[2]] (P 1236), 3 tables (P 1089)
    assert a.num_value_embeds == 3 and train_gpt.value_embed_of_layer(a) == [1, 2] + [None] * 6 + [0, 1, 2]
    # v + 2 * torch.sigmoid(F.linear(x[..., :12], ve_gate_w)) * ve (P 957-958); sa_lambdas[0] * W_qkv,
    # sa_lambdas[1] * W_o (P 950, 969)
    assert a.value_gates
    assert train_gpt.ATTN_GATE_DIMS == 12                  # torch.sigmoid(F.linear(x[..., :12], attn_gate_w)) (P 967)
    assert a.bigram_vocab_size == 50304 * 5                # bigram_vocab_size = 50304 * 5 (P 1746)
    assert a.smear                                         # smear_gate = nn.Linear(12, 1, bias=False) (P 1079)
    assert a.skip_layers == "3,6"                          # skip_in = [3]; skip_out = [6] (P 1207-1208)
    assert a.backout_layer == 7                            # backout_layer = 7 (P 1210)
    assert a.resid_lambda_init == 1.1                      # 1.1 * torch.ones(num_layers), # resid lambdas (P 1187)
    # attn_std = model_dim ** -0.5 (P 1138); normal_(self.lm_head.weight, mean=0, std=0.005) (P 1167);
    # self.embed.weight.copy_(self.lm_head.weight.T) (P 1173)
    assert a.init == "2026"
    # Yarn: (1 / 1024) ** torch.linspace(0, 1, steps=self.head_dim//4) (P 833); self.attn_scale = 0.1 (P 848)
    assert a.yarn and (a.rotary_base, a.attn_scale) == (1024.0, 0.1)
    # logits = 23 * torch.sigmoid((logits + 5) / 7.5) (P 1298)
    assert (a.logit_cap_height, a.logit_cap_shift, a.logit_softcap / 2) == (23.0, 5.0, 7.5)
    # CastedLinearT(model_dim, vocab_size, use_fp8=use_fp8, x_s=100/448, w_s=1.6/448, grad_s=0.75/448) (P 1165)
    assert a.fp8_head and train_gpt.fp8_head_scales(a.model_dim, a.fp8_scales) == (100 / 448, 1.6 / 448, 0.75 / 448)
    # m.weight.data = m.weight.data.bfloat16() for every nn.Embedding and nn.Linear; the four banks (P 1802-1808)
    assert a.bf16_embeds and a.bf16_weights


# -- the parameters, one by one --------------------------------------------------------------------
# The record's, by label: shape (P 1079-1197), optimizer, Adam betas, lr_mul and wd_mul (the table,
# P 1576-1589; an unset lr_mul or wd_mul is 1.0: table_entry.get("lr_mul", 1.0), P 327-328), dtype
# (P 1802-1808; the lm_head created bf16, P 798; scalars and x0_lambdas left fp32). Muon's banks are
# bf16 with a uint16 "mantissa" buffer beside them (P 421): a 32-bit master, ours an fp32 parameter
# read truncated to bf16 (--bf16_weights).
V, D, H, L = 50304, 768, 6, 11
BF16, FP32 = torch.bfloat16, torch.float32


def record_scalar_pad(world_size):  # pad = (-num_layers * 3 - 3) % dist.get_world_size() (P 1183)
    return (-L * 3 - 3) % world_size


def record_parameters(world_size):
    return {  # label: (shape, optimizer, betas, lr_mul, wd_mul, dtype)
        "smear_gate": ((1, 12), "adam", (0.9, 0.99), 0.01, 0.0, BF16),             # nn.Linear(12, 1, bias=False) (P 1079)
        "skip_gate": ((1, 12), "adam", (0.9, 0.99), 0.05, 0.0, BF16),              # nn.Linear(12, 1, bias=False) (P 1083)
        **{f"ve{i}": ((V, D), "adam", (0.75, 0.95), 75.0, 5.0, BF16) for i in range(3)},  # (P 1089)
        "attn_gate_bank": ((10, H, 12), "adam", (0.9, 0.99), 1.0, 1.0, BF16),       # torch.zeros(10, num_heads, 12) (P 1096)
        "ve_gate_bank": ((5, H, 12), "adam", (0.9, 0.99), 1.0, 1.0, BF16),          # torch.zeros(5, num_heads, 12) (P 1098)
        # torch.empty(len(self.attn_layer_indices), 4 * model_dim, hdim) (P 1123), Muon's view (40, 768, 768) (P 1125)
        "attn": ((10, 4 * D, D), "muon", None, 1.0, 1.0, BF16),
        # torch.empty(num_mlp_with_padding, 2, mlp_hdim, model_dim), 11 + 1 = 12 (P 1131-1132); view (24, 3072, 768)
        "mlp": ((12, 2, 4 * D, D), "muon", None, 1.0, 1.0, BF16),
        "lm_head": ((D, V), "adam", (0.5, 0.95), 1.0, 150.0, BF16),                 # weight (in_features, out_features) (P 798)
        "embed": ((V, D), "adam", (0.5, 0.95), 1.0, 150.0, BF16),                   # nn.Embedding(vocab_size, model_dim) (P 1170)
        "bigram_embed": ((50304 * 5, D), "adam", (0.75, 0.95), 75.0, 5.0, BF16),    # (P 1175)
        "x0_lambdas": ((L,), "adam", (0.65, 0.95), 5.0, 0.0, FP32),                 # torch.zeros(num_layers) (P 1180)
        # resid (11), SA pairs (22), bigram (11), smear, backout, skip, pad (P 1184-1196)
        "scalars": ((L + 2 * L + L + 3 + record_scalar_pad(world_size),), "adam", (0.9, 0.99), 5.0, 0.0, FP32),
    }


def record_label(name):
    """Which record parameter holds ours (our layout: per block, and 0-dim scalars)."""
    fixed = {"embed.weight": "embed", "lm_head_w": "lm_head", "bigram_embed.weight": "bigram_embed",
             "smear_gate": "smear_gate", "skip_gate": "skip_gate"}
    if name in fixed:
        return fixed[name]
    if name.startswith("value_embeds."):
        return "ve" + name.split(".")[1]
    suffix = {"attn.qkvo_w": "attn", "mlp.fc_w": "mlp", "mlp.proj_w": "mlp", "attn.gate_w": "attn_gate_bank",
              "attn.ve_gate_w": "ve_gate_bank", "x0_lambda": "x0_lambdas"}
    return next((label for end, label in suffix.items() if name.endswith(end)), "scalars")


def our_shape_in_the_record(name, record_shape):
    """The shape of the record's piece that is ours: a bank's row, its layout restated in ours."""
    if name.endswith("qkvo_w"):      # attn_bank[k]: rows Wq, Wk, Wv, Wo, each (out, in) for F.linear (P 950, 969)
        return (4, D, D)
    if name.endswith(("fc_w", "proj_w")):  # mlp_bank[k, 0] = c_fc, [k, 1] = c_proj, (hidden, dim) (P 1254-1255);
        return (D, 4 * D)            # ours (dim, hidden): relu(x @ c_fc.T)^2 @ c_proj (K 378-382) = relu(x @ fc)^2 @ proj.T
    if name.endswith("gate_w"):      # a bank's row (num_heads, 12)
        return record_shape[1:]
    if name in ("smear_gate", "skip_gate"):  # an nn.Linear(12, 1) weight, (1, 12)
        return (12,)
    if name == "lm_head_w":          # ours (vocab, dim), as F.linear's weight; the record's (dim, vocab): x @ w (P 811)
        return record_shape[::-1]
    if record_label(name) in ("scalars", "x0_lambdas"):  # ours one parameter each; sa_lambdas a pair
        return (2,) if name.endswith("sa_lambdas") else ()
    return record_shape


@pytest.fixture(scope="module")
def speedrun():
    hw = train_gpt.Hardware(torch.device("meta"), torch.bfloat16, "flex", False, "triton", "nccl", "triton")
    with torch.device("meta"):
        model = train_gpt.GPT(ARGS, hw)
    specs = train_gpt.param_specs(model, ARGS)
    return hw, model, specs


def test_every_parameter_matches_the_record(speedrun):
    hw, model, specs = speedrun
    record = record_parameters(8)
    optimizer = train_gpt.ShardedMuonAdam(specs, ARGS, train_gpt.Ranks(), hw)
    muon_scale = {id(slot.spec.param): [] for group in optimizer.muon_groups for slot in group["owned"]}
    for group in optimizer.muon_groups:  # the optimizer's own lr factor of each matrix (aspect x mlp_proj_lr_mult)
        for slot in group["owned"]:
            muon_scale[id(slot.spec.param)].append(slot.lr_scale)
    for spec in specs:
        label = record_label(spec.name)
        shape, optimizer_kind, betas, lr_mul, wd_mul, dtype = record[label]
        assert tuple(spec.param.shape) == our_shape_in_the_record(spec.name, shape), spec.name
        assert spec.optimizer == optimizer_kind, spec.name
        # ours fp32 for Muon: the record's bf16 bank and its 16-bit mantissa (P 751-760), an fp32 master
        assert spec.param.dtype == (FP32 if optimizer_kind == "muon" else dtype), spec.name
        if optimizer_kind == "adam":  # lr = p_cfg.lr * p_cfg.lr_mul (P 658); eff_wd = lr * lr * weight_decay * wd_mul (P 672)
            assert spec.betas == betas, spec.name
            assert ARGS.adam_lr * spec.lr_mult == pytest.approx(0.008 * lr_mul), spec.name
            assert spec.wd_mult == wd_mul, spec.name
            ours_decay = ARGS.adam_lr ** 2 * spec.lr_mult ** 2 * spec.wd_mult * ARGS.adam_weight_decay  # AdamShard.decay
            assert ours_decay == pytest.approx((0.008 * lr_mul) ** 2 * 0.005 * wd_mul), spec.name
            continue
        # Muon: lr_mul = shape_mult * lr_mul on the view (40, 768, 768) or (24, 3072, 768) (P 355-356); c_proj,
        # the odd matrices of the MLP view, x 2 (P 366-367, 728)
        rows, cols = (D, D) if label == "attn" else (4 * D, D)
        record_lr = 0.023 * max(1.0, rows / cols) ** 0.5 * (2.0 if spec.name.endswith("proj_w") else 1.0)
        matrices = 4 if spec.name.endswith("qkvo_w") else 1
        assert [ARGS.muon_lr * s for s in muon_scale[id(spec.param)]] == pytest.approx([record_lr] * matrices), spec.name
    effective = {label: 0.008 * row[3] for label, row in record.items() if row[1] == "adam"}
    assert effective == pytest.approx({"smear_gate": 8e-5, "skip_gate": 4e-4, "ve0": 0.6, "ve1": 0.6, "ve2": 0.6,
                                       "attn_gate_bank": 0.008, "ve_gate_bank": 0.008, "lm_head": 0.008,
                                       "embed": 0.008, "bigram_embed": 0.6, "x0_lambdas": 0.04, "scalars": 0.04})


def test_parameter_counts_match_the_record(speedrun):
    _, model, specs = speedrun
    by_label = {}
    for spec in specs:
        by_label.setdefault(record_label(spec.name), []).append(spec)
    count = lambda label: sum(s.param.numel() for s in by_label[label])  # noqa: E731
    attention_blocks, value_embed_blocks = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10], [0, 1, 8, 9, 10]
    assert [int(s.name.split(".")[1]) for s in by_label["attn"]] == attention_blocks
    assert [int(s.name.split(".")[1]) for s in by_label["ve_gate_bank"]] == value_embed_blocks
    assert len(by_label["mlp"]) == 2 * L and len(by_label["x0_lambdas"]) == L
    # What the record allocates and never reads: its MLP bank's padding layer (index 11: mlp_fcs[11] and
    # mlp_projs[11] are never indexed, layer_to_mlp_idx maps layers 0-10, P 1252-1255, 1279-1280), layer 6's
    # sa_lambdas pair (block 6 has no attention, P 1106) and the scalars' padding (P 1183, 1193). Ours
    # allocates none of them: every other record parameter is ours element for element.
    for world_size in (1, 8):
        record = record_parameters(world_size)
        unread = {"mlp": 2 * 4 * D * D, "scalars": 2 + record_scalar_pad(world_size)}
        for label, (shape, *_rest) in record.items():
            assert count(label) == math.prod(shape) - unread.get(label, 0), (label, world_size)
        record_total = sum(math.prod(row[0]) for row in record.values())
        assert sum(p.numel() for p in model.parameters()) == record_total - sum(unread.values())
    assert record_scalar_pad(8) == 4 and record_scalar_pad(1) == 0
    assert sum(math.prod(row[0]) for row in record_parameters(8).values()) == 466_551_950
    assert sum(p.numel() for p in model.parameters()) == 461_833_352


@pytest.mark.parametrize("rank", [0, 7])
def test_optimizer_state_and_muon_work_per_rank_at_eight_gpus(speedrun, rank):
    """At 8 GPUs each rank orthogonalizes as many matrices as the record's: its banks' views (40, 768,
    768) and (24, 3072, 768) split 5 and 3 per rank (chunk_size = reshape[0] // world_size, P 352),
    our 22 MLP matrices padded to 24 with zero matrices where the record has its padding layer. State in fp32:
    Adam's moments, bf16 parameters too (zeros_like(chunk, dtype=torch.float32), P 399), Muon's
    momentum (P 405-408) and NorMuon's statistic per row of the record's view (P 411-417)."""
    hw, _, specs = speedrun
    optimizer = train_gpt.ShardedMuonAdam(specs, ARGS, train_gpt.Ranks(rank=rank, world_size=8), hw)
    groups = {tuple(g["grad_stack"].shape[1:]): g for g in optimizer.muon_groups}
    attn, mlp = groups[(D, D)], groups[(D, 4 * D)]
    assert (len(attn["owned"]), len(mlp["owned"])) == (40 // 8, 24 // 8)
    assert sum(b.padded - len(b.slots) for b in mlp["buckets"]) == 24 - 2 * L  # two zero matrices: the record's padding
    assert sum(b.padded - len(b.slots) for b in attn["buckets"]) == 0
    # second_mom_shape = (*chunk_shape[:-1], 1) where rows >= cols (P 411-412): 768 per attention matrix,
    # 3072 per MLP matrix; ours on the wide view (768, 3072): one per column, the record's row
    assert attn["second_moment"].shape[1:].numel() == D and mlp["second_moment"].shape[1:].numel() == 4 * D
    moments = [attn["momentum"], mlp["momentum"], attn["second_moment"], mlp["second_moment"]]
    moments += [t for unit in optimizer.adam_shards + optimizer.smalls for t in (unit.exp_avg, unit.exp_avg_sq)]
    assert {t.dtype for t in moments} == {torch.float32}
    shards = {shard.spec.name: shard for shard in optimizer.adam_shards}
    assert shards["embed.weight"].spec.param.dtype == torch.bfloat16
    # the record shards embeddings by rows (param.shape[0] // self.world_size, P 331): 6288 rows of the
    # embeddings at 8 GPUs, its (768, 50304) head in 96 rows of 50304; ours (50304, 768) like the embedding
    assert {name: s.rows_per_rank for name, s in shards.items()} == {
        "embed.weight": V // 8, "lm_head_w": V // 8, "bigram_embed.weight": 50304 * 5 // 8,
        **{f"value_embeds.{i}.weight": V // 8 for i in range(3)}}


@pytest.mark.parametrize("micro_batches, world_size", [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (8, 8)])
def test_gradients_are_the_records_eight_gpu_gradients_at_any_accumulation(micro_batches, world_size):
    """The record backpropagates each micro-batch's summed loss divided by its micro-steps,
    (model(...) / grad_accum_steps).backward() (P 1900), and ranks average (ReduceOp.AVG, P 443, 455,
    462): the gradient is the mean over the 8 micro-batches of their summed losses' gradients, at every
    world size. Ours is the same: backward sums a rank's micro-batches, the optimizer divides (a
    rank's mean here; the ranks' average of those is the mean over all)."""
    from conftest import perturbed_tiny_model
    args, hw, model = perturbed_tiny_model(0.05, micro_batches=micro_batches, bf16_embeds=False, bf16_weights=False)
    specs = train_gpt.param_specs(model, args)
    optimizer = train_gpt.ShardedMuonAdam(specs, args, train_gpt.Ranks(0, 0, world_size, world_size), hw)
    g = torch.Generator().manual_seed(1)
    steps = micro_batches // world_size  # this rank's micro-steps
    batches = [torch.randint(0, train_gpt.BOS_TOKEN, (args.train_seq_len + 1,), generator=g) for _ in range(steps)]
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
    assert math.isclose(optimizer.grad_scale, 1 / steps)
