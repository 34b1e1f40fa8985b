"""Checkpoints and sampling: a run of 2N steps and a run of N steps resumed for N more train the
same model (bit for bit at world size 1, within the multi-process tolerance when the world size
changes), a crash while writing never leaves a .pt, a checkpoint of another configuration is
refused in one line, and sampling is deterministic for a seed and runs on an untrained model."""

import errno
import fcntl
import io
import os
import pathlib
import re
import shutil
import signal
import subprocess
import struct
import sys
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import compare
import train_gpt
from harness import checkpoints as ckpt, config as cfg, launch as launcher, sample as sampling
from conftest import ROOT, before_summary, synthetic_documents, tiny_argv
from shards import write_shard
from test_distributed import EQUIVALENCE, LOSS_RTOL, MOVEMENT_FRACTION, free_port, movement_bounds, rank_env

pytestmark = pytest.mark.slow  # launches fresh processes: the full suite only (README, Test)

# N: the steps before the checkpoint we resume from; every run has 2N. Even: periodic checkpoints
# come after Adam's steps (--adam_every 2: steps 1, 3, 5, 7). The embedding is the head's weights
# until step 5 (2/3 of the 7 scheduled steps, on an Adam step): a run resumed at N splits it.
N = 4
# adam_eps and bf16_embeds as in tests/test_distributed.py (the record's 1e-10 would let Adam turn
# the rounding of nearly cancelled sums into whole steps; a bf16 embedding row rounded the other way
# at another world size moved 14 entries of the tied head by up to 0.4 of an Adam step, 12% of
# their distance, against 7e-5 in fp32), so runs at different world sizes can be compared with its
# tolerance; vocab_size 50305 rows do not divide by 2, so the re-split of Adam rows is padded.
RESUME = dict(num_iterations=2 * N, val_every=N, micro_batches=2, adam_eps=EQUIVALENCE["adam_eps"],
              bf16_embeds=EQUIVALENCE["bf16_embeds"], vocab_size=50305, save_checkpoint=True, checkpoint_every=N)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt_data")
    rng = np.random.default_rng(3)
    write_shard(folder / "c_val_000000.bin", synthetic_documents(rng, 2_000))
    write_shard(folder / "c_train_000001.bin", synthetic_documents(rng, 1_000))  # the run moves on to shard 2
    write_shard(folder / "c_train_000002.bin", synthetic_documents(rng, 20_000))
    return dict(train_files=str(folder / "c_train_*.bin"), val_files=str(folder / "c_val_*.bin"))


def run(argv, ranks=None, world_size=1, keep_at=None, before=None):
    """train() as main() runs it, with a RunLog; returns (result, final checkpoint, log text).
    keep_at=(step, path) copies the checkpoint written at that step to path; before(folder) is
    called with the log's folder before training starts."""
    ranks = ranks or train_gpt.Ranks()
    args = cfg.parse_config(argv, {}, world_size, False)
    log = train_gpt.RunLog(args, ranks, echo=False)
    if before is not None:
        pathlib.Path(log.path).parent.mkdir(parents=True, exist_ok=True)
        before(pathlib.Path(log.path).parent)

    def on_step(step, model, optimizer):
        if keep_at and step == keep_at[0] and ranks.is_master:
            shutil.copyfile(ckpt.checkpoint_path_of(log), keep_at[1])
    result = train_gpt.train(args, ranks, train_gpt.Hardware.detect(args), log, on_step=on_step)
    if not ranks.is_master:
        return result, None, None
    final = ckpt.checkpoint_path_of(log) if args.save_checkpoint else None
    return result, final, open(log.path).read()


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    """A 2N-step run at world size 1 that keeps its step-N checkpoint, and that checkpoint resumed."""
    tmp = tmp_path_factory.mktemp("single")
    argv = tiny_argv(**data, **RESUME, log_dir=tmp / "full")
    full, final, text = run(argv, keep_at=(N, tmp / f"step{N}.pt"))
    leftover = killed_write_leftover(tmp, f"step{N}.pt")  # as if the run had been killed writing there
    # --resume alone continues the run as it was configured (the checkpoint's data, windows, schedule,
    # checkpointing, ...); only this machine's fields come from the preset (warmup_steps: TINY's)
    resumed, resumed_final, resumed_text = run([f"--resume={tmp / f'step{N}.pt'}", f"--log_dir={tmp / 'resumed'}",
                                                "--run_name=again", "--warmup_steps=0"])
    return dict(argv=argv, full=full, final=final, text=text, step_n=tmp / f"step{N}.pt", resumed=resumed,
                resumed_final=resumed_final, resumed_text=resumed_text, leftover=leftover)


def killed_write_leftover(folder, name, machine=None, pid=None):
    """The hidden temporary file a checkpoint write killed outright leaves: by default this
    machine's, from a process that has ended."""
    if pid is None:
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        pid = int(ended.stdout)
    path = folder / f".{name}.{machine or ckpt.machine_tag()}.{pid}.tmp"
    path.write_bytes(b"PK" * 2 ** 19)
    return path


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_resume_continues_bit_for_bit_at_world_size_1(single):
    full, resumed = single["full"], single["resumed"]
    # it trains (the validations: the train loss's multi-token weights change by step; 10.82 -> 10.09)
    assert len(full.train_losses) == 2 * N and full.val_losses[-1][1] < full.val_losses[0][1] - 0.2
    assert resumed.train_losses == full.train_losses[N:]
    assert resumed.val_losses == [v for v in full.val_losses if v[0] >= N]
    a, b = load(single["final"]), load(single["resumed_final"])
    assert a["step"] == b["step"] == 2 * N
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name
    # the resumed run split the embedding from the head (step 5) as the whole run did: a copy trained apart since
    assert not torch.equal(b["model"]["embed.weight"], b["model"]["lm_head_w"].to(b["model"]["embed.weight"].dtype))
    assert a["optimizer"]["adam_steps"] == b["optimizer"]["adam_steps"] == N  # one per two steps
    for x, y in zip(a["optimizer"]["tensors"], b["optimizer"]["tensors"], strict=True):
        assert torch.equal(x, y)
    assert a["loader"] == b["loader"] and a["loader"]["shard"] == 1  # the loader moved on to the second shard
    # the validations before the resume are kept in the next checkpoint (--sample reports the last)
    assert [step for step, _ in a["val_losses"]] == [0, N, 2 * N] and b["val_losses"] == a["val_losses"]
    # the clock goes on from where the first run stopped
    assert resumed.train_time_ms > load(single["step_n"])["train_time_ms"] > 0


@pytest.fixture(scope="module")
def packed(data, tmp_path_factory):
    """A 2N-step run of the 2026-01-19 record's batch schedule over its loader (PackedBatches), 4
    micro-batches a step, in its precision (bf16 embeddings and weights), keeping its step-N
    checkpoint; that checkpoint resumed at world size 1."""
    tmp = tmp_path_factory.mktemp("packed")
    argv = tiny_argv(**data, **dict(RESUME, micro_batches=4, bf16_embeds=True), train_max_doc_len=96,
                     train_seq_len_schedule="64,64,128", skip_layers="0,2", bf16_weights=True,
                     log_dir=tmp / "full")  # 128 from step 5; YaRN at the window changes (steps 3, 5)
    full, final, _ = run(argv, keep_at=(N, tmp / "early.pt"))
    resumed, resumed_final, _ = run([f"--resume={tmp / 'early.pt'}", f"--log_dir={tmp / 'resumed'}",
                                     "--warmup_steps=0"])
    return dict(argv=argv, full=full, final=final, early=tmp / "early.pt", resumed=resumed, resumed_final=resumed_final)


def test_a_run_of_packed_documents_and_a_batch_schedule_resumes_bit_for_bit(packed):
    """PackedBatches' position at a checkpoint (shard, document, chunks taken) resumes the token
    stream, through the schedule's change of length after it."""
    assert packed["resumed"].train_losses == packed["full"].train_losses[N:]
    a, b = load(packed["final"]), load(packed["resumed_final"])
    assert a["loader"] == b["loader"] and set(a["loader"]) >= {"doc", "chunks_taken"}
    assert load(packed["early"])["loader"]["chunks_taken"] == 4 * N  # before the length changes
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name


def test_a_resumed_runs_clock_goes_on_from_the_checkpoints_train_time(single):
    """A resumed run's train_time is the whole run's, as if it had never stopped: its log's lines
    from the checkpoint's step on, and its result, start from the checkpoint's train_time_ms, not
    from 0 (which would make the resumed run look N steps faster; 3 steps of this run are far more
    than the 0.5 ms of a line's rounding)."""
    saved_ms = load(single["step_n"])["train_time_ms"]
    body = single["resumed_text"].split("=" * 100)[-1]
    times = {(int(step), bool(val)): int(ms) for step, val, ms in
             re.findall(r"^step:(\d+)/\d+ (val_loss:\S+ )?train_time:(\d+)ms", body, re.M)}
    first_val, first_step, last_val = times[N, True], times[N + 1, False], times[2 * N, True]
    assert saved_ms > 1 and saved_ms - 0.5 <= first_val <= first_step <= last_val
    assert single["resumed"].train_time_ms == pytest.approx(last_val, abs=0.5)


def test_logs_name_the_checkpoint(single):
    path = single["final"]
    assert path.endswith(".pt") and os.path.exists(path) and os.path.exists(path[:-3] + ".txt")
    assert f"checkpoint: step {N} saved to {path}" in single["text"]
    assert f"checkpoint: step {2 * N} saved to {path}" in single["text"]
    last = single["text"].splitlines()[-2:]
    assert last[0].startswith(f"checkpoint: step {2 * N}") and last[1].startswith("peak memory")
    assert f"resuming from {single['step_n']} at step {N}" in single["resumed_text"]
    saved = load(single["step_n"])
    assert saved["config"]["num_iterations"] == 2 * N and saved["world_size"] == 1
    assert saved["code_sha256"] == ckpt.code_fingerprint()
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]


def test_a_run_that_stops_names_the_checkpoint_to_resume(single, tmp_path):
    """A run that fails after a periodic checkpoint (a crash here; an interruption alike) says which
    step it can go on from, and how, just before the line that says why it ended (which compare.py
    reads); a resumed run that fails before its own first one names the checkpoint it resumed. A
    run that diverged names none: its continuation would diverge again."""
    def crash_at(step_wanted):
        def on_step(step, model, optimizer):
            if step == step_wanted:
                raise RuntimeError("a fork's bug")
        return on_step

    def diverge_at(step_wanted):
        def on_step(step, model, optimizer):
            if step == step_wanted:
                with torch.no_grad():
                    model.lm_head_w.fill_(float("nan"))
        return on_step

    resumed = [f"--resume={single['step_n']}", "--warmup_steps=0"]
    for name, argv, on_step in (("crash", single["argv"], crash_at(N + 1)), ("resumed", resumed, crash_at(N + 1)),
                                ("diverged", single["argv"], diverge_at(N + 1))):
        args = cfg.parse_config(argv + [f"--log_dir={tmp_path / name}"], {}, 1, False)
        log = train_gpt.RunLog(args, train_gpt.Ranks(), echo=False)
        result = train_gpt.train(args, train_gpt.Ranks(), train_gpt.Hardware.detect(args), log, on_step=on_step)
        text = open(log.path).read()
        last = text.splitlines()[-3:]
        assert last[1] == result.failure and last[2].startswith("peak memory")
        assert compare.parse_log_text(text).problems == [result.failure]  # compare.py's exclusion names it
        if name == "diverged":
            assert result.failure.startswith(f"diverged at step {N + 2}/{2 * N}") and "last checkpoint" not in last[0]
            continue
        assert result.failure == f"failed at step {N + 1}/{2 * N}: RuntimeError: a fork's bug"
        if name == "resumed":  # checkpoint_every is N: the run's own first one would have come at 2N
            assert last[0] == (f"last checkpoint: step {N}, {single['step_n']}, which this run resumed "
                               f"(--resume {single['step_n']} goes on from there)")
        else:
            path = ckpt.checkpoint_path_of(log)
            assert last[0] == f"last checkpoint: step {N}, {path} (--resume {path} goes on from there)"


def test_a_resumed_run_stopped_in_warmup_stands_at_the_checkpoints_step_and_names_it(single, tmp_path):
    """Ctrl-C while a resumed run warms up (minutes of compiling on a GPU): the run stands at the
    checkpoint's step, not 0, and the line before names the checkpoint to go on from, as after a crash."""
    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train_gpt.py"), f"--resume={single['step_n']}",
                             "--warmup_steps=100000", f"--log_dir={logs}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            start_new_session=True)
    try:
        assert any(line.startswith("Warming up kernels") for line in proc.stdout), proc.stderr.read()[-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT and err == "", err
    ending = [f"last checkpoint: step {N}, {single['step_n']}, which this run resumed (--resume {single['step_n']} "
              "goes on from there)", f"interrupted at step {N}/{2 * N} (SIGINT)"]
    assert before_summary(out)[-3:-1] == ending and before_summary(out)[-1].startswith("peak memory")
    assert next(logs.glob("*/*.txt")).read_text().splitlines()[-3:] == before_summary(out)[-3:]


# --- world size 2 (gloo), and moving between world sizes -----------------------------------------

def world2_worker(rank, port, jobs, out_dir):
    os.environ.update(rank_env(rank, 2, port))
    torch.set_num_threads(1)
    ranks = train_gpt.Ranks.from_env(os.environ)
    args = cfg.parse_config(jobs[0][0], {}, 2, False)
    train_gpt.init_process_group(args, ranks, train_gpt.Hardware.detect(args))
    for i, (argv, keep_at) in enumerate(jobs):
        result, final, _ = run(argv, ranks, 2, keep_at)
        if rank == 0:
            torch.save(dict(losses=result.train_losses, final=final), os.path.join(out_dir, f"job{i}.pt"))
    dist.destroy_process_group()


def run_world2(jobs, out_dir):
    mp.start_processes(world2_worker, args=(free_port(), jobs, str(out_dir)), nprocs=2, join=True,
                       start_method="spawn")
    return [load(out_dir / f"job{i}.pt") for i in range(len(jobs))]


def assert_same_training(losses, reference_losses, final, reference_final, argv):
    for a, b in zip(reference_losses, losses, strict=True):
        assert b == pytest.approx(a, rel=LOSS_RTOL)
    bounds = movement_bounds(argv)
    got, want = load(final)["model"], load(reference_final)["model"]
    for name, value in want.items():
        # A bf16 parameter is rounded where it is stored, every step: a difference below its last
        # bit can become a whole unit there (2^-7 of the value at most); two are allowed.
        rtol = 2 * 2 ** -7 if value.dtype == torch.bfloat16 else 0
        torch.testing.assert_close(got[name], value, atol=MOVEMENT_FRACTION * bounds[name], rtol=rtol,
                                   msg=lambda m: f"{name}: {m}")


def test_resume_at_world_size_2_and_across_world_sizes(single, packed, data, tmp_path):
    argv = lambda **kw: tiny_argv(**data, **RESUME, **kw)  # noqa: E731
    # at world size 2: the full run (keeping its step-N checkpoint), that checkpoint resumed, and the
    # world-size-1 runs' step-N checkpoints resumed (the gathered state re-split over two ranks; the
    # packed loader's position read by two ranks, each taking every other chunk of a step)
    full2, resumed2, from1, packed_from1 = run_world2([
        (argv(log_dir=tmp_path / "full2"), (N, str(tmp_path / f"w2_step{N}.pt"))),
        (argv(log_dir=tmp_path / "resumed2", resume=tmp_path / f"w2_step{N}.pt"), None),
        (argv(log_dir=tmp_path / "from1", resume=single["step_n"]), None),
        ([f"--resume={packed['early']}", f"--log_dir={tmp_path / 'packed_from1'}", "--warmup_steps=0"], None),
    ], tmp_path)
    # the same token stream: the loader's end position exactly, the losses within rounding (not the
    # weights: in bf16 embeddings a row rounded the other way lifts a few entries of the tied head
    # past their bounds, RESUME's comment)
    assert load(packed_from1["final"])["loader"] == load(packed["final"])["loader"]
    assert packed_from1["losses"] == pytest.approx(packed["full"].train_losses[N:], rel=LOSS_RTOL)
    assert resumed2["losses"] == full2["losses"][N:]  # same world size: the same computation
    a, b = load(full2["final"]), load(resumed2["final"])
    assert all(torch.equal(b["model"][k], v) for k, v in a["model"].items())
    assert b["world_size"] == 2
    # the world-size-2 checkpoint resumed at world size 1
    to1, to1_final, _ = run(argv(log_dir=tmp_path / "to1", resume=tmp_path / f"w2_step{N}.pt"))
    base = argv()
    assert_same_training(to1.train_losses, full2["losses"][N:], to1_final, full2["final"], base)
    assert_same_training(from1["losses"], single["full"].train_losses[N:], from1["final"], single["final"], base)
    # and every run is one computation up to rounding: world size 2 throughout against 1 throughout
    assert_same_training(full2["losses"], single["full"].train_losses, full2["final"], single["final"], base)


# --- refusal and atomic writes --------------------------------------------------------------------

def test_a_checkpoint_of_another_configuration_is_refused(single, tmp_path, capsys):
    argv = single["argv"]
    logs = tmp_path / "logs"
    code = train_gpt.main(argv + [f"--resume={single['step_n']}", "--seed=1", "--muon_lr=0.04",
                                  f"--log_dir={logs}"], {})
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "trained with a different configuration: muon_lr=0.023 there, 0.04 here, seed=0 there, 1 here" in err
    assert not logs.exists()  # refused before anything was written
    # fields that do not change the computation may differ
    args = cfg.parse_config(argv + ["--val_every=1", "--run_name=other", "--save_checkpoint=false",
                                                "--checkpoint_every=0"], {}, 1, False)
    assert ckpt.read_checkpoint(str(single["step_n"]), "resume", args)["step"] == N
    # files that are not checkpoints
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "other.pt").read_bytes()[:300])
    (tmp_path / "folder.pt").mkdir()
    for name, message in [("junk.pt", "not a checkpoint written by train_gpt.py (not a torch.save file)"),
                          ("cut.pt", "not a checkpoint written by train_gpt.py, or a damaged one (zipfile: "),
                          ("other.pt", "not a checkpoint written by"), ("missing.pt", "no such file"),
                          ("folder.pt", "is a folder, not a checkpoint file")]:
        assert train_gpt.main(argv + [f"--resume={tmp_path / name}", f"--log_dir={logs}"], {}) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and f"--resume='{tmp_path / name}'" in err


def test_a_checkpoint_changed_on_disk_is_refused_by_its_crc(single, tmp_path, capsys):
    """torch.load takes the bytes as they are: a few changed inside a tensor (a bad disk, a copy
    gone wrong) would resume from other weights without a word. The zip's CRCs catch it, before
    anything starts, for --resume and --sample alike."""
    damaged = tmp_path / "damaged.pt"
    shutil.copyfile(single["step_n"], damaged)
    with zipfile.ZipFile(damaged) as archive:
        member = max(archive.infolist(), key=lambda info: info.file_size)   # a weight matrix
    with open(damaged, "r+b") as f:
        f.seek(member.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(member.header_offset + 30 + name_length + extra_length + member.file_size // 2)
        f.write(np.float32([0.5] * 64).tobytes())   # finite values: no nan to show it later
    for option in ("resume", "sample"):
        assert train_gpt.main(single["argv"] + [f"--{option}={damaged}", f"--log_dir={tmp_path / 'logs'}"], {}) == 2
        assert capsys.readouterr().err == (f"train_gpt.py: error: --{option}='{damaged}': damaged: {member.filename} "
                                           "fails its CRC check (a copy cut short or changed on disk)\n")
    assert not (tmp_path / "logs").exists()


def test_a_resume_takes_the_fields_it_does_not_set_from_the_checkpoint(single, tmp_path, capsys):
    path = str(single["step_n"])
    trained = load(path)["config"]
    args = cfg.parse_config([f"--resume={path}"], {}, 1, False)
    cpu = cfg.parse_config([], {}, 1, False)
    for name, value in vars(args).items():
        if name == "resume":
            assert value == path
        elif name in ckpt.LAUNCH_FIELDS:  # this machine's: the cpu preset's
            assert value == getattr(cpu, name), name
        else:
            assert value == trained[name], name
    assert (args.model_dim, args.micro_batches, args.save_checkpoint) == (32, 2, True)  # not the cpu preset's
    # set fields win: those that may differ are taken, the others must agree with the checkpoint
    args = cfg.parse_config([f"--resume={path}", "--val_every=1", "--num_layers=4"], {"RUN_NAME": "b"}, 1, False)
    assert (args.val_every, args.run_name, args.num_layers) == (1, "b", 4)
    assert train_gpt.main([f"--resume={path}", f"--log_dir={tmp_path}"], {"SEED": "5"}) == train_gpt.EXIT_CONFIG
    assert capsys.readouterr().err == (f"train_gpt.py: error: --resume={path!r}: trained with a different "
                                       "configuration: seed=0 there, 5 here (set by SEED in the environment)\n")
    # the environment's RESUME is read as the option is; --help shows the values the run would take
    with pytest.raises(cfg.HelpRequested, match=r"--micro_batches=2 "):
        cfg.parse_config(["--help"], {"RESUME": path}, 1, False)
    # a checkpoint that cannot be read lends nothing, and is named once the options pass their checks
    missing = str(tmp_path / "missing.pt")
    with pytest.raises(train_gpt.ConfigError, match="^--val_every=-1: must not be negative$"):
        cfg.parse_config([f"--resume={missing}", "--val_every=-1"], {}, 1, False)
    with pytest.raises(train_gpt.ConfigError, match=f"^--resume='{missing}': no such file$"):
        cfg.parse_config([f"--resume={missing}"], {}, 1, False)
    # at world size 3: not the preset's micro_batches, which the checkpoint would have replaced;
    # a value the user set is theirs to mend first
    with pytest.raises(train_gpt.ConfigError, match=f"^--resume='{missing}': no such file$"):
        cfg.parse_config([f"--resume={missing}"], {}, 3, False)
    with pytest.raises(train_gpt.ConfigError, match="^--micro_batches=2: world size 3 must divide it"):
        cfg.parse_config([f"--resume={missing}", "--micro_batches=2"], {}, 3, False)
    with pytest.raises(cfg.HelpRequested) as shown:
        cfg.parse_config([f"--resume={missing}", "--help"], {}, 1, False)
    assert "then of the --resume checkpoint" not in str(shown.value)
    assert f"The --resume checkpoint gives no values: --resume='{missing}': no such file" in str(shown.value)


def test_a_value_from_the_checkpoint_that_fails_here_says_where_it_came_from(single, tmp_path, capsys):
    path = str(single["step_n"])
    # checkpointing goes as a pair: turning it off keeps the checkpoint's --checkpoint_every out too
    args = cfg.parse_config([f"--resume={path}", "--save_checkpoint=false"], {}, 1, False)
    assert (args.save_checkpoint, args.checkpoint_every) == (False, 0)
    for argv, expected in [(["--checkpoint_every=2"], (True, 2)), (["--checkpoint_every=0"], (True, 0)),
                           (["--save_checkpoint=true"], (True, N))]:
        args = cfg.parse_config([f"--resume={path}"] + argv, {}, 1, False)
        assert (args.save_checkpoint, args.checkpoint_every) == expected, argv
    assert train_gpt.main([f"--resume={path}", "--save_checkpoint=false"], {"CHECKPOINT_EVERY": "2"}) == 2
    assert capsys.readouterr().err == "train_gpt.py: error: CHECKPOINT_EVERY=2: needs --save_checkpoint true\n"
    # with --sample too, the mistake is the pair, not a field the checkpoint contradicts
    assert train_gpt.main([f"--resume={path}", f"--sample={path}", "--seed=5"], {}) == 2
    assert capsys.readouterr().err == "train_gpt.py: error: --sample and --resume: choose one\n"
    # a value the checkpoint gave that fails here says so, and how to change it
    with pytest.raises(train_gpt.ConfigError) as refused:
        cfg.parse_config([f"--resume={path}"], {}, 3, False)
    assert str(refused.value) == ("--micro_batches=2: world size 3 must divide it (set --micro_batches=3 or another "
                                  "multiple of 3) (the value of the --resume checkpoint, which the resumed run must keep)")
    checkpoint = load(path)
    checkpoint["config"].update(log_dir=str(tmp_path / "file" / "logs"), train_files=str(tmp_path / "gone_*.bin"))
    (tmp_path / "file").write_text("a file, not a folder")
    torch.save(checkpoint, tmp_path / "other_machine.pt")
    other = str(tmp_path / "other_machine.pt")
    assert train_gpt.main([f"--resume={other}"], {}) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"train_gpt.py: error: --log_dir='{tmp_path / 'file' / 'logs'}': cannot create the folder")
    assert err.endswith(" (the value of the --resume checkpoint, set --log_dir to change it)\n")
    assert train_gpt.main([f"--resume={other}", f"--log_dir={tmp_path / 'logs'}"], {}) == 1
    assert capsys.readouterr().err == (f"train_gpt.py: error: --train_files='{tmp_path / 'gone_*.bin'}': no training "
                                       "shards match (as set here or by the --resume checkpoint)\n")
    # a preset this file does not have (a fork's) is the checkpoint's, and named so
    checkpoint["config"]["preset"] = "laptop"
    torch.save(checkpoint, tmp_path / "fork.pt")
    fork = r"--resume='.*fork.pt': trained with the preset 'laptop', which this train_gpt.py does not have \(speedrun, cpu\)"
    for argv in ([], ["--preset=cpu"]):
        with pytest.raises(train_gpt.ConfigError, match=f"^{fork}$"):
            cfg.parse_config([f"--resume={tmp_path / 'fork.pt'}"] + argv, {}, 1, False)
    with pytest.raises(cfg.HelpRequested, match=f"The --resume checkpoint gives no values: {fork}"):
        cfg.parse_config([f"--resume={tmp_path / 'fork.pt'}", "--help"], {}, 1, False)


def test_a_field_added_since_the_checkpoint_counts_at_its_default(single, tmp_path):
    """A fork adds a flag: its checkpoints from before the fork resume at the flag's default (on,
    here: normuon and cautious_wd are the speedrun's), and only there."""
    checkpoint = load(single["step_n"])
    del checkpoint["config"]["normuon"], checkpoint["config"]["cautious_wd"]
    torch.save(checkpoint, tmp_path / "before_the_fork.pt")
    path = str(tmp_path / "before_the_fork.pt")
    args = cfg.parse_config(single["argv"], {}, 1, False)
    assert ckpt.read_checkpoint(path, "resume", args)["step"] == N
    args = cfg.parse_config(single["argv"] + ["--normuon=false"], {}, 1, False)
    with pytest.raises(train_gpt.ConfigError, match="different configuration: normuon=True there, False here$"):
        ckpt.read_checkpoint(path, "resume", args)


def test_a_resume_over_other_training_files_ends_in_one_line_naming_them(single, data, tmp_path, capsys):
    """The run's --train_files glob may match other files since (a shard downloaded or removed):
    the loader's position then names another file, and the run is refused before it starts."""
    folder = os.path.dirname(data["train_files"])
    added = os.path.join(folder, "c_train_000000.bin")  # sorts first: the run's files move up one place
    shutil.copyfile(os.path.join(folder, "c_train_000001.bin"), added)
    logs = tmp_path / "logs"
    try:
        code = train_gpt.main(single["argv"] + [f"--resume={single['step_n']}", f"--log_dir={logs}"], {})
    finally:
        os.remove(added)
    err = capsys.readouterr().err
    assert code == train_gpt.EXIT_ERROR and err == (
        f"train_gpt.py: error: c_train_000002.bin: the checkpoint's loader was in this shard, training file 2 in "
        f"name order, which here is {os.path.join(folder, 'c_train_000001.bin')}: the files --train_files matches "
        "must be the run's, none added, removed or renamed\n")
    assert not logs.exists()  # found while checking the data, before the log, compiling or warmup
    # a shard removed since: the position lies past the files there are
    with pytest.raises(train_gpt.DataError, match="training file 2 in name order, but here there are 1: the files"):
        ckpt.check_position(dict(shard=1, file="c_train_000002.bin"), [added])


def test_a_resume_reads_the_data_where_it_moved(single, data, tmp_path):
    """The shards copied to another folder (a node's local disk): the run resumes from there and
    continues exactly."""
    moved = tmp_path / "moved"
    shutil.copytree(os.path.dirname(data["train_files"]), moved)
    argv = [a for a in single["argv"] if not a.startswith(("--train_files=", "--val_files=", "--log_dir="))]
    resumed, _, text = run(argv + [f"--train_files={moved / 'c_train_*.bin'}", f"--val_files={moved / 'c_val_*.bin'}",
                                   f"--resume={single['step_n']}", f"--log_dir={tmp_path / 'logs'}"])
    assert resumed.train_losses == single["full"].train_losses[N:]
    shards = ",".join(str(moved / f"c_train_00000{i}.bin") for i in (1, 2))
    assert f"\ntrain_files={shards}\n" in text   # the log header names the files read


def test_a_resume_over_another_dataset_with_the_same_names_is_refused(single, data, tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(os.path.dirname(data["train_files"]), moved)
    state = load(single["step_n"])["loader"]
    write_shard(moved / state["file"], synthetic_documents(np.random.default_rng(9), state["tokens"] + 10))
    argv = [a for a in single["argv"] if not a.startswith(("--train_files=", "--val_files="))]
    logs = tmp_path / "logs"
    code = train_gpt.main(argv + [f"--train_files={moved / 'c_train_*.bin'}", f"--val_files={moved / 'c_val_*.bin'}",
                                  f"--resume={single['step_n']}", f"--log_dir={logs}"], {})
    assert code == train_gpt.EXIT_ERROR and capsys.readouterr().err == (
        f"train_gpt.py: error: {moved / state['file']}: holds {state['tokens'] + 10:,} tokens, but the checkpoint's "
        f"shard of this name held {state['tokens']:,}: not the data the run was trained on\n")
    assert not logs.exists()


def test_validations_kept_across_a_resume_are_one_per_step():
    result = train_gpt.TrainResult(val_losses=[(6, 4.0), (9, 3.5)], resumed_val_losses=[(0, 10.8), (3, 6.0), (6, 4.1)])
    assert result.all_val_losses() == [(0, 10.8), (3, 6.0), (6, 4.0), (9, 3.5)]


def test_a_finished_run_is_not_resumed(single, tmp_path, capsys):
    logs = tmp_path / "logs"
    assert train_gpt.main(single["argv"] + [f"--resume={single['final']}", f"--log_dir={logs}"], {}) == 2
    err = capsys.readouterr().err
    assert err == (f"train_gpt.py: error: --resume='{single['final']}': saved at the run's last step "
                   f"({2 * N}/{2 * N}); nothing is left to train\n")
    assert not logs.exists()


# The 2025-08-23 record's model and schedules, the options' values before the 2026 defaults.
MODEL_2025 = dict(window_schedule="", yarn=False, value_gates=False, key_offset=False, paired_head_layers="",
                  token_windows=False, value_embed_layers="", bigram_vocab_size=0, smear=False, skip_layers="",
                  backout_layer=-1, init="2025", logit_cap_height=0, mtp=False, embed_split_frac=0)


def test_the_fields_sample_takes_from_the_checkpoint_are_those_the_model_reads():
    """--sample refuses a set option that would change the model (MODEL_FIELDS) and takes the rest
    of the model's configuration from the checkpoint: a fork whose model reads a new field must
    list it there, or --sample would ignore that option silently."""
    from conftest import TINY

    class Recording:
        def __init__(self, args):
            object.__setattr__(self, "args", args)
            object.__setattr__(self, "read", set())

        def __getattr__(self, name):
            self.read.add(name)
            return getattr(self.args, name)
    hw = train_gpt.Hardware(torch.device("cpu"), torch.float32, "sdpa", False, "torch", "gloo")
    read = set()
    # the speedrun's model, and the 2025-08-23 record's (grown windows read window_growth_tokens)
    for config in (TINY, dict(TINY, **MODEL_2025)):
        args = Recording(train_gpt.Hyperparameters(**config))
        model = train_gpt.GPT(args, hw).eval()
        sampling.generate(model, args, [1, 2, 3], max_new_tokens=3)  # what --sample does with it
        read |= args.read
    missing, unread = sorted(read - set(sampling.MODEL_FIELDS)), sorted(set(sampling.MODEL_FIELDS) - read)
    assert (missing, unread) == ([], []), f"sampling.MODEL_FIELDS: add {missing}, remove {unread}"


def test_prompt_belongs_to_sample():
    for prompt in ("Hello", ""):  # set, even to nothing, is set: a training run would ignore it
        with pytest.raises(train_gpt.ConfigError, match=r"^--prompt: only --sample reads it \(--sample CHECKPOINT"):
            cfg.parse_config(tiny_argv(prompt=prompt), {}, 1, False)
    with pytest.raises(train_gpt.ConfigError, match="--sample and --resume: choose one"):
        cfg.parse_config(tiny_argv(sample="a.pt", resume="a.pt"), {}, 1, False)


EDIT_WHILE_TRAINING = """
import glob, hashlib, sys
sys.path.insert(0, sys.argv[1])
import train_gpt
from harness import checkpoints as ckpt
started_with = open(train_gpt.__file__, "rb").read()
write_header = train_gpt.log_header

def header_after_an_edit(*args, **kwargs):  # the user saves the next idea while the run trains
    with open(train_gpt.__file__, "a") as f:
        f.write("# saved while the run trained\\n")
    return write_header(*args, **kwargs)
train_gpt.log_header = header_after_an_edit
assert train_gpt.main(sys.argv[2:-1]) == 0
(log,) = glob.glob(sys.argv[-1] + "/*/*.txt")
checkpoint = ckpt.read_checkpoint(log[:-4] + ".pt", "resume")
print("edit in log:", "# saved while the run trained" in open(log).read())
print("checkpoint names the code that ran:", checkpoint["code_sha256"] == hashlib.sha256(started_with).hexdigest())
"""


def test_an_edit_while_the_run_trains_is_not_taken_for_its_code(data, tmp_path):
    """The log's copy of the code and the checkpoint's code hash are of the file as the process
    found it at start, not of an edit saved meanwhile (a resume would then not warn, and going
    back to the code that trained would warn falsely)."""
    shutil.copy(ROOT / "train_gpt.py", tmp_path / "train_gpt.py")
    shutil.copytree(ROOT / "harness", tmp_path / "harness")
    logs = tmp_path / "logs"
    argv = tiny_argv(**data, num_iterations=2, val_every=0, save_checkpoint=True, log_dir=logs)
    done = subprocess.run([sys.executable, "-c", EDIT_WHILE_TRAINING, str(tmp_path), *argv, str(logs)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "edit in log: False" in done.stdout
    assert "checkpoint names the code that ran: True" in done.stdout


def test_a_checkpoint_that_does_not_fit_the_code_is_refused(single):
    checkpoint = load(single["step_n"])
    checkpoint["optimizer"]["tensors"].pop()  # as if the optimizer kept one tensor more now
    args = cfg.parse_config(single["argv"], {}, 1, False)
    hw = train_gpt.Hardware.detect(args)
    model = train_gpt.GPT(args, hw)
    optimizer = train_gpt.ShardedMuonAdam(train_gpt.param_specs(model, args), args, train_gpt.Ranks(), hw)
    with pytest.raises(ckpt.CheckpointError, match="does not fit this model") as error:
        ckpt.restore_checkpoint(checkpoint, "x.pt", model, optimizer, train_gpt.Ranks(), hw, print)
    assert "\n" not in str(error.value)


def test_a_resume_with_another_cpu_thread_count_says_it_is_not_exact(single):
    """The thread count orders a CPU's sums: the default (the usable cores) may differ where the
    resume runs (another machine, taskset), and the continuation is then close, not bit for bit."""
    checkpoint = load(single["step_n"])
    assert checkpoint["threads"] == torch.get_num_threads()
    args = cfg.parse_config(single["argv"], {}, 1, False)
    hw = train_gpt.Hardware.detect(args)
    for saved_with, warned in ((torch.get_num_threads(), False), (torch.get_num_threads() + 1, True)):
        model = train_gpt.GPT(args, hw)
        optimizer = train_gpt.ShardedMuonAdam(train_gpt.param_specs(model, args), args, train_gpt.Ranks(), hw)
        lines = []
        ckpt.restore_checkpoint(dict(checkpoint, threads=saved_with), "x.pt", model, optimizer,
                                     train_gpt.Ranks(), hw, lines.append)
        warning = (f"warning: x.pt was trained with {saved_with} CPU threads, this run has {torch.get_num_threads()}; "
                   "its sums round in another order, so the continuation is close, not exact")
        assert (warning in lines) is warned


def test_a_checkpoint_that_does_not_fit_ends_the_run_in_set_up_in_one_line(single, tmp_path, capsys, monkeypatch):
    """Found in set-up, once model and optimizer exist, before compiling and warmup (minutes on a
    GPU): one line naming what does not fit, exit 1, nothing written."""
    warmed = []
    monkeypatch.setattr(train_gpt.GPT, "compile_for_training", lambda *a: warmed.append("compile"))
    logs = tmp_path / "logs"
    saved = load(single["step_n"])
    block_weight = next(name for name, t in saved["model"].items() if t.dim() == 2 and "blocks" in name)
    misfits = {
        "optimizer.pt": (lambda c: c["optimizer"]["tensors"].pop(),   # as if the optimizer kept one tensor more now
                         f"optimizer state has {len(saved['optimizer']['tensors']) - 1} tensors, this optimizer "
                         f"{len(saved['optimizer']['tensors'])})"),
        "wider.pt": (lambda c: c["model"].__setitem__(block_weight, torch.zeros(3, 3)),
                     f"{block_weight} is (3, 3) there, {tuple(saved['model'][block_weight].shape)} here)"),
        "renamed.pt": (lambda c: c["model"].__setitem__("extra.weight", c["model"].pop(block_weight)),
                       f"{block_weight} is missing; extra.weight is not in this model)")}
    for name, (change, expected) in misfits.items():
        checkpoint = load(single["step_n"])
        change(checkpoint)
        torch.save(checkpoint, tmp_path / name)
        argv = single["argv"] + [f"--resume={tmp_path / name}", f"--log_dir={logs}", "--compile=true"]
        assert train_gpt.main(argv, {}) == 1
        assert capsys.readouterr().err == f"train_gpt.py: error: {tmp_path / name}: does not fit this model ({expected}\n"
    assert not logs.exists() and not warmed


def test_ranks_holding_different_files_at_the_resume_path_end_in_one_line(single, tmp_path):
    """Two machines, each with its own copy of the checkpoint: one copied before the last periodic
    save holds an older step under the same name. Set-up compares the copies (their zip CRCs)
    and each machine says so in one line, before anything trains."""
    older = load(single["step_n"])
    older["step"] = N - 1
    machines = [tmp_path / "machine0", tmp_path / "machine1"]
    for machine in machines:
        machine.mkdir()
    shutil.copyfile(single["step_n"], machines[0] / "run.pt")
    torch.save(older, machines[1] / "run.pt")
    port = free_port()
    processes = [subprocess.Popen(
        [sys.executable, str(ROOT / "train_gpt.py"), "--resume=run.pt", f"--log_dir={tmp_path / 'logs'}",
         "--dist_timeout_s=120"], cwd=machine, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
        for rank, machine in enumerate(machines)]
    ended = [process.communicate(timeout=300) for process in processes]
    line = (f"train_gpt.py: error: --resume='run.pt': the ranks hold different files at this path (rank 0's step {N}, "
            f"rank 1's step {N - 1}): copy rank 0's to every machine")
    for process, (_, err) in zip(processes, ended):
        assert process.returncode == 1 and err == line + "\n", err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("identities, named", [
    ([(7, 6), (7, 6), (5, 2), (7, 6)], "(rank 0's step 6, rank 2's step 2)"),
    ([(7, 6), (5, 6)], "(at one step, 6: rank 0's and rank 1's)"),   # two saves of one step: another run's?
    ([(7, 6)] + [(5, 2)] * 5, "(rank 0's step 6, rank 1's step 2, rank 2's step 2, rank 3's step 2, 2 more)")])
def test_the_ranks_copies_of_a_checkpoint_are_named_by_step(monkeypatch, identities, named):
    """Each rank's (digest of its file's CRCs, step), gathered: the message names the steps that
    differ from rank 0's, or, where every step is the same, that the files differ all the same.
    Every machine's local rank 0 says it; the other ranks end quietly."""
    def gather(every, held):
        for mine, theirs in zip(every, identities):
            mine.copy_(torch.tensor(theirs))
    monkeypatch.setattr(train_gpt.dist, "all_gather", gather)
    hw = train_gpt.Hardware.detect(train_gpt.Hyperparameters(device="cpu"))
    line = f"--resume='run.pt': the ranks hold different files at this path {named}: copy rank 0's to every machine"
    for local_rank, kind in ((0, ckpt.CheckpointError), (1, launcher.PeerDataError)):
        ranks = train_gpt.Ranks(rank=local_rank, local_rank=local_rank, world_size=len(identities))
        with pytest.raises(kind) as error:
            ckpt.check_ranks_hold_one_checkpoint("run.pt", identities[0], ranks, hw)
        assert str(error.value) == line and type(error.value) is kind
    ranks = train_gpt.Ranks(world_size=len(identities))
    monkeypatch.setattr(train_gpt.dist, "all_gather", lambda every, held: [t.copy_(held) for t in every])
    ckpt.check_ranks_hold_one_checkpoint("run.pt", identities[0], ranks, hw)   # one file: no error


def crash_on_save(obj, f):
    f.write(b"PK\x03\x04" + b"\0" * 4096)  # the start of a zip, as torch.save writes
    raise OSError(28, "No space left on device")


REAL_SAVE = torch.save


def disk_full_after_4k(obj, f):
    """The real torch.save into a file that fills up: torch reports that as a RuntimeError
    ("unexpected pos ...") whose context is the OSError."""
    class FullDisk(io.RawIOBase):
        written = 0

        def writable(self):
            return True

        def write(self, b):
            if self.written + len(b) > 4096:
                raise OSError(28, "No space left on device")
            f.write(b)
            self.written += len(b)
            return len(b)
    REAL_SAVE(obj, FullDisk())


def test_a_crash_while_writing_leaves_no_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "run.pt"
    monkeypatch.setattr(torch, "save", crash_on_save)
    with pytest.raises(OSError):
        ckpt.write_atomically({"step": 2}, str(path))
    assert list(tmp_path.iterdir()) == []  # no .pt, and the temporary file is removed
    # a process killed mid-write leaves only its hidden temporary file, and an older checkpoint intact
    monkeypatch.undo()
    ckpt.write_atomically({"step": 1}, str(path))
    before = path.read_bytes()
    code = ("import os, sys, torch\nfrom harness import checkpoints\n"
            "def killed(obj, f):\n    f.write(b'PK' * 1000); f.flush(); os._exit(9)\n"
            "torch.save = killed\ncheckpoints.write_atomically({'step': 2}, sys.argv[1])\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["run.pt"] and path.read_bytes() == before
    assert [p.name.startswith(".run.pt.") and p.name.endswith(".tmp") for p in tmp_path.glob(".*")] == [True]
    # the next checkpoint written in the folder removes it, and only what dead writers of this machine left
    kept = [killed_write_leftover(tmp_path, "other.pt", pid=os.getpid()),   # a live writer
            killed_write_leftover(tmp_path, "other.pt", machine="another-machine"),  # maybe live, elsewhere
            tmp_path / ".other.pt.12345.tmp", tmp_path / ".notes.tmp"]  # written before machine tags; not ours
    for untagged in kept[2:]:
        untagged.write_bytes(b"x")
    killed = next(p for p in tmp_path.glob(".run.pt.*.tmp"))
    # a writer whose pid this process cannot see (a container sharing the host's name) holds its lock
    in_another_container = killed_write_leftover(tmp_path, "other.pt")
    lines = []
    with open(in_another_container, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        ckpt.remove_killed_writes(str(tmp_path), lines.append)
    assert not killed.exists() and all(p.exists() for p in kept) and in_another_container.exists()
    assert lines == [f"removed {killed} (0.0 MiB): a checkpoint write that was killed left it"]
    ckpt.remove_killed_writes(str(path), lines.append)  # run.pt, not a folder: nothing to do, no error
    assert len(lines) == 1


def no_such_process(pid, signal):
    """os.kill as it answers for a pid that has ended (or that another pid namespace holds)."""
    raise ProcessLookupError(pid)


def test_a_write_in_progress_is_not_removed_even_where_its_pid_looks_dead(tmp_path, monkeypatch):
    """The writer holds its temporary file's lock until the rename: a cleaner that cannot see its
    pid (another pid namespace on this host) leaves it alone."""
    monkeypatch.setattr(os, "kill", no_such_process)
    real_save, lines = torch.save, []

    def save_while_another_run_cleans(obj, f):
        real_save(obj, f)
        ckpt.remove_killed_writes(str(tmp_path), lines.append)
    monkeypatch.setattr(torch, "save", save_while_another_run_cleans)
    ckpt.write_atomically({"step": 1}, str(tmp_path / "run.pt"))
    assert lines == [] and load(tmp_path / "run.pt") == {"step": 1} and os.listdir(tmp_path) == ["run.pt"]


def test_killed_writes_of_another_users_live_process_or_another_machine_are_kept(tmp_path, monkeypatch):
    """os.kill(pid, 0) on another user's process fails with EPERM: it lives, its file stays. The
    machine's name is written so the pattern can read it back (a dotted or odd hostname)."""
    monkeypatch.setattr(train_gpt.platform, "node", lambda: "gpu-7.cluster_a")
    assert ckpt.machine_tag() == "gpu-7-cluster-a"
    leftover = killed_write_leftover(tmp_path, "run.pt", pid=1)   # pid 1 lives
    other = killed_write_leftover(tmp_path, "run.pt", machine="gpu-7-cluster-b")

    def not_permitted(pid, signal):
        raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "kill", not_permitted)
    lines = []
    ckpt.remove_killed_writes(str(tmp_path), lines.append)
    assert lines == [] and leftover.exists() and other.exists()
    monkeypatch.setattr(os, "kill", no_such_process)
    ckpt.remove_killed_writes(str(tmp_path), lines.append)
    assert not leftover.exists() and other.exists() and len(lines) == 1


def test_resuming_removes_what_a_write_killed_beside_the_checkpoint_left(single):
    leftover = single["leftover"]
    assert not leftover.exists()
    assert f"removed {leftover} (1.0 MiB): a checkpoint write that was killed left it" in single["resumed_text"]


def test_a_full_disk_at_a_periodic_checkpoint_lets_training_go_on(data, tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", disk_full_after_4k)
    leftovers = []  # what an earlier run killed while writing there left: removed before the first write
    result, path, text = run(tiny_argv(**data, num_iterations=6, val_every=0, save_checkpoint=True,
                                       checkpoint_every=2, log_dir=tmp_path),
                             before=lambda folder: leftovers.append(killed_write_leftover(folder, "earlier.pt")))
    assert result.steps_done == 6 and result.failure is None and len(result.train_losses) == 6
    failed = [line for line in text.splitlines() if line.startswith("checkpoint not written: ")]
    assert failed == [f"checkpoint not written: {path}: No space left on device"] * 3  # steps 2, 4 and the end
    removed = f"removed {leftovers[0]} (1.0 MiB): a checkpoint write that was killed left it"
    assert not leftovers[0].exists() and text.count(removed) == 1 and text.index(removed) < text.index(failed[0])


@pytest.mark.parametrize("save", [crash_on_save, disk_full_after_4k], ids=["oserror", "torch_runtimeerror"])
def test_a_full_disk_at_the_end_still_ends_in_one_line_and_a_complete_log(data, tmp_path, monkeypatch, save):
    monkeypatch.setattr(torch, "save", save)
    result, path, text = run(tiny_argv(**data, num_iterations=2, val_every=0, save_checkpoint=True,
                                       log_dir=tmp_path))
    assert result.checkpoint_error == f"checkpoint not written: {path}: No space left on device"
    lines = text.splitlines()
    assert lines[-2] == result.checkpoint_error and lines[-1].startswith("peak memory")
    assert not os.path.exists(path) and os.listdir(os.path.dirname(path)) == [os.path.basename(path)[:-3] + ".txt"]


def test_checkpoint_options_are_checked():
    with pytest.raises(train_gpt.ConfigError, match="--checkpoint_every=6: needs --save_checkpoint true"):
        cfg.parse_config(tiny_argv(checkpoint_every=6), {}, 1, False)
    with pytest.raises(train_gpt.ConfigError, match="--top_k=-1: must not be negative"):
        cfg.parse_config(tiny_argv(top_k=-1), {}, 1, False)


# --- sampling -------------------------------------------------------------------------------------

def sample(capsys, path, *options):
    assert train_gpt.main(["--sample", str(path), "--max_new_tokens", "12", *options], {}) == 0
    out, err = capsys.readouterr()
    assert err.startswith("sampled ") and f"from {path} (step {N}, val_loss " in err
    return out


def test_sampling_is_deterministic_for_a_seed(single, capsys):
    path = single["step_n"]
    first = sample(capsys, path, "--prompt", "The function returns", "--seed", "5")
    assert first == sample(capsys, path, "--prompt", "The function returns", "--seed", "5")
    assert first != sample(capsys, path, "--prompt", "The function returns", "--seed", "6")
    # temperature 0 always takes the most likely token: the seed does not matter
    greedy = sample(capsys, path, "--prompt", "The", "--temperature", "0", "--seed", "1")
    assert greedy == sample(capsys, path, "--prompt", "The", "--temperature", "0", "--seed", "2")


def test_sampling_runs_on_the_device_asked_for(single, capsys, monkeypatch):
    """--device cpu on a machine with a GPU samples on the CPU (it once took the GPU regardless)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = single["step_n"]
    assert train_gpt.main(["--sample", str(path), "--max_new_tokens", "4", "--device", "cpu"], {}) == 0
    out, err = capsys.readouterr()
    assert out.strip() and f" on cpu from {path} " in err


def test_sampling_refuses_options_that_would_change_the_checkpoints_model(single, capsys):
    """The model comes from the checkpoint: a set option that differs from it was silently ignored."""
    path = single["step_n"]
    assert train_gpt.main(["--sample", str(path), "--model_dim", "64", "--head_dim", "32"], {}) == train_gpt.EXIT_CONFIG
    out, err = capsys.readouterr()
    assert not out and err == (f"train_gpt.py: error: --model_dim, --head_dim: --sample takes the configuration of "
                               f"'{path}', which has model_dim=32, head_dim=16; leave the option out\n")
    assert train_gpt.main(["--sample", str(path)], {"NUM_ITERATIONS": str(2 * N + 2)}) == train_gpt.EXIT_CONFIG
    assert capsys.readouterr().err.startswith("train_gpt.py: error: NUM_ITERATIONS: --sample takes")
    # the checkpoint's own values, the options sampling reads and those that build no model are accepted
    sample(capsys, path, "--model_dim", "32", "--head_dim", "16", "--num_iterations", str(2 * N), "--seed", "3",
           "--threads", "1", "--micro_batches", "2", "--muon_lr", "0.1")


@pytest.mark.parametrize("option", ["sample", "resume"])
def test_a_model_option_that_also_fails_its_own_check_is_named_against_the_checkpoint(single, option, capsys):
    """--num_layers 6 makes the 4-letter window pattern wrong too; the user set num_layers, and the
    checkpoint is what it contradicts."""
    path = single["step_n"]
    argv = (single["argv"] if option == "resume" else []) + [f"--{option}={path}", "--num_layers=6"]
    assert train_gpt.main(argv, {}) == train_gpt.EXIT_CONFIG
    err = capsys.readouterr().err
    if option == "sample":
        assert err == (f"train_gpt.py: error: --num_layers: --sample takes the configuration of '{path}', which has "
                       "num_layers=4; leave the option out\n")
    else:
        assert err == (f"train_gpt.py: error: --resume={str(path)!r}: trained with a different configuration: "
                       "num_layers=4 there, 6 here\n")
    # where the checkpoint has no say, the option's own check speaks
    assert train_gpt.main(argv[:-1] + ["--temperature=-1", "--val_every=-1"], {}) == train_gpt.EXIT_CONFIG
    assert capsys.readouterr().err == "train_gpt.py: error: --val_every=-1: must not be negative\n"


def test_sampling_from_an_untrained_model_runs():
    args = cfg.parse_config(tiny_argv(), {}, 1, False)
    hw = train_gpt.Hardware.detect(args)
    torch.manual_seed(0)
    model = train_gpt.GPT(args, hw).eval()
    new = sampling.generate(model, args, [464, 2068], 20, seed=0)
    assert len(new) == 20 and all(0 <= t < train_gpt.BOS_TOKEN for t in new)
    # a prompt longer than the model's context (the rotary table's positions) is cut to its last tokens
    seen, trunk = [], model.trunk
    model.trunk = lambda tokens, *a: seen.append(tokens.tolist()) or trunk(tokens, *a)
    prompt, context = list(range(1, 300)), model.rotary.max_seq_len
    assert context < len(prompt) and len(sampling.generate(model, args, prompt, 3, seed=0)) == 3
    assert seen[0] == prompt[-context:] and all(len(tokens) == context for tokens in seen)
    assert seen[1][:-1] == prompt[-context + 1:]  # then the window slides over the new token


def greedy_tokens(model, args, prompt, count, step):
    """The most likely next tokens, one at a time, with the masks and window of training's step."""
    tokens = [train_gpt.BOS_TOKEN, *prompt]
    window = torch.tensor(train_gpt.long_window_blocks_at(step, args))
    for _ in range(count):
        with torch.no_grad():
            logits = model.head(model.trunk(torch.tensor(tokens), window))[-1, :train_gpt.BOS_TOKEN + 1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) + 1:]


def test_greedy_sampling_takes_the_training_models_most_likely_token(single):
    """generate() sees what the trained model sees: the same masks and window as training's step."""
    checkpoint = load(single["step_n"])
    args = train_gpt.Hyperparameters(**checkpoint["config"])
    model = train_gpt.GPT(args, train_gpt.Hardware.detect(args)).eval()
    model.load_state_dict(checkpoint["model"])
    prompt = [464, 2068, 7586, train_gpt.BOS_TOKEN, 464, 318]  # a BOS starts a new document, as in training
    new = sampling.generate(model, args, prompt, 4, temperature=0)
    assert new == greedy_tokens(model, args, prompt, 4, args.num_iterations)


def test_sampling_a_periodic_checkpoint_uses_the_window_it_was_trained_with(single, capsys, tmp_path):
    """--sample on a checkpoint from the middle of training attended over the end of training's
    window (here 3 blocks), wider than the model had seen (2 at step N): now the window of its step."""
    checkpoint = load(single["step_n"])
    args = train_gpt.Hyperparameters(**checkpoint["config"])
    assert checkpoint["step"] == N < args.num_iterations
    assert train_gpt.long_window_blocks_at(N, args) < train_gpt.long_window_blocks_at(args.num_iterations, args)
    # N steps leave the attention's zero-initialized projections near zero, and the samples
    # near independent of the window: weights moved well off them make it matter.
    g = torch.Generator().manual_seed(0)
    checkpoint["model"] = {k: v + 0.3 * torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else v
                           for k, v in checkpoint["model"].items()}
    torch.save(checkpoint, tmp_path / "moved.pt")
    model = train_gpt.GPT(args, train_gpt.Hardware.detect(args)).eval()
    model.load_state_dict(checkpoint["model"])
    encoding = sampling.gpt2_encoding()
    prompt_text = " ".join(f"item {i} of the list," for i in range(14))  # over 2 blocks of 32 tokens
    prompt = encoding.encode_ordinary(prompt_text)
    assert 2 * args.attn_block_size < len(prompt) + 1 < args.train_seq_len - 12
    at_its_step = sampling.generate(model, args, prompt, 12, step=N, seed=1)
    assert at_its_step != sampling.generate(model, args, prompt, 12, seed=1)  # the window matters here
    out = sample(capsys, tmp_path / "moved.pt", "--prompt", prompt_text, "--seed", "1")
    assert out == encoding.decode(at_its_step) + "\n"


def test_sampling_prints_each_token_as_drawn_and_keeps_them_on_ctrl_c(single, capsys, monkeypatch):
    """A long sample took minutes with nothing shown, and Ctrl-C threw it all away: the text now
    comes token by token (whole characters), and Ctrl-C ends with what was drawn and one line."""
    path = single["step_n"]
    whole = sample(capsys, path, "--prompt", "The", "--seed", "3")
    drawn, generate = [], sampling.generate

    def ctrl_c_after_5(*args, on_token, **kwargs):
        def count(token):
            on_token(token)
            drawn.append(capsys.readouterr().out)  # printed at once, before the next token is drawn
            if len(drawn) == 5:
                raise KeyboardInterrupt
        return generate(*args, on_token=count, **kwargs)
    monkeypatch.setattr(sampling, "generate", ctrl_c_after_5)
    assert train_gpt.main(["--sample", str(path), "--max_new_tokens", "12", "--prompt", "The", "--seed", "3"],
                          {}) == 128 + signal.SIGINT
    out, err = capsys.readouterr()
    assert len(drawn) == 5 and whole.startswith("".join(drawn) + out.rstrip("\n")) and out.endswith("\n")
    assert sum(map(bool, drawn)) >= 3  # text came out token by token, not at the end
    assert err.startswith("interrupted (SIGINT) after 5 tokens in ") and f"from {path} (step {N}" in err


def test_ctrl_c_while_the_script_samples_keeps_the_text(single, tmp_path):
    """As a script, Ctrl-C takes its default action until a handler is installed (train_gpt.py's
    first lines): --sample installs one, or a real Ctrl-C would end it silently."""
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
signal.signal(signal.SIGINT, signal.SIG_DFL)  # as `python3 train_gpt.py` starts
import train_gpt
from harness import sample as sampling
generate = sampling.generate
def ctrl_c_after_4(*args, on_token, **kwargs):
    def count(token, drawn=[]):
        on_token(token)
        drawn.append(token)
        if len(drawn) == 4:
            os.kill(os.getpid(), signal.SIGINT)
    return generate(*args, on_token=count, **kwargs)
sampling.generate = ctrl_c_after_4
sys.exit(train_gpt.main(["--sample", {str(single["step_n"])!r}, "--max_new_tokens", "50", "--seed", "3"]))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 128 + signal.SIGINT, done.stderr[-2000:]
    assert done.stderr.startswith("interrupted (SIGINT) after 4 tokens in ") and done.stdout.endswith("\n")
