"""End to end: the script trains a tiny configuration for a few steps and writes a complete log
that records/compare.py can read; in-process training is deterministic and unaffected by warmup."""

import functools
import math
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import train_gpt
from harness import checkpoints as ckpt, config as cfg
from conftest import ROOT, TINY, tiny_argv

STEP_VAL = re.compile(r"^step:(\d+)/(\d+) val_loss:(\d+\.\d{4}) train_time:(\d+)ms step_avg:(\d+\.\d{2})ms$")
STEP_TRAIN = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms step_avg:(\d+\.\d{2})ms$")
PEAK = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB$")


def run_script(tmp_path, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *extra], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_script_writes_a_complete_log(tmp_path, make_shards):
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, run_name="e2e", warmup_steps=1)
    proc = run_script(tmp_path, *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]

    logs = list(log_dir.glob("*_e2e/*.txt"))
    assert len(logs) == 1
    log = logs[0]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_e2e", log.parent.name)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", log.stem)
    text = log.read_text()
    source = (ROOT / "train_gpt.py").read_text()
    assert text.startswith(source)
    lines = text[len(source):].splitlines()
    separators = [i for i, line in enumerate(lines) if line == "=" * 100]
    assert len(separators) == 2
    header = lines[separators[0] + 1:separators[1]]
    assert header[0].startswith("Running Python ")
    assert header[1].startswith("Running PyTorch ")
    assert header[2].startswith("Running Triton version ")
    assert re.fullmatch(r"\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4}", header[3])   # the date, as nvidia-smi's first line
    assert header[4].startswith("CPU: ")
    for key in ("preset=cpu", "run_name=e2e", "target_val_loss=6.0", "num_iterations=4", "world_size=1",
                "effective_device=cpu", "effective_attention=sdpa", "effective_ns_backend=torch",
                "effective_ce_backend=torch", "effective_mlp_backend=torch"):
        assert key in header, key
    for f in train_gpt.dataclasses.fields(train_gpt.Hyperparameters):
        assert any(line.startswith(f"{f.name}=") for line in header), f.name
    # the shards actually read, not the pattern that matched them
    assert f"train_files={train_glob.replace('*', '000001')}" in header
    assert f"val_files={val_glob.replace('*', '000000')}" in header
    assert any(line.startswith("optimizer_state_bytes_per_rank=") for line in header)

    body = lines[separators[1] + 1:]
    val_steps = [int(m.group(1)) for m in map(STEP_VAL.match, body) if m]
    train_steps = [int(m.group(1)) for m in map(STEP_TRAIN.match, body) if m]
    assert val_steps == [0, 2, 4]
    assert train_steps == [1, 2, 3, 4]
    # step_avg is train_time over the k steps done, the time a step took as the record's logs print
    # it (not over k + 1), to its 2 decimals and the rounding of train_time to whole ms
    timed = [(int(m.group(1)), int(m.group(m.re.groups - 1)), float(m.group(m.re.groups)))
             for m in (STEP_VAL.match(line) or STEP_TRAIN.match(line) for line in body) if m]
    assert len(timed) == 7 and timed[-1][1] > 0
    for k, train_time, step_avg in timed:
        assert abs(step_avg - train_time / max(k, 1)) <= 0.5 / max(k, 1) + 0.005 + 1e-9, (k, train_time, step_avg)
    assert PEAK.match(body[-1])
    assert "Resetting Model" in body
    # the console shows the same training lines
    assert "step:4/4 val_loss:" in proc.stdout
    assert proc.stdout.startswith(f"logging to {log}\n")

    import compare
    run = compare.parse_log(log)
    assert run.usable, run.problems
    assert run.total_steps == 4 and run.run_name == "e2e" and run.target_val_loss == 6.0
    assert run.final_val_loss == pytest.approx(float(STEP_VAL.match(
        [line for line in body if line.startswith("step:4/4 val")][0]).group(3)))

    # a second run never overwrites the first log
    again = run_script(tmp_path, *argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(list(log_dir.glob("*_e2e/*.txt"))) == 2
    assert log.read_text() == text


def in_process(make_shards_result, on_step=None, log=None, **overrides):
    train_glob, val_glob, _ = make_shards_result
    args = train_gpt.Hyperparameters(**dict(TINY, train_files=train_glob, val_files=val_glob, **overrides))
    cfg.check_config(args, 1, False)
    hw = train_gpt.Hardware.detect(args)
    log = log or (lambda *a, **k: None)  # noqa: E731
    return train_gpt.train(args, train_gpt.Ranks(), hw, log, on_step=on_step)


def test_warmup_at_the_window_changes_changes_nothing(make_shards):
    """--warmup_at_transitions: warmup trains and validates at steps 0-2 and around each window
    change (YaRN, the batch size and the embedding split move there too); the run is the same."""
    data = make_shards()
    config = dict(SCHEDULES["staged"][0], num_iterations=6)
    lines = []
    cold = in_process(data, warmup_steps=0, **config)
    warm = in_process(data, warmup_steps=1, warmup_at_transitions=True, **config, log=lambda line, **_: lines.append(line))
    assert "Sampling steps [0, 1, 2, 3, 4, 5] for warmup" in lines
    assert warm.train_losses == cold.train_losses and warm.val_losses == cold.val_losses


def test_training_lowers_the_loss_and_warmup_changes_nothing(make_shards):
    """8 steps: Adam steps every second one (--adam_every 2) and the tied embedding at the 2026
    table's lr, so 6 steps lowered the val loss by 0.38 only (on the 2025 defaults by over 0.5).
    The warmup of a number of steps (--warmup_at_transitions false; its default: the test above)."""
    data = make_shards()
    cold = in_process(data, warmup_steps=0, num_iterations=8, val_every=8)  # validations at steps 0 and 8
    warm = in_process(data, warmup_steps=3, warmup_at_transitions=False, num_iterations=8, val_every=8)
    # the initial model's: near ln V, the head N(0, 0.005) and the embedding its copy (exactly ln V with
    # --init 2025's zero head: tests/test_model.py)
    assert cold.val_losses[0][1] == pytest.approx(math.log(50304), abs=1e-2)
    assert cold.val_losses[-1][1] < cold.val_losses[0][1] - 0.5
    assert len(cold.train_losses) == 8 and cold.steps_done == 8
    # warmup runs on random tokens and is then undone: the run is bit-for-bit the same
    assert warm.train_losses == cold.train_losses
    assert warm.val_losses == cold.val_losses


# The first, the 2025-08-23 record's kind: the lr cools down over the whole run, the momentum ramps
# over three of its four steps, the long window grows by a block a step (128 tokens over the run),
# one next-token loss. The second, the 2026-01-19 record's kind: two lr plateaus and windows over 4
# scheduled steps, then 2 extension steps at the final lr and window, the momentum ramping up over 2
# steps and down over the last 2.
SCHEDULES = {
    "grown": (dict(num_iterations=4, val_every=2, micro_batches=1, cooldown_frac=1.0, muon_momentum_warmup_steps=3,
                   extension_steps=0, lr_plateaus="1", muon_momentum_cooldown_steps=0, window_schedule="",
                   window_growth_tokens=128, window_final_blocks=0, window_validate_final_blocks=0, mtp=False),
              None, [1, 1, 2, 3]),
    "staged": (dict(num_iterations=6, extension_steps=2, val_every=2, micro_batches=2, lr_plateaus="1,2",
                    cooldown_frac=0.5, muon_momentum_warmup_steps=2, muon_momentum_cooldown_steps=2,
                    window_schedule="1,2", window_final_blocks=3, window_validate_final_blocks=4, token_windows=True,
                    train_max_doc_len=96, train_seq_len_schedule="64,128", yarn=True, value_gates=True,
                    key_offset=True, paired_head_layers="0", mtp=True, value_embed_layers="0..0", bigram_vocab_size=300,
                    smear=True, skip_layers="0,2", backout_layer=1, resid_lambda_init=1.1, init="2026",
                    logit_cap_height=23.0, logit_cap_shift=5.0, adam_table="2026", adam_weight_decay=0.005,
                    normuon=True, cautious_wd=True, weight_decay=1.2, muon_update_scale="aspect", mlp_proj_lr_mult=2.0,
                    muon_decay="lr2", ns_method="polar_express", adam_every=2, embed_split_frac=0.5, bf16_weights=True),
               ([1, 1, 1, 1.05, 0.1, 0.1], [0.85, 0.9, 0.95, 0.95, 0.95, 0.9]), [1, 1, 2, 2, 3, 3]),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_step_trains_with_the_schedules_at_its_own_step(make_shards, monkeypatch, schedule):
    """train() gives step s (counted from 0) the learning-rate factor, Muon momentum and long
    attention window the schedules give at s, and validates at step s with the window at s: the
    schedule tests pin the functions, this pins the step the loop passes them (s + 1, the count
    once the step is done, would run the whole run one step ahead). on_step(s, ...) runs once s
    steps are done, so it sees the values step s - 1 trained with. Each schedule moves from step to
    step (SCHEDULES), so an off-by-one changes each."""
    forward = train_gpt.GPT.forward
    windows = []  # (in training?, long window in blocks) of each forward pass, in order

    lengths = []  # the tokens of each training forward pass

    shorts = []  # (in training?, short window in blocks)

    scales = []  # (in training?, attention scale): YaRN's, where it follows the windows

    mtp = []  # the multi-token loss's weights of each training forward pass

    def recording_forward(self, tokens, targets, long_window_blocks, short_window_blocks=None, mtp_weights=None):
        windows.append((self.training, int(long_window_blocks)))
        if self.training:
            mtp.append(None if mtp_weights is None else mtp_weights.tolist())
        scales.append((self.training, self.rotary.attn_scale))
        shorts.append((self.training, int(short_window_blocks)))
        if self.training:
            lengths.append(tokens.numel())
        return forward(self, tokens, targets, long_window_blocks, short_window_blocks, mtp_weights)
    monkeypatch.setattr(train_gpt.GPT, "forward", recording_forward)
    seen = []  # (steps done, lr factor, Muon momentum) after each optimizer step
    config, values, expected_blocks = SCHEDULES[schedule]
    result = in_process(make_shards(), **config, on_step=lambda step, model, optimizer: seen.append(
        (step, optimizer.lr_factor, optimizer.muon_momentum)))
    args = train_gpt.Hyperparameters(**dict(TINY, **config))
    trained = range(config["num_iterations"])
    lr = [train_gpt.lr_factor_at(s, args) for s in trained]
    momentum = [train_gpt.muon_momentum_at(s, args) for s in trained]
    blocks = [train_gpt.long_window_blocks_at(s, args) for s in trained]
    assert blocks == expected_blocks
    if values is None:
        assert len(set(lr)) == 4 and len(set(momentum)) == 4
    else:
        assert (lr, momentum) == (pytest.approx(values[0]), pytest.approx(values[1]))
    assert seen == [(s + 1, lr[s], momentum[s]) for s in trained]
    per_step = config["micro_batches"]  # forward passes a step
    assert [w for training, w in windows if training] == [b for b in blocks for _ in range(per_step)]
    assert lengths == [train_gpt.train_seq_len_at(s, args) for s in trained for _ in range(per_step)]
    assert lengths[::per_step] == ([64, 64, 128, 128, 128, 128] if "train_seq_len_schedule" in config else [128] * 4)
    per_validation = TINY["val_tokens"] // TINY["val_seq_len"]
    assert [step for step, _ in result.val_losses] == list(range(0, config["num_iterations"] + 1, 2))
    final = args.window_validate_final_blocks  # the last validation's long window, if set
    assert [w for training, w in windows if not training] == [
        final if final and step == config["num_iterations"] else train_gpt.long_window_blocks_at(step, args)
        for step, _ in result.val_losses for _ in range(per_validation)]
    # the short window is half the step's long one (the last step's at the last validation)
    assert [w for training, w in shorts if training] == [max(long // 2, 1) for long in blocks for _ in range(per_step)]
    assert mtp == [train_gpt.mtp_weights_at(s, args) if args.mtp else None for s in trained
                   for _ in range(per_step)]
    if args.mtp:  # 4 scheduled steps: three weights, then two, then one
        assert [len(w) for w in mtp[::per_step]] == [3, 3, 2, 1, 1, 1]
    if args.yarn:  # each forward pass has the scale of its step's window changes (the last validation's: the last step's)
        def scale_at(step):
            rotary = train_gpt.Rotary(TINY["head_dim"], 8, attn_scale=args.attn_scale, yarn=True)
            train_gpt.follow_windows(rotary, step, args)
            return rotary.attn_scale
        assert [x for training, x in scales if training] == [scale_at(s) for s in trained for _ in range(per_step)]
        assert [x for training, x in scales if not training] == [scale_at(step) for step, _ in result.val_losses
                                                                 for _ in range(per_validation)]
        # one per long window: 1, 2, 3 blocks (grown: and 4 at its last validation, step 4's)
        assert len({x for _, x in scales}) == len({train_gpt.long_window_blocks_at(s, args) for s in trained}
                                                  | {train_gpt.long_window_blocks_at(trained[-1] + 1, args)}) > 2
    assert [w for training, w in shorts if not training] == [
        max(train_gpt.long_window_blocks_at(step, args) // 2, 1) for step, _ in result.val_losses
        for _ in range(per_validation)]


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_compiled_training_gives_the_eager_run(make_shards, monkeypatch, scope):
    """train() with --compile true: warmup (which compiles the training and validation graphs),
    its reset, the optimizer's backward hooks and validation all run through the compiled model,
    and give the eager run's losses; every Muon update goes through the compiled orthogonalizer;
    Adam's update is compiled only where --compile_adam says so (the preset's, as the 2026 record's;
    here with blocks), eager otherwise (TINY's, the 2025 record's). The model and the orthogonalizer are captured with aot_eager (inductor's CPU
    code generation would take minutes; its numerics are checked on a GPU, bench/gpu_proof.py and
    bench/ns_compile.py); Adam's update is inductor's."""
    import torch._dynamo
    compile_for_training = train_gpt.GPT.compile_for_training
    compile_adam = train_gpt.ShardedMuonAdam.compile_adam
    compile_orthogonalizer = train_gpt.ShardedMuonAdam.compile_orthogonalizer
    scopes, orthogonalized = [], []

    def capture_only(model, scope, backend="inductor"):
        scopes.append(scope)
        compile_for_training(model, scope, backend="aot_eager")

    def adam_compiled(optimizer):
        compile_adam(optimizer)
        compiled = optimizer.adam_update

        def counted(*args):
            scopes.append("adam")  # the compiled update is the one train() calls
            return compiled(*args)
        optimizer.adam_update = counted
    def orthogonalizer_captured(optimizer):
        compile_orthogonalizer(optimizer, backend="aot_eager")
        compiled = optimizer.orthogonalize

        def counted(*args):
            orthogonalized.append(compiled)
            return compiled(*args)
        optimizer.orthogonalize = counted
    monkeypatch.setattr(train_gpt.GPT, "compile_for_training", capture_only)
    monkeypatch.setattr(train_gpt.ShardedMuonAdam, "compile_orthogonalizer", orthogonalizer_captured)
    monkeypatch.setattr(train_gpt.ShardedMuonAdam, "compile_adam", adam_compiled)
    data = make_shards()
    # fp32 embeddings: compiled and eager Adam then differ at fp32 rounding only (with bf16 ones,
    # by a bf16 unit in a quarter of the entries: tests/test_optim.py checks that rounding)
    config = dict(warmup_steps=1, num_iterations=4, val_every=2, bf16_embeds=False)
    eager = in_process(data, **config)
    torch._dynamo.reset()
    try:
        compiled = in_process(data, **config, compile=True, compile_scope=scope, compile_adam=scope == "blocks")
    finally:
        torch._dynamo.reset()
    assert scopes[0] == scope
    adam_calls = scopes[1:]
    if scope == "blocks":
        assert adam_calls == ["adam"] * len(adam_calls) and len(adam_calls) > 10
    else:
        assert adam_calls == []  # --compile_adam false: eager
    # (4 warmup steps, TINY's 0-3 around its window changes, + 4 steps) x 2 Muon groups (qkvo and MLP
    # matrices; the 2026 table's gates are Adam's), all through the compiled function: torch.compile's
    # wrapper, not the eager orthogonalize
    warmup = train_gpt.warmup_steps_at_transitions(train_gpt.Hyperparameters(**dict(TINY, **config)))
    assert warmup == [0, 1, 2, 3] and len(orthogonalized) == (4 + 4) * 2
    assert orthogonalized[0] is not train_gpt.orthogonalize
    assert compiled.train_losses == pytest.approx(eager.train_losses, rel=1e-5)
    assert [v for _, v in compiled.val_losses] == pytest.approx([v for _, v in eager.val_losses], rel=1e-5)


@pytest.mark.parametrize("val_every", [0, 1])
def test_running_out_of_data_stops_cleanly(tmp_path, make_shards, val_every):
    """The run validates where it stopped, once: with a validation every step the data runs out at
    a step just validated, which is not validated again (on the speedrun, 10M tokens and a second
    log line)."""
    train_glob, val_glob, _ = make_shards(train_sizes=(1_000,))
    log_dir = tmp_path / "records"
    proc = run_script(tmp_path, *tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir,
                                           num_iterations=50, val_every=val_every))
    assert proc.returncode == 3, proc.stderr[-2000:]
    text = next(log_dir.glob("*/*.txt")).read_text()
    assert "stopping early at step" in text and "training data ran out" in text
    assert "warning: the 1 training shard(s) hold 1,000 tokens but 50 steps need at least 6,400" in text
    validated = [int(STEP_VAL.match(line).group(1)) for line in text.splitlines() if STEP_VAL.match(line)]
    stopped = int(re.search(r"^stopping early at step (\d+)/50", text, re.M).group(1))
    assert validated == (list(range(stopped + 1)) if val_every else [stopped])
    assert PEAK.search(text.splitlines()[-1])


def test_the_clock_counts_the_step_that_found_the_data_gone(make_shards, monkeypatch):
    """With a validation every step the data runs out right after one: the clock restarted after
    that validation and runs until the loop ends, so the time of the step that found no chunk
    (here 60 ms more) is in the run's training time, not lost."""
    next_batch, slept = train_gpt.PackedBatches.next_batch, []

    def slow_when_empty(self, device, seq_len):
        try:
            return next_batch(self, device, seq_len)
        except train_gpt.DataExhausted:
            time.sleep(0.06)
            slept.append(seq_len)
            raise
    monkeypatch.setattr(train_gpt.PackedBatches, "next_batch", slow_when_empty)
    train_glob, val_glob, _ = make_shards(train_sizes=(1_000,))
    args = train_gpt.Hyperparameters(**dict(TINY, train_files=train_glob, val_files=val_glob, num_iterations=50,
                                            val_every=1))
    cfg.check_config(args, 1, False)
    lines = []
    result = train_gpt.train(args, train_gpt.Ranks(), train_gpt.Hardware.detect(args),
                             lambda text, **kwargs: lines.append(text))
    assert result.stopped_early and result.steps_done < 50 and slept == [128]
    last_val = [STEP_VAL.match(line) for line in lines if STEP_VAL.match(line)][-1]
    assert int(last_val.group(1)) == result.steps_done
    assert result.train_time_ms >= int(last_val.group(4)) + 50


@pytest.mark.parametrize("loader, sizes, room", [
    ("packed", (100, 120), "128 (1 x (128 + 1) - 1)"),  # the default's: a step's chunks of 129 tokens
    ("BOS windows", (200, 250), "257 (2 x 1 x 128 + 1)")])  # the 2025 record's margin
def test_shards_too_small_for_one_step_are_refused_before_anything_starts(tmp_path, make_shards, loader, sizes, room):
    """No shard holds one step (the loader's room rule): nothing could train, so the run stops in
    one line before compiling, instead of warning and failing after."""
    train_glob, val_glob, _ = make_shards(train_sizes=sizes)
    log_dir = tmp_path / "records"
    options = dict(train_max_doc_len=0) if loader == "BOS windows" else {}  # (TINY's schedule is already "")
    proc = run_script(tmp_path, *tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, **options))
    assert proc.returncode == 1
    largest = train_glob.replace("*", "000002")
    assert proc.stderr.strip() == (f"train_gpt.py: error: {largest}: the largest training shard holds {sizes[1]} "
                                   "tokens, but a step of micro_batches x train_seq_len = 1 x 128 needs a shard of "
                                   f"more than {room}")
    assert not log_dir.exists()


def without_bos(path):
    """The shard at path rewritten with its BOS tokens replaced: text with no document starts."""
    from shards import write_shard
    tokens = train_gpt.read_shard_tokens(path).astype("int64")
    tokens[tokens == train_gpt.BOS_TOKEN] = 13
    write_shard(path, tokens)


def test_training_shards_without_a_bos_token_are_refused_before_anything_starts(tmp_path, make_shards):
    """Every training window starts at a BOS: shards that hold none pass the header and token
    checks but could train nothing; the run used to compile, then stop with "data ran out"."""
    train_glob, val_glob, _ = make_shards(train_sizes=(40_000, 40_000))
    shards = sorted(Path(train_glob).parent.glob(Path(train_glob).name))
    for shard in shards:
        without_bos(shard)
    log_dir = tmp_path / "records"
    proc = run_script(tmp_path, *tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir))
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"train_gpt.py: error: {shards[0]}: no training shard holds a BOS token (50256), "
                                   "and every training window starts at one: nothing would train (data/fineweb.py "
                                   "starts every document with it)")
    assert not log_dir.exists()


def test_a_training_shard_without_a_bos_token_is_named_and_passed_over(tmp_path, make_shards):
    train_glob, val_glob, (trains, _) = make_shards(train_sizes=(40_000, 40_000))
    first = sorted(Path(train_glob).parent.glob(Path(train_glob).name))[0]
    without_bos(first)
    log_dir = tmp_path / "records"
    proc = run_script(tmp_path, *tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, num_iterations=5))
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = next(log_dir.glob("*/*.txt")).read_text()
    assert f"warning: 1 training shard(s) hold no BOS token (50256) and are passed over, the first {first}" in text
    assert str(first) not in next(line for line in text.splitlines() if line.startswith("train_files="))
    assert not re.search(r"^warning: the ", text, re.M)  # no shortfall: the other shard holds the run's 5 steps
    # 5 steps, Adam on every 2nd (1 and 3): step 4's Adam gradients are summed and never applied
    assert "warning: --num_iterations=5 is not a multiple of adam_every=2: the last 1 step(s)' Adam gradients " \
           "(embeddings, head, scalars) are never applied" in text


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or shutil.which("taskset") is None,
                    reason="needs Linux CPU affinity and taskset")
@pytest.mark.slow
def test_the_default_thread_count_is_the_cpus_the_process_may_use(tmp_path, make_shards):
    """Under taskset (or Slurm, or a container's cpuset) the default is the CPUs allowed, not the
    host's count, and a CPU log says which count ordered its sums."""
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, num_iterations=2, val_every=0)
    proc = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable,
                           str(ROOT / "train_gpt.py"), *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = next(log_dir.glob("*/*.txt")).read_text().split("=" * 100)[1]
    assert "\neffective_threads=1\n" in header


def test_missing_data_fails_before_any_log_is_written(tmp_path):
    log_dir = tmp_path / "records"
    proc = run_script(tmp_path, *tiny_argv(train_files=str(tmp_path / "none_*.bin"), log_dir=log_dir))
    assert proc.returncode == 1
    # a pattern the user gave: no advice to download FineWeb
    assert proc.stderr.strip().splitlines()[-1] == (f"train_gpt.py: error: --train_files='{tmp_path}/none_*.bin': "
                                                    "no training shards match")
    assert "logging to" not in proc.stdout  # it would name a file that never comes to exist
    assert not log_dir.exists() or not any(log_dir.rglob("*.txt"))


def test_cpu_preset_falls_back_to_the_sample_only_without_fineweb(tmp_path, make_shards, monkeypatch):
    args = cfg.parse_config(["--preset", "cpu"], {}, 1, False)
    monkeypatch.setattr(train_gpt, "REPO_DIR", str(tmp_path))  # a checkout without data/fineweb10B
    (tmp_path / "data" / "sample").mkdir(parents=True)
    train_glob, val_glob, _ = make_shards(prefix="sample")
    for f in Path(train_glob).parent.glob("*.bin"):
        f.rename(tmp_path / "data" / "sample" / f.name)
    train, val, note = train_gpt.resolve_data_files(args)
    assert train == [str(tmp_path / "data" / "sample" / "sample_train_000001.bin")] and "embedded sample" in note
    # with FineWeb present, the cpu preset uses it
    (tmp_path / "data" / "fineweb10B").mkdir()
    for name in ("fineweb_train_000001.bin", "fineweb_val_000000.bin"):
        (tmp_path / "data" / "fineweb10B" / name).write_bytes(
            (tmp_path / "data" / "sample" / "sample_val_000000.bin").read_bytes())
    train, val, note = train_gpt.resolve_data_files(args)
    assert train == [str(tmp_path / "data" / "fineweb10B" / "fineweb_train_000001.bin")]
    assert "embedded sample" not in note
    # the speedrun preset never falls back
    speedrun = cfg.parse_config(["--preset", "speedrun"], {}, 1, False)
    for f in (tmp_path / "data" / "fineweb10B").iterdir():
        f.unlink()
    with pytest.raises(train_gpt.DataError, match=r"no training shards match \(FineWeb, the default of --train_files: "
                                                  r"run `python data/cached_fineweb10B.py`, or set --train_files\)$"):
        train_gpt.resolve_data_files(speedrun)
    # only the training files given: the error names the validation files' default
    train_only = cfg.parse_config(["--preset", "speedrun", "--train_files",
                                         str(tmp_path / "data" / "sample" / "sample_train_*.bin")], {}, 1, False)
    with pytest.raises(train_gpt.DataError, match=r"fineweb_val_\*.bin: no validation shards match \(FineWeb, the "
                                                  r"default of --val_files: .*, or set --val_files\)$"):
        train_gpt.resolve_data_files(train_only)


def test_a_run_on_the_sample_resumes_on_the_sample_once_fineweb_is_downloaded(tmp_path, make_shards, monkeypatch):
    """The cpu preset trains on the sample where FineWeb is absent; its checkpoint names the
    sample, so a resume after FineWeb's download goes on in the same token stream (it looked for
    its shard among FineWeb's and ended in an error about --train_files, which the user never set)."""
    monkeypatch.setattr(train_gpt, "REPO_DIR", str(tmp_path))  # a checkout without data/fineweb10B
    (tmp_path / "data" / "sample").mkdir(parents=True)
    train_glob, _, _ = make_shards(prefix="sample")
    for f in Path(train_glob).parent.glob("*.bin"):
        f.rename(tmp_path / "data" / "sample" / f.name)
    kept = tmp_path / "step2.pt"
    monkeypatch.setattr(ckpt, "save_checkpoint", functools.partial(keep_first_checkpoint, kept))
    argv = tiny_argv(num_iterations=4, val_every=2, save_checkpoint=True, checkpoint_every=2)
    assert train_gpt.main(argv + [f"--log_dir={tmp_path / 'full'}"], {}) == 0
    saved = torch.load(kept, weights_only=True)["config"]   # the sample, as a path in the repository (it may move)
    assert (saved["train_files"], saved["val_files"]) == train_gpt.SAMPLE_FILES
    (tmp_path / "data" / "fineweb10B").mkdir()
    for name in ("fineweb_train_000001.bin", "fineweb_val_000000.bin"):   # FineWeb, downloaded since
        shutil.copyfile(tmp_path / "data" / "sample" / "sample_train_000001.bin", tmp_path / "data" / "fineweb10B" / name)
    assert train_gpt.main([f"--resume={kept}", f"--log_dir={tmp_path / 'resumed'}"], {}) == 0
    logs = {name: next((tmp_path / name).glob("*/*.txt")).read_text() for name in ("full", "resumed")}
    assert "fineweb" not in logs["resumed"].split("=" * 100)[-1]
    val = {name: re.findall(r"^step:4/4 val_loss:(\S+)", text, re.M) for name, text in logs.items()}
    assert val["resumed"] == val["full"] and len(val["full"]) == 1


def keep_first_checkpoint(kept, path, step, *args, **kwargs):
    """save_checkpoint, keeping a copy of the first one written (the run's later ones replace it)."""
    written = REAL_SAVE_CHECKPOINT(path, step, *args, **kwargs)
    if not kept.exists():
        shutil.copyfile(path, kept)
    return written


REAL_SAVE_CHECKPOINT = ckpt.save_checkpoint


def test_training_on_a_validation_shard_is_refused(make_shards):
    """A glob that takes in the validation shard too (`data/sample/*.bin`) would make the
    validation loss score text the model trained on."""
    train_glob, val_glob, _ = make_shards()
    everything = train_glob.replace("_train_*", "_*")
    argv = ["--preset", "cpu", "--train_files", everything, "--val_files", val_glob]
    args = cfg.parse_config(argv, {}, 1, False)
    with pytest.raises(train_gpt.DataError) as error:
        train_gpt.resolve_data_files(args)
    assert str(error.value) == (f"{val_glob.replace('*', '000000')}: matched by both --train_files and --val_files; "
                                "validation must not read training shards")


def test_one_data_option_given_is_checked_first_and_the_other_default_explained(tmp_path, monkeypatch):
    """Without FineWeb, --val_files alone: a typo in it is named first; a right one leaves the
    training default, which the sample no longer stands in for, and the error says why."""
    monkeypatch.setattr(train_gpt, "REPO_DIR", str(tmp_path))  # a checkout without data/fineweb10B
    (tmp_path / "data" / "sample").mkdir(parents=True)
    typo = cfg.parse_config(["--preset", "cpu", "--val_files", str(tmp_path / "vall_*.bin")], {}, 1, False)
    with pytest.raises(train_gpt.DataError, match=r"^--val_files='.*vall_\*\.bin': no validation shards match$"):
        train_gpt.resolve_data_files(typo)
    (tmp_path / "v_000000.bin").write_bytes((ROOT / "data" / "sample" / "sample_val_000000.bin").read_bytes())
    right = cfg.parse_config(["--preset", "cpu", "--val_files", str(tmp_path / "v_*.bin")], {}, 1, False)
    with pytest.raises(train_gpt.DataError, match=r"fineweb_train_\*\.bin: no training shards match \(FineWeb, the "
                       r"default of --train_files: .*, or set --train_files; the embedded sample stands in only "
                       r"where neither option is set\)$"):
        train_gpt.resolve_data_files(right)


@pytest.mark.slow
def test_a_copy_of_train_gpt_outside_the_repository_says_where_its_default_data_is(tmp_path):
    """A fork copied to a folder of its own (without harness/: plain --field=value options) finds no
    data/ beside it: the line says so."""
    fork = tmp_path / "fork" / "train_gpt.py"
    fork.parent.mkdir()
    shutil.copy(ROOT / "train_gpt.py", fork)
    done = subprocess.run([sys.executable, str(fork), "--preset=cpu", "--num_iterations=1",
                           f"--log_dir={tmp_path / 'logs'}"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == train_gpt.EXIT_ERROR, done.stderr
    assert done.stderr == (f"train_gpt.py: error: {fork.parent}/data/sample/sample_train_*.bin: no training shards "
                           "match (the default data lies in data/ beside train_gpt.py: keep a fork beside data/, or "
                           "set --train_files)\n")
    assert not (tmp_path / "logs").exists()
    # what needs harness/ says so before anything starts
    done = subprocess.run([sys.executable, str(fork), "--sample=x.pt"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert (done.returncode, done.stderr) == (2, "train_gpt.py: error: --sample: needs harness/ beside train_gpt.py\n")
    for bad, line in (("--num_iterations=abc", "--num_iterations=abc: expected a value of type int"),
                      ("--smear=maybe", "--smear=maybe: expected true or false"),
                      ("--preset=big", "--preset=big: expected one of speedrun, cpu")):
        done = subprocess.run([sys.executable, str(fork), bad], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert (done.returncode, done.stderr) == (2, f"train_gpt.py: error: {line}\n")


@pytest.mark.slow
def test_a_copy_of_train_gpt_beside_data_trains_the_cpu_preset_on_the_sample(tmp_path):
    """Without --preset, on a CPU: the cpu preset by name, so the embedded sample stands in for FineWeb."""
    fork = tmp_path / "fork" / "train_gpt.py"
    fork.parent.mkdir()
    shutil.copy(ROOT / "train_gpt.py", fork)
    (fork.parent / "data").symlink_to(ROOT / "data")
    done = subprocess.run([sys.executable, str(fork), "--num_iterations=5", "--extension_steps=1", "--val_tokens=2048",
                           f"--log_dir={tmp_path / 'logs'}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [log] = (tmp_path / "logs").glob("*/*.txt")
    text = log.read_text()
    assert "\npreset=cpu\n" in text and "data/sample/sample_train_" in text
    assert "step:5/5 val_loss:" in text


def test_bad_token_in_a_late_shard_stops_before_training(make_shards):
    train_glob, val_glob, (trains, _) = make_shards(train_sizes=(5_000, 5_000, 5_000))
    last = sorted(Path(train_glob).parent.glob("syn_train_*.bin"))[-1]
    raw = bytearray(last.read_bytes())
    raw[1024 + 2 * 4321:1024 + 2 * 4322] = (60000).to_bytes(2, "little")
    last.write_bytes(bytes(raw))
    args = train_gpt.Hyperparameters(**dict(TINY, train_files=train_glob, val_files=val_glob))
    steps = []
    with pytest.raises(train_gpt.DataError) as err:
        train_gpt.train(args, train_gpt.Ranks(), train_gpt.Hardware.detect(args), lambda *a, **k: None,
                        on_step=lambda *a: steps.append(a))
    assert str(err.value) == f"{last}: token 60000 at index 4321 is >= vocab size 50257"
    assert steps == []


def test_garbage_is_collected_once_after_warmup_before_the_first_timed_step(make_shards, monkeypatch):
    """As the record (gc.collect() after its warmup, before its clock): once, after the model is
    reset and before the clock's first reading after it."""
    lines = []
    monkeypatch.setattr(train_gpt, "gc", types.SimpleNamespace(collect=lambda: lines.append("<gc>")))
    perf_counter = time.perf_counter
    def clock():
        lines.append("<clock>")
        return perf_counter()
    monkeypatch.setattr(train_gpt.time, "perf_counter", clock)
    in_process(make_shards(), num_iterations=2, warmup_steps=1, log=lambda line, **_: lines.append(line))
    assert lines.count("<gc>") == 1
    reset = lines.index("Resetting Model")
    assert lines[reset:].index("<gc>") < lines[reset:].index("<clock>")


def test_clock_stops_during_validation(make_shards, monkeypatch):
    """Validation time is not training time: slow every validation window down by 0.3 s and the
    reported train_time does not grow by it."""
    data = make_shards()
    original = train_gpt.val_batches

    def slow_val_batches(*args, **kwargs):
        for batch in original(*args, **kwargs):
            time.sleep(0.3)
            yield batch
    monkeypatch.setattr(train_gpt, "val_batches", slow_val_batches)
    started = time.perf_counter()
    result = in_process(data, num_iterations=3, val_every=1)
    wall_ms = 1000 * (time.perf_counter() - started)
    windows = 4 * (TINY["val_tokens"] // TINY["val_seq_len"])  # 4 validations (steps 0..3)
    assert 0 < result.train_time_ms < wall_ms - windows * 300


def test_values_the_environment_sets_are_named_on_the_console(tmp_path, make_shards, capsys):
    """A variable left in the shell (an old `export SEED=7`) changes the run: the console says so."""
    train_glob, val_glob, _ = make_shards()
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path, num_iterations=2)
    environ = {"SEED": "7", "NUM_ITERATIONS": "3", "HOME": "/root"}  # the command line wins over NUM_ITERATIONS
    assert train_gpt.main(argv, environ) == 0
    out = capsys.readouterr().out
    assert out.startswith("set by the environment: SEED=7\nlogging to ") and "step:2/2 val_loss:" in out
    assert train_gpt.main(argv, {}) == 0
    assert "set by the environment" not in capsys.readouterr().out


def test_the_console_shows_an_eta_and_ends_by_saying_how_the_run_went(tmp_path, make_shards, capsys):
    """Step lines on the console carry an eta (the log keeps the public format, which compare.py
    parses); the last console line gives the final val loss against the target, the train time and
    the log's absolute path."""
    train_glob, val_glob, _ = make_shards()
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path / "logs", num_iterations=3,
                     val_every=0, target_val_loss=20.0)
    assert train_gpt.main(argv, {}) == 0
    out = capsys.readouterr().out.splitlines()
    log = next((tmp_path / "logs").glob("*/*.txt"))
    steps = [line for line in out if line.startswith("step:") and "val_loss" not in line]
    assert [re.fullmatch(r"step:(\d)/3 train_time:\d+ms step_avg:\d+\.\d\dms eta:\d+m\d\ds", line)[1]
            for line in steps] == ["1", "2", "3"]
    assert steps[-1].endswith(" eta:0m00s")
    logged = [line for line in log.read_text().splitlines() if line.startswith("step:")]
    assert [line.split(" eta:")[0] for line in steps] == [line for line in logged if "val_loss" not in line]
    final, train_ms = re.search(r"^step:3/3 val_loss:(\d+\.\d+) train_time:(\d+)ms", log.read_text(), re.M).groups()
    assert out[-1] == (f"val_loss {float(final):.4f} reached the target 20.0; train time "
                       f"{int(train_ms) / 1000:.1f} s; log {log.resolve()}")
    assert os.path.isabs(out[-1].split("; log ")[1])
    argv[-1] = "--target_val_loss=1.0"
    assert train_gpt.main(argv, {}) == 0
    assert " missed the target 1.0; train time " in capsys.readouterr().out.splitlines()[-1]


def test_the_default_log_folder_is_the_repositorys_records_wherever_the_run_starts(tmp_path, monkeypatch):
    """`cd /tmp && run.sh` read the repository's data but wrote to /tmp/records: the default
    records/ is the repository's; a folder the user names is relative to where they are."""
    monkeypatch.chdir(tmp_path)
    today = time.strftime("%Y-%m-%d")
    default = train_gpt.Hyperparameters(run_name="x")
    assert train_gpt.run_folder(default) == os.path.join(str(ROOT), "records", f"{today}_x")
    named = train_gpt.Hyperparameters(run_name="x", log_dir="mine")
    assert train_gpt.run_folder(named) == os.path.join("mine", f"{today}_x")
