"""The configuration of a run, read and checked before anything starts: the command line and the
environment over the preset (with --resume, the checkpoint's values in between), each value checked
with one line naming the field as the user set it, --help, and hints for near misses."""

import contextlib
import dataclasses
import difflib
import inspect
import io
import math
import os
import re
import tempfile
import tokenize

import torch

import train_gpt as tg

FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(tg.Hyperparameters)}
FIELD_NAMES = frozenset(FIELD_TYPES)
FLEX_TILE = 128  # on CUDA, --attn_block_size must be a multiple (check_config says why)
# Fields that take one of a fixed set of values (booleans aside); check_config and --help read this.
CHOICES = dict(preset=tuple(tg.PRESETS), ns_method=tg.NS_METHODS, ns_backend=("auto",) + tg.NS_BACKENDS,
               muon_update_scale=("2025", "moonlight", "aspect"), muon_decay=("lr", "lr2"), matrix_optimizer=("muon", "adam"), device=("auto", "cpu", "cuda"),
               compile_scope=("model", "blocks"), init=("2025", "2026"), adam_table=("2025", "2026"),
               fp8_scales=("bounded", "2026"), ce_backend=("auto",) + tg.NS_BACKENDS,
               mlp_backend=("auto",) + tg.NS_BACKENDS, attn_backend=("flex", "varlen"))


class CheckpointMismatch(tg.ConfigError):
    """A set field that the --resume or --sample checkpoint's configuration contradicts."""


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
        raise tg.ConfigError(f"{option}={text!r}: expected a boolean (true/false, 1/0, yes/no, on/off)")
    try:
        return kind(text)
    except ValueError:
        raise tg.ConfigError(f"{option}={text!r}: expected {kind.__name__}") from None


def command_line_options(argv):
    """{field: value text} of the options on the command line, and whether --help is among them.
    A boolean field without a value (`--normuon`, or `--normuon --seed 1`) is switched on."""
    cli = {}
    help_requested = False
    tokens = list(argv)
    previous = None  # the last option's field: a path after a *_files value is the shell's expansion of it
    while tokens:
        token = tokens.pop(0)
        if token in ("-h", "--help"):
            help_requested = True
            continue
        if not token.startswith("--"):
            expanded = (f" (probably the shell's expansion of --{previous}'s glob: quote it)"
                        if previous in ("train_files", "val_files") else "")
            raise tg.ConfigError(f"unexpected argument {token!r}: options look like --field value{expanded}")
        name, sep, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if name not in FIELD_NAMES:
            close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            raise tg.ConfigError(f"unknown option --{name}{hint}")
        if not sep:
            if tokens and not tokens[0].startswith("--") and tokens[0] != "-h":  # `--x --seed 1`: not x=--seed
                value = tokens.pop(0)
            elif FIELD_TYPES[name] is bool:
                value = "true"
            else:
                raise tg.ConfigError(f"--{name}: missing value (--{name} VALUE, or --{name}=VALUE for one "
                                  "that starts with --)")
        cli[name], previous = value, name
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
            resumed = tg.harness("checkpoints").read_checkpoint(resume_path, "resume", verify=verify_checkpoint)
            inherited = tg.harness("checkpoints").resumed_fields(resumed, resume_path, set_fields)
        except tg.ConfigError as e:
            resumed, unreadable = None, e
    machine_default = "speedrun" if cuda_available else "cpu"
    preset = cli.get("preset", environ.get("PRESET", inherited.get("preset", machine_default)))
    if preset not in tg.PRESETS:
        raise tg.ConfigError(f"--preset={preset!r}: expected one of {', '.join(tg.PRESETS)}")
    values = {**tg.PRESETS[preset], "preset": preset, **inherited}
    for f in dataclasses.fields(tg.Hyperparameters):
        if f.name in cli:
            values[f.name] = _parse_value(f"--{f.name}", cli[f.name], f.type)
        elif f.name in from_environment:
            values[f.name] = _parse_value(f.name.upper(), environ[f.name.upper()], f.type)
    args = tg.Hyperparameters(**values)
    if "checkpoint_every" in inherited and not args.save_checkpoint:  # --save_checkpoint false, alone
        args.checkpoint_every = 0
    try:
        check_config(args, world_size, cuda_available)
        sample_only = sorted({"prompt", "max_new_tokens", "temperature", "top_k"} & set_fields)
        if sample_only and not args.sample:  # a training run would ignore them in silence
            raise tg.ConfigError(f"--{sample_only[0]}: only --sample reads it (--sample CHECKPOINT --{sample_only[0]} ...)")
        table_fields = {"embed_lr_mult", "head_lr_mult", "scalar_lr_mult"} | \
            ({"adam_beta1", "adam_beta2"} if args.matrix_optimizer != "adam" else set())  # on Adam the matrices take them
        table_set = sorted(table_fields & set_fields)
        if table_set and args.adam_table == "2026":
            raise tg.ConfigError(f"--{table_set[0]}: --adam_table 2026 takes Adam's betas and lr multipliers from "
                                 "ADAM_2026 in train_gpt.py (edit it there)")
    except tg.ConfigError as e:
        if not help_requested:
            try:
                if resumed is not None and not args.sample:  # with both, "choose one" is the mistake
                    tg.harness("checkpoints").check_resumable(resumed, resume_path, args, from_environment)
                if args.sample:
                    tg.harness("sample").check_against_checkpoint(args, set_fields)
            except CheckpointMismatch:
                raise
            except Exception:  # a checkpoint that cannot be read is named once the options are right
                pass
            if unreadable is not None and field_named_by(e) not in set_fields | {None}:
                raise unreadable  # the value that fails is one the checkpoint would have replaced
            raise from_the_preset(from_the_checkpoint(e, inherited), args, set_fields | set(inherited)) from None
        refusal = named_as_set(str(e), argv, environ)
        raise HelpRequested(f"{config_help(args, cuda_available, from_environment, unreadable)}\n"
                            f"These values are refused: {refusal}") from None
    if help_requested:  # after the overrides, so the help shows the values this run would use
        raise HelpRequested(config_help(args, cuda_available, from_environment, unreadable))
    if unreadable is not None:
        raise unreadable
    if resumed is not None:  # a checkpoint of another configuration is refused before anything starts
        tg.harness("checkpoints").check_resumable(resumed, resume_path, args, from_environment)
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
    except tg.ConfigError:
        from_environment = set_by_environment({}, environ)
    subject, sep, rest = message.partition(": ")

    def as_set(match):
        return match.group(1).upper() if match.group(1) in from_environment else match.group(0)
    return re.sub(r"(?<![^ ])--(\w+)", as_set, subject) + sep + rest


def field_descriptions():
    """Each field's trailing comment in the Hyperparameters source: the one place it is written. A
    comment alone on the next lines, in the same column, continues it."""
    source = inspect.getsource(tg.Hyperparameters)
    comments = {token.start[0]: (token.start[1], token.string.lstrip("#").strip())
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    descriptions, last = {}, None  # last: (field, its comment's column)
    for number, line in enumerate(source.splitlines(), start=1):
        match = re.match(r"\s+(\w+):", line)
        column, text = comments.get(number, (None, None))
        if match:
            last = (match.group(1), column) if column is not None else None
            if last:
                descriptions[last[0]] = text
        elif last and column == last[1] and not line[:column].strip():
            descriptions[last[0]] += " " + text
        else:
            last = None
    return descriptions


def config_help(args, cuda_available, from_environment=(), unreadable=None):
    """unreadable: why the --resume checkpoint could not be read (its values are then missing)."""
    descriptions = field_descriptions()
    launch_fields = tg.harness("checkpoints").LAUNCH_FIELDS if args.resume else ()
    lines = ["usage: train_gpt.py [--field value ...]   (or FIELD=value in the environment; a true/false field "
             "alone is true)",
             f"Values are those of the {args.preset} preset"
             + (f", then of the --resume checkpoint (but for this machine's {', '.join(sorted(launch_fields))})"
                if args.resume and unreadable is None else "") + f", with this environment and command line; "
             f"presets: {', '.join(tg.PRESETS)} (--preset, default {'speedrun' if cuda_available else 'cpu'} "
             "on this machine).", ""]
    on_sample = tg.trains_on_sample(args)  # the rows show what the run reads, not the FineWeb globs it cannot
    shown = dict(zip(("train_files", "val_files"), tg.SAMPLE_FILES)) if on_sample else {}
    settings = [(f"--{f.name}={shown.get(f.name, getattr(args, f.name))}", f)
                for f in dataclasses.fields(tg.Hyperparameters)]
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
        lines.append(f"FineWeb's shards are not all in {os.path.join(tg.REPO_DIR, 'data/fineweb10B')}: this run reads "
                     f"the embedded sample, {', '.join(tg.SAMPLE_FILES)}.")
    return "\n".join(lines)


def check_log_dir(args):
    """The run's log folder must be creatable and writable: checked by creating it and a temporary
    file there (permission bits alone would pass /proc for root), then removing both again."""
    folder = tg.run_folder(args)
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
        raise tg.ConfigError(f"--log_dir={args.log_dir!r}: {doing} ({e.strerror or e})") from None
    finally:
        for path in created:
            with contextlib.suppress(OSError):
                os.rmdir(path)


def unapplied_adam_steps(args):
    """A warning (a line) where the run ends between Adam steps: its last num_iterations % adam_every
    steps' Adam gradients are summed and never applied (the record's 1600 steps, every other, are even)."""
    left = args.num_iterations % args.adam_every
    if args.num_iterations < args.adam_every:
        return [f"warning: --num_iterations={args.num_iterations} is below adam_every={args.adam_every}: Adam never "
                "steps (the embeddings, head and scalars keep their initial values)"]
    return [f"warning: --num_iterations={args.num_iterations} is not a multiple of adam_every={args.adam_every}: "
            f"the last {left} step(s)' Adam gradients (embeddings, head, scalars) are never applied"] if left else []


def data_shortfall(files, args, without_bos=()):
    """Warnings (lines) if some training shards hold no BOS token (without_bos; files are the
    others) or too few tokens for a step, or the shards cannot last num_iterations steps. Windows
    skip the tails of documents, so the need is a lower bound. A DataError where nothing would
    train (after minutes of compiling): no shard holds a BOS, where every window starts, or none
    has room for one step (the loader's rule) of the batch size schedule's first stage."""
    if not files:
        raise tg.DataError(f"{without_bos[0]}: no training shard holds a BOS token ({tg.BOS_TOKEN}), and every training "
                        "window starts at one: nothing would train (data/fineweb.py starts every document with it)")
    warnings = [f"warning: {len(without_bos)} training shard(s) hold no BOS token ({tg.BOS_TOKEN}) and are passed over, "
                f"the first {without_bos[0]}"] if without_bos else []
    sizes = [tg.read_shard_header(f) for f in files]
    stages = {}  # each train_seq_len of the schedule and the first step it trains
    for step in range(args.num_iterations):
        stages.setdefault(tg.train_seq_len_at(step, args), step)

    def room_for_a_step(seq_len):  # a shard must hold more tokens than this (the loader's rule)
        if args.train_max_doc_len:  # PackedBatches: a step's chunks of seq_len + 1 tokens, at least
            return args.micro_batches * (seq_len + 1) - 1, "{} x ({} + 1) - 1"
        return tg.step_room(args.micro_batches, seq_len), "2 x {} x {} + 1"  # TrainBatches at a shard's start
    seq_len = next(iter(stages))
    room, rule = room_for_a_step(seq_len)
    if max(sizes) <= room:
        raise tg.DataError(f"{files[sizes.index(max(sizes))]}: the largest training shard holds {max(sizes):,} tokens, "
                           f"but a step of micro_batches x train_seq_len = {args.micro_batches} x {seq_len} "
                           f"needs a shard of more than {room:,} ({rule.format(args.micro_batches, seq_len)})")
    have = sum(size for size in sizes if size > room)
    passed_over = set()
    for seq_len, first_step in stages.items():  # a batch size schedule's larger steps pass over more shards
        room, rule = room_for_a_step(seq_len)
        stage = f" from step {first_step} (train_seq_len {seq_len})" if len(stages) > 1 else ""
        if max(sizes) <= room:
            warnings.append(f"warning: no training shard holds more than {room:,} tokens "
                            f"({rule.format(args.micro_batches, seq_len)}), a step{stage}: training will stop there")
            break
        small = [f for f, size in zip(files, sizes) if size <= room and f not in passed_over]
        if small:
            warnings.append(f"warning: {len(small)} training shard(s) hold at most {room:,} tokens, too few for a step"
                            f"{stage} ({rule.format('micro_batches', 'train_seq_len')}), and are passed over, the first {small[0]}")
            passed_over.update(small)
    need = args.micro_batches * sum(tg.train_seq_len_at(step, args) for step in range(args.num_iterations))
    if have < need:
        warnings.append(f"warning: the {len(files)} training shard(s) hold {have:,} tokens but {args.num_iterations} "
                        f"steps need at least {need:,}; training will stop early (`python data/cached_fineweb10B.py N` "
                        "downloads more)")
    return warnings


def check_shapes(args, world_size, cuda_available):
    """train_gpt.check_config: the shapes the computation needs to fit together."""
    def need(ok, message):
        if not ok:
            raise tg.ConfigError(message)

    fitting = -(-args.micro_batches // world_size) * world_size
    need(args.micro_batches % world_size == 0,
         f"--micro_batches={args.micro_batches}: world size {world_size} must divide it ("
         + ("launch a number of processes that divides it, e.g. 1, 2, 4 or 8 for the speedrun's 8, or "
            if tg.uses_cuda(args, cuda_available) else "")
         + f"set --micro_batches={fitting} or another multiple of {world_size})")
    bs = args.attn_block_size
    for name in ["train_seq_len", "val_seq_len"]:
        need(getattr(args, name) % bs == 0,
             f"--{name}={getattr(args, name)}: must be a multiple of attn_block_size={bs}")
    if args.train_seq_len_schedule:
        need(all(n % bs == 0 for n in tg._numbers(args.train_seq_len_schedule, int)),
             f"--train_seq_len_schedule={args.train_seq_len_schedule!r}: each length must be a multiple of "
             f"attn_block_size={bs}")
        need(args.train_max_doc_len > 0, f"--train_seq_len_schedule={args.train_seq_len_schedule!r}: needs packed "
             "documents (--train_max_doc_len, e.g. 2048): windows from a BOS keep one length")
    need(args.val_tokens % args.val_seq_len == 0,
         f"--val_tokens={args.val_tokens}: must be a multiple of val_seq_len={args.val_seq_len}")
    need(args.vocab_size > tg.BOS_TOKEN, f"--vocab_size={args.vocab_size}: must exceed the BOS token id {tg.BOS_TOKEN}")
    need(args.num_heads * args.head_dim == args.model_dim,
         f"--head_dim={args.head_dim}: num_heads x head_dim must equal model_dim={args.model_dim} "
         f"(the q,k,v,o weights are one (4, dim, dim) tensor)")
    need(args.head_dim % 4 == 0, f"--head_dim={args.head_dim}: must be a multiple of 4 (half-truncated rotary)")
    need(args.num_layers >= 2, f"--num_layers={args.num_layers}: must be at least 2 (the U-net skips join an encoder "
         "block to a decoder block)")
    need(args.model_dim >= tg.ATTN_GATE_DIMS, f"--model_dim={args.model_dim}: must be at least {tg.ATTN_GATE_DIMS} "
         f"(the attention gate reads {tg.ATTN_GATE_DIMS} dims)")
    need(len(args.window_pattern) == args.num_layers and set(args.window_pattern) <= {"L", "S"},
         f"--window_pattern={args.window_pattern!r}: needs one letter L or S per layer ({args.num_layers})")
    try:
        free = tg._layer_list(args.attention_free_layers)
    except ValueError:
        raise tg.ConfigError(f"--attention_free_layers={args.attention_free_layers!r}: "
                             "expected comma-separated block indices") from None
    need(all(0 <= i < args.num_layers for i in free),
         f"--attention_free_layers={args.attention_free_layers!r}: indices must lie in [0, {args.num_layers})")
    need(2 * args.num_value_embeds <= args.num_layers,
         f"--num_value_embeds={args.num_value_embeds}: needs at least twice as many layers ({args.num_layers})")
    try:
        paired = tg._layer_list(args.paired_head_layers)
    except ValueError:
        raise tg.ConfigError(f"--paired_head_layers={args.paired_head_layers!r}: "
                             "expected comma-separated block indices") from None
    need(all(0 <= i < args.num_layers and i not in free for i in paired),
         f"--paired_head_layers={args.paired_head_layers!r}: indices must be blocks with attention in [0, {args.num_layers})")
    for option, used in [("paired_head_layers", paired), ("key_offset", args.key_offset)]:
        need(not used or args.yarn, f"--{option}={getattr(args, option)!r}: needs --yarn (its rotary leaves the "
             "second half of each head's dims stationary)")
    need(not paired or args.num_heads % 2 == 0, f"--paired_head_layers={args.paired_head_layers!r}: needs an even "
         f"num_heads, not {args.num_heads}")
    layout = args.value_embed_layers
    need(not layout or (len(layout) == args.num_layers and all(c == "." or c.isdigit() and int(c) < args.num_value_embeds
                                                                for c in layout)),
         f"--value_embed_layers={layout!r}: needs one character per layer ({args.num_layers}), '.' or an index below "
         f"num_value_embeds={args.num_value_embeds}")
    try:
        skip = tg._layer_list(args.skip_layers)
    except ValueError:
        skip = None
    need(skip is not None and (not skip or len(skip) == 2 and 0 <= skip[0] < skip[1] < args.num_layers),
         f"--skip_layers={args.skip_layers!r}: expected two block indices, from and to, 0 <= from < to < {args.num_layers}")
    need(args.bigram_vocab_size != 1, "--bigram_vocab_size=1: needs at least 2 rows (the last is the first position's)")
    need(-1 <= args.backout_layer < args.num_layers,
         f"--backout_layer={args.backout_layer}: must lie in [-1, {args.num_layers}) (-1: none)")
    with_value_embeds = [i for i in free if tg.value_embed_of_layer(args)[i] is not None]
    need(not with_value_embeds,
         f"--attention_free_layers={args.attention_free_layers!r}: blocks {with_value_embeds} "
         f"take value embeddings (num_value_embeds={args.num_value_embeds}) and need attention")


def check_config(args, world_size, cuda_available):
    """Reject values that cannot work, with one line naming the field and the problem: each value
    on its own, then check_shapes (the shapes fitting together), then the choices."""
    def need(ok, message):
        if not ok:
            raise tg.ConfigError(message)

    for f in dataclasses.fields(args):  # inf and nan would pass the range checks below, or fail them obscurely
        if f.type is float:
            need(math.isfinite(getattr(args, f.name)), f"--{f.name}={getattr(args, f.name)}: must be a finite number")
    positive = ["val_tokens", "train_seq_len", "val_seq_len", "micro_batches", "vocab_size", "num_layers",
                "model_dim", "num_heads", "head_dim", "mlp_ratio", "attn_block_size", "num_iterations",
                "window_growth_tokens", "muon_bucket_matrices", "dist_timeout_s", "check_every", "adam_lr", "muon_lr",
                "embed_lr_mult", "head_lr_mult", "scalar_lr_mult", "matrix_lr_mult", "mlp_proj_lr_mult", "attn_scale",
                "logit_softcap", "rotary_base", "adam_shard_min_numel", "adam_eps"]  # eps 0: an unseen token's row is 0/0
    for name in positive:
        need(getattr(args, name) > 0, f"--{name}={getattr(args, name)}: must be positive")
    for name in ["val_every", "warmup_steps", "threads", "num_value_embeds", "muon_momentum_warmup_steps",
                 "weight_decay", "checkpoint_every", "max_new_tokens", "temperature", "top_k"]:
        need(getattr(args, name) >= 0, f"--{name}={getattr(args, name)}: must not be negative")
    for name in ["extension_steps", "window_final_blocks", "window_validate_final_blocks", "muon_momentum_cooldown_steps",
                 "train_max_doc_len", "bigram_vocab_size", "logit_cap_height", "adam_weight_decay"]:
        need(getattr(args, name) >= 0, f"--{name}={getattr(args, name)}: must not be negative")
    need(args.extension_steps < args.num_iterations,
         f"--extension_steps={args.extension_steps}: must be below num_iterations={args.num_iterations}")
    need(args.muon_momentum_cooldown_steps <= args.num_iterations,
         f"--muon_momentum_cooldown_steps={args.muon_momentum_cooldown_steps}: must not exceed "
         f"num_iterations={args.num_iterations}")
    for name, kind, what in [("lr_plateaus", float, "positive numbers"), ("window_schedule", int, "positive integers"),
                             ("train_seq_len_schedule", int, "positive integers")]:
        text = getattr(args, name)
        try:
            values = tg._numbers(text, kind)
        except ValueError:
            values = None
        may_be_empty = name != "lr_plateaus"  # empty: the window grows (window_growth_tokens); train_seq_len throughout
        need(values is not None and (values or may_be_empty) and all(0 < v < math.inf for v in values),
             f"--{name}={text!r}: expected comma-separated {what}")
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
    check_shapes(args, world_size, cuda_available)
    tg.parse_ns_coeffs(args.ns_coeffs)
    for name, allowed in CHOICES.items():
        need(getattr(args, name) in allowed, f"--{name}={getattr(args, name)!r}: expected one of {', '.join(allowed)}")
    need(args.device != "cuda" or cuda_available, "--device=cuda: no CUDA device is available")
    # FlexAttention's fused CUDA kernels tile the mask in blocks of up to 128 tokens, which must
    # divide the mask's own (a block of 64 failed to compile on an H100). --sample runs SDPA.
    need(args.attn_block_size % FLEX_TILE == 0 or not tg.uses_cuda(args, cuda_available) or args.sample
         or args.attn_backend == "varlen",
         f"--attn_block_size={args.attn_block_size}: on CUDA, FlexAttention's kernels need a multiple of {FLEX_TILE} "
         f"(a new run: --attn_block_size {FLEX_TILE}; any run, a resumed one too: --device cpu)")
    # FlashAttention's window counts tokens (window_size=(W, 0)): it cannot draw a window of whole blocks
    need(args.attn_backend != "varlen" or args.token_windows, "--attn_backend=varlen: needs --token_windows true "
         "(FlashAttention's window reaches W tokens back, not whole blocks)")
    need(args.attn_backend != "varlen" or not tg.uses_cuda(args, cuda_available) or varlen_attn_available(),
         f"--attn_backend=varlen: torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn with a "
         "window_size (torch 2.11 or newer)")
    for name in ("ns_backend", "ce_backend", "mlp_backend"):
        need(getattr(args, name) != "triton" or tg.triton is not None, f"--{name}=triton: triton is not installed")
        need(getattr(args, name) != "triton" or tg.uses_cuda(args, cuda_available) or tg.TRITON_INTERPRETING,
             f"--{name}=triton: needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
    need(not (args.sample and args.resume), "--sample and --resume: choose one")
    need(args.adam_every >= 1, f"--adam_every={args.adam_every}: must be at least 1")
    need(args.checkpoint_every % args.adam_every == 0, f"--checkpoint_every={args.checkpoint_every}: must be a multiple "
         f"of adam_every={args.adam_every} (Adam's summed gradients between its steps are not saved)")
    need(0.0 <= args.embed_split_frac <= 1.0, f"--embed_split_frac={args.embed_split_frac}: must lie in [0, 1]")
    # tied to a zero head (--init 2025 starts the head at zero), every activation and gradient is zero: nothing trains
    need(not args.embed_split_frac or args.init != "2025", f"--init=2025: its zero head is the tied embedding (--embed_split_frac={args.embed_split_frac:g}), so nothing would train: add --embed_split_frac 0")
    need(not args.embed_split_frac or args.vocab_size * args.model_dim >= args.adam_shard_min_numel,
         f"--embed_split_frac={args.embed_split_frac}: the split copies the head's sharded Adam state: needs "
         f"adam_shard_min_numel <= vocab_size x model_dim")
    need(not args.checkpoint_every or args.save_checkpoint,
         f"--checkpoint_every={args.checkpoint_every}: needs --save_checkpoint true")


def varlen_attn_available():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "window_size" in inspect.signature(varlen_attn).parameters


def check_machine(args, ranks):
    """What this machine must offer the configuration, before Hardware.detect builds on it."""
    if not tg.uses_cuda(args, torch.cuda.is_available()):
        return
    gpus = torch.cuda.device_count()
    if ranks.local_world_size > gpus:
        raise tg.ConfigError(f"LOCAL_WORLD_SIZE={ranks.local_world_size} in the environment: this machine has "
                             f"{gpus} GPUs; start at most one process per GPU (NPROC={gpus} ./run.sh)")
    # torch.compile does nothing under TORCHDYNAMO_DISABLE=1, and FlexAttention then runs unfused:
    # every score held at once, and the mask's block lists, which hold the window, ignored.
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1" and not args.sample and args.attn_backend == "flex":
        raise tg.ConfigError("TORCHDYNAMO_DISABLE=1 in the environment: on CUDA FlexAttention runs only compiled "
                             "(unset it: --compile false keeps the rest eager; or --device cpu)")
    # torch._scaled_mm, the FP8 head's matrix multiply, takes multiples of 16 only: otherwise
    # found at the first step, after minutes of compiling. --sample runs the head in bf16.
    fp8 = args.fp8_head and torch.cuda.get_device_capability(ranks.local_rank) >= (8, 9)
    for name in ["model_dim", "vocab_size"]:
        if fp8 and getattr(args, name) % 16 and not args.sample:
            raise tg.ConfigError(f"--{name}={getattr(args, name)}: the FP8 head needs a multiple of 16 on this GPU "
                                 "(a new run: --fp8_head false; any run, a resumed one too: --device cpu)")


def ranks_from_env(environ):
    """train_gpt.Ranks.from_env, where a malformed or inconsistent set of torchrun's variables is a
    ConfigError."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        text, least = environ.get(name, "1" if name.endswith("WORLD_SIZE") else "0"), int(name.endswith("WORLD_SIZE"))
        if not text.isdecimal() or int(text) < least:
            raise tg.ConfigError(f"{name}={text!r} in the environment: expected an integer >= {least}")
    ranks = tg.Ranks.from_env(environ)
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
        raise tg.ConfigError(f"{problem} in the environment")
    return ranks


def missing_data_hint(args, option, is_default, on_sample):
    """What to do where the option's pattern matches no shard (the end of resolve_data_files' error)."""
    if not os.path.isdir(os.path.join(tg.REPO_DIR, "data", "sample")):  # a fork outside the repository
        return (f" (the default data lies in data/ beside train_gpt.py, and {tg.REPO_DIR} has no data/sample/: keep "
                f"a fork in the repository's root, beside data/, or set --{option})" if is_default else "")
    if on_sample:
        return ""
    if not is_default:
        return " (as set here or by the --resume checkpoint)" if args.resume else ""
    return (f" (FineWeb, the default of --{option}: run `python data/cached_fineweb10B.py`, or set --{option}"
            + ("; the embedded sample stands in only where neither option is set)" if args.preset == "cpu" else ")"))


def field_named_by(error):
    """The field a ConfigError is about (its message starts --field), or None."""
    named = re.match(r"--(\w+)", str(error))
    return named.group(1) if named else None


def from_the_preset(error, args, set_fields):
    """A ConfigError about a value nobody set (its first --field), saying it is the preset's, where
    the message does not already say how to set it (nor, with --sample, where the checkpoint gives it)."""
    name = field_named_by(error)
    if name is None or name in set_fields or name not in FIELD_NAMES or str(error).count(f"--{name}") > 1 \
            or (args.sample and name in tg.harness("sample").MODEL_FIELDS):
        return error
    return type(error)(f"{error} (the {args.preset} preset's value)")


def from_the_checkpoint(error, inherited):
    """A ConfigError about a value the --resume checkpoint gave (its first --field is in inherited),
    saying so: the user did not write it."""
    name = field_named_by(error)
    if name not in inherited:
        return error
    free = name in tg.harness("checkpoints").RESUME_FREE_FIELDS
    remedy = f"set --{name} to change it" if free else "which the resumed run must keep"
    return type(error)(f"{error} (the value of the --resume checkpoint, {remedy})")
