"""Configuration: presets, overrides from the command line and the environment, and rejection of
bad values with one line naming the field, before any process group, file or data is touched."""

import dataclasses
import itertools
import os
import subprocess
import sys

import pytest

import train_gpt
from harness import config as cfg
from conftest import ROOT


def parse(argv=(), environ=None, world_size=1, cuda=False):
    return cfg.parse_config(list(argv), environ or {}, world_size, cuda)


def test_default_preset_follows_the_hardware():
    assert parse(cuda=False).preset == "cpu"
    speedrun = parse(cuda=True)
    assert speedrun.preset == "speedrun"
    assert (speedrun.num_layers, speedrun.model_dim, speedrun.num_iterations) == (11, 768, 1600)  # the 2026 record's


def test_a_copy_without_the_harness_takes_the_machines_preset_as_the_harness_does():
    """train_gpt.py alone (plain_config: --field=value options) names the preset it applied, so that
    the cpu preset falls back to the embedded sample and the log says cpu."""
    for plain, options in (([], []), (["--preset=speedrun", "--num_iterations=70"], ["--preset", "speedrun",
                                                                                    "--num_iterations", "70"])):
        assert train_gpt.plain_config(plain) == parse(options)
    assert train_gpt.plain_config([]).preset == "cpu"


def test_the_extension_steps_train_at_train_seq_len_after_a_schedule():
    """As the record's train_bs_extension: the schedule's lengths by thirds, then train_seq_len."""
    args = parse(["--preset", "speedrun", "--train_seq_len", "65536"], cuda=True)
    assert [train_gpt.train_seq_len_at(s, args) for s in (0, 519, 520, 1040, 1559, 1560, 1599)] == \
        [16384, 16384, 32768, 49152, 49152, 65536, 65536]
    fixed = parse(["--preset", "speedrun", "--train_seq_len_schedule", "", "--train_seq_len", "32768"], cuda=True)
    assert {train_gpt.train_seq_len_at(s, fixed) for s in range(1600)} == {32768}


def test_the_console_eta_counts_the_tokens_left_not_the_steps():
    """The speedrun's micro-batches grow 16Ki, 32Ki, 48Ki by thirds of 1560 steps, then 40 at 48Ki:
    after step 1 in 1 s, what is left takes (tokens left / 16Ki) s = 3239 s, not 1599 s."""
    args = parse(["--preset", "speedrun"], cuda=True)
    through = list(itertools.accumulate(train_gpt.train_seq_len_at(s, args) for s in range(1600)))
    per_token = 1 / 16384
    assert train_gpt.eta_seconds(1000, 1, through) == pytest.approx(per_token * (520 * (16384 + 32768 + 49152)
                                                                                 + 40 * 49152 - 16384))
    assert train_gpt.eta_seconds(1000, 1, through) == pytest.approx(3239)  # the steps' count says 1599
    assert train_gpt.eta_seconds(5000, 1600, through) == 0


def test_a_refused_value_nobody_set_is_named_as_the_presets():
    with pytest.raises(train_gpt.ConfigError, match=r"^--extension_steps=4: must be below num_iterations=4 "
                       r"\(the cpu preset's value\)$"):
        parse(["--num_iterations", "4"])
    with pytest.raises(train_gpt.ConfigError, match=r"^--extension_steps=40: must be below num_iterations=30 "
                       r"\(the speedrun preset's value\)$"):
        parse(["--num_iterations", "30"], cuda=True)
    with pytest.raises(train_gpt.ConfigError, match=r"^--extension_steps=4: must be below num_iterations=4$"):
        parse(["--num_iterations", "4"], {"EXTENSION_STEPS": "4"})  # set by the user: no note
    odd_heads = ["--num_heads", "3", "--model_dim", "768", "--head_dim", "256"]
    with pytest.raises(train_gpt.ConfigError, match=r"needs an even num_heads, not 3 \(the speedrun preset's value\)$"):
        parse(odd_heads, cuda=True)
    with pytest.raises(train_gpt.ConfigError, match=r"needs an even num_heads, not 3$"):  # --sample: the checkpoint's
        parse(["--sample", "missing.pt", *odd_heads], cuda=True)


def test_a_glob_the_shell_expanded_is_named_as_such():
    with pytest.raises(train_gpt.ConfigError, match=r"^unexpected argument '/d/b_2.bin': options look like --field "
                       r"value \(probably the shell's expansion of --val_files's glob: quote it\)$"):
        parse(["--seed", "1", "--val_files", "/d/b_1.bin", "/d/b_2.bin"])
    with pytest.raises(train_gpt.ConfigError, match=r"^unexpected argument '2': options look like --field value$"):
        parse(["--seed", "1", "2"])


def test_cpu_preset_changes_only_its_own_fields():
    cpu, defaults, preset = parse(["--preset", "cpu"]), train_gpt.Hyperparameters(), train_gpt.PRESETS["cpu"]
    for field in dataclasses.fields(train_gpt.Hyperparameters):  # the rest keep the speedrun's values
        expected = "cpu" if field.name == "preset" else preset.get(field.name, getattr(defaults, field.name))
        assert getattr(cpu, field.name) == expected, field.name
    assert cpu.muon_lr == defaults.muon_lr and cpu.num_layers == preset["num_layers"] != defaults.num_layers


def test_command_line_and_environment_overrides():
    args = parse(["--num_iterations", "7", "--muon_lr=0.02", "--normuon", "true"], {"VAL_EVERY": "3"})
    assert (args.num_iterations, args.muon_lr, args.normuon, args.val_every) == (7, 0.02, True, 3)
    # The command line beats the environment, which beats the preset.
    args = parse(["--val_every", "5"], {"VAL_EVERY": "3", "SEED": "11"})
    assert (args.val_every, args.seed) == (5, 11)
    assert parse([], {"PRESET": "speedrun"}).preset == "speedrun"
    assert parse(["--run-name", "x"]).run_name == "x"  # dashes are accepted for underscores


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), ("off", False), ("False", False)])
def test_booleans(value, expected):
    assert parse(["--compile", value]).compile is expected


def test_a_boolean_alone_switches_it_on():
    args = parse(["--normuon", "--seed", "1", "--cautious_wd"])
    assert (args.normuon, args.seed, args.cautious_wd) == (True, 1, True)
    assert parse(["--normuon", "false"]).normuon is False
    assert parse(["--seed", "-1", "--ns_coeffs", "-1,2,3"]).seed == -1  # a value may start with one dash
    with pytest.raises(cfg.HelpRequested):
        parse(["--normuon", "-h"])  # help, not normuon='-h'


def test_a_bad_boolean_is_refused_naming_every_accepted_spelling():
    with pytest.raises(train_gpt.ConfigError) as error:
        parse(["--compile", "maybe"])
    assert str(error.value) == "--compile='maybe': expected a boolean (true/false, 1/0, yes/no, on/off)"


BAD = [
    (["--bogus", "1"], {}, 1, "unknown option --bogus"),
    (["--num_layer", "3"], {}, 1, "did you mean --num_layers"),
    (["--num_iterations", "ten"], {}, 1, "--num_iterations='ten': expected int"),
    (["--compile", "maybe"], {}, 1, "--compile='maybe': expected a boolean"),
    ([], {"MUON_LR": "fast"}, 1, "MUON_LR='fast': expected float"),
    (["--train_seq_len", "1000"], {}, 1, "--train_seq_len=1000: must be a multiple of attn_block_size=64"),
    (["--preset", "speedrun"], {}, 3, "world size 3 must divide"),
    (["--ns_method", "svd"], {}, 1, "--ns_method='svd': expected one of newton_schulz, polar_express, aol"),
    (["--run_name", "../escape"], {}, 1, "--run_name='../escape': use letters, digits"),
    (["--window_pattern", "LLL"], {}, 1, "--window_pattern='LLL': needs one letter L or S per layer (4)"),
    (["--num_layers", "1", "--window_pattern", "L", "--num_value_embeds", "0"], {}, 1, "--num_layers=1: must be at least 2"),
    (["--num_heads", "3"], {}, 1, "--head_dim=64: num_heads x head_dim must equal model_dim=128"),
    (["--cooldown_frac", "1.5"], {}, 1, "--cooldown_frac=1.5: must lie in [0, 1]"),
    (["--preset", "gpu"], {}, 1, "--preset='gpu': expected one of speedrun, cpu"),
    (["--num_iterations"], {}, 1, "missing value"),
    (["--seed", "--normuon"], {}, 1, "--seed: missing value"),  # not --seed=--normuon
    (["positional"], {}, 1, "unexpected argument"),
    (["--device", "cuda"], {}, 1, "no CUDA device"),
    (["--adam_beta1", "1"], {}, 1, "--adam_beta1=1.0: must lie in [0, 1)"),
    (["--attention_free_layers", "2"], {}, 1, "blocks [2] take value embeddings"),  # the cpu preset's layout 1.01
    (["--attention_free_layers", "0,2", "--num_value_embeds", "1", "--value_embed_layers", "", "--paired_head_layers", ""],
     {}, 1, "blocks [0] take value embeddings"),  # the layout num_value_embeds makes (2025)
    (["--rotary_base", "0"], {}, 1, "--rotary_base=0.0: must be positive"),
    (["--key_offset", "--yarn", "false", "--paired_head_layers", ""], {}, 1, "--key_offset=True: needs --yarn"),
    (["--value_embed_layers", "012"], {}, 1, "--value_embed_layers='012': needs one character per layer (4)"),
    (["--value_embed_layers", "0..3"], {}, 1, "an index below num_value_embeds=2"),
    (["--skip_layers", "6,3"], {}, 1, "--skip_layers='6,3': expected two block indices, from and to"),
    (["--skip_layers", "3"], {}, 1, "--skip_layers='3': expected two block indices"),
    (["--backout_layer", "4"], {}, 1, "--backout_layer=4: must lie in [-1, 4)"),
    (["--bigram_vocab_size", "1"], {}, 1, "--bigram_vocab_size=1: needs at least 2 rows"),
    (["--bigram_vocab_size", "-5"], {}, 1, "--bigram_vocab_size=-5: must not be negative"),
    (["--init", "2024"], {}, 1, "--init='2024': expected one of 2025, 2026"),
    (["--adam_table", "2026", "--embed_lr_mult", "50"], {}, 1,
     "--embed_lr_mult: --adam_table 2026 takes Adam's betas and lr multipliers from ADAM_2026"),
    (["--adam_table", "2026", "--adam_beta2", "0.9"], {}, 1,
     "--adam_beta2: --adam_table 2026 takes Adam's betas and lr multipliers from ADAM_2026"),  # Muon's matrices
    (["--adam_weight_decay", "-1"], {}, 1, "--adam_weight_decay=-1.0: must not be negative"),
    (["--muon_decay", "lr3"], {}, 1, "--muon_decay='lr3': expected one of lr, lr2"),
    (["--adam_every", "2", "--save_checkpoint", "--checkpoint_every", "3"], {}, 1,
     "--checkpoint_every=3: must be a multiple of adam_every=2"),
    (["--adam_every", "0"], {}, 1, "--adam_every=0: must be at least 1"),
    (["--embed_split_frac", "1.5"], {}, 1, "--embed_split_frac=1.5: must lie in [0, 1]"),
    (["--init", "2025"], {}, 1, "--init=2025: its zero head is the tied embedding (--embed_split_frac=0.666667)"),
    (["--mlp_proj_lr_mult", "0"], {}, 1, "--mlp_proj_lr_mult=0.0: must be positive"),
    (["--paired_head_layers", "0", "--yarn", "false", "--key_offset", "false"], {}, 1,
     "--paired_head_layers='0': needs --yarn"),
    (["--paired_head_layers", "7", "--yarn"], {}, 1, "--paired_head_layers='7': indices must be blocks with attention"),
    (["--paired_head_layers", "0,x", "--yarn"], {}, 1, "--paired_head_layers='0,x': expected comma-separated"),
    (["--paired_head_layers", "0", "--yarn", "--num_heads", "3", "--head_dim", "256", "--model_dim", "768"], {}, 1,
     "needs an even num_heads, not 3"),
    (["--muon_lr", "inf"], {}, 1, "--muon_lr=inf: must be a finite number"),
    ([], {"ADAM_LR": "nan"}, 1, "--adam_lr=nan: must be a finite number"),
    (["--weight_decay", "-inf"], {}, 1, "--weight_decay=-inf: must be a finite number"),
    (["--check_every", "0"], {}, 1, "--check_every=0: must be positive"),
    (["--adam_eps", "0"], {}, 1, "--adam_eps=0.0: must be positive"),  # a row no token has reached: 0/0
    # in parse_config, which bench/ab.py and gpu_proof.py ask before their first run
    (["--temperature", "0.5"], {}, 1, "--temperature: only --sample reads it"),
    (["--ns_coeffs", "3,-4.7"], {}, 1, "--ns_coeffs='3,-4.7': expected finite a,b,c triples"),
    (["--ns_coeffs", "3,-4,2;x,1,1"], {}, 1, "--ns_coeffs='3,-4,2;x,1,1': expected finite a,b,c triples separated by ';'"),
    (["--ns_coeffs", "3,-4,inf"], {}, 1, "--ns_coeffs='3,-4,inf': expected finite a,b,c triples separated by ';'"),
    (["--seed", str(-2 ** 63 - 1)], {}, 1, f"--seed={-2 ** 63 - 1}: must lie in [-2^63, 2^64 - 1)"),
    # seed + 1 overflowed in warmup
    ([], {"SEED": str(2 ** 64 - 1)}, 1, f"--seed={2 ** 64 - 1}: must lie in [-2^63, 2^64 - 1)"),
]


@pytest.mark.parametrize("argv, environ, world_size, needle", BAD)
def test_bad_values_name_the_field(argv, environ, world_size, needle):
    with pytest.raises(train_gpt.ConfigError) as err:
        parse(argv, environ, world_size)
    message = str(err.value)
    assert needle in message and "\n" not in message


def test_flex_attention_block_size_is_checked_where_cuda_trains():
    """The cpu preset's 64-token mask blocks failed to compile in FlexAttention's CUDA kernels on
    an H100 (its tiles are up to 128 tokens), after start-up; now refused before anything starts.
    On CPU (SDPA) and for --sample (SDPA everywhere) any block size is fine."""
    with pytest.raises(train_gpt.ConfigError) as err:
        parse(["--preset", "cpu"], cuda=True)
    assert str(err.value) == ("--attn_block_size=64: on CUDA, FlexAttention's kernels need a multiple of 128 "
                              "(a new run: --attn_block_size 128; any run, a resumed one too: --device cpu)")
    assert parse(["--preset", "cpu", "--attn_block_size", "128"], cuda=True).attn_block_size == 128
    assert parse(["--preset", "cpu", "--device", "cpu"], cuda=True).attn_block_size == 64
    assert parse(["--preset", "cpu", "--sample", "run.pt"], cuda=True).attn_block_size == 64
    assert parse(["--preset", "speedrun", "--attn_block_size", "256"], cuda=True).attn_block_size == 256


def test_main_rejects_before_touching_anything(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    environ = {"WORLD_SIZE": "3", "RANK": "0", "PRESET": "speedrun", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert train_gpt.main([f"--log_dir={log_dir}"], environ) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train_gpt.py: error: --micro_batches=8")
    assert not log_dir.exists()
    assert not train_gpt.dist.is_initialized()


def test_script_exit_status_and_single_line(tmp_path):
    env = dict(os.environ, NUM_ITERATIONS="-4")
    proc = subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), "--preset", "cpu"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "train_gpt.py: error: NUM_ITERATIONS=-4: must be positive"  # as set
    assert list(tmp_path.iterdir()) == []


def help_text(argv, environ=None, cuda=False):
    with pytest.raises(cfg.HelpRequested) as help_info:
        parse(argv, environ, cuda=cuda)
    return str(help_info.value).splitlines()


def test_a_fields_comment_continued_on_the_next_lines_is_its_help_text_whole():
    import inspect
    continued = [line.strip().lstrip("#").strip() for line in inspect.getsource(train_gpt.Hyperparameters).splitlines()
                 if line.strip().startswith("#") and len(line) - len(line.lstrip()) > 8]
    assert len(continued) >= 5  # yarn's, attn_backend's, muon_update_scale's, ...
    help_lines = help_text(["--help"])
    for text in continued:
        assert any(text in line for line in help_lines if line.startswith("  --")), text
    [yarn] = [line for line in help_lines if line.startswith("  --yarn=")]
    assert "stretches it and raises attn_scale (false: pairs (i, i + head_dim/2), fp32, 2025) [true|false]" in yarn


def test_help_shows_the_active_values_descriptions_and_choices():
    lines = help_text(["--help", "--preset", "cpu"], {"SEED": "7"})  # --help may come first
    fields = {line.split()[0]: line for line in lines if line.startswith("  --")}
    assert [name.split("=")[0] for name in fields] == [f"--{f.name}" for f in train_gpt.dataclasses.fields(
        train_gpt.Hyperparameters)]
    assert "--num_layers=4" in fields and "--seed=7" in fields  # the cpu preset's value, then the environment's
    assert fields["--seed=7"].endswith("(set by SEED in the environment)")
    assert sum("in the environment)" in line for line in fields.values()) == 1
    # descriptions are the dataclass comments, choices where the set is fixed
    assert fields["--num_layers=4"].endswith("int    transformer blocks")
    assert fields["--ns_method=polar_express"].endswith("[newton_schulz|polar_express|aol]")
    compile_help = "torch.compile the model (--compile_scope: in how many graphs), the orthogonalizer [true|false]"
    assert fields["--compile=False"].endswith(compile_help)
    assert fields["--compile_scope=model"].endswith("alone [model|blocks]")
    assert fields["--preset=cpu"].endswith("[speedrun|cpu]")
    assert all(len(line.split(None, 2)) == 3 for line in fields.values())  # every field is described
    speedrun = help_text(["--help"], cuda=True)  # the default preset with CUDA
    assert any(line.startswith("  --num_layers=11 ") for line in speedrun)
    assert "(--preset, default speedrun on this machine)" in speedrun[1]


def test_help_with_values_that_are_refused_says_so_last():
    lines = help_text(["--help", "--preset", "cpu", "--train_seq_len", "1000"])
    assert "  --train_seq_len=1000 " in "\n".join(lines)
    assert lines[-1] == "These values are refused: --train_seq_len=1000: must be a multiple of attn_block_size=64"
    assert not any(line.startswith("These values") for line in help_text(["--help", "--preset", "cpu"]))
    from_environment = help_text(["--help", "--preset", "cpu"], {"NUM_ITERATIONS": "-4"})
    assert from_environment[-1] == "These values are refused: NUM_ITERATIONS=-4: must be positive"


def test_help_says_when_the_cpu_preset_reads_the_embedded_sample(monkeypatch):
    monkeypatch.setattr(train_gpt, "REPO_DIR", "/nonexistent")  # no FineWeb there
    note = "FineWeb's shards are not all in /nonexistent/data/fineweb10B: this run reads the embedded sample, "
    lines = help_text(["--help", "--preset", "cpu"])
    assert lines[-1].startswith(note)
    # the two rows show the files the run reads, not FineWeb's globs
    assert [line.split()[0] for line in lines if line.startswith(("  --train_files=", "  --val_files="))] == [
        "--train_files=data/sample/sample_train_*.bin", "--val_files=data/sample/sample_val_*.bin"]
    for argv in (["--train_files", "x"], ["--val_files", "x"], ["--preset", "speedrun"]):
        lines = help_text(["--help", "--preset", "cpu", *argv])
        assert not any(line.startswith(note[:40]) for line in lines)
        assert not any("data/sample/" in line for line in lines)


@pytest.mark.slow
def test_script_help_exits_0(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), "--preset", "cpu", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    assert "  --num_iterations=120 " in proc.stdout and list(tmp_path.iterdir()) == []
    # `--help | head -1`: the reader is gone before the help is written; no traceback
    read_end, write_end = os.pipe()
    os.close(read_end)
    gone = subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), "--preset", "cpu", "--help"], cwd=tmp_path,
                          stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write_end)
    assert gone.returncode == 0 and gone.stderr == ""


@pytest.mark.parametrize("environ, needle", [({"RANK": "x"}, "RANK='x'"), ({"RANK": "²"}, "RANK='²'"),  # a digit to isdigit()
                                             ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'")])
def test_malformed_torchrun_variables(capsys, environ, needle):
    assert train_gpt.main([], environ) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {"SAMPLE": "nowhere.pt"}, "SAMPLE='nowhere.pt': no such file"),
    (["--sample", "nowhere.pt"], {"SAMPLE": "other.pt"}, "--sample='nowhere.pt': no such file"),
    ([], {"PROMPT": "Hi"}, "PROMPT: only --sample reads it"),
    (["--top_k", "5"], {}, "--top_k: only --sample reads it (--sample CHECKPOINT --top_k ...)"),  # was ignored
    ([], {"TEMPERATURE": "0.5"}, "TEMPERATURE: only --sample reads it"),
    ([], {"SAMPLE": "a.pt", "RESUME": "b.pt"}, "SAMPLE and RESUME: choose one"),
    (["--resume=b.pt"], {"SAMPLE": "a.pt"}, "SAMPLE and --resume: choose one"),
    (["--prompt=--sample"], {"SAMPLE": "a.pt"}, "SAMPLE='a.pt': no such file"),  # '--sample' is the prompt
    (["--check-every=0"], {"CHECK_EVERY": "5"}, "--check_every=0: "),
    ([], {"CHECK_EVERY": "0"}, "CHECK_EVERY=0: "),
])
def test_errors_name_a_field_as_it_was_set(tmp_path, capsys, argv, environ, expected):
    """A field the environment set is named as it is there (a stray SAMPLE in the shell must not
    blame a --sample the user never passed); one the command line set, as it is there."""
    assert train_gpt.main([*argv, f"--log_dir={tmp_path}"], environ) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"train_gpt.py: error: {expected}"), err
    assert list(tmp_path.iterdir()) == []


COMMON_VARIABLES = ("PATH HOME USER SHELL LANG TERM PWD HOSTNAME CUDA_HOME CUDA_VISIBLE_DEVICES LD_LIBRARY_PATH "
                    "PYTHONPATH OMP_NUM_THREADS MKL_NUM_THREADS MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK "
                    "LOCAL_WORLD_SIZE GROUP_RANK ROLE_RANK NODE_RANK NPROC NNODES TORCHELASTIC_RUN_ID "
                    "TRITON_INTERPRET TORCH_LOGS PYTORCH_CUDA_ALLOC_CONF NCCL_DEBUG NCCL_IB_DISABLE "
                    "NCCL_SOCKET_IFNAME CUDA_DEVICE_MAX_CONNECTIONS SLURM_JOB_ID SLURM_PROCID HF_HOME WANDB_PROJECT "
                    "TMPDIR VIRTUAL_ENV CONDA_PREFIX TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR CUDA_LAUNCH_BLOCKING "
                    "OUT NUM_THREADS MODEL_DIR").split()


def test_a_variable_that_nearly_names_a_field_is_said_to_be_ignored(tmp_path, capsys):
    """NUM_ITERATION=5 (a letter short) was ignored in silence; now a line says so, before
    anything else (here the log folder then fails; also before --help). Common variables never
    match."""
    assert cfg.near_misses_in_environment({name: "1" for name in COMMON_VARIABLES}) == []
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    environ = {"NUM_ITERATION": "5", "MICRO_BATCH": "2", "PATH": "/bin", "OMP_NUM_THREADS": "1", "SEED": "3",
               "num_iteration": "4"}  # lower case is no field's way
    assert train_gpt.main([f"--log_dir={blocker / 'records'}"], environ) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[:2] == ["ignored: MICRO_BATCH=2 in the environment names no field (did you mean MICRO_BATCHES?)",
                       "ignored: NUM_ITERATION=5 in the environment names no field (did you mean NUM_ITERATIONS?)"]
    assert len(err) == 3 and "cannot create the folder" in err[2]
    assert train_gpt.main(["--help"], environ) == 0
    assert capsys.readouterr().err.strip().splitlines() == err[:2]


def test_unwritable_log_dir_is_rejected_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert train_gpt.main([f"--log_dir={blocker / 'records'}"], {}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    folder = train_gpt.run_folder(train_gpt.Hyperparameters(log_dir=str(blocker / "records")))
    assert err == [f"train_gpt.py: error: --log_dir='{blocker / 'records'}': cannot create the folder {folder!r} "
                   "(Not a directory)"]
    # a folder that does not exist yet but can be created is fine
    cfg.check_log_dir(train_gpt.Hyperparameters(log_dir=str(tmp_path / "new" / "records")))


def test_ns_coeffs_parse():
    option = parse(["--ns_coeffs", " 3.4445,-4.775,2.0315 ; 1,0,0; "]).ns_coeffs
    assert train_gpt.parse_ns_coeffs(option) == [(3.4445, -4.775, 2.0315), (1.0, 0.0, 0.0)]
    assert train_gpt.parse_ns_coeffs("") is None


@pytest.mark.parametrize("steps, every, left", [(1600, 2, 0), (1601, 2, 1), (7, 3, 1), (8, 3, 2), (5, 1, 0), (1, 2, 1)])
def test_a_run_ending_between_adam_steps_is_warned_of(steps, every, left):
    """Adam steps on steps every-1, 2 every-1, ...: the last steps % every steps' gradients are
    summed and never applied (the record's 1600 steps, every other, end on one)."""
    args = train_gpt.Hyperparameters(num_iterations=steps, adam_every=every)
    applied = [s for s in range(steps) if train_gpt.adam_steps_at(s, args)]
    assert steps - 1 - (applied[-1] if applied else -1) == left
    warned = cfg.unapplied_adam_steps(args)
    if steps < every:  # no Adam step at all
        assert warned == [f"warning: --num_iterations={steps} is below adam_every={every}: Adam never steps (the "
                          "embeddings, head and scalars keep their initial values)"]
        return
    assert warned == ([f"warning: --num_iterations={steps} is not a multiple of adam_every={every}: the last {left} "
                       "step(s)' Adam gradients (embeddings, head, scalars) are never applied"] if left else [])


def test_adam_betas_are_taken_under_the_2026_table_where_the_matrices_train_on_adam():
    """The 2026 table fixes the embeddings', head's and scalars' betas; with --matrix_optimizer adam the
    block matrices train at --adam_beta1/2, so those options are no longer refused."""
    args = cfg.parse_config(["--preset=cpu", "--adam_table=2026", "--matrix_optimizer=adam", "--adam_beta1=0.7",
                                "--adam_beta2=0.9"], {}, world_size=1, cuda_available=False)
    model = train_gpt.GPT(args, train_gpt.Hardware.detect(args))
    specs = {s.name: s for s in train_gpt.param_specs(model, args)}
    matrices = [s for s in specs.values() if s.group == "matrix" and not s.name.endswith("gate_w")]
    assert matrices and all(s.betas == (0.7, 0.9) and s.optimizer == "adam" for s in matrices)
    assert specs["lm_head_w"].betas == train_gpt.ADAM_2026["head"][:2]  # the table's, untouched
    with pytest.raises(train_gpt.ConfigError, match="--embed_lr_mult: --adam_table 2026"):
        cfg.parse_config(["--preset=cpu", "--adam_table=2026", "--matrix_optimizer=adam", "--embed_lr_mult=2"],
                            {}, world_size=1, cuda_available=False)
