"""The port to the record of 2026-01-19 ("Bigram Hash Embedding", 1600 steps): its schedules, by
step, from the options that express them. Each record function is restated below from its
train_gpt.py (../shared/peers/modded-nanogpt_93f0e6b9/train_gpt.py, lines named beside it) and
compared with ours at every step 0..1600. RECORD_2026 lists the record's values of our options:
the defaults (the speedrun preset) are those values, as test_the_defaults_are_the_records_schedules
checks. The 2025-08-23 record's schedules remain options (RECORD_2025_SCHEDULES)."""

import pytest
import torch

import train_gpt

RECORD_2026 = dict(
    num_iterations=1600, extension_steps=40,              # num_scheduled_iterations 1560 + num_extension_iterations 40
    lr_plateaus="1,1.52,1.73",                            # lr_max = 1.0; 1.52 if x > 1/3; 1.73 if x > 2/3
    cooldown_frac=0.55, final_lr_frac=0.1,                # cooldown_frac = 0.55; (1 - w) * 0.1; step > 1560: 0.1
    muon_momentum_start=0.85, muon_momentum_end=0.95,     # momentum_min=0.85, momentum_max=0.95
    muon_momentum_warmup_steps=300, muon_momentum_cooldown_steps=50,  # muon_warmup_steps=300, muon_cooldown_steps=50
    window_schedule="3,7,11", window_final_blocks=13,     # ws_schedule = (3, 7, 11); ws_final = 13
    micro_batches=8, train_seq_len_schedule="16384,32768,49152",  # grad_accum_steps = 8 // W; train_bs_schedule / 8
    mtp=True,                                             # _build_mtp_schedule
)
ARGS = train_gpt.Hyperparameters()
SCHEDULED, STEPS = 1560, 1600
# the 2025-08-23 record's schedules (peers/modded-nanogpt_9d9dc969_train_gpt.py): 1695 steps, one lr plateau,
# cooldown 0.45, no extension, no momentum cooldown, windows grown by window_growth_tokens x progress
RECORD_2025_SCHEDULES = dict(num_iterations=1695, extension_steps=0, lr_plateaus="1", cooldown_frac=0.45,
                             muon_momentum_cooldown_steps=0, window_schedule="", window_final_blocks=0, mtp=False)


def test_the_defaults_are_the_records_schedules():
    assert {k: getattr(ARGS, k) for k in RECORD_2026} == RECORD_2026


def record_get_lr(step):  # P 1519-1532
    if step > SCHEDULED:
        return 0.1
    lr_max = 1.0
    x = step / SCHEDULED
    if x > 1 / 3:
        lr_max = 1.52
    if x > 2 / 3:
        lr_max = 1.73
    if x >= 1 - 0.55:
        w = (1 - x) / 0.55
        return lr_max * w + (1 - w) * 0.1
    return lr_max


def record_get_ws(step):  # P 1508-1516: (short, long) in blocks of 128 tokens
    if step >= SCHEDULED:
        return 13 // 2, 13
    x = step / SCHEDULED
    long = (3, 7, 11)[int(3 * x)]
    return long // 2, long


def record_get_muon_momentum(step):  # P 1534-1546
    cooldown_start = STEPS - 50
    if step < 300:
        return 0.85 + step / 300 * (0.95 - 0.85)
    if step > cooldown_start:
        return 0.95 - (step - cooldown_start) / 50 * (0.95 - 0.85)
    return 0.95


def record_get_bs(step):  # P 1501-1506: tokens per step over all ranks, (8, 16, 24) x 2048 x 8
    if step >= SCHEDULED:
        return 24 * 2048 * 8
    return (8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8)[int(3 * (step / SCHEDULED))]


def test_batch_size_is_the_records_at_every_step():
    ours = [ARGS.micro_batches * train_gpt.train_seq_len_at(s, ARGS) for s in range(STEPS + 1)]
    assert ours == [record_get_bs(s) for s in range(STEPS + 1)]
    assert [s for s in range(1, STEPS + 1) if ours[s] != ours[s - 1]] == [520, 1040]


def record_mtp_weights(step):  # P 1628-1641 (_build_mtp_schedule)
    x = step / SCHEDULED
    if x < 1 / 3:
        return [1.0, 0.5, 0.25 * (1 - 3 * x)]
    if x < 2 / 3:
        return [1.0, 0.5 * (1 - (3 * x - 1))]
    return [1.0]


def test_multi_token_weights_are_the_records_at_every_step():
    ours = [train_gpt.mtp_weights_at(s, ARGS) for s in range(STEPS + 1)]
    assert ours == [record_mtp_weights(s) for s in range(STEPS + 1)]
    assert [s for s in range(1, STEPS + 1) if len(ours[s]) != len(ours[s - 1])] == [520, 1040]
    assert train_gpt.mtp_weights_at(0, train_gpt.Hyperparameters(mtp=False)) == [1.0]  # without it: the next token only


def test_lr_factor_is_the_records_at_every_step():
    ours = [train_gpt.lr_factor_at(s, ARGS) for s in range(STEPS + 1)]
    assert ours == [record_get_lr(s) for s in range(STEPS + 1)]  # exactly: the same float operations
    # the values docs/port-2026-01-19.md derived: three plateaus, the cooldown from 702, the 1.73 jump inside it
    assert ours[520] == 1.0 and ours[521] == 1.52 and ours[702] == 1.52 and ours[703] < 1.52  # 702: w = 1
    assert ours[1040] == pytest.approx(0.96061, abs=5e-6) and ours[1041] == pytest.approx(1.08598, abs=5e-6)
    assert ours[1559] == pytest.approx(0.1019, abs=5e-5) and ours[1560:] == [0.1] * 41


def test_long_window_is_the_records_at_every_step():
    ours = [train_gpt.long_window_blocks_at(s, ARGS) for s in range(STEPS + 1)]
    assert ours == [record_get_ws(s)[1] for s in range(STEPS + 1)]
    changes = [s for s in range(1, STEPS + 1) if ours[s] != ours[s - 1]]
    assert changes == [520, 1040, 1560]  # the record's transition steps (its warmup samples s-1, s, s+1)
    # the short window: half the long one (at least a block), as the loop and attention_masks take it
    assert [train_gpt.short_window_blocks(long) for long in ours] == [record_get_ws(s)[0] for s in range(STEPS + 1)]
    assert train_gpt.short_window_blocks(torch.tensor(13)).item() == 6 and train_gpt.short_window_blocks(1) == 1


def test_muon_momentum_is_the_records_at_every_step():
    ours = [train_gpt.muon_momentum_at(s, ARGS) for s in range(STEPS + 1)]
    record = [record_get_muon_momentum(s) for s in range(STEPS + 1)]
    assert ours == record  # exactly: with a cooldown the warmup is the 2026 form, start + frac * (end - start)
    assert ours[1550] == 0.95 and ours[1599] == pytest.approx(0.852) and ours[1600] == pytest.approx(0.85)


def test_without_the_new_options_the_schedules_are_the_2025_records():
    """The 2025 options (lr_plateaus "1", no extension, no momentum cooldown, no window schedule)
    give the 2025-08-23 record's get_lr, momentum and window growth."""
    a = train_gpt.Hyperparameters(**RECORD_2025_SCHEDULES)  # 2025-08-23's lines (peers/modded-nanogpt_9d9dc969_train_gpt.py 922-928, 1000-1010)
    assert a.window_growth_tokens == 1728 and a.attn_block_size == 128  # the record's, and still the defaults
    assert train_gpt.mtp_weights_at(0, a) == [1.0]
    for step in range(a.num_iterations):
        x = step / a.num_iterations
        w = (1 - x) / 0.45
        lr = 1.0 if x < 1 - 0.45 else w * 1.0 + (1 - w) * 0.1
        assert train_gpt.lr_factor_at(step, a) == lr, step
        frac = min(step / 300, 1)
        assert train_gpt.muon_momentum_at(step, a) == (1 - frac) * 0.85 + frac * 0.95, step
        v = 1728 * x
        window = next(m for m in range(128, int(v) + 1 + 128, 128) if m >= v)  # next_multiple_of_n(v, n=128)
        assert train_gpt.long_window_blocks_at(step, a) == window // 128, step


@pytest.mark.parametrize("option, value, message", [
    ("lr_plateaus", "1,x", "--lr_plateaus='1,x': expected comma-separated positive numbers"),
    ("lr_plateaus", "", "--lr_plateaus='': expected comma-separated positive numbers"),
    ("lr_plateaus", "1,-2", "--lr_plateaus='1,-2': expected comma-separated positive numbers"),
    ("window_schedule", "3,0", "--window_schedule='3,0': expected comma-separated positive integers"),
    ("window_schedule", "3,7.5", "--window_schedule='3,7.5': expected comma-separated positive integers"),
    ("extension_steps", "1600", "--extension_steps=1600: must be below num_iterations=1600"),
    ("extension_steps", "-1", "--extension_steps=-1: must not be negative"),
    ("muon_momentum_cooldown_steps", "1601", "--muon_momentum_cooldown_steps=1601: must not exceed num_iterations=1600"),
    ("window_final_blocks", "-3", "--window_final_blocks=-3: must not be negative"),
])
def test_bad_schedule_options_fail_in_one_line(option, value, message):
    config = train_gpt.harness("config")
    argv = [f"--{k}={v}" for k, v in RECORD_2026.items()] + [f"--{option}={value}"]
    with pytest.raises(train_gpt.ConfigError) as error:
        config.parse_config(["--preset=cpu", *argv], {}, world_size=1, cuda_available=False)
    assert str(error.value) == message


def test_warmup_samples_the_records_steps():
    # every log of the record: "Sampling steps [0, 1, 2, 519, 520, 521, 1039, 1040, 1041, 1559, 1560, 1561] for warmup"
    assert train_gpt.warmup_steps_at_transitions(ARGS) == [0, 1, 2, 519, 520, 521, 1039, 1040, 1041, 1559, 1560, 1561]


def test_warmup_also_samples_a_change_of_batch_alone():
    """Where the extension's length differs from the last stage's and the window does not change
    (--window_final_blocks 0 keeps the last entry), the warmup still compiles the new shape."""
    a = train_gpt.Hyperparameters(window_final_blocks=0, train_seq_len=65536)
    assert train_gpt.long_window_blocks_at(1559, a) == train_gpt.long_window_blocks_at(1560, a)
    assert train_gpt.train_seq_len_at(1559, a) != train_gpt.train_seq_len_at(1560, a)
    assert train_gpt.warmup_steps_at_transitions(a) == [0, 1, 2, 519, 520, 521, 1039, 1040, 1041, 1559, 1560, 1561]
    b = train_gpt.Hyperparameters(window_final_blocks=0)  # same window and same length: nothing new to compile
    assert train_gpt.train_seq_len_at(1559, b) == train_gpt.train_seq_len_at(1560, b) == 49152
    assert train_gpt.warmup_steps_at_transitions(b) == [0, 1, 2, 519, 520, 521, 1039, 1040, 1041]
