"""The port to the record of 2026-01-19: its model's pieces against restatements of the record's
code (../shared/peers/modded-nanogpt_93f0e6b9/train_gpt.py, lines named beside each), in fp32 on
CPU. Until the speedrun preset becomes that record, each piece is an option (docs/port-2026-01-19.md)."""

import math

import pytest
import torch

import train_gpt

BLOCK = 128  # the record's block_size, in which its windows count


class RecordYarn:
    """P 816-860 (Yarn) and 862-912 (YarnPairedHead): frequencies on adjacent dim pairs, bf16
    tables for 2 x max_seq_len positions, apply(old, new) at a long-window change."""
    def __init__(self, head_dim, max_seq_len, paired=False):
        self.head_dim, self.max_seq_len, self.paired = head_dim, max_seq_len, paired
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
        rotations = BLOCK * old_window * self.angular_freq / (2 * torch.pi)
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
