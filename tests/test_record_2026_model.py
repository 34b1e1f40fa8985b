"""The port to the record of 2026-01-19: its model's pieces against restatements of the record's
code (../shared/peers/modded-nanogpt_93f0e6b9/train_gpt.py, lines named beside each), in fp32 on
CPU. Until the speedrun preset becomes that record, each piece is an option (docs/port-2026-01-19.md)."""

import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt

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
