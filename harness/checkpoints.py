"""Checkpoints: with --save_checkpoint, rank 0 writes records/<date>_<run_name>/<run_id>.pt beside
the log at the end (and every --checkpoint_every steps), outside the timed clock: the model, the
whole optimizer state gathered into its world-size-1 layout (so a run may resume at another world
size; the state is re-split there), the step and training time so far, the configuration, the RNG
state, the loader's position in the token stream and a hash of train_gpt.py. A file is written
under a temporary name and renamed, so a crash never leaves a .pt that looks complete. --resume
continues such a run exactly where it stopped."""

import dataclasses
import fcntl
import hashlib
import os
import platform
import re
import time
import zipfile

import torch
import torch.distributed as dist

import train_gpt as tg

CHECKPOINT_FORMAT = 1
# Fields of this machine and this command: a resumed run takes them from its own command line,
# environment and preset, never from the checkpoint (whose machine may have had other GPUs, or none).
LAUNCH_FIELDS = {"device", "threads", "compile", "compile_scope", "overlap_comms", "ns_backend", "attn_backend",
                 "dist_timeout_s", "check_every", "warmup_steps"}
# Fields that choose where, how fast or with what logging training runs, not what it computes
# (device, ns_backend, attn_backend, compile, compile_scope, compile_adam and CPU threads change rounding only):
# a run may resume with other values of these. compile_adam is no field of the machine: a resumed
# run keeps the rounding it chose, unless told otherwise. The data may move to another folder: the
# loader's shard is checked by name and length (check_position below).
RESUME_FREE_FIELDS = LAUNCH_FIELDS | {"compile_adam", "run_name", "log_dir", "target_val_loss", "val_every",
                                      "train_files", "val_files", "save_checkpoint", "checkpoint_every", "resume",
                                      "sample", "prompt", "max_new_tokens", "temperature", "top_k"}


class CheckpointError(tg.DataError):
    """A checkpoint of the same configuration that still does not fit (written by other code)."""


def checkpoint_path_of(log):
    """records/<date>_<run_name>/<run_id>.pt beside the log (None on ranks other than 0)."""
    path = getattr(log, "path", None)
    return os.path.splitext(path)[0] + ".pt" if path else None


def code_fingerprint():
    return hashlib.sha256(tg.source_code()).hexdigest()


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
    optimizer.gather_fp32_masters()  # with bf16 traffic a rank holds only its own matrices' in full
    optimizer_state = optimizer_state_dict(optimizer)
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
            raise tg.ConfigError(f"--{option}={path!r}: not a checkpoint written by train_gpt.py (not a torch.save file)")
        if verify:  # torch.load reads the bytes as they are: a changed one goes unseen
            with zipfile.ZipFile(path) as archive:
                damaged = archive.testzip()
            if damaged is not None:
                raise tg.ConfigError(f"--{option}={path!r}: damaged: {damaged} fails its CRC check (a copy cut short "
                                  "or changed on disk)")
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise tg.ConfigError(f"--{option}={path!r}: no such file") from None
    except IsADirectoryError:
        raise tg.ConfigError(f"--{option}={path!r}: is a folder, not a checkpoint file") from None
    except OSError as e:
        raise tg.ConfigError(f"--{option}={path!r}: cannot read ({e.strerror or e})") from None
    except (tg.ConfigError, tg.harness("launch").Interrupted):
        raise
    except Exception as e:  # torch raises many kinds for a file that is not a checkpoint
        reader = "zipfile" if isinstance(e, zipfile.BadZipFile) else "torch.load"
        raise tg.ConfigError(f"--{option}={path!r}: not a checkpoint written by train_gpt.py, or a damaged one "
                          f"({reader}: {tg.first_line(e)})") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise tg.ConfigError(f"--{option}={path!r}: not a checkpoint written by train_gpt.py")
    if args is not None:
        check_resumable(checkpoint, path, args)
    return checkpoint


def check_resumable(checkpoint, path, args, from_environment=frozenset()):
    """Refuse to resume a checkpoint trained with another configuration (naming every field that
    differs, and the variable where the environment set it) or
    one that has nothing left to train."""
    here = dataclasses.asdict(args)
    saved = with_new_fields_at_default(checkpoint["config"])
    differ = [name for name in sorted((saved.keys() | here.keys()) - RESUME_FREE_FIELDS)
              if saved.get(name, "(absent)") != here.get(name, "(absent)")]
    if differ:
        raise tg.harness("config").CheckpointMismatch(f"--resume={path!r}: trained with a different configuration: " + ", ".join(
            f"{n}={saved.get(n, '(absent)')!r} there, {here.get(n, '(absent)')!r} here"
            + (f" (set by {n.upper()} in the environment)" if n in from_environment else "") for n in differ))
    if checkpoint["step"] >= args.num_iterations:
        raise tg.ConfigError(f"--resume={path!r}: saved at the run's last step ({checkpoint['step']}/"
                          f"{args.num_iterations}); nothing is left to train")


def with_new_fields_at_default(config):
    """A checkpoint's configuration where a field added since it was written (a fork's new flag)
    counts at its default in Hyperparameters."""
    return {**dataclasses.asdict(tg.Hyperparameters()), **config}


def resumed_fields(checkpoint, path, set_fields):
    """{field: value} a resumed run takes from its checkpoint: what this command leaves unset,
    except this machine's fields (LAUNCH_FIELDS)."""
    config = with_new_fields_at_default(checkpoint["config"])
    if config["preset"] not in tg.PRESETS:
        raise tg.ConfigError(f"--resume={path!r}: trained with the preset {config['preset']!r}, which this "
                          f"train_gpt.py does not have ({', '.join(tg.PRESETS)})")
    kept = set(set_fields) | LAUNCH_FIELDS | {"resume"}
    return {name: value for name, value in config.items() if name in tg.harness("config").FIELD_NAMES - kept}


def zip_crc_digest(path):
    """A digest of the CRCs in a zip's directory (no read of its contents), as an int64."""
    with zipfile.ZipFile(path) as archive:
        crcs = sorted((info.filename.split("/", 1)[-1], info.CRC) for info in archive.infolist())
    return int.from_bytes(hashlib.sha256(repr(crcs).encode()).digest()[:7], "little")


def check_ranks_hold_one_checkpoint(path, identity, ranks, hw):
    """Every rank reads --resume itself, on several machines each its own copy: one copied before
    the last periodic save holds an older step under the same name, and the ranks would train on
    from different states. identity: (zip_crc_digest, step) of this rank's file."""
    every = tg.harness("launch").gathered(identity, ranks, hw)
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
        raise (CheckpointError if ranks.local_rank == 0 else tg.harness("launch").PeerDataError)(message)


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
        check_optimizer_state_fits(optimizer, checkpoint["optimizer"])
    except KeyError as e:
        misfits.append(f"the optimizer state has no {e}")
    except (ValueError, TypeError) as e:
        misfits.append(tg.first_line(e))
    if misfits:
        raise CheckpointError(f"{path}: does not fit this model ({'; '.join(misfits[:3])}"
                              f"{f'; {len(misfits) - 3} more' if len(misfits) > 3 else ''})")


def restore_checkpoint(checkpoint, path, model, optimizer, ranks, hw, log):
    """Load model, optimizer (this rank's share) and RNG state; returns (step, training time in ms)."""
    try:
        model.load_state_dict(checkpoint["model"])
        load_optimizer_state(optimizer, checkpoint["optimizer"])
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


def last_checkpoint_line(step, path, resumed):
    """Where a run that failed or was stopped can go on from; before the line that says why."""
    return (f"last checkpoint: step {step}, {path}{', which this run resumed' if resumed else ''} (--resume {path} "
            "goes on from there)")


def optimizer_state_layouts(optimizer):
    """Each of the optimizer's state_tensors() with how it is split over ranks: "matrices" (dim 0: this rank's
    matrices of a Muon shape group; with each one's position in the group, -1 for padding, and
    the group's size), "rows" (an Adam shard's rows; with the parameter's row count) or
    "replicated" (the small parameters' state, the same on every rank)."""
    groups = {id(t): g for g in optimizer.muon_groups for t in g.values() if isinstance(t, torch.Tensor)}
    shards = {id(t): s for s in optimizer.adam_shards for t in vars(s).values() if isinstance(t, torch.Tensor)}
    for t in optimizer.state_tensors():
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


def optimizer_state_dict(optimizer):
    """The whole state in its world-size-1 layout, on the CPU: sharded tensors are gathered to
    rank 0 and put in global order, so it can be loaded at any world size. Every rank must call
    it; rank 0 gets the state, the others None."""
    W, master = optimizer.world_size, optimizer.rank == 0
    tensors = []
    for t, layout, info in optimizer_state_layouts(optimizer):
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
    return dict(adam_steps=optimizer.adam_steps, tensors=tensors) if master else None


def check_optimizer_state_fits(optimizer, state):
    """ValueError where an optimizer_state_dict() (of any world size) does not fit optimizer; else
    the layouts it is loaded into."""
    layouts = list(optimizer_state_layouts(optimizer))
    if len(state["tensors"]) != len(layouts):
        raise ValueError(f"optimizer state has {len(state['tensors'])} tensors, this optimizer {len(layouts)}")
    for (t, layout, info), full in zip(layouts, state["tensors"]):
        expected = tuple(t.shape) if layout == "replicated" else (info[1] if layout == "matrices" else info, *t.shape[1:])
        if tuple(full.shape) != expected:
            raise ValueError(f"optimizer state tensor of shape {tuple(full.shape)} where {expected} was expected")
    return layouts


@torch.no_grad()
def load_optimizer_state(optimizer, state):
    """Load into optimizer this rank's share of an optimizer_state_dict() saved at any world size."""
    for (t, layout, info), full in zip(check_optimizer_state_fits(optimizer, state), state["tensors"]):
        full = full.to(t.device, t.dtype)
        if layout == "matrices":
            index = info[0]
            t.zero_()
            t[index >= 0] = full[index[index >= 0]]
        elif layout == "rows":
            part = full[optimizer.rank * t.shape[0]:(optimizer.rank + 1) * t.shape[0]]
            t.zero_()
            t[:part.shape[0]] = part
        else:
            t.copy_(full)
    optimizer.adam_steps = state["adam_steps"]


def check_position(state, files):
    """A checkpoint's state() must name the file at its index among these training files, of the
    same length: the run's glob may match other files since (a shard added, removed or renamed),
    or the data may have moved, and a shard of the same name with another length is other data."""
    shard = state["shard"]
    if shard >= len(files) or os.path.basename(files[shard]) != state["file"]:
        here = f"which here is {files[shard]}" if shard < len(files) else f"but here there are {len(files)}"
        raise tg.DataError(f"{state['file']}: the checkpoint's loader was in this shard, training file {shard + 1} "
                        f"in name order, {here}: the files --train_files matches must be the run's, none "
                        "added, removed or renamed")
    tokens = tg.read_shard_header(files[shard])
    if state.get("tokens", tokens) != tokens:   # (checkpoints from before this check lack the count)
        raise tg.DataError(f"{files[shard]}: holds {tokens:,} tokens, but the checkpoint's shard of this name held "
                        f"{state['tokens']:,}: not the data the run was trained on")


class Checkpoints:
    """train()'s checkpoints: the --resume checkpoint, read in set-up and restored after warmup; the
    saves beside the log; the line naming where a run that failed can go on from."""

    def __init__(self, args, ranks, hw, log):
        self.args, self.ranks, self.hw, self.log = args, ranks, hw, log
        self.path = checkpoint_path_of(log) if args.save_checkpoint else None
        if args.save_checkpoint and ranks.is_master and self.path is None:
            raise ValueError("save_checkpoint: the checkpoint goes beside the log, so train() needs a RunLog")
        self.checkpoint = self.identity = None
        self.resumed_step = self.saved_step = 0
        if args.resume:  # parse_config checked it (its CRCs too); a read that fails now fails on one rank alone
            self.checkpoint = read_checkpoint(args.resume, "resume", args, verify=False)
            self.identity = zip_crc_digest(args.resume), self.checkpoint["step"]
            self.resumed_step = self.checkpoint["step"]
        self.resuming = self.checkpoint is not None

    def check_fits(self, model, optimizer, train_files):
        """In set-up: the loader's shard among train_files, the weights and optimizer state in the
        model and optimizer built here."""
        if self.checkpoint is not None:
            if self.checkpoint["loader"] is not None:
                check_position(self.checkpoint["loader"], train_files)
            check_checkpoint_fits(self.checkpoint, self.args.resume, model, optimizer)

    def check_ranks_hold_one(self):
        if self.checkpoint is not None and self.ranks.world_size > 1:
            check_ranks_hold_one_checkpoint(self.args.resume, self.identity, self.ranks, self.hw)

    def restore(self, model, optimizer):
        """After warmup: (step, training time in ms, the loader's state, the validations so far)."""
        checkpoint, self.checkpoint, self.resuming = self.checkpoint, None, False  # unmapped once copied in
        try:
            step, train_time_ms = restore_checkpoint(checkpoint, self.args.resume, model, optimizer, self.ranks,
                                                     self.hw, self.log)
        except CheckpointError:
            self.resumed_step = 0  # it does not fit: no line offers to go on from it
            raise
        return step, train_time_ms, checkpoint["loader"], checkpoint["val_losses"]

    def save(self, step, train_time_ms, model, optimizer, batches, result):
        """Every rank calls this; the line of a failed write, or None."""
        error = save_checkpoint(self.path, step, train_time_ms, self.args, self.ranks, model, optimizer, batches,
                                result, self.log)
        self.saved_step = step if error is None else self.saved_step
        return error

    def log_where_to_go_on(self):
        """Before the line that says why a run failed or stopped: its last checkpoint, if any."""
        if self.ranks.is_master and (self.saved_step or self.resumed_step):
            self.log(last_checkpoint_line(self.saved_step or self.resumed_step,
                                          self.path if self.saved_step else self.args.resume, resumed=not self.saved_step))
