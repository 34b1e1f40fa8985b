"""The port to the record of 2026-01-19: its model's pieces against restatements of the record's
code (../shared/peers/modded-nanogpt_93f0e6b9/train_gpt.py, lines named beside each), in fp32 on
CPU. The speedrun preset (the defaults) is that record; the 2025-08-23 record's pieces remain options
(TINY_2025 below names them)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt
from conftest import TINY
from test_record_2026_data import record_bigram_hash

BLOCK = 128  # the record's block_size, in which its windows count


class RecordYarn:
    """P 816-860 (Yarn) and 862-912 (YarnPairedHead): frequencies on adjacent dim pairs, bf16
    tables for 2 x max_seq_len positions, apply(old, new) at a long-window change."""
    def __init__(self, head_dim, max_seq_len, paired=False, block_size=BLOCK):
        self.head_dim, self.max_seq_len, self.paired, self.block_size = head_dim, max_seq_len, paired, block_size
        self.reset()

    def _tables(self):
        t = torch.arange(2 * self.max_seq_len, dtype=torch.float32)
        if self.paired:
            theta1, theta2 = torch.outer(2 * t, self.angular_freq), torch.outer(2 * t + 1, self.angular_freq)
            cos, sin = torch.cat((theta1.cos(), theta2.cos()), dim=-1), torch.cat((theta1.sin(), theta2.sin()), dim=-1)
        else:
            theta = torch.outer(t, self.angular_freq)
            cos, sin = theta.cos(), theta.sin()
        self.factor1, self.factor2 = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
        self.factor2[..., 1::2] *= -1

    def reset(self):
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=self.head_dim // 4, dtype=torch.float32)
        angular_freq = angular_freq.repeat_interleave(2)
        self.angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(self.head_dim // 2)])
        self._tables()
        self.attn_scale = 0.1

    def apply(self, old_window, new_window, alpha=1, beta=32):
        rotations = self.block_size * old_window * self.angular_freq / (2 * torch.pi)
        scaling_factor = old_window / new_window
        interpolation_weight = torch.clamp((rotations - alpha) / (beta - alpha), 0, 1)
        self.angular_freq *= scaling_factor + interpolation_weight * (1 - scaling_factor)
        self._tables()
        self.attn_scale *= 0.2 * math.log(new_window / old_window) + 1

    def rotary(self, x_BTHD):  # in fp32, as the compiled record computes it (one rounding at the end)
        T = x_BTHD.size(-3)
        factor1, factor2 = self.factor1[None, :T, None, :].float(), self.factor2[None, :T, None, :].float()
        x_flip = x_BTHD.view(*x_BTHD.shape[:-1], x_BTHD.shape[-1] // 2, 2).flip(-1).view(x_BTHD.shape)
        return factor1 * x_BTHD + factor2 * x_flip


def test_yarn_tables_scale_and_rotation_are_the_records_through_every_window_change():
    head_dim, max_seq_len, T = 128, 512, 96
    ours = train_gpt.Rotary(head_dim, max_seq_len, base=1024.0, attn_scale=0.1, yarn=True)
    record, paired = RecordYarn(head_dim, max_seq_len), RecordYarn(head_dim, max_seq_len, paired=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, 6, head_dim, generator=gen)
    scales = []
    for old, new in [(None, 3), (3, 3), (3, 7), (7, 11), (11, 13)]:  # the record's long windows, 1560 steps
        ours.follow(new, BLOCK)
        if old is not None and old != new:
            record.apply(old, new)
            paired.apply(old, new)
        assert ours.cos.dtype == torch.bfloat16
        assert torch.equal(ours.freqs, record.angular_freq)
        assert torch.equal(ours.cos, record.factor1) and torch.equal(ours.sin, record.factor2)
        assert ours.attn_scale == record.attn_scale
        assert torch.equal(ours(x), record.rotary(x))
        # paired heads (P 997-1003): heads (2j, 2j+1) as one of 256 dims, turned at positions 2t and 2t+1
        assert torch.equal(ours(x, paired=True), paired.rotary(x.view(1, T, 3, 2 * head_dim)).view(x.shape))
        scales.append(ours.attn_scale)
    assert scales == pytest.approx([0.1, 0.1, 0.116946, 0.127518, 0.131778], abs=5e-7)  # docs/port-2026-01-19.md
    # dims head_dim/2.. never turn: the key offset shifts those (stationary) dims
    assert torch.equal(ours(x)[..., head_dim // 2:], x[..., head_dim // 2:])
    ours.reset()
    record.reset()
    assert torch.equal(ours.cos, record.factor1) and ours.attn_scale == 0.1 and ours.window is None


def test_yarn_state_at_a_step_is_the_live_runs():
    """A resumed run (and --sample) replays the window changes up to its step: the same
    frequencies, tables and scale as the run that went through them."""
    args = train_gpt.Hyperparameters(num_iterations=30, extension_steps=3, window_schedule="1,2,4",
                                     window_final_blocks=5, yarn=True, attn_block_size=64)
    live = train_gpt.Rotary(32, 64, attn_scale=0.1, yarn=True)
    replayed = train_gpt.Rotary(32, 64, attn_scale=0.1, yarn=True)
    for step in range(args.num_iterations + 1):
        live.follow(train_gpt.long_window_blocks_at(step, args), args.attn_block_size)
        if step in (0, 8, 9, 18, 27, 30):
            train_gpt.follow_windows(replayed, step, args)
            assert torch.equal(replayed.cos, live.cos) and torch.equal(replayed.freqs, live.freqs)
            assert replayed.attn_scale == live.attn_scale
    assert live.attn_scale > 0.1 * 1.2  # four changes: 1 -> 2 -> 4 -> 5


def test_the_2025_rotary_is_untouched_by_windows():
    rotary = train_gpt.Rotary(64, 128, attn_scale=0.12)
    cos = rotary.cos.clone()
    rotary.follow(3, 64)
    rotary.follow(7, 64)
    rotary.reset()
    assert torch.equal(rotary.cos, cos) and rotary.cos.dtype == torch.float32 and rotary.attn_scale == 0.12


# --- attention (P 928-1027) ------------------------------------------------------------------------

def record_varlen_attention(q, k, v, cu_seqlens, scale, window):
    """flash_attn_varlen_func(causal=True, window_size=(window, 0)) for B = 1: query i attends key j
    in its cu_seqlens segment with i - window <= j <= i."""
    T = q.size(1)
    pos = torch.arange(T)
    segment = torch.searchsorted(cu_seqlens[1:], pos, right=True)
    allowed = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= window)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)


def record_attention(x, qkvo_w, sa_lambdas, ve, ve_gate_w, attn_gate_w, yarn, key_offset, seqlens, bm_size, paired,
                     head_dim):
    """CausalSelfAttention.forward (P 937-970) and PairedHeadCausalSelfAttention.forward (P 981-1026)."""
    norm = lambda t: F.rms_norm(t, (t.size(-1),))  # noqa: E731
    B, T, dim = x.shape
    H = dim // head_dim
    q, k, v = F.linear(x, sa_lambdas[0] * qkvo_w[:dim * 3]).view(B, T, 3 * H, head_dim).chunk(3, dim=-2)
    q, k = norm(q), norm(k)
    if paired:
        q, k = q.view(B, T, H // 2, head_dim * 2), k.view(B, T, H // 2, head_dim * 2)
        v = v.reshape(B, T * 2, H // 2, head_dim)
        q, k = yarn.rotary(q), yarn.rotary(k)
        q, k = q.view(B, T * 2, H // 2, head_dim), k.view(B, T * 2, H // 2, head_dim)
        if ve is not None:
            ve_gate_out = 2 * torch.sigmoid(F.linear(x[..., :12], ve_gate_w)).view(B, T * 2, H // 2, 1)
            v = v + ve_gate_out * ve.view_as(v)
        seqlens = 2 * seqlens
    else:
        q, k = yarn.rotary(q), yarn.rotary(k)
        if key_offset:  # compiled in the record: the shift reads the keys before it writes
            k[:, 1:, :, head_dim // 2:] = k[:, :-1, :, head_dim // 2:].clone()
        if ve is not None:
            ve_gate_out = 2 * torch.sigmoid(F.linear(x[..., :12], ve_gate_w)).view(B, T, H, 1)
            v = v + ve_gate_out * ve.view_as(v)
    y = record_varlen_attention(q, k, v, seqlens, yarn.attn_scale, bm_size)
    y = y.reshape(B, T, H, head_dim)
    y = y * torch.sigmoid(F.linear(x[..., :12], attn_gate_w)).view(B, T, H, 1)
    y = y.contiguous().view(B, T, H * head_dim)
    return F.linear(y, sa_lambdas[1] * qkvo_w[dim * 3:])


@pytest.mark.parametrize("kind", ["long, key offset", "short", "paired", "no value embedding", "paired, no value embedding"])
def test_attention_is_the_records(kind):
    """Our attention with --value_gates --yarn --key_offset --paired_head_layers against the
    record's (its varlen FlashAttention call as a dense computation), output and gradients in
    fp32, on packed documents (cu_seqlens from the BOS tokens, a document cut off at the start)."""
    head_dim, H, T, block = 16, 4, 64, 8
    paired, long = "paired" in kind, kind.startswith("long")
    has_ve = "no value" not in kind
    args = train_gpt.Hyperparameters(preset="cpu", model_dim=H * head_dim, num_heads=H, head_dim=head_dim, yarn=True,
                                     value_gates=True, key_offset=True, token_windows=True, attn_block_size=block,
                                     attn_scale=0.1)
    hw = train_gpt.Hardware.detect(args)
    rotary = train_gpt.Rotary(head_dim, T, attn_scale=0.1, yarn=True)
    for window in (3, 7):  # one YaRN change: a scale other than the initial one
        rotary.follow(window, block)
    torch.manual_seed(0)
    attn = train_gpt.CausalSelfAttention(args, rotary, has_ve, key_offset=long, paired=paired)
    with torch.no_grad():  # away from the zero initializations
        for p in attn.parameters():
            p.add_(0.3 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1000, (T,), generator=gen)
    tokens[[5, 20, 23, 40]] = train_gpt.BOS_TOKEN  # positions 0-4: the end of a document cut off at the start
    x = torch.randn(1, T, H * head_dim, generator=gen, requires_grad=True)
    ve = torch.randn(1, T, H * head_dim, generator=gen) if has_ve else None
    long_blocks, short_blocks = torch.tensor(3), torch.tensor(1)
    mask_kind = "p" * paired + ("L" if long else "S")
    mask = train_gpt.attention_masks(tokens, long_blocks, args, hw, short_blocks, kinds=[mask_kind])[mask_kind]
    ours = attn(x, ve, mask)

    record_yarn = RecordYarn(head_dim, T, paired=paired, block_size=block)
    record_yarn.apply(3, 7)
    seqlens = torch.tensor([0, 5, 20, 23, 40, T], dtype=torch.int32)
    qkvo_w = attn.qkvo_w.detach().flatten(0, 1).clone().requires_grad_()  # the record's bank row: Wq, Wk, Wv, Wo
    sa = attn.sa_lambdas.detach().clone().requires_grad_()
    ve_gate = attn.ve_gate_w.detach().clone().requires_grad_() if has_ve else None
    gate = attn.gate_w.detach().clone().requires_grad_()
    x_record = x.detach().clone().requires_grad_()
    window = (long_blocks if long else short_blocks).item() * block
    record = record_attention(x_record, qkvo_w, sa, ve, ve_gate, gate, record_yarn, long, seqlens, window, paired, head_dim)
    torch.testing.assert_close(ours, record, rtol=1e-5, atol=1e-6)
    grad = torch.randn(ours.shape, generator=gen)
    ours.backward(grad)
    record.backward(grad)
    pairs = [(x.grad, x_record.grad), (attn.qkvo_w.grad.flatten(0, 1), qkvo_w.grad), (attn.sa_lambdas.grad, sa.grad),
             (attn.gate_w.grad, gate.grad)] + ([(attn.ve_gate_w.grad, ve_gate.grad)] if has_ve else [])
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --- the whole model (P 1073-1301) ------------------------------------------------------------------

RECORD_ARCHITECTURE = dict(  # the record's, which the defaults are (checked below)
    num_layers=11, attention_free_layers="6", window_pattern="SSSLSSSSSSL", paired_head_layers="0,2,5,9",
    num_value_embeds=3, value_embed_layers="12......012", skip_layers="3,6", backout_layer=7, smear=True,
    resid_lambda_init=1.1, init="2026", yarn=True, value_gates=True, key_offset=True, token_windows=True,
    logit_cap_height=23.0, logit_cap_shift=5.0, mtp=True, attn_scale=0.1,
)
RECORD_MODEL = dict(  # that architecture at width 64 (4 heads of 16), windows in blocks of 8 tokens, in fp32
    preset="cpu", model_dim=64, num_heads=4, head_dim=16, bigram_vocab_size=1000, attn_block_size=8,
    bf16_embeds=False, bf16_weights=False, fp8_head=False, compile=False, train_seq_len=128, val_seq_len=128,
)


def record_forward(P, tokens, targets, seqlens, mtp_weights, ws_short, ws_long, yarn, yarn_paired, training,
                   block=8, head_dim=16):
    """GPT.forward (P 1199-1301) with P's parameters (names as in the record), in fp32: its 11
    layers' fixed structure (no attention in layer 6, paired heads in 0, 2, 5, 9, long windows and
    the key offset in 3 and 10, the skip from 3 into 6, the backout of 7); the fused softcapped
    multi-token loss (K 397-437) written out."""
    L = 11
    norm = lambda t: F.rms_norm(t, (t.size(-1),))  # noqa: E731
    scalars = P["scalars"]
    resid_lambdas, x0_lambdas = scalars[:L], P["x0_lambdas"]
    sa_lambdas, bigram_lambdas = scalars[L:3 * L].view(-1, 2), scalars[3 * L:4 * L]
    smear_lambda, backout_lambda, skip_lambda = scalars[4 * L], scalars[4 * L + 1], scalars[4 * L + 2]
    short_bm, long_bm = ws_short * block, ws_long * block
    bm_sizes = [short_bm] * 3 + [long_bm] + [short_bm] * 2 + [None] + [short_bm] * 3 + [long_bm]
    key_offset = [b == long_bm for b in bm_sizes]
    x = F.embedding(tokens, P["embed"])
    x0_bigram = F.embedding(record_bigram_hash(tokens, 1000), P["bigram_embed"])[None]
    ve = [F.embedding(tokens, P[f"ve{i}"]) for i in range(3)]
    ve = [ve[1], ve[2]] + [None] * (L - 5) + [ve[0], ve[1], ve[2]]
    smear_gate_out = smear_lambda * torch.sigmoid(F.linear(x[1:, :12], P["smear_gate"]))
    x = torch.cat([x[:1], x[1:] + smear_gate_out * x[:-1]])
    x = x0 = norm(x[None])
    ag, veg = P["attn_gate_bank"].unbind(0), P["ve_gate_bank"].unbind(0)
    attn_gates = list(ag[:6]) + [None] + list(ag[6:])
    ve_gates = [veg[0], veg[1]] + [None] * (L - 5) + [veg[2], veg[3], veg[4]]
    attn_index = {layer: i for i, layer in enumerate(layer for layer in range(L) if layer != 6)}
    skips, x_backout = [], None
    for i in range(L):
        if i == 6:
            x = x + torch.sigmoid(skip_lambda) * 2 * torch.sigmoid(F.linear(x0[..., :12], P["skip_gate"])) * skips.pop()
        if i == 0:
            x = (resid_lambdas[0] + x0_lambdas[0]) * x + bigram_lambdas[0] * x0_bigram
        else:
            x = resid_lambdas[i] * x + x0_lambdas[i] * x0 + bigram_lambdas[i] * x0_bigram
        if i != 6:
            paired = i in (0, 2, 5, 9)
            x = x + record_attention(norm(x), P["attn_bank"][attn_index[i]], sa_lambdas[i], ve[i], ve_gates[i],
                                     attn_gates[i], yarn_paired if paired else yarn, key_offset[i], seqlens,
                                     bm_sizes[i], paired, head_dim)
        c_fc, c_proj = P["mlp_bank"][i, 0], P["mlp_bank"][i, 1]  # (hidden, dim) each
        x = x + F.relu(norm(x) @ c_fc.T).square() @ c_proj
        if i == 3:
            skips.append(x)
        if i == 7:
            x_backout = x
    x = x - backout_lambda * x_backout
    logits = norm(x)[0] @ P["lm_head"]  # lm_head stored (dim, vocab)
    z = 23 * torch.sigmoid((logits + 5) / 7.5)
    if not training:
        return F.cross_entropy(z, targets, reduction="mean")
    lse, rows = torch.logsumexp(z, dim=-1), torch.arange(z.size(0))
    loss = z.new_zeros(())
    for k, w in enumerate(mtp_weights.tolist()):
        valid = rows + k < z.size(0)
        loss = loss + (w * (lse[valid] - z[rows[valid], targets[rows[valid] + k]])).sum()
    return loss


def record_parameters(model):
    """The record's parameter tensors, made from ours (differentiably: gradients reach ours)."""
    blocks, L = model.blocks, len(model.blocks)
    scalars = torch.cat([torch.stack([b.resid_lambda for b in blocks]),
                         torch.cat([b.attn.sa_lambdas if b.attn is not None else torch.tensor([0.5, 1.0]) for b in blocks]),
                         torch.stack([b.bigram_lambda for b in blocks]),
                         torch.stack([model.smear_lambda, model.backout_lambda, model.skip_lambda])])
    attn = [b.attn for b in blocks if b.attn is not None]
    return dict(
        scalars=scalars, x0_lambdas=torch.stack([b.x0_lambda for b in blocks]),
        embed=model.embed.weight, bigram_embed=model.bigram_embed.weight, lm_head=model.lm_head_w.T,
        **{f"ve{i}": e.weight for i, e in enumerate(model.value_embeds)},
        smear_gate=model.smear_gate[None], skip_gate=model.skip_gate[None],
        attn_gate_bank=torch.stack([a.gate_w for a in attn]),
        ve_gate_bank=torch.stack([a.ve_gate_w for a in attn if a.ve_gate_w is not None]),
        attn_bank=torch.stack([a.qkvo_w.flatten(0, 1) for a in attn]),
        mlp_bank=torch.stack([torch.stack([b.mlp.fc_w.T, b.mlp.proj_w.T]) for b in blocks]),
    )


def test_the_model_is_the_records_loss_and_gradients():
    """Our GPT with the record's options against the record's forward pass written out, in fp32:
    the training loss (three multi-token weights) and every parameter's gradient, the validation
    loss; the initializations the record's (P 1128-1197) where they are exact (zeros, copies)."""
    args = train_gpt.Hyperparameters(**RECORD_MODEL)
    assert {k: getattr(args, k) for k in RECORD_ARCHITECTURE} == RECORD_ARCHITECTURE
    train_gpt.harness("config").check_config(args, 1, False)
    hw = train_gpt.Hardware.detect(args)
    torch.manual_seed(0)
    model = train_gpt.GPT(args, hw)
    assert torch.equal(model.embed.weight, model.lm_head_w) and 0.004 < model.lm_head_w.std() < 0.006
    assert all(not ve.weight.any() for ve in model.value_embeds) and not model.bigram_embed.weight.any()
    assert all(b.resid_lambda.item() == torch.tensor(1.1).item() and b.x0_lambda.item() == 0 for b in model.blocks)
    assert model.skip_lambda.item() == -1.5 and model.backout_lambda.item() == 0.5 and model.smear_lambda.item() == 0
    bound = 3 ** 0.5 * 64 ** -0.5  # q, k, v: U(+-sqrt(3) dim^-0.5)
    qkv = model.blocks[0].attn.qkvo_w[:3]
    assert qkv.abs().max() <= bound and qkv.abs().max() > 0.95 * bound and not model.blocks[0].attn.qkvo_w[3].any()
    with torch.no_grad():  # away from the zero initializations
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        model.lm_head_w.mul_(50)  # logits of a few units: where the cap's shift shows (sigmoid' is even)
    for window in (3, 7):  # YaRN once
        model.rotary.follow(window, args.attn_block_size)
    yarn, yarn_paired = RecordYarn(16, 128, block_size=8), RecordYarn(16, 128, paired=True, block_size=8)
    yarn.apply(3, 7)
    yarn_paired.apply(3, 7)
    gen = torch.Generator().manual_seed(1)
    chunk = torch.randint(0, 50257, (129,), generator=gen)
    chunk[[0, 30, 31, 77, 100]] = train_gpt.BOS_TOKEN
    tokens, targets = chunk[:-1], chunk[1:]
    seqlens = torch.tensor([0, 30, 31, 77, 100, 128], dtype=torch.int32)
    mtp = torch.tensor([1.0, 0.5, 0.2])
    ours = model(tokens, targets, torch.tensor(7), torch.tensor(3), mtp)
    record = record_forward(record_parameters(model), tokens, targets, seqlens, mtp, 3, 7, yarn, yarn_paired, True)
    torch.testing.assert_close(ours, record, rtol=1e-5, atol=0)
    params = list(model.parameters())
    ours_grads = torch.autograd.grad(ours, params)
    record_grads = torch.autograd.grad(record, params, allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), ours_grads, record_grads):
        assert b is not None and a.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item(), msg=lambda m: f"{name}: {m}")
    model.eval()
    with torch.no_grad():
        ours = model(tokens, targets, torch.tensor(7), torch.tensor(3))
        record = record_forward(record_parameters(model), tokens, targets, seqlens, None, 3, 7, yarn, yarn_paired, False)
    torch.testing.assert_close(ours, record, rtol=1e-5, atol=0)


@pytest.mark.parametrize("options", ["record 2025", "record 2026", "record 2026 without smear"])
def test_bf16_activations_stay_bf16(options):
    """On a GPU the residual stream is bf16: no fp32 parameter may promote it (a (1,)-shaped fp32
    scalar times a bf16 tensor is fp32; a 0-dim one keeps bf16). Checked on CPU with the GPU's
    compute dtype: every block's input and output, and the logits, are bf16."""
    config = TINY_2025 if options == "record 2025" else dict(TINY, smear=options == "record 2026")
    args = train_gpt.Hyperparameters(**config)
    hw = dataclasses.replace(train_gpt.Hardware.detect(args), compute_dtype=torch.bfloat16)
    model = train_gpt.GPT(args, hw)
    dtypes = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, inputs, output: dtypes.append((inputs[0].dtype, output.dtype)))
    tokens = torch.randint(0, 50257, (64,))
    tokens[0] = train_gpt.BOS_TOKEN
    logits = model(tokens, None, torch.tensor(2), torch.tensor(1))
    assert dtypes == [(torch.bfloat16, torch.bfloat16)] * args.num_layers
    assert model.trunk(tokens, torch.tensor(2), torch.tensor(1)).dtype == torch.bfloat16  # the backout's too
    assert logits.dtype == torch.float32  # the capped logits, in fp32 for the loss


# The 2025-08-23 record's model at 4 blocks of width 32: its option values, where the defaults (the
# 2026 record's; conftest's TINY at this size) differ.
TINY_2025 = dict(preset="cpu", num_layers=4, model_dim=32, num_heads=2, head_dim=16, attention_free_layers="2",
                 num_value_embeds=1, value_embed_layers="", window_pattern="LSSL", attn_block_size=16,
                 train_seq_len=64, val_seq_len=64, fp8_head=False, compile=False, yarn=False, value_gates=False,
                 key_offset=False, token_windows=False, paired_head_layers="", bigram_vocab_size=0, smear=False,
                 skip_layers="", backout_layer=-1, init="2025", resid_lambda_init=1.0, logit_cap_height=0.0,
                 logit_cap_shift=0.0, attn_scale=0.12, mtp=False, bf16_weights=False)


def test_fp8_head_scales_are_the_records():
    # lm_head = CastedLinearT(..., x_s=100/448, w_s=1.6/448, grad_s=0.75/448) (P 1165)
    assert train_gpt.fp8_head_scales(768, "2026") == (100 / 448, 1.6 / 448, 0.75 / 448)
    args = train_gpt.Hyperparameters(**TINY)  # the default scales
    assert args.fp8_scales == "2026"
    assert train_gpt.GPT(args, train_gpt.Hardware.detect(args)).fp8_scales == (100 / 448, 1.6 / 448, 0.75 / 448)


# --- the fused softcapped multi-token loss (K 397-532) -----------------------------------------------

def record_fused_loss(logits, targets, mtp_weights, A=23.0, B=5.0, C=7.5):
    """fused_softcapped_entropy_fwd_kernel (K 397-437) per row, written with torch: z = A sigmoid((x + B)/C),
    loss_r = sum_k w_k (lse_r - z_r[target_{r+k}]) for r + k < n_rows."""
    z = A * torch.sigmoid((logits.double() + B) / C)
    lse = torch.logsumexp(z, dim=-1)
    losses = torch.zeros(logits.shape[0], dtype=torch.float64)
    for r in range(logits.shape[0]):
        for k, w in enumerate(mtp_weights.tolist()):
            if r + k < logits.shape[0]:
                losses[r] += w * (lse[r] - z[r, targets[r + k]])
    return losses


def record_fused_loss_grad(logits, targets, mtp_weights, grad_losses, A=23.0, B=5.0, C=7.5):
    """fused_softcapped_entropy_bwd_kernel (K 439-480): grad_x = g_r (S_w softmax(z) - sum_k w_k [col = t_{r+k}])
    x z (1 - sigmoid(u)) / C, S_w the weights of the row's predictions within the micro-batch."""
    x = logits.double()
    sig = torch.sigmoid((x + B) / C)
    z = A * sig
    p = torch.softmax(z, dim=-1)
    grad = torch.zeros_like(x)
    for r in range(x.shape[0]):
        dz = torch.zeros(x.shape[1], dtype=torch.float64)
        for k, w in enumerate(mtp_weights.tolist()):
            if r + k < x.shape[0]:
                dz += w * p[r]
                dz[targets[r + k]] -= w
        grad[r] = grad_losses[r] * dz * z[r] * (1 - sig[r]) / C
    return grad


@pytest.mark.parametrize("weights", [[1.0, 0.5, 0.2], [1.0, 0.35], [1.0]])
def test_the_fused_loss_kernels_and_their_twin_are_the_records(weights):
    """The Triton kernels (in the interpreter) and the torch twin against the record's kernels
    restated, forward (per-row losses) and backward, fp32, over 2500 columns (three blocks of 1024,
    the last partial) and 40 rows (the last rows predict fewer tokens)."""
    gen = torch.Generator().manual_seed(6)
    logits = 4 * torch.randn(40, 2500, generator=gen)
    targets = torch.randint(0, 2500, (40,), generator=gen)
    mtp = torch.tensor(weights)
    grad_losses = torch.rand(40, generator=gen)
    expected = record_fused_loss(logits, targets, mtp)
    expected_grad = record_fused_loss_grad(logits, targets, mtp, grad_losses)
    for backend in ("triton", "torch"):
        x = logits.clone().requires_grad_()
        loss_fn = train_gpt.CappedMultiTokenLoss.apply if backend == "triton" else train_gpt.capped_multi_token_loss_torch
        losses = loss_fn(x, targets, mtp, 23.0, 5.0, 7.5)
        torch.testing.assert_close(losses.double(), expected, rtol=1e-5, atol=1e-5, msg=lambda m, b=backend: f"{b}: {m}")
        losses.backward(grad_losses)
        torch.testing.assert_close(x.grad.double(), expected_grad, rtol=1e-4, atol=1e-7, msg=lambda m, b=backend: f"{b}: {m}")


def test_the_model_runs_the_fused_loss_where_asked():
    """--ce_backend triton: the model's training loss and gradients through the kernels equal the
    twin's (conftest's TINY model, 16 positions: the interpreter is slow over 50304 columns)."""
    results = {}
    for backend in ("torch", "triton"):
        args = train_gpt.Hyperparameters(**dict(TINY, ce_backend=backend, train_seq_len=16,
                                                attn_block_size=8, bf16_weights=False))  # fp32: equal to 1e-5
        hw = train_gpt.Hardware.detect(args)
        assert hw.ce_backend == backend
        torch.manual_seed(0)
        model = train_gpt.GPT(args, hw)
        chunk = torch.randint(0, 50257, (17,), generator=torch.Generator().manual_seed(7))
        chunk[0] = train_gpt.BOS_TOKEN
        loss = model(chunk[:-1], chunk[1:], torch.tensor(2), torch.tensor(1), torch.tensor([1.0, 0.5, 0.25]))
        loss.backward()
        results[backend] = (loss.detach(), model.lm_head_w.grad.clone(), model.blocks[0].mlp.fc_w.grad.clone())
    for a, b in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_bf16_weights_read_the_fp32_master_truncated():
    """The record keeps its Muon matrices as bf16 with a 16-bit mantissa beside them: the forward pass
    reads the high 16 bits of the fp32 master, i.e. truncated toward zero. as_compute does the same,
    and passes the gradient straight through."""
    w = (torch.randn(64, 48) * 3).requires_grad_()
    bits = w.detach().view(torch.int32)
    expected = (bits >> 16).to(torch.int16).view(torch.bfloat16)  # the record's (p_precise_raw >> 16) as bf16
    ours = train_gpt.as_compute(w, torch.bfloat16, truncate=True)
    assert torch.equal(ours, expected) and not torch.equal(ours, w.detach().to(torch.bfloat16))
    assert torch.equal(train_gpt.as_compute(w, torch.bfloat16), w.detach().to(torch.bfloat16))  # without: rounded
    (ours.float() * torch.arange(48.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(48.0).expand(64, 48))
    assert train_gpt.as_compute(w, torch.float32, truncate=True) is w  # fp32 activations (CPU): the master itself
