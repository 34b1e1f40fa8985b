"""Summarize a folder of speedrun logs and compare it with a baseline folder.

    python records/compare.py RUNS_DIR [BASELINE_DIR] [--target 3.28] [--out DIR]

A record claim rests on two statistics (see records/README.md): a one-sided
one-sample t-test that the mean final validation loss is below the target, and a
Welch t-test showing the runs are faster than a baseline measured on the same
machine. Both are only honest if every run that enters them is a complete,
distinct run of the same configuration on the same hardware. So this script
parses every `*.txt` log in a folder, excludes (with a warning, never silently)
runs that are unfinished, truncated, duplicated, or whose hardware or step count
differ from the folder's majority, prints a short table, and then writes
`statistics.md` and `val_loss_vs_time.png` into RUNS_DIR (or --out DIR). It reads
the logs and never modifies them.

Log layout: the trainer's source code, a line of exactly 100 '=', a header
(Python/PyTorch/Triton versions, nvidia-smi output or a `CPU: ...` line,
optionally `key=value` configuration lines), another line of 100 '=', then the
training lines (`step:...`, `peak memory ...`). The source code may itself contain
text that looks like training lines, so training lines are read only after the
LAST separator and header fields only between the last two (the public logs of
early 2025 add a section naming the data files after the header: then the two
before).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import re
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

SEPARATOR = "=" * 100
GENERATED_MARK = "; rerun it rather than editing this file."  # how a statistics.md of ours is known
DEFAULT_TARGET = 3.28
# Significance level the record rules use for the loss test; applied to the
# speed test too so both verdicts read the same way.
ALPHA = 0.01
# The rules ask for a baseline run the same day: machines drift (thermals,
# drivers, neighbours), so an older baseline is flagged.
MAX_BASELINE_GAP_HOURS = 24
STATISTICS_FILE = "statistics.md"
PLOT_FILE = "val_loss_vs_time.png"

_VAL_RE = re.compile(
    r"^step:(\d+)/(\d+) val_loss:(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf) train_time:(\d+)ms\b"
)
_STEP_RE = re.compile(r"^step:(\d+)/(\d+) ")
# The public logs of early 2025 close with "peak memory consumption: N MiB" (allocated only).
_PEAK_RE = re.compile(r"^peak memory (?:allocated: (\d+) MiB reserved: (\d+) MiB|consumption: (\d+) MiB)\s*$")
_PYTHON_RE = re.compile(r"^Running Python (\S+)")
_TORCH_RE = re.compile(r"^Running PyTorch (\S+)(?: compiled for CUDA (\S+))?")
_TRITON_RE = re.compile(r"^Running Triton version (?!not installed)(\S+)")
# A GPU row of nvidia-smi's device table: index, name, persistence mode, '|'.
# Process rows also start with an index but never have On/Off before a '|'.
_GPU_ROW_RE = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|\s+(\S+)")
_DRIVER_RE = re.compile(r"Driver Version: (\S+)")
# nvidia-smi's first line, e.g. "Sun Jul 13 01:45:26 2025"
_SMI_DATE_RE = re.compile(r"^(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \w{3} +\d+ \d\d:\d\d:\d\d \d{4}\s*$")
_CPU_RE = re.compile(r"^CPU: (.+?)\s*$")
_GPU_LINE_RE = re.compile(r"^GPU: (.+?) \(nvidia-smi unavailable\)\s*$")  # train_gpt.py without nvidia-smi
_KEY_VALUE_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)=(.*)$")
# The trainer's last lines when a run ends early (train_gpt.py, main() and the training loop). Each
# may come before the first step line: a signal during compilation or warmup ends the log with
# "interrupted at step 0/N", a crash in the first validation with "failed at step 0/N: ..."
# ("rank R: failed ..." on a multi-GPU run).
_ENDED_RE = re.compile(
    r"^(interrupted at step \d+/\d+ \(SIG\w+(?:(?: twice| then SIG\w+): stopped mid-step)?\)"
    r"|diverged at step \d+/\d+: .*|stopping early at step \d+/\d+|(?:rank \d+: )?failed at step \d+/\d+: .*)"
)
# A line of Python source: the public logs replace the source by one line saying it was omitted.
_CODE_RE = re.compile(r"^(import|from|def|class) ")
# Header settings that may differ between runs of one configuration: names, seeds, where files lie,
# and what changes neither the training nor its clock (checkpoints are written with the clock
# stopped; sampling options and the rendezvous timeout act outside training).
IGNORED_CONFIG = frozenset({"run_name", "seed", "log_dir", "train_files", "val_files", "save_checkpoint",
                            "checkpoint_every", "dist_timeout_s", "sample", "prompt", "max_new_tokens",
                            "temperature", "top_k", "resume"})  # a resumed run is warned about on its own
# Header values the trainer computes from the settings and world_size (train_gpt.py log_header):
# where they differ, so does a setting that is listed already, or the code (warned about on its
# own). The effective_* values depend on the machine as well and are compared.
DERIVED_CONFIG = frozenset({"parameters", "optimizer_state_bytes_per_rank", "grad_accum_steps"})
NOT_COMPARED = IGNORED_CONFIG | DERIVED_CONFIG


class FolderError(Exception):
    """A folder cannot be summarized; the message is one line for the user."""


@dataclass
class RunLog:
    """What one log says about one run. `problems` non-empty means excluded."""

    path: Path | None
    run_id: str
    total_steps: int | None = None  # N in "step:k/N"
    last_step: int | None = None  # highest k logged, for "unfinished" messages
    final_val_loss: float | None = None  # val_loss at step N
    train_time_ms: int | None = None  # train_time on the step-N val line
    val_curve: list[tuple[int, int, float]] = field(default_factory=list)
    peak_mem_allocated_mib: int | None = None
    peak_mem_reserved_mib: int | None = None
    python_version: str | None = None
    torch_version: str | None = None
    cuda_version: str | None = None
    triton_version: str | None = None
    hardware: str | None = None  # "8x NVIDIA H100 80GB HBM3" or "CPU: ... x2"
    machine: str | None = None  # nvidia-smi driver and GPU bus ids: tells machines apart
    started: datetime | None = None  # nvidia-smi's timestamp
    run_name: str | None = None
    target_val_loss: float | None = None
    config: dict[str, str] = field(default_factory=dict)  # header key=value lines
    content_hash: str = ""
    code_hash: str | None = None  # hash of the trainer's source the log starts with (None: stripped)
    run_hash: str | None = None  # hash of the training section (after last separator)
    problems: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return not self.problems

    @property
    def name(self) -> str:
        return self.path.name if self.path is not None else self.run_id

    @property
    def software(self) -> str:
        cuda = f" (CUDA {self.cuda_version})" if self.cuda_version else ""
        return (
            f"Python {self.python_version or '?'}, PyTorch {self.torch_version or '?'}"
            f"{cuda}, Triton {self.triton_version or 'n/a'}"
        )


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogateescape")).hexdigest()


def _parse_header(lines: list[str], run: RunLog) -> None:
    gpus: dict[int, str] = {}
    bus_ids: list[str] = []
    driver = cpu = gpu_name = None
    for line in lines:
        if m := _PYTHON_RE.match(line):
            run.python_version = m.group(1)
        elif m := _TORCH_RE.match(line):
            run.torch_version, run.cuda_version = m.group(1), m.group(2)
        elif m := _TRITON_RE.match(line):
            run.triton_version = m.group(1)
        elif m := _GPU_ROW_RE.match(line):
            gpus[int(m.group(1))] = m.group(2)
            bus_ids.append(m.group(3))
        elif m := _DRIVER_RE.search(line):
            driver = m.group(1)
        elif _SMI_DATE_RE.match(line):
            run.started = datetime.strptime(line.strip(), "%a %b %d %H:%M:%S %Y")
        elif m := _CPU_RE.match(line):
            cpu = m.group(1)
        elif m := _GPU_LINE_RE.match(line):
            gpu_name = m.group(1)
        elif m := _KEY_VALUE_RE.match(line.strip()):
            tokens = line.split()
            if all(_KEY_VALUE_RE.match(t) for t in tokens):
                # "world_size=8 device=cuda": several settings on one line
                run.config.update(t.split("=", 1) for t in tokens)
            else:
                run.config[m.group(1)] = m.group(2).strip()
    if gpus:
        counts = Counter(gpus.values())
        run.hardware = " + ".join(f"{n}x {model}" for model, n in sorted(counts.items()))
        run.machine = f"driver {driver}, GPUs at {' '.join(sorted(bus_ids))}"
    elif cpu:
        run.hardware = f"CPU: {cpu}"
    elif gpu_name:  # rank 0's GPU only: every rank's is taken to be the same
        run.hardware = f"{run.config.get('world_size', '?')}x {gpu_name}"
    run.run_name = run.config.get("run_name")
    if "target_val_loss" in run.config:
        try:
            run.target_val_loss = float(run.config["target_val_loss"])
        except ValueError:
            pass  # treated as unstated; the raw value stays in run.config


def _last_words(training: list[str]) -> str | None:
    """The line before a closing 'peak memory' line, unless it is a step line. The trainer writes
    'peak memory' last whenever its training loop ends, right after the line saying why when it
    ended early; that line is quoted when it is none of the endings _ENDED_RE knows (a bad data
    shard mid-run ends the log with the file's name and what is wrong with it)."""
    lines = [line for line in training if line.strip()]
    if len(lines) >= 2 and _PEAK_RE.match(lines[-1]) and not _STEP_RE.match(lines[-2]):
        return lines[-2].strip()
    return None


def parse_log_text(text: str, run_id: str = "?", path: Path | None = None) -> RunLog:
    """Parse the text of one log. Never raises on malformed input: what is wrong
    with the log is recorded in `RunLog.problems`."""
    run = RunLog(path=path, run_id=run_id, content_hash=_sha1(text))
    lines = text.splitlines()
    separators = [i for i, line in enumerate(lines) if line.rstrip() == SEPARATOR]
    if not separators:
        run.problems.append(
            "no line of 100 '=' (not a training log, or truncated inside the source code)"
        )
        return run
    headers = sum(1 for line in lines[separators[0]:] if _PYTHON_RE.match(line))
    if headers > 1:  # two logs joined: the last one's lines alone would pass for a whole run
        run.problems.append(f"{headers} 'Running Python' lines: several runs in one file?")
        return run
    if any(_CODE_RE.match(line) for line in lines[: separators[0]]):  # not a placeholder for stripped code
        run.code_hash = _sha1("\n".join(lines[: separators[0]]))
    if len(separators) >= 2:
        header = lines[separators[-2] + 1 : separators[-1]]
        # The public logs of early 2025 have one more section: versions and nvidia-smi, a
        # separator, the data files, a separator. The section before is read only then.
        if len(separators) >= 3 and not any(_PYTHON_RE.match(line) for line in header):
            earlier = lines[separators[-3] + 1 : separators[-2]]
            if any(_PYTHON_RE.match(line) for line in earlier):
                header = earlier
        _parse_header(header, run)
    training = lines[separators[-1] + 1 :]

    step_totals = Counter()
    val_points = []  # (index in training, step, train_time_ms, val_loss)
    ended = None  # the trainer's line saying the run was interrupted, diverged, crashed or ran out of data
    for index, line in enumerate(training):
        if m := _ENDED_RE.match(line):
            ended = ended or m.group(1)
        if m := _STEP_RE.match(line):
            step, total = int(m.group(1)), int(m.group(2))
            step_totals[total] += 1
            run.last_step = step if run.last_step is None else max(run.last_step, step)
        if m := _VAL_RE.match(line):
            val_points.append((index, int(m.group(1)), int(m.group(4)), float(m.group(3))))
    if ended:
        ended = ended.split(":")[0] if ended.startswith("stopping early") else ended
    last_words = _last_words(training)
    if not step_totals:
        if ended:
            run.problems.append(ended)
        elif last_words:
            run.problems.append(f"no step lines after the last separator; the run ended with: {last_words}")
        else:
            run.problems.append(
                "no step lines after the last separator (run never started, or log truncated)"
            )
        return run
    run.run_hash = _sha1("\n".join(training))
    if len(step_totals) > 1:
        totals = ", ".join(str(t) for t in sorted(step_totals))
        run.problems.append(f"step lines disagree on the step count ({totals}); several runs in one file?")
        return run
    (run.total_steps,) = step_totals
    run.val_curve = [(step, ms, loss) for _, step, ms, loss in val_points]

    finals = [point for point in val_points if point[1] == run.total_steps]
    if ended and (not finals or ended.startswith("diverged")):
        run.problems.append(ended)
        return run
    if not finals:
        run.problems.append(
            f"unfinished: no validation line at step {run.total_steps}/{run.total_steps}"
            f" (last step logged: {run.last_step})"
            + (f"; the run ended with: {last_words}" if last_words else "")
        )
        return run
    if len(finals) > 1:
        run.problems.append(
            f"{len(finals)} validation lines at step {run.total_steps}; several runs in one file?"
        )
        return run
    final_index, _, run.train_time_ms, run.final_val_loss = finals[0]
    if not math.isfinite(run.final_val_loss):
        run.problems.append(f"final validation loss is {run.final_val_loss}")

    for line in training[final_index + 1 :]:
        if m := _PEAK_RE.match(line):
            allocated, reserved, consumption = m.groups()
            run.peak_mem_allocated_mib = int(allocated or consumption)
            run.peak_mem_reserved_mib = int(reserved) if reserved else None
    if run.peak_mem_allocated_mib is None:
        # The trainer's last line; without it the log was cut (disk full, killed
        # while flushing) and we cannot trust that what precedes is complete.
        run.problems.append("truncated: no 'peak memory' line after the final validation")
    return run


def parse_log(path: str | Path) -> RunLog:
    """Parse one log file; run_id is the file name without `.txt`."""
    path = Path(path)
    # Undecodable bytes must not abort a whole comparison; they cannot be in the
    # lines we parse anyway.
    text = path.read_text(encoding="utf-8", errors="surrogateescape")
    return parse_log_text(text, run_id=path.stem, path=path)


@dataclass
class RecordFolder:
    """The parsed logs of one folder, with exclusions applied."""

    path: Path
    runs: list[RunLog]
    warnings: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.path.name

    @property
    def usable(self) -> list[RunLog]:
        return [r for r in self.runs if r.usable]

    @property
    def excluded(self) -> list[RunLog]:
        return [r for r in self.runs if not r.usable]

    def majority(self, attribute: str):
        """The most common value of a RunLog attribute among usable runs."""
        values = [getattr(r, attribute) for r in self.usable]
        return Counter(values).most_common(1)[0][0] if values else None

    @property
    def hardware(self) -> str | None:
        return self.majority("hardware")

    @property
    def total_steps(self) -> int | None:
        return self.majority("total_steps")


def _exclude_duplicates(runs: list[RunLog]) -> None:
    # The first file (by name) of each duplicate group is kept: one copy of a
    # run is a legitimate sample, the extra copies would inflate n.
    first_by_content: dict[str, RunLog] = {}
    first_by_run: dict[str, RunLog] = {}
    for run in runs:
        if original := first_by_content.get(run.content_hash):
            run.problems.append(f"duplicate: identical content to {original.name}")
        elif run.run_hash and (original := first_by_run.get(run.run_hash)):
            run.problems.append(f"duplicate: identical training output to {original.name}")
        first_by_content.setdefault(run.content_hash, run)
        if run.run_hash:
            first_by_run.setdefault(run.run_hash, run)


def _exclude_resumed_twins(runs: list[RunLog]) -> None:
    """A run resumed from another's checkpoint (written beside that run's log, named by its run
    id) repeats that run's steps after the checkpoint: where both logs are here, the first is kept."""
    by_id = {r.run_id: r for r in runs if r.usable}
    for run in runs:
        original = by_id.get(Path(run.config.get("resume") or "").stem)
        if run.usable and original is not None and original is not run:
            run.problems.append(f"duplicate: resumes {original.name} from its checkpoint")


def _unknown_if_none(value) -> str:
    return "unknown" if value is None else str(value)


def _exclude_minority(runs: list[RunLog], attribute: str, what: str) -> None:
    """Exclude usable runs whose `attribute` differs from the majority value."""
    usable = [r for r in runs if r.usable]
    counts = Counter(getattr(r, attribute) for r in usable).most_common()
    if len(counts) < 2:
        return
    if counts[0][1] == counts[1][1]:
        split = ", ".join(f"{_unknown_if_none(value)}: {runs_count(n)}" for value, n in counts)
        for run in usable:
            run.problems.append(f"{what} split evenly with no majority ({split}); split the folder")
        return
    majority = counts[0][0]
    for run in usable:
        value = getattr(run, attribute)
        if value != majority:
            run.problems.append(
                f"{what} {_unknown_if_none(value)} differs from the folder's majority"
                f" ({_unknown_if_none(majority)})"
            )


def _note_minority_software(folder: RecordFolder) -> None:
    # Different software on the same hardware is legitimate (e.g. a rebuilt
    # container) but can shift timings, so it is reported without excluding.
    counts = Counter(r.software for r in folder.usable)
    if len(counts) < 2:
        return
    majority = counts.most_common(1)[0][0]
    for run in folder.usable:
        if run.software != majority:
            folder.warnings.append(
                f"{folder.label}/{run.name}: different software ({run.software};"
                f" majority: {majority}); kept"
            )


def load_folder(path: str | Path) -> RecordFolder:
    """Parse every `*.txt` log in `path` and apply the exclusion rules.

    Raises FolderError if the folder is missing, not a directory, or has no logs.
    A folder whose logs are all excluded is returned (with warnings); callers
    check `.usable`.
    """
    path = Path(path)
    if not path.exists():
        raise FolderError(f"{path}: no such folder")
    if not path.is_dir():
        raise FolderError(f"{path}: not a folder")
    files = sorted(p for p in path.glob("*.txt") if p.is_file())
    if not files:
        raise FolderError(f"{path}: no *.txt run logs in this folder")
    runs = []
    for file in files:
        try:
            runs.append(parse_log(file))
        except OSError as error:
            run = RunLog(path=file, run_id=file.stem)
            run.problems.append(f"unreadable: {error.strerror or error}")
            runs.append(run)
    _exclude_duplicates(runs)
    _exclude_resumed_twins(runs)
    _exclude_minority(runs, "total_steps", "step count")
    _exclude_minority(runs, "hardware", "hardware")
    folder = RecordFolder(path=path, runs=runs)
    for run in folder.excluded:
        folder.warnings.append(f"{folder.label}/{run.name}: excluded: {'; '.join(run.problems)}")
    _note_minority_software(folder)
    for run in folder.usable:
        if run.config.get("resume"):
            folder.warnings.append(f"{folder.label}/{run.name}: resumed from {run.config['resume']}; kept, but its "
                                   "set-up and warmup ran twice: not a record run")
    names = {r.run_name for r in folder.usable if r.run_name is not None}
    if len(names) > 1:
        folder.warnings.append(f"{folder.label}: logs state different run_name values: {', '.join(sorted(names))}")
    differing, partial = config_differences(folder.usable)
    if differing:
        folder.warnings.append(f"{folder.label}: the runs differ in configuration: {differing}; kept, "
                               "but their statistics mix configurations")
    if partial:
        folder.warnings.append(f"{folder.label}: settings only some of the logs record: {partial}; written by "
                               "another version of train_gpt.py or on another device, so not compared")
    codes = Counter(r.code_hash for r in folder.usable if r.code_hash)
    if len(codes) > 1:
        versions = codes.most_common()
        counts = [runs_count(versions[0][1])] + [
            f"{runs_count(n)}: " + ", ".join(sorted(r.name for r in folder.usable if r.code_hash == code))
            for code, n in versions[1:]]
        folder.warnings.append(f"{folder.label}: the runs were made by {len(codes)} different versions of the "
                               "training script (the source each log starts with: " + "; ".join(counts)
                               + "); kept, but their statistics mix code versions")
    # Two validations after step 0 at least: step 0's loss is ln(50304) for every seed under
    # --init 2025 (a zero head) and near it under 2026 (a N(0, 0.005) head), and two final losses
    # alone may agree to 4 decimals by chance.
    curves = {tuple(loss for _, _, loss in r.val_curve) for r in folder.usable}
    if len(folder.usable) > 1 and len(curves) == 1 and len(folder.usable[0].val_curve) >= 3:
        folder.warnings.append(f"{folder.label}: all {len(folder.usable)} runs have the same validation losses: "
                               "one run repeated (the same --seed on a deterministic device, such as a CPU); "
                               "the loss statistics say nothing about its spread: vary --seed")
    else:
        seeds = {r.config.get("seed") for r in folder.usable}
        if len(folder.usable) > 1 and len(seeds) == 1 and None not in seeds:
            folder.warnings.append(f"{folder.label}: all {len(folder.usable)} runs used seed {seeds.pop()}: they "
                                   "start from the same weights, so the loss statistics leave out the spread over "
                                   "initialisations (the record's runs each drew their own): vary --seed")
    return folder


def runs_count(n: int) -> str:
    return f"{n} run" + "s" * (n != 1)


def config_differences(runs: list[RunLog]) -> tuple[str, str]:
    """The header settings (other than names, seeds, paths and values derived from the others) whose
    values differ among the runs that record them, e.g. "muon_lr (0.05: 3 runs, 0.04: 1 run)"; and
    those that only some of the logs record, with how many (a setting added to the header since
    the others were written, or one written only on some devices). "" where there is none."""
    configs = [r.config for r in runs if r.config]
    keys = sorted({key for config in configs for key in config} - NOT_COMPARED)
    parts, partial = [], []
    for key in keys:
        counts = sorted(Counter(config[key] for config in configs if key in config).items(),
                        key=lambda value_count: (-value_count[1], value_count[0]))  # ties in a fixed order
        recorded = sum(n for _, n in counts)
        if len(counts) > 1:
            parts.append(f"{key} (" + ", ".join(f"{value}: {runs_count(n)}" for value, n in counts)
                         + (f"; {len(configs) - recorded} without it" if recorded < len(configs) else "") + ")")
        elif recorded < len(configs):
            partial.append(f"{key} ({recorded} of {len(configs)})")
    return ", ".join(parts), ", ".join(partial)


def resolve_target(cli_target: float | None, folders: list[RecordFolder]) -> tuple[float, str, list[str]]:
    """The loss target: --target, else the one the logs state, else 3.28.
    Returns (target, where it came from, warnings)."""
    if cli_target is not None:
        return cli_target, "--target", []
    stated = {r.target_val_loss for f in folders for r in f.usable if r.target_val_loss is not None}
    if len(stated) == 1:
        return stated.pop(), "target_val_loss stated in the logs", []
    if len(stated) > 1:
        values = ", ".join(str(v) for v in sorted(stated))
        return DEFAULT_TARGET, "default", [
            f"logs state different target_val_loss values ({values}); using {DEFAULT_TARGET}"
        ]
    return DEFAULT_TARGET, "default", []


def baseline_warnings(runs: RecordFolder, baseline: RecordFolder) -> list[str]:
    """Reasons the time comparison may not be the same-machine, same-day
    comparison the record rules ask for."""
    found = []
    if runs.hardware != baseline.hardware:
        found.append(
            f"hardware differs between runs ({runs.hardware}) and baseline ({baseline.hardware});"
            " the time comparison is not a same-machine comparison"
        )
    elif runs.majority("machine") != baseline.majority("machine"):
        found.append(
            f"nvidia-smi shows another driver or other GPU bus ids for the baseline"
            f" ({baseline.majority('machine')}) than for the runs ({runs.majority('machine')});"
            " probably not the same machine"
        )
    if runs.majority("software") != baseline.majority("software"):
        found.append(
            f"software differs between runs ({runs.majority('software')}) and baseline"
            f" ({baseline.majority('software')}); it can change timings by itself"
        )
    if runs.total_steps != baseline.total_steps:
        found.append(
            f"step count differs between runs ({runs.total_steps}) and baseline ({baseline.total_steps}):"
            " the times are of different amounts of training, so their ratio is a speedup only if both"
            " reach the target"
        )
    runs_target, baseline_target = runs.majority("target_val_loss"), baseline.majority("target_val_loss")
    if (DEFAULT_TARGET if runs_target is None else runs_target) != (
            DEFAULT_TARGET if baseline_target is None else baseline_target):
        def stated(target):
            return f"{DEFAULT_TARGET:g}, the default: not stated" if target is None else f"{target:g}"
        found.append(
            f"target_val_loss differs between runs ({stated(runs_target)}) and baseline"
            f" ({stated(baseline_target)}): they are not trained to the same loss"
        )
    runs_config = _majority_config(runs)
    baseline_config = _majority_config(baseline)
    if runs_config and baseline_config:
        keys = sorted((runs_config.keys() & baseline_config.keys()) - NOT_COMPARED)
        differing = [f"{key} ({runs_config[key]} vs {baseline_config[key]})"
                     for key in keys if runs_config[key] != baseline_config[key]]
        if differing:
            found.append(f"configuration differs between runs and baseline: {', '.join(differing)}; "
                         "make sure that is the change being tested")
        only_runs = sorted(runs_config.keys() - baseline_config.keys() - NOT_COMPARED)
        only_baseline = sorted(baseline_config.keys() - runs_config.keys() - NOT_COMPARED)
        if only_runs or only_baseline:
            sides = [f"only the runs' logs record {', '.join(only_runs)}"] * bool(only_runs) + [
                f"only the baseline's record {', '.join(only_baseline)}"] * bool(only_baseline)
            found.append(f"{'; '.join(sides)}: written by another version of train_gpt.py or on another"
                         " device, so not compared")
    baseline_by_output = {r.run_hash: r for r in baseline.usable}
    if shared := [(r, baseline_by_output[r.run_hash]) for r in runs.usable if r.run_hash in baseline_by_output]:
        run, twin = shared[0]
        found.append(
            f"{runs_count(len(shared))} in both folders (identical training output, e.g. {runs.label}/{run.name}"
            f" and {baseline.label}/{twin.name}); the comparison is not between independent runs"
        )
    runs_started = sorted(r.started for r in runs.usable if r.started)
    baseline_started = sorted(r.started for r in baseline.usable if r.started)
    if runs_started and baseline_started:
        gap = abs(runs_started[len(runs_started) // 2] - baseline_started[len(baseline_started) // 2])
        if gap.total_seconds() > MAX_BASELINE_GAP_HOURS * 3600:
            found.append(
                f"the baseline ran {gap.total_seconds() / 86400:.1f} days apart from the runs"
                " (median nvidia-smi timestamps); run it the same day"
            )
    elif undated := [folder.label for folder, started in ((runs, runs_started), (baseline, baseline_started))
                     if not started]:
        found.append(f"no start time in the logs of {' and '.join(undated)} (nvidia-smi's date line, which"
                     " train_gpt.py writes on every device since 2026-11-27): the same-day check was not made")
    return found


def _majority_config(folder: RecordFolder) -> dict[str, str]:
    """Each header setting's most common value among the folder's usable runs."""
    configs = [r.config for r in folder.usable if r.config]
    keys = {key for config in configs for key in config}
    return {key: Counter(c[key] for c in configs if key in c).most_common(1)[0][0] for key in keys}


def _p_value(test_name: str, *args, **kwargs) -> float | None:
    """p-value of scipy.stats.<test_name>, or None where it is undefined."""
    # Imported here: scipy.stats takes seconds to import, and the error paths
    # (missing folder, no usable run) should answer at once.
    from scipy import stats

    with warnings.catch_warnings():
        # scipy warns on near-constant samples; we report those as undefined
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(getattr(stats, test_name)(*args, **kwargs).pvalue)
    return p if math.isfinite(p) else None


def _has_spread(values) -> bool:
    return len(values) >= 2 and float(np.std(values, ddof=1)) > 0


@dataclass
class Summary:
    """Statistics of one folder's usable runs. None means undefined (n/a)."""

    n: int
    loss_mean: float
    loss_std: float | None  # sample std, ddof=1
    loss_p: float | None  # one-sided one-sample t-test: mean < target
    target: float
    time_mean_ms: float
    time_std_ms: float | None
    time_median_ms: float
    time_min_ms: int
    time_max_ms: int


def summarize(runs: list[RunLog], target: float) -> Summary:
    if not runs:
        raise ValueError("summarize needs at least one run")
    losses = np.array([r.final_val_loss for r in runs])
    times = np.array([r.train_time_ms for r in runs], dtype=float)
    loss_p = (
        _p_value("ttest_1samp", losses, target, alternative="less")
        if _has_spread(losses) else None
    )
    return Summary(
        n=len(runs),
        loss_mean=float(losses.mean()),
        loss_std=float(losses.std(ddof=1)) if len(runs) >= 2 else None,
        loss_p=loss_p,
        target=target,
        time_mean_ms=float(times.mean()),
        time_std_ms=float(times.std(ddof=1)) if len(runs) >= 2 else None,
        time_median_ms=float(np.median(times)),
        time_min_ms=int(times.min()),
        time_max_ms=int(times.max()),
    )


@dataclass
class Comparison:
    """Runs against baseline. Differences are runs minus baseline; p-values are
    Welch t-tests (scipy ttest_ind, equal_var=False), None where undefined."""

    time_diff_ms: float
    time_p_two_sided: float | None
    time_p_faster: float | None  # one-sided: runs' mean time < baseline's
    loss_diff: float
    loss_p_two_sided: float | None
    loss_p_lower: float | None  # one-sided: runs' mean loss < baseline's
    speedup: float  # baseline mean time / runs mean time
    runs_steps: int | None = None  # the step count of the runs and of the baseline
    baseline_steps: int | None = None
    time_diff_interval_ms: tuple[float, float] | None = None  # 95% Welch confidence interval
    loss_diff_interval: tuple[float, float] | None = None

    @property
    def same_steps(self) -> bool:
        """The time ratio is a speedup at equal work only. With other step counts it is one only if
        both reach the target (a record may well train fewer steps): it is then called a time
        ratio, with the step counts beside it."""
        return self.runs_steps == self.baseline_steps

    @property
    def steps_note(self) -> str:
        return f"runs {self.runs_steps} steps, baseline {self.baseline_steps}"


def compare(runs: list[RunLog], baseline: list[RunLog]) -> Comparison:
    def welch(attribute: str):
        a = np.array([getattr(r, attribute) for r in runs], dtype=float)
        b = np.array([getattr(r, attribute) for r in baseline], dtype=float)
        if len(a) < 2 or len(b) < 2 or not (_has_spread(a) or _has_spread(b)):
            return float(a.mean() - b.mean()), None, None, None
        two_sided = _p_value("ttest_ind", a, b, equal_var=False)
        one_sided = _p_value("ttest_ind", a, b, equal_var=False, alternative="less")
        return float(a.mean() - b.mean()), two_sided, one_sided, _welch_interval(a, b)

    time_diff, time_p2, time_p1, time_interval = welch("train_time_ms")
    loss_diff, loss_p2, loss_p1, loss_interval = welch("final_val_loss")
    speedup = float(np.mean([r.train_time_ms for r in baseline]) / np.mean([r.train_time_ms for r in runs]))
    steps = [Counter(r.total_steps for r in group).most_common(1)[0][0] for group in (runs, baseline)]
    return Comparison(time_diff, time_p2, time_p1, loss_diff, loss_p2, loss_p1, speedup, *steps,
                      time_interval, loss_interval)


def _welch_interval(a, b, confidence=0.95) -> tuple[float, float]:
    """The confidence interval of mean(a) - mean(b), from Welch's t."""
    from scipy import stats

    interval = stats.ttest_ind(a, b, equal_var=False).confidence_interval(confidence)
    return float(interval.low), float(interval.high)


# ---------------------------------------------------------------- reporting

def _fmt_p(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.3g}"


def _fmt_loss(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _fmt_std(x: float | None, scale: float = 1.0, digits: int = 5) -> str:
    return "n/a" if x is None else f"{x / scale:.{digits}f}"


def _fmt_s(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms / 1000:.3f}"


def _fmt_mib(x: int | None) -> str:
    return "n/a" if x is None else str(x)


TOO_FEW_RUNS = "a t-test needs at least 2 runs"


def _verdict(p: float | None, runs: int = 2) -> str:
    """runs: the fewest usable runs of the folders the test reads."""
    if p is None:
        return f"undetermined (p n/a{': ' + TOO_FEW_RUNS if runs < 2 else ''})"
    return f"{'yes' if p < ALPHA else 'no'} (p = {_fmt_p(p)}, threshold {ALPHA})"


def _summary_rows(folder: RecordFolder, summary: Summary) -> list[tuple[str, str]]:
    s = summary
    return [
        ("runs used", f"{s.n} of {len(folder.runs)}"),
        ("final val loss mean", _fmt_loss(s.loss_mean)),
        ("final val loss std", _fmt_std(s.loss_std)),
        (f"p (mean loss < {s.target:g})", _fmt_p(s.loss_p) + (f" ({TOO_FEW_RUNS})" if s.n < 2 else "")),
        ("train time mean (s)", _fmt_s(s.time_mean_ms)),
        ("train time std (s)", _fmt_std(s.time_std_ms, 1000, 3)),
        ("train time median (s)", _fmt_s(s.time_median_ms)),
        ("train time min (s)", _fmt_s(s.time_min_ms)),
        ("train time max (s)", _fmt_s(s.time_max_ms)),
        ("steps", str(folder.total_steps)),
        ("hardware", _unknown_if_none(folder.hardware)),
    ]


def _fmt_interval(interval: tuple[float, float] | None, scale: float = 1.0, digits: int = 5) -> str:
    return "n/a" if interval is None else f"{interval[0] / scale:+.{digits}f} .. {interval[1] / scale:+.{digits}f}"


def _comparison_rows(c: Comparison) -> list[tuple[str, str, str, str, str]]:
    return [
        ("train time (s)", f"{c.time_diff_ms / 1000:+.3f}", _fmt_interval(c.time_diff_interval_ms, 1000, 3),
         _fmt_p(c.time_p_two_sided), f"{_fmt_p(c.time_p_faster)} (runs faster)"),
        ("final val loss", f"{c.loss_diff:+.5f}", _fmt_interval(c.loss_diff_interval),
         _fmt_p(c.loss_p_two_sided), f"{_fmt_p(c.loss_p_lower)} (runs lower)"),
    ]


def _md_table(header: list[str], rows: list) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def _run_rows(folder: RecordFolder) -> list[tuple]:
    rows = []
    for run in folder.runs:
        memory = (
            f"{run.peak_mem_allocated_mib} / {_fmt_mib(run.peak_mem_reserved_mib)}"
            if run.peak_mem_allocated_mib is not None else "n/a"
        )
        rows.append((
            run.run_id, _fmt_loss(run.final_val_loss), _fmt_s(run.train_time_ms),
            run.total_steps if run.total_steps is not None else "n/a", memory,
            "yes" if run.usable else "excluded",
        ))
    return rows


def render_statistics(
    runs: RecordFolder,
    summary: Summary,
    target_source: str,
    baseline: RecordFolder | None = None,
    baseline_summary: Summary | None = None,
    comparison: Comparison | None = None,
    warnings_: list[str] = (),
    command: str = "",
) -> str:
    """The text of statistics.md."""
    out = [f"# Statistics: {runs.label}", ""]
    if command:
        out += [f"Generated by `{command}`{GENERATED_MARK}", ""]
    out += [f"Target: {summary.target:g} ({target_source}).", "", "## Summary", ""]
    header = ["", f"runs: {runs.label}"]
    rows = _summary_rows(runs, summary)
    if baseline is not None:
        header.append(f"baseline: {baseline.label}")
        rows = [(*row, other[1]) for row, other in zip(rows, _summary_rows(baseline, baseline_summary))]
    out += _md_table(header, rows) + [""]

    target_check = f"- mean final val loss < {summary.target:g}: {_verdict(summary.loss_p, summary.n)}"
    out += ["## Record checks", "", target_check]
    if comparison is not None:
        caveat = "" if comparison.same_steps else (
            f"; but with other step counts ({comparison.steps_note}) that counts only if both reach the target")
        fewest = min(summary.n, baseline_summary.n)
        out.append(f"- faster than the baseline: {_verdict(comparison.time_p_faster, fewest)}{caveat}")
    else:
        out.append("- faster than the baseline: not checked (no baseline folder given)")
    out.append("")

    if comparison is not None:
        out += [
            "## Against the baseline", "",
            "Welch t-tests (unequal variances); differences are runs minus baseline.", "",
        ]
        out += _md_table(["", "difference", "95% interval", "p two-sided", "p one-sided"],
                         _comparison_rows(comparison))
        ratio = f"(baseline mean time / runs mean time): {comparison.speedup:.4f}x"
        out += ["", f"Speedup {ratio}" if comparison.same_steps else
                f"Time ratio {ratio}; not a speedup at equal work ({comparison.steps_note})", ""]

    for folder in [runs] + ([baseline] if baseline is not None else []):
        out += [f"## Runs: {folder.label}", ""]
        out += _md_table(
            ["run id", "final val loss", "train time (s)", "steps", "peak memory alloc / reserved (MiB)", "used"],
            _run_rows(folder),
        )
        out.append("")

    out += ["## Warnings", ""]
    out += [f"- {w}" for w in warnings_] if warnings_ else ["None."]
    out += ["", "## Software and hardware seen (usable runs)", ""]
    for folder in [runs] + ([baseline] if baseline is not None else []):
        for what, values in (
            ("hardware", Counter(_unknown_if_none(r.hardware) for r in folder.usable)),
            ("software", Counter(r.software for r in folder.usable)),
        ):
            for value, n in sorted(values.items()):
                out.append(f"- {folder.label}: {what} {value}: {runs_count(n)}")
    out.append("")
    return "\n".join(out)


def loss_axis_limits(runs: list[RunLog], target: float) -> tuple[float, float]:
    """The plot's loss range. Runs that end below 3.9 are seen from 4.0 down: the early losses
    (10.8 at step 0, ~4.6 at the speedrun's step 125) would flatten the region that matters.
    Others (CPU runs end near 5.7) up to their highest validation after step 0."""
    losses = [(step, loss) for r in runs for step, _, loss in r.val_curve if math.isfinite(loss)]
    bottom = min([loss for _, loss in losses] + [target])
    reach_target_region = max(r.final_val_loss for r in runs) < 3.9
    top = 4.0 if reach_target_region else max([4.0] + [loss for step, loss in losses if step > 0])
    margin = 0.05 * (top - bottom)
    return bottom - margin, top + margin


def plot_curves(runs: RecordFolder, target: float, out_path: Path, baseline: RecordFolder | None = None) -> None:
    """Validation loss against training time for every usable run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    groups = [(runs, "tab:blue", f"runs: {runs.label}")]
    if baseline is not None:
        groups.append((baseline, "tab:orange", f"baseline: {baseline.label}"))
    for folder, colour, label in groups:
        for i, run in enumerate(folder.usable):
            seconds = [ms / 1000 for _, ms, _ in run.val_curve]
            losses = [loss for _, _, loss in run.val_curve]
            ax.plot(seconds, losses, color=colour, alpha=0.6, linewidth=1, marker=".",
                    label=f"{label} (n={len(folder.usable)})" if i == 0 else None)
    ax.axhline(target, color="tab:red", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_ylim(*loss_axis_limits([run for folder, _, _ in groups for run in folder.usable], target))
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"Validation loss vs training time: {runs.label}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def _terminal_table(runs: RecordFolder, summary: Summary, baseline, baseline_summary, comparison) -> str:
    rows = _summary_rows(runs, summary)
    columns = [[label for label, _ in rows], [value for _, value in rows]]
    titles = ["", f"runs: {runs.label}"]
    if baseline is not None:
        columns.append([value for _, value in _summary_rows(baseline, baseline_summary)])
        titles.append(f"baseline: {baseline.label}")
    widths = [max(len(t), *(len(v) for v in col)) for t, col in zip(titles, columns)]
    lines = ["  ".join(t.ljust(w) for t, w in zip(titles, widths))]
    for i in range(len(rows)):
        lines.append("  ".join(col[i].ljust(w) for col, w in zip(columns, widths)))
    if comparison is not None:
        c = comparison
        interval = (f"95% interval {_fmt_interval(c.time_diff_interval_ms, 1000, 3)} s; "
                    if c.time_diff_interval_ms else "")
        lines.append(
            (f"speedup {c.speedup:.4f}x" if c.same_steps else
             f"time ratio {c.speedup:.4f}x (not a speedup at equal work: {c.steps_note})")
            + f"; time diff {c.time_diff_ms / 1000:+.3f} s ({interval}Welch p two-sided {_fmt_p(c.time_p_two_sided)},"
            f" p faster {_fmt_p(c.time_p_faster)}); loss diff {c.loss_diff:+.5f}"
            f" (p two-sided {_fmt_p(c.loss_p_two_sided)})"
        )
        fewest = min(summary.n, baseline_summary.n)
        lines.append(f"faster than the baseline: {_verdict(c.time_p_faster, fewest)}")  # the ratio is no evidence
    return "\n".join(lines)


def _load_usable(path: str) -> RecordFolder:
    folder = load_folder(path)
    if not folder.usable:
        for warning in folder.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        raise FolderError(f"{folder.path}: no usable run among {len(folder.runs)} log(s) (see warnings above)")
    return folder


class _OneLineArgumentParser(argparse.ArgumentParser):
    """A bad option is reported in one line (no usage dump), exit status 2."""

    def error(self, message):
        self.exit(2, f"compare.py: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineArgumentParser(
        description="Summarize the run logs in RUNS_DIR (and compare them with BASELINE_DIR)."
    )
    parser.add_argument("runs_dir", metavar="RUNS_DIR")
    parser.add_argument("baseline_dir", metavar="BASELINE_DIR", nargs="?")
    parser.add_argument("--target", type=float, default=None,
                        help=f"loss target (default: the logs' target_val_loss, else {DEFAULT_TARGET})")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help=f"folder for {STATISTICS_FILE} and {PLOT_FILE} (default: RUNS_DIR)")
    args = parser.parse_args(argv)
    if args.target is not None and not math.isfinite(args.target):
        parser.error(f"--target={args.target}: expected a finite loss")
    if args.out == "":
        parser.error("--out='': an empty path (an unset variable?); name a folder")
    if args.out is not None:   # refused before the table, unlike a folder that refuses the write
        existing = Path(args.out)
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            parser.error(f"--out={args.out}: " + ("not a folder" if existing == Path(args.out)
                                                    else f"{existing} is not a folder"))
    try:
        runs = _load_usable(args.runs_dir)
        baseline = None
        if args.baseline_dir is not None:
            if Path(args.baseline_dir).resolve() == Path(args.runs_dir).resolve():
                raise FolderError(f"{args.baseline_dir}: the baseline is the runs folder itself")
            baseline = _load_usable(args.baseline_dir)
    except FolderError as error:
        print(f"compare.py: error: {error}", file=sys.stderr)
        return 1

    folders = [runs] + ([baseline] if baseline else [])
    target, target_source, all_warnings = resolve_target(args.target, folders)
    all_warnings = [w for f in folders for w in f.warnings] + all_warnings
    summary = summarize(runs.usable, target)
    baseline_summary = comparison = None
    if baseline is not None:
        baseline_summary = summarize(baseline.usable, target)
        comparison = compare(runs.usable, baseline.usable)
        all_warnings += baseline_warnings(runs, baseline)
    command = "python records/compare.py " + " ".join(
        [args.runs_dir] + ([args.baseline_dir] if args.baseline_dir else [])
        + ([f"--target {args.target:g}"] if args.target is not None else [])
    )
    text = render_statistics(runs, summary, target_source, baseline, baseline_summary,
                             comparison, all_warnings, command)
    # The figures first: a folder that cannot be written (the public logs, read-only) loses no output.
    print(_terminal_table(runs, summary, baseline, baseline_summary, comparison))
    for warning in all_warnings:
        print(f"warning: {warning}")
    out = Path(args.out) if args.out is not None else runs.path
    statistics = out / STATISTICS_FILE
    with contextlib.suppress(OSError):  # one of ours is replaced; a file of the same name a person wrote is kept
        if statistics.is_file() and GENERATED_MARK not in statistics.read_text(errors="replace"):
            print(f"compare.py: error: {statistics}: exists and was not written by compare.py; move it, or "
                  "write elsewhere with --out DIR", file=sys.stderr)
            return 1
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / STATISTICS_FILE).write_text(text)
        plot_curves(runs, target, out / PLOT_FILE, baseline)
    except OSError as error:
        print(f"compare.py: error: {out}: cannot write {STATISTICS_FILE} and {PLOT_FILE} "
              f"({error.strerror or error})" + ("; --out DIR writes them elsewhere" if args.out is None else ""),
              file=sys.stderr)
        return 1
    print(f"wrote {out / STATISTICS_FILE} and {out / PLOT_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
