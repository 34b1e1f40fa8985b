"""GPU proof in one command: turn a few minutes on one GPU into the evidence that every CUDA path
of train_gpt.py works, and how fast it is.

    python bench/gpu_proof.py --out DIR [--phases env,correct,kernels,train,peer] [--steps N]
    python bench/gpu_proof.py --out DIR --phases env,warm     # then, on the same machine: env,peer,train
    python bench/gpu_proof.py --cpu-smoke --out DIR          # every phase at tiny sizes on CPU
    python bench/gpu_proof.py --merge A/report.json B/report.json ... [--out DIR]
    python bench/gpu_proof.py --lease 1 --out DIR     # a 15-minute lease's first call; then:
    python bench/gpu_proof.py --lease 2 --total SECONDS --out DIR

writes DIR/report.md (tables to read) and DIR/report.json (the same figures). Phases:
  env      versions of Python, torch, triton, CUDA and the driver; GPU name, SMs, memory
  correct  each Triton kernel and each ns_method against the PyTorch twin on every Muon matrix
           shape of the speedrun, in bf16, against an fp64 run (stated bounds); the fused MLP's
           output and gradients (--mlp_backend triton) likewise; FlexAttention with
           flex_block_mask against SDPA with dense_attention_mask, outputs and gradients; with token
           windows (the 2026 record's), FlexAttention and varlen_attn (--attn_backend varlen) on packed
           record-like documents, paired heads too, and the varlen masks against the dense ones; the FP8
           head's forward and backward against bf16; graphs, recompiles and graph breaks of the
           compiled model at each --compile_scope
  kernels  ms and TFLOP/s of orthogonalizing the speedrun's Muon stacks (the work of one rank at
           1 and at 8 GPUs), every ns_method on the Triton and on the torch.compile'd torch
           backend, and the ratio to compiled torch Newton-Schulz; then FlexAttention against varlen_attn,
           forward and backward at the 2026 record's shapes (--kernel-parts: which, in which order)
  warm     (only when named) ours and the peer compiled, untimed, each the run its phase times,
           stopped at its first timed step (at once where the GPU's memory holds both), so that the
           train and peer phases after it, in this command or the next on the same machine, start
           from warm compilation caches; the autotuning choices these runs saved are removed
  train    train_gpt.py, speedrun preset, 1 GPU (its micro-batches accumulated), N steps (the last E
           of them the extension: --extension-steps) on a timing dataset written here: start-up
           seconds, steady ms/step over steps 20..N and per stage of the schedules, peak
           memory, val loss at the start and the end, recompiles and graph breaks, and a profile
           of a few steps before the steady window (--profile: device time per kernel family,
           host syncs); then the same figures for each variant (--variants: by default
           --compile_scope blocks) and each other ns_method
  peer     the public record script (--peer PATH; default the 2026-01-19 record in peers/) on the
           same data for the same N steps and schedule, on a copy with the listed edits only (its
           schedule lengths, validation tokens and cadence; FA3 from the hub -> torch's
           varlen_attn), profiled over the same steps; the ratios ours / peer, per stage too, the
           val losses of both, and both profiles side by side

Each phase runs in its own process with its own time budget (--budget PHASE=SECONDS): a phase that
fails, crashes or runs out of time records its traceback or log tail in the report and the others
still run; a check that fails inside a phase does not stop the phase's other checks. Timings are
benchmark figures, not pass/fail criteria. --merge combines the report.json files of several
commands (say, one per phase group on the GPU machine) into one report. Without a CUDA device only
--cpu-smoke, --merge and --phases env run; other phases are refused before any work.
"""

import argparse
import datetime
import hashlib
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(REPO_ROOT, "train_gpt.py")
PROFILER = os.path.join(REPO_ROOT, "bench", "profile_step.py")
PHASES = ("env", "correct", "kernels", "warm", "train", "peer")
DEFAULT_PHASES = ("env", "correct", "kernels", "train", "peer")   # warm only when named
CPU_PHASES = ("env",)                # what runs without a GPU (it records that there is none)
# Seconds per phase on a GPU: env+correct+kernels, train, and peer each fit one 10-minute command.
BUDGET_S = {"env": 40, "correct": 250, "kernels": 240, "warm": 540, "train": 530, "peer": 530}
SMOKE_BUDGET_S = {"env": 60, "correct": 120, "kernels": 120, "warm": 120, "train": 180, "peer": 60}
# The warm phase runs ours and the peer at once only where both fit in the GPU's memory: on an
# H100 the 2025 runs' peaks (33,480 and 47,700 MiB reserved) added up to more than its 79 GiB; the
# 2026 runs' are unknown (each validation pass makes 256Ki x 50304 logits: 26 GiB in bf16).
WARM_TOGETHER_MIN_GIB = 100
STEADY_FROM = 20                     # steady ms/step is measured over steps STEADY_FROM..N (per stage: from here on)
SMOKE_STEADY_FROM = 3                # (tiny CPU runs: steps 3..N)
# Profiled steps A+1..B of the main and peer runs: past warmup and the first compilations, and over
# before the steady window (the trace is written during step B+1, on the clock).
DEFAULT_PROFILE, SMOKE_PROFILE = "12:15", "1:2"
# The 2026-01-19 record (train_gpt.py, with the triton_kernels.py it imports beside it), copied from
# ../shared/peers into the git-ignored peers/ so that it travels to a GPU machine with the working tree.
PEER_SOURCE = "modded-nanogpt_93f0e6b9"
DEFAULT_PEER = os.path.join("peers", PEER_SOURCE, "train_gpt.py")
PEER_SIBLINGS = ("triton_kernels.py",)   # files a 2026 peer imports from its own folder
# Validation tokens of the peer: the 2026 record reads them in multiples of its val_batch_size (2Mi:
# 8 micro-batches of 256Ki at world size 1), the 2025 record's (--peer PATH) in multiples of 256Ki.
PEER_VAL_TOKENS = {"2026": 2 * 1024 * 1024, "2025": 256 * 1024}
RUN_VAL_TOKENS = 2 * 1024 * 1024     # ours: the 2026 peer's validation tokens, so both losses are on the same ones
DEFAULT_STEPS = 96                   # main and peer runs: 84 scheduled steps (three stages of 28) and 12 extension
STAGE_PARTS = 3                      # ours and the record's batch and window schedules: equal thirds of the scheduled steps
STAGE_SKIP = 4                       # per-stage steady ms/step leaves out each stage's first 4 steps (size changes)
SMOKE_TRAINER_ARGV = ["--preset", "cpu", "--model_dim", "32", "--num_heads", "2", "--head_dim", "16",
                      "--train_seq_len", "256", "--train_seq_len_schedule", "128,192,256", "--val_seq_len", "256",
                      "--micro_batches", "2", "--warmup_steps", "1"]
SMOKE_VAL_TOKENS = 512
# Trainer fields every train run sets itself (a variant's flags come last and would override them)
PROOF_SETS = {"preset", "num_iterations", "extension_steps", "val_tokens", "val_every", "train_files", "val_files",
              "log_dir", "run_name", "ns_method"}
DEFAULT_VARIANTS = "--compile_scope blocks"   # the departure the main run (the record's whole-model compile) lacks
# --total: what a phase may take is cut to what is left of the command's time less this margin. A
# worker ends on its own budget (5 s under it); the margin covers the report and, where a worker
# hangs, most of the backstop (20 s over the budget, then 10 s to SIGKILL).
TOTAL_MARGIN_S = 25
MIN_PHASE_S = 30                     # with less left than this (or than its budget), a phase is skipped
# This project's GPU lease: 15 minutes of device time, a machine that takes 0.5 to 2 minutes to
# start (30-33 s twice) and goes back after 30 s idle, commands of at most 10 minutes: two calls,
# back to back, each main and peer run LEASE_STEPS steps (84 scheduled in three stages of 28, then
# 12 extension), ours with the record's attention (varlen_attn). Which two calls depends on the
# GPU, told by its memory (nvidia-smi, else torch in a child process: never a CUDA context in this
# one; unknown, the H100 plan). Assumed, as no GPU has run the 2026 code yet: cold start-ups on one
# GPU of 7-8 minutes for the record (its log: "~7 minutes on first execution", on 8 GPUs; its
# 2025 predecessor took 412 s on an H100 and more than 485 s on an H200) and 5-6 for ours (the
# 2025 preset took 225-290 s; the 2026 one compiles a graph per window size, as the record);
# 40-90 s from warm caches (38.5 and 39.8 s in 2025); 96 steps in about 50 s (8 micro-batches a
# step: 8 x the record's mean 61.5 ms on 8 H100s); and about 40 s more a run at its end for the
# last validation (its window of 20 blocks compiles then, warm or cold, as neither warmup has it).
# On an H200 (141 GiB) the first call compiles both at once (warm; the record's start-up is the
# critical path) and stops each at its first timed step; the second (T = about 900 - 33 - 470 -
# 20 - 45 = 330 s) times both from warm caches, the record first with at most LEASE_PEER_SHARE of
# the time, then ours with the rest: each needs 130-180 s, so the second run may be cut in its
# extension, and the ratios are taken over the steps both reached, stage by stage. On an H100 the
# two cannot run at once (each run's peak is unknown, over 26 GiB for the validation logits alone)
# nor one after the other: the record, cold, goes in the call that can run longest, and ours
# follows only if the second call leaves its phase OURS_MIN_S (it will not, with T of about 280),
# else the correctness checks and one GPU's kernel stacks. Both second calls end with the
# correctness checks, in whatever time is left (a phase with under MIN_PHASE_S is skipped).
OURS_MIN_S = 420
LEASE_STEPS = DEFAULT_STEPS
LEASE_MAIN_FLAGS = "--attn_backend varlen"   # the record's attention call (its FA3 swapped for varlen_attn)
LEASE_PEER_SHARE = 0.5
LEASE_PLANS = {
    "one at a time": {1: dict(phases="env,peer", total=570),
                      2: dict(phases="env,train,correct"),
                      "short": dict(phases="env,kernels,correct", kernel_gpus="1")},
    "together": {1: dict(phases="env,warm", total=570),
                 2: dict(phases="env,peer,train,correct", peer_share=LEASE_PEER_SHARE)},
}
KERNEL_PARTS = ("muon", "attention")   # what the kernels phase times, in this order by default (--kernel-parts)
ORTHO_MIN_ROWS = 384                 # rows per kernel and orthogonalize check on a GPU (see phase_correct)
# e4m3 rounds by at most 2^-4 relative, e5m2 by 2^-3. The logits (two e4m3 operands) measure ~4%; the
# gradients (an e5m2 one) ~3% with bounded scales and ~8% with the record's: the target logits' gradients,
# ~ -1 / (0.75 / 448) = -597, round to e5m2's -640 (bounded: -448, exact).
FP8_BOUNDS = {"logits": 0.08, "grad_x": 0.12, "grad_w": 0.12}


# -----------------------------------------------------------------------------------------------
# Command line

class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv):
    p = OneLineParser(prog="gpu_proof.py", description=__doc__.split("\n\n")[0])
    # --total counts from here: the checks below load torch in child processes, tens of seconds on a fresh machine
    p.set_defaults(started=time.time())
    p.add_argument("--out", help="folder for report.md, report.json, data and logs (must not hold a report yet)")
    p.add_argument("--phases", default=None,
                   help=f"comma-separated subset of {','.join(PHASES)} (default {','.join(DEFAULT_PHASES)})")
    p.add_argument("--steps", type=int, default=None, help=f"training steps of the main and peer runs (default "
                   f"{DEFAULT_STEPS}; 4 with --cpu-smoke)")
    p.add_argument("--extension-steps", type=int, default=None, metavar="E",
                   help="the last E of --steps run past the schedules, in ours (--extension_steps) and in the peer "
                        "(num_extension_iterations; the rest are its num_scheduled_iterations) (default steps // 8)")
    p.add_argument("--variant-steps", type=int, default=None,
                   help="training steps of the runs of the other ns_methods (default min(steps, 30))")
    p.add_argument("--ns-methods", default=None,
                   help="ns_methods the train phase runs, the first for --steps (default: the trainer's default "
                        "first, then the others)")
    p.add_argument("--main-flags", default="", help="trainer flags of the main run (default none: the preset)")
    p.add_argument("--variants", default=None,
                   help="trainer flags of the runs after the main one, one run per ';'-separated set (a ';' "
                        "before a flag separates sets; quote values as in a shell), before "
                        f"the other ns_methods' runs (default {DEFAULT_VARIANTS!r}; '' for none)")
    p.add_argument("--profile", default=None, metavar="A:B",
                   help=f"profile steps A+1..B of the main train run and of the peer run with bench/profile_step.py "
                        f"(default {DEFAULT_PROFILE}; {SMOKE_PROFILE} with --cpu-smoke; 'none': no profile); B must "
                        "come before the steady window")
    p.add_argument("--peer", default=None, help=f"the public record script (default {DEFAULT_PEER} when it exists: "
                   "the 2026-01-19 record; the 2025-08-23 one's single file works too)")
    p.add_argument("--peer-replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                   help="one more exact edit of the peer copy (OLD must occur once); listed in the report")
    p.add_argument("--budget", action="append", default=[], metavar="PHASE=SECONDS",
                   help="time budget of one phase (defaults: "
                        + ", ".join(f"{k}={v}" for k, v in BUDGET_S.items()) + ")")
    p.add_argument("--kernel-gpus", default=None, metavar="W,W",
                   help="world sizes whose per-rank Muon stacks the kernels phase times, in this order (1 and/or 8; "
                        "default 8,1, on --cpu-smoke 8): a short budget can go to those not yet timed")
    p.add_argument("--kernel-parts", default=None, metavar="PART,PART",
                   help=f"what the kernels phase times, in this order: {', '.join(KERNEL_PARTS)} (the Muon stacks; "
                        "FlexAttention vs varlen_attn at the 2026 record's shapes) (default "
                        f"{','.join(KERNEL_PARTS)})")
    p.add_argument("--total", type=float, default=None, metavar="SECONDS",
                   help="the whole command's time, its option checks included: each phase's budget is cut to what is left of it (less "
                        f"{TOTAL_MARGIN_S} s), so a phase ends on its own budget with its figures; one that would get "
                        f"under {MIN_PHASE_S} s is skipped")
    p.add_argument("--lease", type=int, choices=(1, 2), default=None,
                   help="call 1 or 2 of a 15-minute GPU lease (bench/README.md): sets --phases, --ns-methods, "
                        "--variants and the budgets by the GPU's memory (call 2 needs --total: the time left)")
    p.add_argument("--report-copy", default=None, metavar="PATH",
                   help="also write report.json here after every phase (e.g. $OUT/1.json: it comes back even "
                        "where the command is killed before a cp after it)")
    p.add_argument("--cpu-smoke", action="store_true", help="every phase at tiny sizes on CPU (Triton interpreted)")
    p.add_argument("--merge", nargs="+", metavar="REPORT_JSON", help="merge these reports (later phases win) into "
                   "--out (default records/gpu_proof/<date>_<device>; --cpu-smoke reports: an --out outside it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)

    if opts.worker:
        return opts
    if opts.merge:
        for path in opts.merge:
            if not os.path.isfile(path):
                p.error(f"--merge: {path}: no such file")
        return opts
    if not opts.out:
        p.error("--out DIR is required")
    if opts.total is not None and not 0 < opts.total < float("inf"):
        p.error(f"--total={opts.total}: expected a positive number of seconds")
    if opts.lease is not None:
        given = [name for name, value in (("--phases", opts.phases), ("--ns-methods", opts.ns_methods),
                                          ("--variants", opts.variants), ("--kernel-gpus", opts.kernel_gpus))
                 if value is not None]
        if given:
            p.error(f"--lease {opts.lease} sets {given[0]} itself; run without --lease to choose it")
        if opts.lease == 2 and opts.total is None:
            p.error("--lease 2 needs --total SECONDS: the first call's reply's lease.budget_left_s less 45")
        memory = gpu_memory_gib()
        plan = lease_plan(opts.lease, memory, opts.total)
        opts.phases, opts.kernel_gpus = plan["phases"], plan.get("kernel_gpus")
        # the preset as it is, once, with the record's attention: the comparison first (flex: a later lease)
        opts.ns_methods, opts.variants = trainer_default("ns_method"), ""
        opts.main_flags = opts.main_flags or LEASE_MAIN_FLAGS
        opts.total = opts.total or plan.get("total")
        opts.steps = opts.steps or LEASE_STEPS
        lease_peer_share = plan.get("peer_share")
        told = (f"the GPU has {memory:.0f} GiB" if memory else
                "the GPU's memory is unknown (nvidia-smi and torch did not say)")
        print(f"[gpu_proof] --lease {opts.lease}: {told}: phases {opts.phases}, "
              f"--total {opts.total:g}", flush=True)
    opts.phases = opts.phases or ",".join(DEFAULT_PHASES)
    opts.variants = DEFAULT_VARIANTS if opts.variants is None else opts.variants
    phases = [x.strip() for x in opts.phases.split(",") if x.strip()]
    unknown = [x for x in phases if x not in PHASES]
    if unknown or not phases:
        p.error(f"--phases={opts.phases!r}: unknown phase {unknown[0] if unknown else '(none)'}; "
                f"expected a subset of {','.join(PHASES)}")
    opts.phases = list(dict.fromkeys(phases))   # in the order given: a short lease runs the one it lacks first
    opts.steady_from = SMOKE_STEADY_FROM if opts.cpu_smoke else STEADY_FROM
    if opts.steps is None:
        opts.steps = 4 if opts.cpu_smoke else DEFAULT_STEPS
    if opts.extension_steps is None:
        opts.extension_steps = opts.steps // 8
    if not 0 <= opts.extension_steps < opts.steps:
        p.error(f"--extension-steps={opts.extension_steps}: expected 0 <= E < --steps={opts.steps}")
    if opts.variant_steps is None:
        opts.variant_steps = 4 if opts.cpu_smoke else min(opts.steps, 30)
    for name, value in (("--steps", opts.steps), ("--variant-steps", opts.variant_steps)):
        if value <= opts.steady_from:
            p.error(f"{name}={value}: must exceed {opts.steady_from} (steady ms/step is measured over steps "
                    f"{opts.steady_from}..N)")
    profile = opts.profile or (SMOKE_PROFILE if opts.cpu_smoke else DEFAULT_PROFILE)
    opts.profile = None
    if profile != "none":
        window = re.fullmatch(r"(\d+):(\d+)", profile)
        if not window or not 1 <= int(window[1]) < int(window[2]):
            p.error(f"--profile={profile!r}: expected A:B with integers 1 <= A < B, or 'none'")
        if int(window[2]) >= opts.steady_from:
            p.error(f"--profile={profile!r}: B must be below {opts.steady_from}: the trace is written during step "
                    f"B+1, which must come before the steady window (steps {opts.steady_from}..N)")
        opts.profile = [int(window[1]), int(window[2])]
    budgets = dict(SMOKE_BUDGET_S if opts.cpu_smoke else BUDGET_S)
    for item in opts.budget:
        name, _, value = item.partition("=")
        if name not in PHASES or not value.replace(".", "", 1).isdigit() or float(value) <= 0:
            p.error(f"--budget={item!r}: expected PHASE=SECONDS with PHASE one of {','.join(PHASES)}")
        budgets[name] = float(value)
    if opts.lease is not None and lease_peer_share:   # the peer first, leaving ours its share
        budgets["peer"] = min(budgets["peer"], lease_peer_share * (opts.total - TOTAL_MARGIN_S - 10))
    opts.budgets = budgets
    gpu_phases = [x for x in opts.phases if x not in CPU_PHASES]
    # Each GPU phase would otherwise spend its whole budget failing, minutes in all.
    if gpu_phases and not opts.cpu_smoke and not cuda_visible():
        p.error(f"needs a CUDA GPU for the {','.join(gpu_phases)} phase{'s' * (len(gpu_phases) > 1)} and none is "
                "visible; --cpu-smoke runs every phase at tiny sizes on CPU, --phases env needs no GPU")
    if opts.ns_methods is not None:
        opts.ns_methods = [x.strip() for x in opts.ns_methods.split(",") if x.strip()]
        known = trainer_ns_methods()
        bad = [m for m in opts.ns_methods if m not in known]
        if bad or not opts.ns_methods:
            p.error(f"--ns-methods: unknown method {bad[0] if bad else '(none)'}; expected some of {','.join(known)}")
    try:  # a ';' starts a new set only before a flag: --ns_coeffs "a,b,c;a,b,c" keeps its own
        opts.variants = [as_pairs(shlex.split(v)) for v in re.split(r";\s*(?=--)|;\s*$", opts.variants) if v.strip()]
        opts.main_flags = as_pairs(shlex.split(opts.main_flags))
    except ValueError as e:  # shlex: an unclosed quote
        p.error(f"--variants/--main-flags: {e}")
    given = [(option, flags) for option, flag_sets in (("--main-flags", [opts.main_flags]), ("--variants", opts.variants))
             for flags in flag_sets if flags]
    for option, flags in given:
        names = flags[::2]
        if len(flags) % 2 or not all(n.startswith("--") for n in names):
            p.error(f"{option}: {' '.join(flags)!r}: expected trainer flags as '--name value' pairs")
        reserved = [n for n in names if n[2:].replace("-", "_") in PROOF_SETS]
        if reserved:
            p.error(f"{option}: {reserved[0]}: the proof sets it (use --steps, --ns-methods)")
    problems = trainer_config_errors([flags for _, flags in given], opts.cpu_smoke) if given else []
    for (option, flags), problem in zip(given, problems):
        if problem:
            p.error(f"{option}: {' '.join(flags)!r}: {problem}")
    if opts.kernel_gpus is not None:
        worlds = [x.strip() for x in opts.kernel_gpus.split(",")]
        if not worlds or any(w not in ("1", "8") for w in worlds) or len(set(worlds)) < len(worlds):
            p.error(f"--kernel-gpus={opts.kernel_gpus!r}: expected 1, 8, 8,1 or 1,8")
        opts.kernel_gpus = [int(w) for w in worlds]
    if opts.kernel_parts is not None:
        parts = [x.strip() for x in opts.kernel_parts.split(",")]
        if not parts or any(x not in KERNEL_PARTS for x in parts) or len(set(parts)) < len(parts):
            p.error(f"--kernel-parts={opts.kernel_parts!r}: expected some of {','.join(KERNEL_PARTS)}, each once")
        opts.kernel_parts = parts
    if opts.report_copy is not None:
        folder = os.path.dirname(os.path.abspath(opts.report_copy))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            p.error(f"--report-copy={opts.report_copy}: {folder} is not a writable folder")
    if opts.peer is not None and not os.path.isfile(opts.peer):
        p.error(f"--peer={opts.peer}: no such file")
    if opts.peer is None and os.path.isfile(os.path.join(REPO_ROOT, DEFAULT_PEER)):
        opts.peer = os.path.join(REPO_ROOT, DEFAULT_PEER)
    needs_peer = [x for x in ("warm", "peer") if x in opts.phases]
    if needs_peer and opts.peer is None and not opts.cpu_smoke:
        p.error(f"--phases includes {needs_peer[0]} but no peer script was given and {DEFAULT_PEER} does not exist: copy "
                f"the record's folder there (mkdir -p peers && cp -r ../shared/peers/{PEER_SOURCE} peers/) or pass "
                "--peer PATH")
    if opts.peer:
        opts.peer = os.path.abspath(opts.peer)
        missing = [name for name in PEER_SIBLINGS if peer_kind(opts.peer) == "2026"
                   and not os.path.isfile(os.path.join(os.path.dirname(opts.peer), name))]
        if missing:
            p.error(f"--peer={opts.peer}: {missing[0]} must sit beside it (the script imports it); copy the record's "
                    "whole folder")
    if os.path.exists(os.path.join(opts.out, "report.json")):
        p.error(f"--out={opts.out}: {os.path.join(opts.out, 'report.json')} exists; choose a new folder")
    parent = os.path.abspath(opts.out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        p.error(f"--out={opts.out}: {parent} is not a writable folder")
    return opts


def as_pairs(flags):
    """Trainer flags as '--name value' pairs, read as the trainer reads them: --name=value split, and
    a true/false field without a value (--normuon, before another flag or at the end) made true."""
    switches = trainer_switches()
    pairs = []
    for i, token in enumerate(flags):
        name, sep, value = token.partition("=")
        bare = i + 1 == len(flags) or flags[i + 1].startswith("--")
        if token.startswith("--") and sep:
            pairs += [name, value]
        elif token.startswith("--") and bare and token[2:].replace("-", "_") in switches:
            pairs += [token, "true"]
        else:
            pairs.append(token)
    return pairs


def trainer_switches():
    """The trainer's true/false fields, read from its source (no import: torch is slow to load)."""
    fields = open(TRAINER).read().partition("class Hyperparameters:")[2].partition("\n\n\n")[0]
    return set(re.findall(r"^    (\w+): bool = ", fields, re.M))


def trainer_config_errors_here(flag_sets, cpu_smoke):
    """What train_gpt.py's parse_config says of a train run's configuration with each set of flags
    (None: nothing), in this process: it loads torch."""
    import train_gpt
    base = SMOKE_TRAINER_ARGV if cpu_smoke else ["--preset", "speedrun"]
    said = []
    for flags in flag_sets:
        try:
            train_gpt.harness("config").parse_config(base + list(flags), {}, world_size=1, cuda_available=not cpu_smoke)
            said.append(None)
        except train_gpt.ConfigError as e:
            said.append(str(e))
    return said


def trainer_config_errors(flag_sets, cpu_smoke):
    """trainer_config_errors_here, asked in one child process (torch is slow to load here), so that
    a bad value fails now, not after the main run has spent minutes of the GPU."""
    code = ("import json, sys\n"
            "from bench.gpu_proof import trainer_config_errors_here\n"
            "print(json.dumps(trainer_config_errors_here(json.loads(sys.argv[1]), sys.argv[2] == 'smoke')))\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code, json.dumps([list(f) for f in flag_sets]),
                           "smoke" if cpu_smoke else "speedrun"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return [f"train_gpt.py did not load: {(done.stderr.strip().splitlines() or ['?'])[-1]}"] * len(flag_sets)
    return json.loads(done.stdout.strip().splitlines()[-1])


def cuda_visible():
    """Whether torch sees a CUDA device, asked in a child process: torch is slow to load here, and
    the phases' processes, not this one, are to hold the GPU."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    return done.stdout.strip() == "True"


def trainer_default(name):
    """A field's default in the trainer's Hyperparameters, read from its source (a string field)."""
    fields = open(TRAINER).read().partition("class Hyperparameters:")[2].partition("\n\n\n")[0]
    return re.search(rf'^    {name}: str = "([^"]*)"', fields, re.M)[1]


def trainer_ns_methods():
    """The trainer's ns_methods, read from its source (no import: torch is slow to load)."""
    text = open(TRAINER).read()
    match = re.search(r"^NS_METHODS\s*=\s*\(([^)]*)\)", text, re.M)
    return re.findall(r"[\"'](\w+)[\"']", match.group(1)) if match else ["aol", "polar_express", "newton_schulz"]


# -----------------------------------------------------------------------------------------------
# Orchestration: one process per phase, each with its own time budget

def lease_plan(call, memory_gib, total):
    """What call 1 or 2 of a lease runs on a GPU of memory_gib, with total seconds (call 2: left)."""
    plans = LEASE_PLANS["together" if memory_gib >= WARM_TOGETHER_MIN_GIB else "one at a time"]
    if call == 2 and "short" in plans and total < OURS_MIN_S + TOTAL_MARGIN_S + 10:   # (+10: Python, env)
        return plans["short"]
    return plans[call]


def run_proof(opts):
    out = os.path.abspath(opts.out)
    os.makedirs(os.path.join(out, "phases"), exist_ok=True)
    settings = dict(steps=opts.steps, extension_steps=opts.extension_steps, variant_steps=opts.variant_steps,
                    steady_from=opts.steady_from,
                    ns_methods=opts.ns_methods, main_flags=opts.main_flags, variants=opts.variants, peer=opts.peer,
                    peer_replace=opts.peer_replace, cpu_smoke=opts.cpu_smoke, budgets=opts.budgets,
                    profile=opts.profile, kernel_gpus=opts.kernel_gpus, kernel_parts=opts.kernel_parts)
    with open(os.path.join(out, "settings.json"), "w") as f:
        json.dump(settings, f, indent=1)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if opts.cpu_smoke:
        env["TRITON_INTERPRET"] = "1"   # before train_gpt defines its kernels
        env["CUDA_VISIBLE_DEVICES"] = ""
    phases = {}
    commands = [shlex.join(["python", "bench/gpu_proof.py"] + sys.argv[1:])]
    deadline = opts.started + opts.total if opts.total else None
    for phase in opts.phases:
        budget = opts.budgets[phase]
        if deadline is not None:
            left = deadline - time.time() - TOTAL_MARGIN_S
            if left < min(budget, MIN_PHASE_S):
                phases[phase] = result = new_phase_result(phase)
                result["status"], result["skipped"] = "skipped", f"{max(left, 0):.0f} s left of --total={opts.total:g}"
                print(f"[gpu_proof] {phase}: skipped ({result['skipped']})", flush=True)
                write_report(out, build_report(phases, commands, opts.cpu_smoke), opts.report_copy)
                continue
            if left < budget:   # the worker reads its budget from settings.json
                budget = settings["budgets"][phase] = left
                with open(os.path.join(out, "settings.json"), "w") as f:
                    json.dump(settings, f, indent=1)
        print(f"[gpu_proof] {phase}: running (budget {budget:.0f} s)", flush=True)
        try:
            phases[phase] = result = run_phase_process(phase, out, budget, env)
            print(f"[gpu_proof] {phase}: {result['status']} in {result.get('seconds', 0):.0f} s "
                  f"({result['checks']['passed']} checks passed, {result['checks']['failed']} failed, "
                  f"{len(result['errors'])} errors)", flush=True)
            # After every phase: a command cut short from outside still leaves the report of the phases it ran.
            write_report(out, build_report(phases, commands, opts.cpu_smoke), opts.report_copy)
        except KeyboardInterrupt:  # `timeout` around a lease's command, or Ctrl-C: keep what the phase finished
            if phase not in phases:
                phases[phase] = read_phase_result(phase, out)
                phases[phase]["status"] = "interrupted"
            write_report(out, build_report(phases, commands, opts.cpu_smoke), opts.report_copy)
            raise
    print(f"[gpu_proof] wrote {os.path.join(out, 'report.md')} and report.json", flush=True)
    return 0 if all(p["status"] in ("ok", "skipped") for p in phases.values()) else 1


def read_phase_result(phase, out):
    """What a phase's worker recorded (it rewrites its json after every check)."""
    try:
        with open(os.path.join(out, "phases", f"{phase}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return new_phase_result(phase)


def run_phase_process(phase, out, budget, env):
    """Run one phase in a child process; kill its whole process group when the budget is spent."""
    log_path = os.path.join(out, "phases", f"{phase}.log")
    start = time.time()
    with open(log_path, "w") as log:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", phase, "--out", out],
                                 stdout=log, stderr=subprocess.STDOUT, env=dict(env, GPU_PROOF_PARENT=str(os.getpid())),
                                 cwd=REPO_ROOT, start_new_session=True)
        timed_out = False
        try:
            child.wait(timeout=budget + 20)   # the worker watches its own budget; this is the backstop
        except subprocess.TimeoutExpired:
            timed_out = True
            end_worker(child)
        except KeyboardInterrupt:   # Ctrl-C or SIGTERM here: the worker, in its own session, ends too
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_IGN)   # a second Ctrl-C must not leave it running
            end_worker(child)
            raise
    result = read_phase_result(phase, out)
    result["seconds"] = round(time.time() - start, 1)
    if timed_out:
        result["status"] = "timeout"
        result["notes"].append(f"killed after its budget of {budget:.0f} s; figures above are what it finished")
    elif child.returncode != 0 or result["status"] == "running":
        result["status"] = "crashed"
        result["notes"].append(f"the phase process exited with status {child.returncode}")
    if result["status"] in ("timeout", "crashed"):
        result["errors"].append({"check": "phase process (log tail)", "traceback": tail(log_path, 60)})
    return result


def end_worker(child):
    """SIGTERM to the worker's process group (the worker ends the trainers it started, then
    itself), SIGKILL if it is still there 10 s later."""
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    except ProcessLookupError:   # it had ended already
        child.wait()


class Interrupted(KeyboardInterrupt):
    """SIGTERM to the parent, handled like Ctrl-C."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


def tail(path, lines):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def new_phase_result(phase):
    return {"phase": phase, "status": "running", "skipped": None, "values": {}, "tables": [], "notes": [],
            "errors": [], "checks": {"passed": 0, "failed": 0}}


class Recorder:
    """A phase's results, rewritten to disk after every change so a killed phase keeps what it did."""

    def __init__(self, path, phase, deadline=float("inf")):
        self.path = path
        self.deadline = deadline
        self.data = new_phase_result(phase)
        self.flush()

    def flush(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def value(self, key, value):
        self.data["values"][key] = value
        self.flush()

    def note(self, text):
        self.data["notes"].append(text)
        self.flush()

    def table(self, title, columns):
        table = {"title": title, "columns": list(columns), "rows": []}
        self.data["tables"].append(table)
        self.flush()
        return table

    def row(self, table, values, ok=None):
        """Add a row; ok (True/False) counts it as a passed or failed check and fills the 'ok' column."""
        if ok is not None:
            self.data["checks"]["passed" if ok else "failed"] += 1
            values = list(values) + ["yes" if ok else "**NO**"]
        table["rows"].append(values)
        self.flush()

    def attempt(self, what, fn, *args, **kwargs):
        """Run one check; an exception is recorded with its traceback and the phase goes on. Once the
        phase's budget is spent, the remaining checks are listed as not run."""
        start = time.time()
        if start > self.deadline:
            self.data["partial"] = True
            self.note(f"{what}: not run, the phase budget was spent")
            return None
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - every failure must end up in the report, whatever it is
            self.data["errors"].append({"check": what, "traceback": traceback.format_exc()})
            return None
        finally:
            self.data.setdefault("seconds_by_step", {})[what] = round(time.time() - start, 1)
            self.flush()

    def skip(self, reason):
        self.data["skipped"] = reason
        self.flush()

    def finish(self):
        if self.data["errors"] or self.data["checks"]["failed"]:
            self.data["status"] = "failed"
        elif self.data["skipped"]:
            self.data["status"] = "skipped"
        elif self.data.get("partial"):
            self.data["status"] = "partial"   # all that ran is fine, but the budget left something out
        else:
            self.data["status"] = "ok"
        self.flush()


RUNNING = set()   # process groups of the trainers a worker has started and not yet reaped
STARTING = []     # one entry per trainer between its Popen and its entry in RUNNING
HELD_SIGNALS = []


def end_running_and_exit(signum, frame):
    """The worker's SIGTERM handler: its trainers end, then the worker, at once. (Raising SystemExit
    here would land in whatever frame runs, a weakref callback or a thread join, that may swallow
    it and go on; the phase's results are on disk already, the Recorder writes each change.) While
    a trainer starts, the signal waits for its pid in RUNNING: it would live on, in its own session."""
    HELD_SIGNALS.append(signum)   # first: a trainer's thread that ends its start now finds it
    if STARTING:
        return
    for pgid in list(RUNNING):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(128 + signum)


def worker_main(phase, out):
    signal.signal(signal.SIGTERM, end_running_and_exit)
    parent = int(os.environ.get("GPU_PROOF_PARENT", os.getppid()))   # not getppid(): it may be gone already

    def end_with_the_parent():   # killed outright (a lease's limit), it cannot end this session's trainers
        while os.getppid() == parent:
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=end_with_the_parent, daemon=True).start()
    with open(os.path.join(out, "settings.json")) as f:
        settings = json.load(f)
    deadline = time.time() + settings["budgets"][phase] - 5
    rec = Recorder(os.path.join(out, "phases", f"{phase}.json"), phase, deadline - 15)
    ctx = dict(settings, out=out, deadline=deadline, phase=phase)
    try:
        PHASE_FUNCTIONS[phase](rec, ctx)
    except Exception:  # noqa: BLE001 - recorded in the report like any failed check
        rec.data["errors"].append({"check": phase, "traceback": traceback.format_exc()})
    rec.finish()
    return 0


# -----------------------------------------------------------------------------------------------
# Shared helpers for phases (imported lazily: torch and train_gpt load only inside workers)

def import_trainer():
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import train_gpt
    return train_gpt


def file_sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def rel_err(out, ref):
    """||out - ref||_F / ||ref||_F in fp64; NaN or inf anywhere gives inf (never passes)."""
    out, ref = out.double(), ref.double()
    if not bool(out.isfinite().all()):
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def twin_bound(twin_err, dtype_name):
    """A kernel passes when it is as accurate as the PyTorch twin at the same precision, both measured
    against fp64: error <= 1.5 x the twin's + a floor of about one rounding step."""
    return 1.5 * twin_err + (1e-3 if dtype_name == "bfloat16" else 1e-5)


def fmt(x):
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:.0f}"
        return f"{x:.4g}" if abs(x) >= 1e-3 else f"{x:.2e}"
    return "" if x is None else str(x)


def speedrun_args(tg, extra=()):
    return tg.harness("config").parse_config(["--preset", "speedrun", *extra], {}, world_size=1, cuda_available=True)


def muon_layout(tg, torch):
    """The speedrun's Muon matrices: their stored shapes, and per wide shape (rows <= cols) the number
    of matrices one rank orthogonalizes at world sizes 1 and 8, read from ShardedMuonAdam's state on
    the meta device (the momentum stacks), or computed from the bucket rule if that fails."""
    import dataclasses
    args = speedrun_args(tg)
    hw = dataclasses.replace(tg.Hardware.detect(args), device=torch.device("meta"))
    with torch.device("meta"):
        model = tg.GPT(args, hw)
    specs = [s for s in tg.param_specs(model, args) if s.optimizer == "muon"]
    stored = sorted({tuple(s.param.shape[-2:]) for s in specs})
    counts = {}
    for s in specs:
        rows, cols = s.param.shape[-2:]
        wide = (min(rows, cols), max(rows, cols))
        counts[wide] = counts.get(wide, 0) + math.prod(s.param.shape[:-2])
    per_rank, source = {}, "ShardedMuonAdam.state_tensors() on the meta device"
    for world in (1, 8):
        try:
            ranks = tg.Ranks(rank=0, local_rank=0, world_size=world, local_world_size=world)
            opt = tg.ShardedMuonAdam(tg.param_specs(model, args), args, ranks, hw)
            found = {}
            for t in opt.state_tensors():
                if t.ndim == 3 and tuple(t.shape[1:]) in counts:
                    found[tuple(t.shape[1:])] = found.get(tuple(t.shape[1:]), 0) + t.shape[0]
            if set(found) != set(counts):
                raise RuntimeError(f"momentum stacks {found} do not cover the Muon shapes {counts}")
        except Exception as e:  # noqa: BLE001 - fall back to the documented bucket rule
            source = f"computed from the bucket rule ({type(e).__name__}: {str(e)[:80]})"
            bucket = world * -(-args.muon_bucket_matrices // world)
            found = {shape: sum(-(-min(bucket, n - i) // world) for i in range(0, n, bucket))
                     for shape, n in counts.items()}
        per_rank[world] = found
    return dict(stored=stored, counts=counts, per_rank=per_rank, source=source)


def smoke_dim(d):
    return d // 48 if d >= 96 else d


def ns_steps(tg, method):
    return len(tg.default_coeffs(method))


def orthogonalize_flops(m, n, steps, symmetric):
    """GEMM FLOPs to orthogonalize one m x n matrix (elementwise work not counted). Per step on the
    wide orientation: Gram 2m^2n, A@A 2m^3, B@X 2m^2n; the symmetric kernels compute half of the
    Gram and of A@A. AOL's scaling reuses the first Gram, so it adds no GEMM."""
    m, n = min(m, n), max(m, n)
    return steps * ((3 * m * m * n + m ** 3) if symmetric else (4 * m * m * n + 2 * m ** 3))


# -----------------------------------------------------------------------------------------------
# Phase env

def phase_env(rec, ctx):
    import torch
    rec.value("python", sys.version.split()[0])
    rec.value("platform", platform.platform())
    rec.value("torch", torch.__version__)
    rec.value("torch_cuda", torch.version.cuda)
    try:
        import triton
        rec.value("triton", triton.__version__)
    except ImportError:
        rec.value("triton", "not installed")
    rec.value("cpu_count", os.cpu_count())
    rec.value("train_gpt_sha256", file_sha256(TRAINER))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        rec.value("git_commit", commit or "not a git checkout")
    except (OSError, subprocess.SubprocessError):
        rec.value("git_commit", "git unavailable")
    if ctx["cpu_smoke"] or not torch.cuda.is_available():
        rec.value("device", "cpu")
        if not ctx["cpu_smoke"]:
            rec.note("no CUDA device: the other phases need one (or --cpu-smoke)")
        return
    props = torch.cuda.get_device_properties(0)
    rec.value("device", props.name)
    rec.value("capability", f"{props.major}.{props.minor}")
    rec.value("sm_count", props.multi_processor_count)
    rec.value("memory_gib", round(props.total_memory / 2 ** 30, 1))
    rec.value("cudnn", torch.backends.cudnn.version())
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
        rec.value("driver_maxclock_powerlimit", query)
    except (OSError, subprocess.SubprocessError) as e:
        rec.value("driver_maxclock_powerlimit", f"nvidia-smi unavailable ({e})")


# -----------------------------------------------------------------------------------------------
# Phase correct

def phase_correct(rec, ctx):
    import torch
    tg = import_trainer()
    cuda = not ctx["cpu_smoke"]
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    seed = int(time.time()) % 100000
    torch.manual_seed(seed)
    rec.value("seed", seed)
    rec.value("dtype", str(dtype).removeprefix("torch."))
    layout = rec.attempt("Muon layout", muon_layout, tg, torch)
    stored = [(768, 768), (768, 3072), (6, 12)] if layout is None else layout["stored"]
    # plus a tall matrix: the speedrun stores every Muon matrix wide, but the kernels' transposed
    # path serves forks that store one tall
    stored = sorted(set(stored) | {(768, 768), (768, 3072), (3072, 768), (6, 12)})
    if not cuda:
        stored = sorted({(smoke_dim(r), smoke_dim(c)) for r, c in stored})
        rec.note("cpu smoke: shapes divided by 48 (768 -> 16), fp32, Triton under its interpreter")
    rec.value("muon_shapes", [f"{r}x{c}" for r, c in stored])
    wide = sorted({(min(s), max(s)) for s in stored})
    batch = 4 if cuda else 2
    dname = str(dtype).removeprefix("torch.")

    kernels = rec.table(f"Triton kernels vs the PyTorch twin ({dname}), relative Frobenius error against fp64 "
                        "on the same inputs; bound = 1.5 x twin + floor",
                        ["kernel", "shape (batch)", "triton err", "twin err", "bound", "ok"])
    # Four tiny matrices are too few for an error ratio: at 6x12 in bf16 aol's error is 0.09 on
    # average and up to 0.18, and an fp32 rather than bf16 row sum in the Schur scale (the
    # kernel's, against the twin's) alone moves 4% of such draws past 1.5x the twin's error (bf16
    # emulated on CPU; tests/test_gpu_proof.py). Stacks of at least 384 rows average that out.
    def stack(r, c):
        return max(batch, ORTHO_MIN_ROWS // min(r, c)) if cuda else batch

    for m, n in wide:
        rec.attempt(f"kernels {m}x{n}", check_kernels, rec, kernels, tg, torch, (stack(m, n), m, n), device, dtype)

    mlp = rec.table(f"Fused MLP (Triton, relu^2 in the first GEMM) vs the PyTorch twin ({dname}), relative "
                    "Frobenius error against the twin in fp64 on the same inputs; bound = 1.5 x twin + floor",
                    ["tensor", "shape", "triton err", "twin err", "triton vs twin", "bound", "ok"])
    mlp_dim = 768 if cuda else smoke_dim(768)   # the speedrun's width
    for rows in (4096, 4133) if cuda else (45,):   # an odd count: a partial last row tile
        rec.attempt(f"fused MLP {rows} rows", check_fused_mlp, rec, mlp, tg, torch, rows, mlp_dim, device, dtype)

    loss = rec.table(f"Fused multi-token loss (Triton: soft cap and cross-entropy, --ce_backend triton) vs the "
                     f"PyTorch twin, {dname} logits, relative Frobenius error against fp64 on the same inputs; "
                     "compiled: torch.compile'd whole, as in the compiled model (floats reach the kernel as fp64); "
                     "bound = 1.5 x twin + floor", ["tensor", "shape", "triton err", "twin err", "triton vs twin",
                                                    "bound", "ok"])
    for compiled in (False, True) if cuda else (False,):
        rec.attempt("fused loss" + " compiled" * compiled, check_capped_loss, rec, loss, tg, torch,
                    4133 if cuda else 45, 50304 if cuda else 1000, device, dtype, compiled)
    if not cuda:
        rec.note("fused loss compiled: skipped: dynamo cannot trace the Triton interpreter")

    ortho = rec.table(f"orthogonalize_triton vs orthogonalize_torch ({dname}), relative error against the "
                      "fp64 twin; bound = 1.5 x twin + floor",
                      ["ns_method", "shape (batch)", "triton err", "twin err", "triton vs twin", "bound", "ok"])
    for r, c in stored:
        for method in tg.NS_METHODS:
            rec.attempt(f"orthogonalize {method} {r}x{c}", check_orthogonalize, rec, ortho, tg, torch,
                        (stack(r, c), r, c), method, device, dtype)

    rec.attempt("attention", check_attention, rec, tg, torch, cuda)
    rec.attempt("fp8 head", check_fp8, rec, tg, torch, cuda)
    check_compile(rec, tg, torch, cuda)


def check_kernels(rec, table, tg, torch, shape, device, dtype):
    batch, m, n = shape
    dname = str(dtype).removeprefix("torch.")
    where = f"{m}x{n} ({batch})"
    G = torch.randn(shape, device=device)
    X = (G / G.norm(dim=(-2, -1), keepdim=True)).to(dtype)   # an iterate: ||X|| <= 1, as in the loop
    X64 = X.double()
    a, b, c = 3.4445, -4.7750, 2.0315

    def poisoned(*size):
        return torch.full(size, float("nan"), device=device, dtype=dtype)

    # gram: A = X X^T (and the fp32 row sums of |A| that AOL reads)
    A_ref = X64 @ X64.mT
    A_tri, sums = tg.gram_triton(X, with_row_abs_sum=True, out=poisoned(batch, m, m))
    A_twin = X @ X.mT
    err, twin = rel_err(A_tri, A_ref), rel_err(A_twin, A_ref)
    rec.row(table, ["gram", where, err, twin, twin_bound(twin, dname)], ok=err <= twin_bound(twin, dname))
    sums_err = rel_err(sums, A_ref.abs().sum(-1))
    rec.row(table, ["gram row |A| sums (fp32)", where, sums_err, None, 1e-3 if dname == "bfloat16" else 1e-5],
            ok=sums_err <= (1e-3 if dname == "bfloat16" else 1e-5))

    # sym_poly: B = b A' + c A' A', A' = diag(s) A diag(s), with and without the first step's scale
    A = A_tri
    s = torch.rsqrt(A.float().abs().sum(-1).clamp_min(1e-30))    # AOL's row scale
    for scaled in (False, True):
        A64 = A.double() * (s.double()[:, :, None] * s.double()[:, None, :] if scaled else 1.0)
        ref = b * A64 + c * A64 @ A64
        tri = tg.sym_poly_triton(A, b, c, scale=s if scaled else None, out=poisoned(batch, m, m))
        A_in = (A.float() * s[:, :, None] * s[:, None, :]).to(dtype) if scaled else A
        twin_out = torch.baddbmm(A_in, A_in, A_in, beta=b, alpha=c)
        err, twin = rel_err(tri, ref), rel_err(twin_out, ref)
        rec.row(table, ["sym_poly" + (" scaled" if scaled else ""), where, err, twin, twin_bound(twin, dname)],
                ok=err <= twin_bound(twin, dname))

    # poly_apply: X' = a X + B X, with and without the row scale
    B = tg.sym_poly_triton(A, b, c)
    for scaled in (False, True):
        X_in64 = X64 * (s.double()[:, :, None] if scaled else 1.0)
        ref = a * X_in64 + B.double() @ X_in64
        tri = tg.poly_apply_triton(B, X, a, row_scale=s if scaled else None, out=poisoned(batch, m, n))
        X_in = (X.float() * s[:, :, None]).to(dtype) if scaled else X
        twin_out = torch.baddbmm(X_in, B, X_in, beta=a, alpha=1.0)
        err, twin = rel_err(tri, ref), rel_err(twin_out, ref)
        rec.row(table, ["poly_apply" + (" scaled" if scaled else ""), where, err, twin, twin_bound(twin, dname)],
                ok=err <= twin_bound(twin, dname))


def check_fused_mlp(rec, table, tg, torch, rows, dim, device, dtype):
    """FusedReLUSquareMLP (the model's MLP under --mlp_backend triton) against relu_square_mlp_torch:
    the output and the three gradients, the weights stored (dim, 4 dim) as the model's."""
    dname = str(dtype).removeprefix("torch.")
    x = torch.randn(rows, dim, device=device)
    x = (x * x.square().mean(-1, keepdim=True).rsqrt()).to(dtype)   # RMS-normed, as the MLP's input
    fc = ((torch.rand(dim, 4 * dim, device=device) * 2 - 1) * 3 ** 0.5 * 0.5 * dim ** -0.5).to(dtype)  # the init
    proj = (torch.randn(dim, 4 * dim, device=device) * 0.5 * dim ** -0.5).to(dtype)   # trained: not zero
    grad = torch.randn(rows, dim, device=device).to(dtype)

    def run(fn, *inputs):
        inputs = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*inputs)
        out.backward(grad.to(out.dtype))
        return [out.detach()] + [t.grad for t in inputs]

    ref = run(tg.relu_square_mlp_torch, x.double(), fc.double(), proj.double())
    tri = run(tg.FusedReLUSquareMLP.apply, x, fc, proj)
    twin = run(tg.relu_square_mlp_torch, x, fc, proj)
    for name, t, w, r in zip(("output", "grad x", "grad fc_w", "grad proj_w"), tri, twin, ref):
        err, twin_err = rel_err(t, r), rel_err(w, r)
        bound = twin_bound(twin_err, dname)
        rec.row(table, [name, f"{rows}x{dim}, hidden {4 * dim}", err, twin_err, rel_err(t, w), bound],
                ok=err <= bound and t.dtype == dtype and tuple(t.shape) == tuple(w.shape))


def check_capped_loss(rec, table, tg, torch, rows, vocab, device, dtype, compiled):
    """CappedMultiTokenLoss (the training loss on CUDA) against capped_multi_token_loss_torch: the
    per-row losses and the logits' gradient of their sum, at the preset's cap, with the first third's
    weights of the next 3 tokens and the last third's single one (a kernel of its own: a count of 1
    is a constexpr); compiled, the way the compiled model launches the kernels."""
    args = tg.Hyperparameters()
    cap = (args.logit_cap_height or 2 * args.logit_softcap, args.logit_cap_shift, args.logit_softcap / 2)  # GPT.head's
    logits = (4 * torch.randn(rows, vocab, device=device)).to(dtype)   # a trained head's spread
    targets = torch.randint(0, vocab, (rows + 1,), device=device)[1:]   # the loader's view, off alignment

    def reference(z, weights):  # the twin's formula, in z's dtype (the twin itself computes in fp32)
        z = cap[0] * torch.sigmoid((z + cap[1]) / cap[2])
        lse, losses = z.logsumexp(-1), torch.zeros(rows, dtype=z.dtype, device=device)
        for k, w in enumerate(weights.tolist()):
            losses[:rows - k] += w * (lse[:rows - k] - z[:rows - k].gather(1, targets[k:, None]).squeeze(1))
        return losses

    def run(fn, x, weights):
        x = x.detach().clone().requires_grad_()
        losses = fn(x, weights)
        losses.sum().backward()
        return losses.detach(), x.grad

    kernel = lambda x, weights: tg.CappedMultiTokenLoss.apply(x, targets, weights, *cap)   # noqa: E731
    if compiled:
        kernel = torch.compile(kernel, fullgraph=True, dynamic=False)
    for values in ([1.0, 0.5, 0.25], [1.0]):
        weights = torch.tensor(values, device=device)
        ref = run(reference, logits.double(), weights)
        tri = run(kernel, logits, weights)
        twin = run(lambda x, w: tg.capped_multi_token_loss_torch(x, targets, w, *cap), logits, weights)
        label = f" ({len(values)} weight{'s' * (len(values) > 1)}{', compiled' * compiled})"
        for name, t, w, r in zip(("losses" + label, "grad logits" + label), tri, twin, ref):
            err, twin_err = rel_err(t, r), rel_err(w, r)
            bound = twin_bound(twin_err, str(t.dtype).removeprefix("torch."))  # losses: fp32 of exact bf16 inputs
            rec.row(table, [name, f"{rows}x{vocab}", err, twin_err, rel_err(t, w), bound],
                    ok=err <= bound and t.dtype == w.dtype and tuple(t.shape) == tuple(w.shape))


def check_orthogonalize(rec, table, tg, torch, shape, method, device, dtype):
    dname = str(dtype).removeprefix("torch.")
    G = torch.randn(shape, device=device).to(dtype)
    ref = tg.orthogonalize_torch(G.double(), method)
    tri = tg.orthogonalize_triton(G, method)
    twin = tg.orthogonalize_torch(G, method)
    err, twin_err = rel_err(tri, ref), rel_err(twin, ref)
    bound = twin_bound(twin_err, dname)
    rec.row(table, [method, f"{shape[1]}x{shape[2]} ({shape[0]})", err, twin_err, rel_err(tri, twin), bound],
            ok=err <= bound and tuple(tri.shape) == tuple(shape))


def doc_tokens(torch, T, n_docs, generator, device):
    """T random tokens in n_docs documents (a BOS at each start, the first at position 0)."""
    tokens = torch.randint(0, 50000, (T,), generator=generator)
    starts = torch.randperm(T - 1, generator=generator)[:n_docs - 1] + 1
    tokens[starts] = 50256
    tokens[0] = 50256
    return tokens.to(device)


def record_doc_tokens(torch, T, generator, device, max_doc_len=2048):
    """T random tokens packed as the 2026 record's batches: documents from a BOS at 0, their lengths
    exponential with a median of ~400 tokens (the record's loader: "median doc length is ~400"), cut
    at max_doc_len."""
    lengths = (torch.empty(T).exponential_(1 / 575, generator=generator).long() + 1).clamp(max=max_doc_len)
    starts = torch.cumsum(lengths, 0) - lengths
    tokens = torch.randint(0, 50000, (T,), generator=generator)
    tokens[starts[starts < T]] = 50256
    return tokens.to(device)


def validation_bounds(tg, torch, tokens):
    """The varlen bounds the trainer finds at set-up for validation, here of one window's documents."""
    return tg.validation_document_bounds(torch.cat([tokens, tokens[:1]]).cpu(), tokens.numel())


def validation_varlen_mask(tg, torch, tokens, window, block, paired):
    """The varlen mask the trainer gives a validation window."""
    longest, capacity = validation_bounds(tg, torch, tokens)
    return tg.varlen_mask(tokens, window, block, longest, paired=paired, capacity=capacity)


def varlen_allowed(torch, mask, total):
    """What varlen_attn computes from a VarlenMask: query i sees key j in its segment with i - W <= j <= i."""
    pos = torch.arange(total, device=mask.starts.device)
    segment = torch.searchsorted(mask.starts.long(), pos, right=True)
    return (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= mask.window)


def reference_attention(q, k, v, allowed, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


def check_attention(rec, tg, torch, cuda):
    """FlexAttention with the trainer's BlockMask against SDPA with its dense mask, outputs and
    gradients, both against a reference in higher precision on the same (rounded) inputs."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention
    gen = torch.Generator().manual_seed(int(time.time()))
    if cuda:
        device, dtype, ref_dtype = torch.device("cuda"), torch.bfloat16, torch.float32
        T, block, H, D, n_docs = 6144, 128, 6, 128, 9
    else:
        device, dtype, ref_dtype = torch.device("cpu"), torch.float32, torch.float64
        T, block, H, D, n_docs = 256, 32, 2, 16, 4
    # Compiled on CPU too: only compiled does FlexAttention follow the BlockMask's block lists
    # (the trainer's mask_mod leaves the window to them). On CPU it checks the forward only.
    flex = torch.compile(flex_attention, dynamic=False)
    tokens = doc_tokens(torch, T, n_docs, gen, device)
    table = rec.table(f"FlexAttention (BlockMask) and SDPA (dense mask) vs a {str(ref_dtype)[6:]} reference: "
                      f"{T} tokens, {n_docs} documents, {H} heads of {D}, blocks of {block}; "
                      "bound = 2 x SDPA's error + 1e-3",
                      ["window (blocks)", "tensor", "flex err", "sdpa err", "bound", "ok"])
    scale = 0.12
    for window in (1, T // block // 4, T // block):
        w = torch.tensor(window, device=device)
        q, k, v = (torch.randn(1, H, T, D, generator=gen).to(device, dtype) for _ in range(3))
        dy = torch.randn(1, H, T, D, generator=gen).to(device, dtype)
        allowed = tg.dense_attention_mask(tokens, w, block)
        ref_in = [t.to(ref_dtype).requires_grad_() for t in (q, k, v)]
        ref_out = reference_attention(*ref_in, allowed, scale)
        ref_grads = torch.autograd.grad(ref_out, ref_in, dy.to(ref_dtype))
        sd_in = [t.clone().requires_grad_() for t in (q, k, v)]
        sd_out = F.scaled_dot_product_attention(*sd_in, attn_mask=allowed, scale=scale)
        sd_grads = torch.autograd.grad(sd_out, sd_in, dy)
        block_mask = tg.flex_block_mask(tokens, w, block)
        if cuda:
            fx_in = [t.clone().requires_grad_() for t in (q, k, v)]
            fx_out = flex(*fx_in, block_mask=block_mask, scale=scale)
            fx_grads = torch.autograd.grad(fx_out, fx_in, dy)
        else:
            with torch.no_grad():
                fx_out = flex(q, k, v, block_mask=block_mask, scale=scale)
            fx_grads = (None, None, None)
        for name, fx, sd, ref in zip(("output", "grad q", "grad k", "grad v"), (fx_out, *fx_grads),
                                     (sd_out, *sd_grads), (ref_out, *ref_grads)):
            sd_err = rel_err(sd, ref)
            bound = 2 * sd_err + 1e-3
            if fx is None:
                rec.row(table, [window, name, "n/a (no CPU backward)", sd_err, None, ""])
                continue
            fx_err = rel_err(fx, ref)
            rec.row(table, [window, name, fx_err, sd_err, bound], ok=fx_err <= bound)
    check_token_window_attention(rec, tg, torch, cuda, gen)


def check_token_window_attention(rec, tg, torch, cuda, gen):
    """The 2026 record's attention (--token_windows): both CUDA backends through the trainer's attend,
    FlexAttention (a BlockMask) and varlen (torch's FlashAttention-2, --attn_backend varlen), against
    a reference in higher precision, on packed record-like documents, paired heads too; and on every
    device, that the varlen mask's starts and window allow what the dense mask allows."""
    import torch.nn.functional as F
    if cuda:
        device, dtype, ref_dtype = torch.device("cuda"), torch.bfloat16, torch.float32
        T, block, H, D, longest = 8192, 128, 6, 128, 2048
    else:
        device, dtype, ref_dtype = torch.device("cpu"), torch.float32, torch.float64
        T, block, H, D, longest = 256, 32, 2, 16, 48
    if not cuda:
        rec.note("token windows, cpu smoke: the varlen masks only (FlexAttention has no CPU backward, varlen_attn "
                 "no CPU kernel)")
    table = rec.table(f"Token windows (the 2026 record's): FlexAttention and varlen_attn through attend vs a "
                      f"{str(ref_dtype)[6:]} reference, {T} tokens in record-like documents (at most {longest}; "
                      f"'whole': validation's, uncut, bounds from the window's documents), {H} heads of {D}, "
                      f"blocks of {block}; bound = 2 x SDPA's error + 1e-3",
                      ["window (blocks)", "heads", "documents", "tensor", "flex err", "varlen err", "sdpa err", "bound",
                       "ok"])
    scale = 0.12
    for window, paired, whole in ((1, False, False), (3, False, False), (13, False, False), (1, True, False),
                                  (13, True, False), (13, False, True)):
        tokens = record_doc_tokens(torch, T, gen, device, T if whole else longest)
        n, h = (2 * T, H // 2) if paired else (T, H)
        allowed = tg.dense_attention_mask(tokens, window, block, token_window=True, paired=paired)
        vmask = validation_varlen_mask(tg, torch, tokens, window, block, paired) if whole else \
            tg.varlen_mask(tokens, window, block, longest, paired=paired)
        heads = f"{h} x {D}" + (" paired" if paired else "")
        docs = f"{int((tokens == tg.BOS_TOKEN).sum())}" + (" whole" if whole else "")
        rec.row(table, [window, heads, docs, "varlen mask = dense mask", None, None, None, None],
                ok=bool(torch.equal(varlen_allowed(torch, vmask, n), allowed)))
        if not cuda:   # FlexAttention has no CPU backward, varlen_attn no CPU kernel
            continue
        q, k, v, dy = (torch.randn(1, n, h, D, generator=gen).to(device, dtype) for _ in range(4))
        ref_in = [t.transpose(1, 2).to(ref_dtype).requires_grad_() for t in (q, k, v)]
        ref_out = reference_attention(*ref_in, allowed, scale)
        ref = [ref_out.detach(), *torch.autograd.grad(ref_out, ref_in, dy.transpose(1, 2).to(ref_dtype))]
        sd_in = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
        sd_out = F.scaled_dot_product_attention(*sd_in, attn_mask=allowed, scale=scale)
        sd = [sd_out.detach(), *torch.autograd.grad(sd_out, sd_in, dy.transpose(1, 2))]
        flex_mask = tg.flex_block_mask(tokens, torch.tensor(window, device=device), block, token_window=True,
                                       paired=paired)
        results = []
        for mask in (flex_mask, vmask):
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            out = tg.attend(*ins, mask, scale)   # (1, n, h, D), as the reference's transpose
            results.append([t.transpose(1, 2) for t in (out.detach(), *torch.autograd.grad(out, ins, dy))])
        for i, name in enumerate(("output", "grad q", "grad k", "grad v")):
            sd_err = rel_err(sd[i], ref[i])
            errs = [rel_err(r[i], ref[i]) for r in results]
            bound = 2 * sd_err + 1e-3
            rec.row(table, [window, heads, docs, name, *errs, sd_err, bound], ok=all(e <= bound for e in errs))


def check_fp8(rec, tg, torch, cuda):
    """The trainer's FP8 head product x @ w.T (its custom op) against bf16, both against fp32: with
    each kind of static scales (the preset's first) and each master weight dtype (--bf16_weights's
    bf16 first; its fp32 gradient reaches the weight through autograd's cast)."""
    import torch.nn.functional as F
    T, D, V = (8192, 768, 50304) if cuda else (256, 64, 1000)
    device = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(int(time.time()))
    x0 = F.rms_norm(torch.randn(T, D, generator=gen), (D,)).to(device).bfloat16()  # the head's input is normed
    w_fp32 = (0.02 * torch.randn(V, D, generator=gen)).to(device)
    targets = torch.randint(0, V, (T,), generator=gen).to(device)
    form = "fp8_matmul custom op, static scales"
    rec.value("fp8_form", form)
    preset = speedrun_args(tg).fp8_scales
    table = rec.table(f"FP8 head ({form}) vs bf16, relative error against fp32: {T} tokens x {D} -> {V}, "
                      "loss = cross-entropy (sum) of the soft-capped logits; the preset's scales "
                      f"({preset}) and bf16 weight first",
                      ["scales", "weight", "tensor", "fp8 err", "bf16 err", "bound", "ok"])

    def run(kind, w0, scales=None):
        x = (x0.float() if kind == "fp32" else x0).clone().requires_grad_()
        w = (w0.float() if kind == "fp32" else w0).clone().requires_grad_()
        if kind == "fp8":
            logits = tg.fp8_matmul(x, w, *scales)
        else:
            logits = F.linear(x, w.to(x.dtype))
        loss = F.cross_entropy(30 * torch.sigmoid(logits.float() / 7.5), targets, reduction="sum")
        loss.backward()
        return logits.float(), x.grad.float(), w.grad.float()

    kinds = sorted(tg.harness("config").CHOICES["fp8_scales"], key=lambda kind: kind != preset)
    for weight_dtype in (torch.bfloat16, torch.float32):
        w0 = w_fp32.to(weight_dtype)
        ref, bf16 = run("fp32", w0), run("bf16", w0)   # the reference reads the same (rounded) weight
        for kind in kinds:
            fp8 = run("fp8", w0, tg.fp8_head_scales(D, kind))
            for name, f8, b16, r in zip(("logits", "grad_x", "grad_w"), fp8, bf16, ref):
                err = rel_err(f8, r)
                rec.row(table, [kind, str(weight_dtype).removeprefix("torch."), name, err, rel_err(b16, r),
                                FP8_BOUNDS[name]], ok=err <= FP8_BOUNDS[name])


def compile_counts(tg, torch, argv, cuda, backend, fp8_head=None):
    """Graphs, graph breaks and eager fallbacks of model.compile_for_training(scope) (argv's
    --compile_scope): round 1 is a training
    micro-step and a validation forward; round 2 repeats both at a later step's window size. The
    count is dynamo's, of every compiled function: on CUDA it includes the FP8 head's two op bodies,
    each compiled on its own (train_gpt._on_device_of). fp8_head (CPU only) overrides the hardware's
    choice; the op bodies are then compiled as on CUDA, with this backend, so that the CPU capture
    counts the graphs a CUDA run with the FP8 head has."""
    import dataclasses
    import torch._dynamo
    from torch._dynamo.utils import counters
    args = tg.harness("config").parse_config(argv, {}, world_size=1, cuda_available=cuda)
    hw = tg.Hardware.detect(args)
    on_device_of = tg._on_device_of
    if fp8_head is not None and not cuda:
        hw = dataclasses.replace(hw, fp8_head=fp8_head)
        tg._on_device_of = lambda t, fn: tg._compiled(fn, backend)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    try:
        model = tg.GPT(args, hw).to(hw.device)
        model.compile_for_training(args.compile_scope, backend=backend)
        gen = torch.Generator().manual_seed(0)
        for step in (0, args.num_iterations // 2):
            long = tg.long_window_blocks_at(step, args)   # (long, short) and the loss's weights, as train() passes them
            windows = [b if hw.attention == "varlen" else torch.tensor(b, device=hw.device) for b in (long, tg.short_window_blocks(long))]
            # the weights' count changes by thirds (a graph each, which warmup compiles): round 2 keeps step 0's,
            # so that it tests the window alone
            mtp = torch.tensor(tg.mtp_weights_at(0, args), device=hw.device) if args.mtp else None
            model.embed_tied = tg.embed_tied_at(step, args)   # as train()'s enter_step(step) sets it
            model.train()
            tokens = doc_tokens(torch, args.train_seq_len + 1, 8, gen, hw.device)
            model(tokens[:-1], tokens[1:], *windows, mtp).backward()
            model.zero_grad(set_to_none=True)
            model.eval()
            with torch.no_grad():
                tokens = doc_tokens(torch, args.val_seq_len + 1, 8, gen, hw.device)
                model(tokens[:-1], tokens[1:], *windows)
            graphs.append(counters["stats"]["unique_graphs"])
        breaks = sum(counters["graph_break"].values())
        fallbacks = [r for r in counters["unimplemented"] if "recompile" in r.lower()]
    finally:
        tg._on_device_of = on_device_of
        torch._dynamo.reset()
    bodies = " (op bodies compiled)" if hw.fp8_head else ""
    return dict(graphs_round1=graphs[0], new_graphs_round2=graphs[1] - graphs[0], graph_breaks=breaks,
                eager_fallbacks=len(fallbacks), fp8_head=hw.fp8_head,
                hw=f"{hw.device.type}, {hw.attention}, fp8={hw.fp8_head}{bodies}")


# The smoke run proves the compile check's code path on a 4-block layout (fewer graphs to trace).
SMOKE_LAYOUT = ["--num_layers", "4", "--window_pattern", "LSSL", "--attention_free_layers", "2", "--num_value_embeds",
                "1", "--value_embed_layers", "0..0", "--paired_head_layers", "1", "--skip_layers", "1,3",
                "--backout_layer", "1"]
# A CPU capture is small: the graphs do not depend on sizes, and torch._scaled_mm on a CPU can be a scalar
# loop (17 ns per multiply-add on a Sapphire Rapids VM: 75 s per scope at 256 tokens of width 64).
CPU_CAPTURE_SIZES = ["--device", "cpu", "--model_dim", "32", "--num_heads", "2", "--head_dim", "16",
                     "--attn_block_size", "32", "--train_seq_len", "32", "--val_seq_len", "128"]


def check_compile(rec, tg, torch, cuda):
    """The CUDA run against a CPU capture of the same layout with the same FP8 choice. The CPU
    capture attends with SDPA (FlexAttention has no CPU backward): which attention a block calls
    does not change how many graphs the blocks need, and the CUDA count checks that. The smoke run
    captures the FP8 layout an H100 runs (its measured count is the expected one)."""
    layout = ["--preset", "speedrun"] + ([] if cuda else SMOKE_LAYOUT)
    cpu_argv = layout + CPU_CAPTURE_SIZES
    table = rec.table("torch.compile of the model for training (model.compile_for_training, backend aot_eager: "
                      "graph capture and AOT backward, no code generation, except the FP8 op bodies, which "
                      "train_gpt.py compiles with inductor on CUDA; the train phase counts the "
                      "inductor run), at each --compile_scope: model (the record's: one graph for training, "
                      "one for validation) and blocks (each block and the head on its own). "
                      "Expected: as many graphs as the CPU capture of the same layout and FP8 choice "
                      "(SDPA for FlexAttention, the op bodies compiled as on CUDA), no new graphs in "
                      "round 2 (later window), no graph breaks, no fallback to eager",
                      ["scope", "count", "measured", "expected", "ok"])
    for scope in tg.harness("config").CHOICES["compile_scope"]:   # one attempt each: a failure of one keeps the other's counts
        rec.attempt(f"compile counts {scope}", compile_scope_counts, rec, table, tg, torch, cuda, scope, layout,
                    cpu_argv)


def compile_scope_counts(rec, table, tg, torch, cuda, scope, layout, cpu_argv):
    argv = ["--compile_scope", scope]
    if cuda:
        measured = compile_counts(tg, torch, layout + argv + ["--train_seq_len", "4096", "--val_seq_len", "8192"],
                                  True, "aot_eager")
        expected = compile_counts(tg, torch, cpu_argv + argv, False, "aot_eager", fp8_head=measured["fp8_head"])
    else:
        measured = expected = compile_counts(tg, torch, cpu_argv + argv, False, "eager", fp8_head=True)
    rec.value("compile_hw", measured["hw"])
    rec.value("compile_expected_hw", expected["hw"])
    for key, want in (("graphs_round1", expected["graphs_round1"]), ("new_graphs_round2", 0),
                      ("graph_breaks", 0), ("eager_fallbacks", 0)):
        rec.row(table, [scope, key, measured[key], want], ok=measured[key] == want)


# -----------------------------------------------------------------------------------------------
# Phase kernels

def phase_kernels(rec, ctx):
    parts = {"muon": time_orthogonalizers, "attention": time_attention}
    for part in ctx.get("kernel_parts") or KERNEL_PARTS:
        rec.attempt(f"kernels: {part}", parts[part], rec, ctx)


def time_attention(rec, ctx):
    """FlexAttention against varlen_attn (--attn_backend), each through the trainer's attend, at the 2026
    record's shapes: 16Ki and 48Ki tokens a micro-batch, 6 heads of 128 (paired: 3 over 2T positions),
    windows of 1 to 13 blocks, packed record-like documents; then one validation-sized forward pass,
    documents whole (varlen's bounds from them, as the trainer's). Largest first: a short budget
    times what the training steps mostly run."""
    import torch
    tg = import_trainer()
    cuda = not ctx["cpu_smoke"]
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        lengths, windows, H, D, block, longest, val_len = (49152, 16384), (1, 5, 13), 6, 128, 128, 2048, 262144
    else:
        lengths, windows, H, D, block, longest, val_len = (512,), (1, 3), 2, 16, 32, 128, 1024
        rec.note("attention timing, cpu smoke: the masks only (FlexAttention has no CPU backward, varlen_attn "
                 "no CPU kernel)")
    gen = torch.Generator().manual_seed(0)
    table = rec.table("Attention through attend (the trainer's call): median ms of one call; FlexAttention (a "
                      "BlockMask, compiled) vs varlen_attn (FlashAttention-2, torch's); 'flex / varlen' above 1: "
                      f"varlen is faster; documents as the record's packed ones (median ~400 tokens, at most "
                      f"{longest}); mask ms: building it for one micro-batch (eager)",
                      ["tokens", "heads", "window (blocks)", "pass", "flex ms", "varlen ms", "flex / varlen",
                       "flex mask ms", "varlen mask ms"])
    plan = [(T, paired, w, True) for T in lengths for paired in (False, True) for w in windows]
    for T, paired, window, train in plan + [(val_len, False, windows[-1], False)]:
        if time.time() > ctx["deadline"] - 30:
            rec.data["partial"] = True
            rec.note("attention timing: stopped early: the phase budget was spent")
            break
        tokens = record_doc_tokens(torch, T, gen, device, longest if train else T)
        # validation's bounds come once per run (set-up), not with each mask: outside the timed call
        bound, capacity = (longest, None) if train else validation_bounds(tg, torch, tokens)
        n, h = (2 * T, H // 2) if paired else (T, H)
        builders = {"flex": lambda: tg.flex_block_mask(tokens, torch.tensor(window, device=device), block,
                                                      token_window=True, paired=paired),
                    "varlen": lambda: tg.varlen_mask(tokens, window, block, bound, paired=paired, capacity=capacity)}
        mask_ms = {name: rec.attempt(f"time {name} mask {T} {window}", time_call, torch, cuda, build)
                   for name, build in builders.items()}
        ms = {}
        if cuda:
            q, k, v = (torch.randn(1, n, h, D, device=device, dtype=torch.bfloat16, requires_grad=train)
                       for _ in range(3))
            dy = torch.randn_like(q)
            for name, build in builders.items():
                def call(mask=build()):
                    with torch.set_grad_enabled(train):
                        out = tg.attend(q, k, v, mask, 0.12)
                        return torch.autograd.grad(out, (q, k, v), dy) if train else out
                ms[name] = rec.attempt(f"time {name} attention {T} {window}", time_call, torch, cuda, call)
        flex, varlen = ms.get("flex"), ms.get("varlen")
        rec.row(table, [T, f"{h} x {D}" + " paired (2T)" * paired, window,
                        "forward + backward" if train else "forward (validation, documents whole)", flex, varlen,
                        flex / varlen if flex and varlen else None, mask_ms["flex"], mask_ms["varlen"]])


def time_orthogonalizers(rec, ctx):
    import torch
    tg = import_trainer()
    cuda = not ctx["cpu_smoke"]
    layout = muon_layout(tg, torch)
    rec.value("layout_source", layout["source"])
    rec.value("muon_matrices", {f"{m}x{n}": k for (m, n), k in layout["counts"].items()})
    import torch._dynamo
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))   # one graph per method x stack shape
    # as the trainer's compile_orthogonalizer: without dynamic=False, a second stack shape would
    # recompile it with dynamic shapes, unlike the 'triton compiled' row and the trainer
    compiled = torch.compile(tg.orthogonalize_torch, dynamic=False, fullgraph=True,
                             backend="inductor" if cuda else "eager")
    backends = [("triton", tg.orthogonalize_triton), ("torch", compiled)]
    if cuda:   # as the record compiles its Triton Newton-Schulz, and the trainer under --compile: no Python between launches
        backends.insert(1, ("triton compiled", torch.compile(tg.orthogonalize_triton, dynamic=False, fullgraph=True)))
    dtype = torch.bfloat16 if cuda else torch.float32
    worlds = ctx.get("kernel_gpus") or ((8, 1) if cuda else (8,))
    if not cuda:
        rec.note(f"cpu smoke: shapes divided by 48, at most 2 matrices, one timed call, world size "
                 f"{' then '.join(map(str, worlds))}, "
                 "torch.compile "
                 "with the eager backend: the figures prove the code path, not a speed; no 'triton compiled' "
                 "backend (dynamo cannot trace interpreted kernels)")
    table = rec.table("Orthogonalizing one rank's Muon stack: median ms per call (CUDA events, after warmup); "
                      "TFLOP/s counts the GEMM FLOPs each backend executes (symmetric kernels: half the Gram and "
                      "A@A); 'vs torch NS' = ms of compiled torch Newton-Schulz / ms (higher is faster)",
                      ["GPUs", "stack", "ns_method", "steps", "backend", "ms", "TFLOP/s", "vs torch NS",
                       "vs triton NS"])
    timed = {}   # (GPUs, method, backend): ms of each stack it was timed on
    shapes = sorted(layout["counts"], key=lambda s: -s[0] * s[1])
    # By default the 8 GPUs' stacks first (the speedrun's); --kernel-gpus picks and orders them.
    plan = [(world, shape) for world in worlds for shape in shapes]
    out_of_time = False
    # A backend that fails on every method of a stack is not tried again: on the H100 each failed
    # compilation cost about 10 s, and ten of them spent the budget meant for the 8-GPU stacks.
    given_up = set()
    for world, (m, n) in plan:
        count = layout["per_rank"][world][(m, n)]
        if not cuda:
            m, n, count = smoke_dim(m), smoke_dim(n), min(count, 2)
        G = torch.randn(count, m, n, device="cuda" if cuda else "cpu").to(dtype)
        times, rows = {}, []
        for method in tg.NS_METHODS:
            steps = ns_steps(tg, method)
            for backend, fn in backends:
                if time.time() > ctx["deadline"] - 20:
                    out_of_time = True
                    break
                if backend in given_up:
                    continue
                ms = rec.attempt(f"time {backend} {method} {m}x{n}x{count}", time_call, torch, cuda,
                                 lambda fn=fn, method=method: fn(G, method))
                times[(method, backend)] = ms
                if ms is not None:
                    timed.setdefault((world, method, backend), []).append(ms)
                flops = count * orthogonalize_flops(m, n, steps, symmetric=backend.startswith("triton"))
                rows.append([world, f"{count} x {m}x{n}", method, steps, backend, ms,
                             None if not ms else flops / (ms * 1e-3) / 1e12, None, None])
                rec.row(table, rows[-1])
        for backend, _ in backends:
            tried = [times[(method, backend)] for method in tg.NS_METHODS if (method, backend) in times]
            if backend not in given_up and len(tried) == len(tg.NS_METHODS) and all(t is None for t in tried):
                given_up.add(backend)
                rec.note(f"{backend}: failed on every ns_method of {count} x {m}x{n} (tracebacks under errors), "
                         "so not tried on the later stacks")
        ns_torch, ns_triton = times.get(("newton_schulz", "torch")), times.get(("newton_schulz", "triton"))
        for row in rows:   # the same lists as the table's rows
            ms = row[5]
            row[7] = ns_torch / ms if ms and ns_torch else None
            row[8] = ns_triton / ms if ms and ns_triton and row[4].startswith("triton") else None
        rec.flush()
        if out_of_time:
            rec.data["partial"] = True
            rec.note("stopped early: the phase budget was spent")
            break
    summary = rec.table("One rank's orthogonalization work per optimizer step (sum over its stacks; empty "
                        "where a stack was not timed)", ["GPUs", "ns_method", "backend", "ms per step", "vs torch NS"])
    for world in (1, 8):
        # a sum over some of the stacks would understate the step and overstate the ratio
        stacks = sum(1 for w, _ in plan if w == world)
        whole = {k: sum(v) for k, v in timed.items() if k[0] == world and len(v) == stacks}
        base = whole.get((world, "newton_schulz", "torch"))
        for method in tg.NS_METHODS:
            for backend, _ in backends:
                ms = whole.get((world, method, backend))
                rec.row(summary, [world, method, backend, ms, base / ms if ms and base else None])


def time_call(torch, cuda, fn):
    fn()   # compile, autotune and allocate outside the timing
    if not cuda:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    try:
        import triton.testing
        fn()
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    except (ImportError, TypeError):
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


# -----------------------------------------------------------------------------------------------
# Timing data (train and peer phases)

def sample_documents():
    """The embedded sample's documents (data/sample), each starting with BOS, as numpy arrays."""
    import numpy as np
    sys.path.insert(0, REPO_ROOT)
    from data.shards import BOS, read_shard
    out = {}
    for split, name in (("train", "sample_train_000001.bin"), ("val", "sample_val_000000.bin")):
        tokens = read_shard(os.path.join(REPO_ROOT, "data", "sample", name)).astype(np.int64)
        starts = np.flatnonzero(tokens == BOS)
        out[split] = np.split(tokens, starts[1:])
    return out


def repeat_documents(docs, count):
    import numpy as np
    reps = -(-count // sum(len(d) for d in docs))
    return np.concatenate(docs * reps)[:count]


def run_schedules(ctx):
    """(steps, extension steps) of every run the phases start: the main and peer runs', then the
    variants' (which take steps // 8 for their extension, as --extension-steps by default)."""
    main = (ctx["steps"], ctx["extension_steps"])
    variant = (ctx["variant_steps"], ctx["extension_steps"] if ctx["variant_steps"] == ctx["steps"]
               else ctx["variant_steps"] // 8)
    return list(dict.fromkeys([main, variant]))


def packed_positions(doc_lengths, seq_lens, max_doc_len):
    """Shard tokens passed over, from its start, by a loader of packed documents (the 2026 record's
    BOSFinder, our PackedBatches: the same rule) filling one micro-batch of seq_len + 1 tokens per
    entry of seq_lens: each document from its BOS, cut at max_doc_len (the rest skipped), the last
    one cut to fit. doc_lengths repeat, as the timing shard's documents do."""
    docs, passed = itertools.cycle(doc_lengths), 0
    for seq_len in seq_lens:
        filled = 0
        while filled <= seq_len:
            length = next(docs)
            filled += min(length, max_doc_len, seq_len + 1 - filled)
            passed += length
    return passed


def timing_data(ctx, tg, args, val_tokens):
    """DIR/data/fineweb10B/fineweb_{train,val}_*.bin in the standard shard format: the sample's
    documents repeated to the size every run needs (reused when already there and big enough).
    Neither loader goes past its shard's end (ours stops the run, the record's fails), so the train
    shard holds what packing the documents takes for every run's schedule of micro-batch sizes, at
    world size 1 (8 micro-batches a step), and for the record's warmup (its steps around each
    window change, from the shard's start again); validation, val_tokens and one validation
    micro-batch per warmup step (the record's, from one loader). A 2025 peer (--peer), and ours
    without packing, read windows from a BOS, 8 x 2 x seq_len tokens of buffer ahead of every step:
    then that is the bound."""
    import dataclasses
    sys.path.insert(0, REPO_ROOT)
    from data.shards import read_header, write_shard
    folder = os.path.join(ctx["out"], "data", "fineweb10B")
    os.makedirs(folder, exist_ok=True)
    docs = sample_documents()
    lengths = [len(d) for d in docs["train"]]
    train_need, warmup_steps = 0, 1
    for steps, extension in run_schedules(ctx):
        run = dataclasses.replace(args, num_iterations=steps, extension_steps=extension)
        warmup = tg.warmup_steps_at_transitions(run) if args.warmup_at_transitions else []
        warmup_steps = max(warmup_steps, len(warmup) + 1)
        for schedule in (range(steps), warmup):
            seq_lens = [tg.train_seq_len_at(step, run) for step in schedule for _ in range(args.micro_batches)]
            train_need = max(train_need, packed_positions(lengths, seq_lens, args.train_max_doc_len or args.train_seq_len))
    margin = 65536   # a document or more past the last one read
    need = {"train": train_need + margin,
            "val": max(warmup_steps, 8) * args.val_seq_len + val_tokens + margin}
    if not args.train_max_doc_len or ctx.get("peer") and peer_kind(ctx["peer"]) == "2025":
        longest = max(steps for steps, _ in run_schedules(ctx))
        need["train"] = max(need["train"], (longest + 2) * args.micro_batches * (2 * args.train_seq_len + 4096)
                            + args.train_seq_len)
    paths = {"train": os.path.join(folder, "fineweb_train_000001.bin"),
             "val": os.path.join(folder, "fineweb_val_000000.bin")}
    for split, path in paths.items():
        if os.path.exists(path) and read_header(path) >= need[split]:
            continue
        write_shard(path, repeat_documents(docs[split], need[split]))
    counts = {split: read_header(path) for split, path in paths.items()}
    note = (f"timing data: data/sample's CPython-documentation documents (train: {len(lengths)} documents, mean "
            f"length {sum(lengths) / len(lengths):.0f} tokens; val: {len(docs['val'])} documents) repeated in order "
            f"to {counts['train']:,} train and {counts['val']:,} val tokens in the standard shard format, written "
            f"to {folder}: what the longest schedule packs at world size 1 ({train_need:,} tokens passed over) and "
            "more. Not FineWeb: the val losses show training works, not how well it generalizes (the data repeats).")
    return os.path.join(folder, "fineweb_train_*.bin"), os.path.join(folder, "fineweb_val_*.bin"), note


# -----------------------------------------------------------------------------------------------
# Running a trainer and reading its log

STEP_RE = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+(?:\.\d+)?)ms step_avg:")
VAL_RE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) train_time:(\d+(?:\.\d+)?)ms")
MEM_RE = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB")


def parse_run_log(text, steady_from=STEADY_FROM, extension=None):
    """Figures from a log in the speedrun's line format (ours and the public record's); with
    extension (the run's extension steps), its steady ms/step stage by stage too (run_stages)."""
    steps, vals, memory, total = {}, {}, None, None
    lines = text.splitlines()
    separators = [i for i, line in enumerate(lines) if line == "=" * 100]
    for line in lines[separators[-1] + 1 if separators else 0:]:   # the output, after the header
        if m := STEP_RE.match(line):
            steps[int(m.group(1))], total = float(m.group(3)), int(m.group(2))
        elif m := VAL_RE.match(line):
            vals[int(m.group(1))] = float(m.group(3))
        elif m := MEM_RE.match(line):
            memory = (int(m.group(1)), int(m.group(2)))
    last = max(steps) if steps else 0
    steady = None
    if last > steady_from and steady_from in steps:
        steady = (steps[last] - steps[steady_from]) / (last - steady_from)
    figures = dict(steps_done=last, steady_ms=steady, first_step_ms=steps.get(1), steady_from=steady_from,
                   train_time_ms=[[step, ms] for step, ms in sorted(steps.items())],
                   peak_allocated_mib=memory[0] if memory else None, peak_reserved_mib=memory[1] if memory else None,
                   val_loss_start=vals.get(0), val_loss_end=vals[max(vals)] if vals and max(vals) > 0 else None,
                   val_end_step=max(vals) if vals and max(vals) > 0 else None)   # (a run cut short: no end)
    if extension is not None and total and extension < total:
        figures["extension_steps"] = extension
        figures["stages"] = [dict(stage=name, steps=[first + 1, end], **stage_steady(steps, first, end, steady_from))
                             for name, first, end in run_stages(total, extension)]
    return figures


def run_stages(total, extension):
    """A run's stages as (name, first step, end), steps counted from 0 (the log's line step:s ends
    step s - 1): each equal part of the scheduled steps (ours: train_seq_len_schedule and
    window_schedule; the record's get_bs and get_ws: both int(3 * (step / scheduled))), then the
    extension, if any."""
    scheduled = total - extension
    part = [int(STAGE_PARTS * (step / scheduled)) for step in range(scheduled)]
    stages = [(f"{k + 1}/{STAGE_PARTS}", part.index(k), scheduled - part[::-1].index(k))
              for k in range(STAGE_PARTS) if k in part]
    return stages + ([("extension", scheduled, total)] if extension else [])


def stage_steady(times, first, end, steady_from, *others):
    """Steady ms/step of steps first..end - 1 from train_time at the log's step lines (times:
    {step line: ms}): from the line first + STAGE_SKIP (the size or window changed at first: its
    first steps may allocate or wait on the loader) and not before steady_from (the profile's
    window lies before it), to end or the last line the run, and each of the others, reached."""
    start = max(first + STAGE_SKIP, steady_from)
    stop = min([end] + [max(t) if t else 0 for t in (times, *others)])
    if stop <= start or not all(start in t and stop in t for t in (times, *others)):
        return dict(timed=None, ms=None)
    return dict(timed=[start, stop], ms=(times[stop] - times[start]) / (stop - start))


def run_logged(cmd, cwd, env, timeout, stdout_path, until=None):
    """Run cmd, writing its output with a timestamp per line; returns (status, [(t, line)], seconds).
    status is the exit code, 'timeout' after killing its process group, or 'stopped' where it was
    killed at its first line that matches the regex until."""
    start = time.time()
    lines, stopped = [], []
    STARTING.append(cmd)
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)
        RUNNING.add(proc.pid)
    finally:
        STARTING.remove(cmd)
        if HELD_SIGNALS and not STARTING:
            end_running_and_exit(HELD_SIGNALS[0], None)

    def reader():
        with open(stdout_path, "w") as f:
            for line in proc.stdout:
                t = time.time() - start
                lines.append((t, line.rstrip("\n")))
                f.write(f"{t:8.2f} {line}")
                f.flush()
                if until is not None and not stopped and until.match(line):
                    stopped.append(t)
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        status = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = "timeout"
    RUNNING.discard(proc.pid)
    thread.join(timeout=10)
    return "stopped" if stopped else status, lines, time.time() - start


def console_figures(lines):
    """Start-up seconds (launch to the first step line, less its train_time) and the dynamo messages
    (TORCH_LOGS=recompiles,graph_breaks) before and after that point."""
    first = None
    for t, line in lines:
        m = STEP_RE.match(line) or VAL_RE.match(line)
        if m:
            train_ms = float(m.group(3) if STEP_RE.match(line) else m.group(4))
            first = (t, t - train_ms / 1000)
            break
    counts = {"recompiles_warmup": 0, "recompiles_timed": 0, "graph_breaks": 0}
    examples = []
    for t, line in lines:
        timed = first is not None and t >= first[0]
        if "Recompiling function" in line:
            counts["recompiles_timed" if timed else "recompiles_warmup"] += 1
            if timed and len(examples) < 3:
                examples.append(line.split("]")[-1].strip())
        elif "[__graph_breaks] Graph break" in line:
            counts["graph_breaks"] += 1
    return dict(startup_s=None if first is None else round(first[1], 1), **counts, timed_recompile_examples=examples)


def run_columns():
    return ["run", "ns_method", "flags", "steps", "exit", "start-up s", "steady ms/step", "peak alloc MiB",
            "peak reserved MiB", "val loss start", "val loss end", "recompiles warmup/timed", "graph breaks"]


def run_row(label, method, figures):
    return [label, method, figures.get("flags") or "", figures.get("steps_done"), figures.get("exit"), figures.get("startup_s"),
            figures.get("steady_ms"), figures.get("peak_allocated_mib"), figures.get("peak_reserved_mib"),
            figures.get("val_loss_start"), figures.get("val_loss_end"),
            f"{figures.get('recompiles_warmup')}/{figures.get('recompiles_timed')}", figures.get("graph_breaks")]


def child_env(cpu_smoke):
    """The environment of every trainer the proof starts. Inductor's cache entries then hold the
    generated code, not its compiled kernels with their configurations cut down to a choice saved
    earlier: a run that hits the cache tunes its kernels itself (see phase_warm). It is part of the
    cache key, so the warm runs and the timed ones must agree on it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_LOGS="recompiles,graph_breaks",
               TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE="0")
    if cpu_smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# -----------------------------------------------------------------------------------------------
# Phase train

def phase_train(rec, ctx):
    tg = import_trainer()
    drop_choices_a_warm_phase_left(rec)
    smoke = ctx["cpu_smoke"]
    base, args, val_tokens, train_files, val_files = trainer_setup(rec, ctx, tg)
    rec.note(f"each run: `python train_gpt.py {' '.join(base)} --num_iterations N --extension_steps E --val_tokens "
             f"{val_tokens}` on that data, 1 process, {args.micro_batches} micro-batches per step (of "
             f"{args.train_seq_len_schedule or args.train_seq_len} tokens); the lr, batch and window schedules are "
             "compressed into N - E steps, then E extension steps (so are the peer's); start-up = launch to the "
             f"first step (imports, data checks, compilation, {args.warmup_steps} warmup steps); steady ms/step = "
             f"(train_time at step N - at step {ctx['steady_from']}) / (N - {ctx['steady_from']}); "
             "runs after the first reuse its compilation caches, so their start-up is not comparable (after "
             "a warm phase on this machine, the first's is not either)")
    methods = ctx["ns_methods"] or [args.ns_method] + [m for m in tg.NS_METHODS if m != args.ns_method]
    if smoke and not ctx["ns_methods"]:
        methods = methods[:2]
        rec.note("cpu smoke: the default ns_method and one other (the code path of every further run is the same)")
    # (row label, ns_method, extra trainer flags): the main run, each variant, each other ns_method
    main_flags = ctx["main_flags"]
    runs = ([("main", methods[0], main_flags)] + [("variant", methods[0], main_flags + f) for f in ctx["variants"]]
            + [("ns_method", method, main_flags) for method in methods[1:]])
    table = rec.table("Training runs of train_gpt.py", run_columns())
    log_dir = os.path.join(ctx["out"], "train")
    main_startup = None
    for i, (label, method, flags) in enumerate(runs):
        name = run_name(method, flags)
        steps = ctx["steps"] if i == 0 else ctx["variant_steps"]
        extension = dict(run_schedules(ctx))[steps]
        remaining = ctx["deadline"] - time.time() - 5
        # another compile scope compiles afresh: it needs about the main run's start-up again
        needed = 10 if smoke else max(90, (main_startup or 0) + 60) if label == "variant" else 90
        if remaining < needed:
            rec.data["partial"] = True
            again = f"--ns-methods {method}" + (f" --main-flags {shlex.quote(shlex.join(flags))}" if flags else "")
            rec.note(f"{name}: not run, {remaining:.0f} s of the phase budget left (run `--phases env,train "
                     f"--steps {steps} {again} --variants ''` in another command; --merge adds its run to these)")
            continue
        argv = trainer_argv(base, steps, extension, val_tokens, steps if i == 0 else 0, train_files, val_files,
                            log_dir, f"proof_{name}", method, flags)
        profiled = os.path.join(ctx["out"], "profile_ours") if i == 0 and ctx["profile"] else None
        command = ([PROFILER, "--out", profiled, "--steps", "{}:{}".format(*ctx["profile"]), "--"] if profiled
                   else [TRAINER])
        status, lines, seconds = run_logged([sys.executable, *command, *argv], REPO_ROOT, child_env(smoke),
                                            remaining, os.path.join(ctx["out"], f"train_{name}.console.txt"))
        logs = sorted(glob_files(os.path.join(log_dir, f"*_proof_{name}", "*.txt")), key=os.path.getmtime)
        figures = parse_run_log(open(logs[-1]).read(), ctx["steady_from"], extension) if logs else {}
        figures.update(console_figures(lines), exit=status, wall_s=round(seconds, 1), log=logs[-1] if logs else None,
                       flags=" ".join(flags))
        label_stages(figures, tg, args, steps, extension)
        rec.row(table, run_row(label, method, figures))
        rec.value(f"run_{name}", figures)
        if i == 0:
            stage_table(rec, f"ours ({name})", figures)
            rec.value("main", dict(figures, ns_method=method, name=name))
            main_startup = figures.get("startup_s")
            if profiled:
                record_profile(rec, "ours", name, profiled)
        run_ended(rec, f"train run {name}", status, lines, figures.get("steps_done"))


def label_stages(figures, tg, args, steps, extension):
    """Each stage's micro-batch tokens and long window (blocks), by the trainer's schedules (the
    record's are the same: tests/test_record_2026_schedules.py)."""
    import dataclasses
    run = dataclasses.replace(args, num_iterations=steps, extension_steps=extension)
    for stage in figures.get("stages") or []:
        first = stage["steps"][0] - 1
        stage.update(micro_batch=tg.train_seq_len_at(first, run), window=tg.long_window_blocks_at(first, run))


def stage_table(rec, who, figures):
    if not figures.get("stages"):
        return
    table = rec.table(f"Steady ms/step per stage, {who}: each stage's steps from its {STAGE_SKIP + 1}th (and from "
                      f"step {figures['steady_from'] + 1}) to its last", ["stage", "steps", "micro-batch tokens",
                                                                           "long window (blocks)", "timed steps", "ms/step"])
    for stage in figures["stages"]:
        timed = stage.get("timed")
        rec.row(table, [stage["stage"], "{}..{}".format(*stage["steps"]), stage.get("micro_batch"), stage.get("window"),
                        "{}..{}".format(timed[0] + 1, timed[1]) if timed else None, stage["ms"]])


def run_ended(rec, what, status, lines, steps_done=None):
    """A run the phase's budget cut short leaves the phase partial: its figures are what it reached
    (a lease's short call is planned so). Any other failed exit is an error, with the console's tail."""
    if status == "timeout":
        rec.data["partial"] = True
        reached = "" if steps_done is None else f" after {steps_done} steps" if steps_done else " before its first step"
        rec.note(f"{what}: cut short by the phase's budget{reached}; its figures are what it reached"
                 + ("" if steps_done else "; its console ended: " + " | ".join(line for _, line in lines[-8:])))
    elif status not in (0, "stopped"):   # (stopped: on purpose, at the line it was run until)
        rec.data["errors"].append({"check": f"{what} (exit {status}), console tail",
                                   "traceback": "\n".join(line for _, line in lines[-40:])})
    rec.flush()


def trainer_setup(rec, ctx, tg):
    """What the train and warm phases run ours with: the preset's flags (the smoke model's on
    CPU), its settings, the validation tokens and the timing data's file patterns (noted)."""
    smoke = ctx["cpu_smoke"]
    base = SMOKE_TRAINER_ARGV if smoke else ["--preset", "speedrun"]
    args = tg.harness("config").parse_config(base, {}, world_size=1, cuda_available=not smoke)
    val_tokens = SMOKE_VAL_TOKENS if smoke else RUN_VAL_TOKENS
    train_files, val_files, note = timing_data(ctx, tg, args, val_tokens)
    rec.note(note)
    return base, args, val_tokens, train_files, val_files


def trainer_argv(base, steps, extension, val_tokens, val_every, train_files, val_files, log_dir, name, method, flags):
    """The trainer's command line in the train phase, and in the warm phase (which stops it at its
    first timed step: the same schedule compiles the same graphs)."""
    return base + ["--num_iterations", str(steps), "--extension_steps", str(extension), "--val_tokens", str(val_tokens),
                   "--val_every", str(val_every),
                   "--train_files", train_files, "--val_files", val_files, "--log_dir", log_dir, "--run_name", name,
                   "--ns_method", method, *flags]


def run_name(method, flags):
    """('newton_schulz', ['--compile_scope', 'blocks']) -> 'newton_schulz_compile_scope-blocks': a
    --run_name and a report key, which tells every run of a merged report apart."""
    pairs = [f"{n[2:]}-{v}" for n, v in zip(flags[::2], flags[1::2])]
    return re.sub(r"[^A-Za-z0-9._-]", ".", "_".join([method] + pairs))


def glob_files(pattern):
    import glob
    return glob.glob(pattern)


# -----------------------------------------------------------------------------------------------
# Phase peer

def peer_kind(path):
    """'2026' for the 2026-01-19 record's script (its schedule: scheduled and extension steps), else
    '2025' (the 2025-08-23 record's single file, --peer PATH)."""
    return "2026" if re.search(r"^\s+num_scheduled_iterations\s*:", open(path).read(), re.M) else "2025"


# The 2026 record's two attention calls (P 962-965, 1018-1022), each told apart by the line(s)
# before it, and what the copy calls instead: torch's varlen_attn with the same arguments. FA3's
# causal=True with window_size=(W, 0) is, in varlen_attn, window_size=(W, 0) alone (torch's
# docstring: "(W, 0) for causal attention with sliding window of size W"; its FlashAttention-2
# reads the right window 0 as causal), as in our --attn_backend varlen (attend).
FA3_CALL = ("        y = flash_attn_interface.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=seqlens, "
            "cu_seqlens_k=seqlens,\n"
            "                                                        max_seqlen_q=max_len, max_seqlen_k=max_len,\n"
            "                                                        causal=True, softmax_scale=yarn.attn_scale, "
            "window_size=(bm_size, 0))")
VARLEN_CALL = ("        y = varlen_attn(q[0], k[0], v[0], seqlens, seqlens, max_len, max_len,  # gpu_proof: FA3's call\n"
               "                        scale=yarn.attn_scale,\n"
               "                        window_size=(bm_size, 0))  # causal, as FA3's causal=True with this window")
FA3_CALL_BEFORE = ("        # use flash_attn over flex_attn @varunneal. flash_attn_varlen suggested by @YouJiacheng\n",
                   "        max_len = 2 * max_len\n\n")


def peer_edits(text, kind, steps, extension):
    """The (old, new) edits a peer copy gets for a run of steps steps, extension of them past its
    schedules, validating at step 0 and at the end: each old occurs once in the script, and each
    new has as many lines (the copy's line numbers are the script's). The 2026 record: its FA3
    from the hub (no internet on a GPU lease) for torch's varlen_attn, its two schedule lengths, its
    validation tokens and cadence. The 2025 record: num_iterations and val_tokens."""
    if kind == "2025":
        edits = []
        for name, value in (("num_iterations", steps), ("val_tokens", PEER_VAL_TOKENS[kind])):
            found = re.findall(rf"^[ \t]+{name}[ \t]*=[ \t]*\d+", text, re.M)
            if len(found) != 1:
                raise ValueError(f"expected one line '{name} = <int>', found {len(found)}")
            edits.append((found[0], re.sub(r"\d+$", str(value), found[0])))
        return edits
    hyper = [(name, re.findall(rf"^    {name}: int = \d+", text, re.M)) for name in
             ("num_scheduled_iterations", "num_extension_iterations", "val_tokens", "val_loss_every")]
    for name, found in hyper:
        if len(found) != 1:
            raise ValueError(f"expected one line '    {name}: int = <int>', found {len(found)}")
    values = {"num_scheduled_iterations": steps - extension, "num_extension_iterations": extension,
              "val_tokens": PEER_VAL_TOKENS[kind], "val_loss_every": steps}
    return [("from kernels import get_kernel",
             "from torch.nn.attention.varlen import varlen_attn  # gpu_proof: for FA3 from the hub (offline)"),
            ("flash_attn_interface = get_kernel('varunneal/flash-attention-3').flash_attn_interface",
             "# gpu_proof: no FA3 from the hub (no internet); its two calls below are varlen_attn's"),
            *[(before + FA3_CALL, before + VARLEN_CALL) for before in FA3_CALL_BEFORE],
            *[(found[0], re.sub(r"\d+$", str(values[name]), found[0])) for name, found in hyper]]


def apply_edit(text, old, new, what):
    """text with old (which must occur once) replaced by new, and (line, before, after): the line
    where old starts and the whole lines it spans, before and after."""
    if text.count(old) != 1:
        raise ValueError(f"{what}: {old!r} occurs {text.count(old)} times, expected once")
    at = text.index(old)
    first, last = text.rfind("\n", 0, at) + 1, text.find("\n", at + len(old))
    last = len(text) if last < 0 else last
    before = text[first:last]
    return text[:at] + new + text[at + len(old):], (text.count("\n", 0, at) + 1, before, before.replace(old, new, 1))


def peer_copy(ctx, steps, extension, folder=None):
    """Copy the peer script (and the files it imports from its folder) into folder (default
    DIR/peer/) with peer_edits made (and any --peer-replace edits after them); returns (path,
    [(line number, before, after)])."""
    text = open(ctx["peer"]).read()
    kind = peer_kind(ctx["peer"])
    edits = []
    for old, new in peer_edits(text, kind, steps, extension):
        text, edit = apply_edit(text, old, new, ctx["peer"])
        edits.append(edit)
    edits.sort()   # in the file's order (each keeps the lines it spans: the line numbers hold in the copy)
    for old, new in ctx["peer_replace"]:
        text, edit = apply_edit(text, old, new, f"--peer-replace in {ctx['peer']}")
        edits.append(edit)
    folder = folder or os.path.join(ctx["out"], "peer")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, os.path.basename(ctx["peer"]))
    with open(path, "w") as f:
        f.write(text)
    for name in PEER_SIBLINGS if kind == "2026" else ():
        shutil.copyfile(os.path.join(os.path.dirname(ctx["peer"]), name), os.path.join(folder, name))
    return path, edits


def one_line(text):
    """An edit's lines as one markdown table cell."""
    return " ⏎ ".join(line.strip() for line in text.split("\n")).replace("|", "\\|")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_env(ctx):
    """The peer at world size 1, reading the timing data under DIR."""
    env = child_env(False)
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), DATA_PATH=ctx["out"])
    return env


def phase_peer(rec, ctx):
    smoke = ctx["cpu_smoke"]
    if not ctx["peer"]:
        rec.skip("no peer script (--peer PATH)")
        return
    rec.value("peer_script", ctx["peer"])
    rec.value("peer_sha256", file_sha256(ctx["peer"]))
    kind = peer_kind(ctx["peer"])
    steps, extension = ctx["steps"], ctx["extension_steps"]
    path, edits = peer_copy(ctx, steps, extension)
    rec.value("peer_edits", {str(line): dict(before=before, after=after) for line, before, after in edits})  # (json only)
    table = rec.table("Edits made to the copy of the peer script (nothing else differs; ⏎ joins the lines of one "
                      "edit, exact in report.json's peer_edits)", ["line", "original", "copy"])
    for line, before, after in edits:
        rec.row(table, [line, one_line(before), one_line(after)])
    if kind == "2026":
        rec.note("the peer's attention is torch's varlen_attn (FlashAttention-2) where the record calls FA3: its "
                 "ms/step is the record's computation on that kernel, not the record's own speed; ours is compared "
                 "on the same kernel only with --attn_backend varlen (a lease's default)")
    if smoke:
        rec.skip("needs CUDA (the copy and its edits above were made and checked)")
        return
    tg = import_trainer()
    drop_choices_a_warm_phase_left(rec)
    args = speedrun_args(tg)
    train_files, val_files, note = timing_data(ctx, tg, args, RUN_VAL_TOKENS)
    rec.note(note)
    rec.note("run: RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 DATA_PATH=DIR python <copy> (world size 1: 8 micro-batches "
             "accumulated), log in DIR/peer/logs/<uuid>.txt; figures read as for ours")
    env = peer_env(ctx)
    remaining = ctx["deadline"] - time.time() - 5
    folder = os.path.dirname(path)
    command, profiled = [path], None
    if ctx["profile"]:   # its steps counted by its step lines: its optimizer is not a torch.optim one
        profiled = os.path.join(ctx["out"], "profile_peer")
        command = [PROFILER, "--out", profiled, "--steps", "{}:{}".format(*ctx["profile"]), "--steps-by", "log",
                   "--script", path]
    status, lines, seconds = run_logged([sys.executable, *command], folder, env, remaining,
                                        os.path.join(ctx["out"], "peer.console.txt"))
    logs = sorted(glob_files(os.path.join(folder, "logs", "*.txt")), key=os.path.getmtime)
    figures = parse_run_log(open(logs[-1]).read(), ctx["steady_from"], extension) if logs else {}
    figures.update(console_figures(lines), exit=status, wall_s=round(seconds, 1), log=logs[-1] if logs else None)
    label_stages(figures, tg, args, steps, extension)
    runs = rec.table("Peer run", run_columns())
    rec.row(runs, run_row("peer", {"2026": "polar_express", "2025": "newton_schulz"}[kind] + " (record)", figures))
    rec.value("run", figures)
    stage_table(rec, "the peer", figures)
    if profiled:
        record_profile(rec, "peer", "the record script", profiled)
    run_ended(rec, "peer run", status, lines, figures.get("steps_done"))


def record_profile(rec, who, run, folder, warmup=0):
    """The figures bench/profile_step.py wrote to folder (profile.json), as a value and a table;
    warmup: the untimed steps the profiled optimizer steps include (the peer's)."""
    try:
        with open(os.path.join(folder, "profile.json")) as f:
            data = json.load(f)
    except OSError:
        rec.note(f"{who}: no profile written (the run ended before its window); its console says why")
        return
    first, last = (step - warmup for step in data["steps"])
    data["timed_steps"] = [first, last]
    rec.value(f"profile_{who}", data)
    if data["device_ms_per_step"] is None:
        rec.note(f"{who}: steps {first}..{last} profiled on the CPU: no device kernels (CPU time in "
                 f"{os.path.basename(folder)}/kernels.txt)")
        return
    counted = f" (optimizer steps {data['steps'][0]}..{data['steps'][1]}, after {warmup} warmup steps)" if warmup else ""
    table = rec.table(f"Profile of {who} ({run}) over timed steps {first}..{last}{counted}: device time per "
                      f"step, {data['host_syncs_per_step']} host syncs per step (bench/profile_step.py; "
                      f"kernels.txt, syncs.txt and the trace in {os.path.basename(folder)}/)",
                      ["kernel family", "ms/step", "calls/step"])
    for family, (ms, calls) in data["device_ms_per_step"].items():
        rec.row(table, [family, ms, calls])


# -----------------------------------------------------------------------------------------------
# Phase warm

def phase_warm(rec, ctx):
    """Compile ours (the main run's flags) and the peer, untimed, each the run its timed phase
    makes (the same steps and schedule: the windows, sizes and YaRN scales its graphs hold), stopped
    at its first timed step, after its warmup compiled every graph its steps need: their
    compilation and kernel builds fill this machine's caches (inductor's, Triton's), so the train
    and peer phases after it start in minutes less (the last validation's window still compiles
    at the end of each timed run: no warmup has it). Two cold start-ups one after the other take
    more than a 15-minute lease holds; compiling is mostly CPU work, so the two run at once where
    the GPU's memory holds both (how much that saves is for a GPU run to show; one that runs out of
    memory beside the other goes again alone, see run_jobs). The autotuning
    choices they saved are removed after them (or, if this phase is cut short, by the next train
    or peer phase): made with two processes on one GPU, they could be slower ones. With those
    gone, and inductor's cache entries holding code rather than kernels tuned down to one
    configuration (child_env), the timed runs choose their kernels' configurations again."""
    smoke = ctx["cpu_smoke"]
    base, args, val_tokens, train_files, val_files = trainer_setup(rec, ctx, import_trainer())
    method = (ctx["ns_methods"] or [args.ns_method])[0]
    name = run_name(method, ctx["main_flags"])
    folder = os.path.join(ctx["out"], "warm")
    steps, extension = ctx["steps"], ctx["extension_steps"]
    ours = [sys.executable, TRAINER, *trainer_argv(base, steps, extension, val_tokens, steps, train_files, val_files,
                                                   folder, f"warm_{name}", method, ctx["main_flags"])]
    jobs = [("ours", ours, REPO_ROOT, child_env(smoke), os.path.join(ctx["out"], f"warm_{name}.console.txt"))]
    rec.note(f"ours: the train phase's main run ({name}) up to its first timed step; its variants and other "
             "ns_methods compile in the train phase as before")
    if not ctx["peer"]:
        rec.note("peer: no peer script (--peer PATH), not warmed")
    elif smoke:
        peer_copy(ctx, steps, extension, os.path.join(folder, "peer"))
        rec.note("peer: needs CUDA, not run (its copy was made)")
    else:
        path, _ = peer_copy(ctx, steps, extension, os.path.join(folder, "peer"))
        jobs.insert(0, ("peer", [sys.executable, path], os.path.dirname(path), peer_env(ctx),
                        os.path.join(ctx["out"], "warm_peer.console.txt")))   # the longer start-up first
    memory = gpu_memory_gib() if len(jobs) > 1 else None
    together = memory is not None and memory >= WARM_TOGETHER_MIN_GIB
    if memory is not None and not together:
        has = f"the GPU has {memory:.0f} GiB, under" if memory else "the GPU's memory is unknown, not known to hold"
        rec.note(f"one after the other: {has} the {WARM_TOGETHER_MIN_GIB} GiB both runs' peaks need at once")
    rec.value("together", together)
    table = rec.table("Warm-up runs (untimed; start-up cold" + (", the two at once)" if together else ")"),
                      ["run", "exit", "start-up s", "seconds", "recompiles", "graph breaks"])
    marker = warm_marker()
    since = time.time()
    with open(marker, "w") as f:
        f.write(repr(since))
    # Ended 15 s before the phase's deadline: the choices they saved must be removed before it.
    results, alone = run_jobs(jobs, ctx["deadline"] - 15, together, STEP_RE)
    for label, (status, lines, seconds) in results.items():
        if label in alone:
            rec.note(f"{label}: ran out of the GPU's memory beside the other run; again alone (its start-up and "
                     "figures are the second try's, its seconds both tries')")
        figures = console_figures(lines)
        rec.row(table, [label, status, figures["startup_s"], round(seconds, 1),
                        figures["recompiles_warmup"] + figures["recompiles_timed"], figures["graph_breaks"]])
        rec.value(label, dict(figures, exit=status, wall_s=round(seconds, 1)))
        run_ended(rec, f"warm-up run {label}", status, lines)
    removed = drop_autotune_choices(since)
    os.remove(marker)
    rec.value("autotune_choices_removed", removed)
    rec.note(f"removed {removed} autotuning choice file(s) these runs saved (inductor's *.best_config; Triton's "
             "*.autotune.json, which it writes only where TRITON_CACHE_AUTOTUNING=1): the timed runs tune again")


def drop_choices_a_warm_phase_left(rec):
    """At the start of the train and peer phases: the autotuning choices of a warm phase that was
    cut short before it removed them (its marker is still there)."""
    marker = warm_marker()
    if not os.path.exists(marker):
        return
    with open(marker) as f:
        since = float(f.read())
    removed = drop_autotune_choices(since)
    os.remove(marker)
    rec.note(f"removed {removed} autotuning choice file(s) a warm phase cut short had left")


OUT_OF_MEMORY = "CUDA out of memory"   # torch's OutOfMemoryError message


def run_jobs(jobs, deadline, together, until=None):
    """Run (label, cmd, cwd, env, console) jobs with run_logged, at once or one after the other,
    each until the deadline (or its first line matching until); {label: (status, lines, seconds)}
    (status 'error' where the job could not be run, its traceback as its lines). Run at once, a job
    that ran out of the GPU's memory beside the others runs again alone in what is left (its console
    beside the first one's, X.console.txt as X.alone.console.txt; seconds are both tries'). Returns
    (results, the labels of the jobs run again alone)."""
    results, alone = {}, []

    def one(label, cmd, cwd, env, console):
        try:
            results[label] = run_logged(cmd, cwd, env, deadline - time.time() - 5, console, until)
        except Exception:  # noqa: BLE001 - a thread's exception would otherwise only reach stderr
            results[label] = ("error", [(0.0, line) for line in traceback.format_exc().splitlines()], 0.0)
    if not together:
        for job in jobs:
            one(*job)
        return results, alone
    threads = [threading.Thread(target=one, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for label, cmd, cwd, env, console in jobs:
        status, lines, seconds = results[label]
        if status not in (0, "stopped", "timeout") and any(OUT_OF_MEMORY in line for _, line in lines):
            alone.append(label)
            one(label, cmd, cwd, env, console.replace(".console.txt", ".alone.console.txt", 1)
                if ".console.txt" in console else console + ".alone")
            status, lines, again = results[label]
            results[label] = status, lines, seconds + again
    return {job[0]: results[job[0]] for job in jobs}, alone


def gpu_memory_gib():
    """The first GPU's memory, from nvidia-smi, else from torch in a child process (asked here, torch
    would hold a CUDA context on that GPU in this process while the two runs need its memory); 0
    where neither answers."""
    queries = (["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
               [sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**20)"])
    for query in queries:
        try:
            mib = subprocess.run(query, capture_output=True, text=True, timeout=60).stdout.split()
            return float(mib[0]) / 1024
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            continue
    return 0.0


def cache_roots():
    """The folders where inductor and Triton keep what they compile and tune on this machine."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:   # older torch
        from torch._inductor.runtime.runtime_utils import cache_dir
    return list(dict.fromkeys([cache_dir(), os.environ.get("TRITON_CACHE_DIR")
                               or os.path.expanduser("~/.triton/cache")]))


def warm_marker():
    return os.path.join(cache_roots()[0], "gpu_proof_warm_began")


def drop_autotune_choices(since, roots=None):
    """Delete the autotuning results saved at or after `since` (inductor's *.best_config, Triton's
    *.autotune.json) under the cache folders; returns how many."""
    removed = 0
    for root in dict.fromkeys(roots or cache_roots()):
        for folder, _, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith((".best_config", ".autotune.json")) and os.path.getmtime(path) >= since - 1:
                    os.remove(path)
                    removed += 1
    return removed


PHASE_FUNCTIONS = {"env": phase_env, "correct": phase_correct, "kernels": phase_kernels, "warm": phase_warm,
                   "train": phase_train, "peer": phase_peer}


# -----------------------------------------------------------------------------------------------
# Report

def build_report(phases, commands, cpu_smoke):
    phases = {name: phases[name] for name in PHASES if name in phases}   # in reading order, however run
    env = phases.get("env", {}).get("values", {})
    report = dict(tool="bench/gpu_proof.py", created=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), commands=commands, cpu_smoke=cpu_smoke,
        meta={k: env.get(k) for k in ("device", "torch", "triton", "torch_cuda", "train_gpt_sha256", "git_commit")},
        phases=phases)
    report["comparison"] = compare_with_peer(phases)
    return report


def compare_with_peer(phases):
    ours = phases.get("train", {}).get("values", {}).get("main")
    peer = phases.get("peer", {}).get("values", {}).get("run")
    if not ours or not peer:
        return None

    def ratio(key):
        return ours[key] / peer[key] if ours.get(key) and peer.get(key) else None
    # Over the steps both reached: step times grow with the attention window (731 ms at step 20,
    # 789 at 60 on an H100), so a run cut short by its budget must not set its early steps against
    # the other's later ones. (Reports from before the step times were kept: each run's own window.)
    times = [dict(run.get("train_time_ms") or []) for run in (ours, peer)]
    start, end = ours.get("steady_from"), min(ours.get("steps_done") or 0, peer.get("steps_done") or 0)
    window, steady = None, [ours.get("steady_ms"), peer.get("steady_ms")]
    if start is not None and end > start and all(start in t and end in t for t in times):
        window, steady = [start, end], [(t[end] - t[start]) / (end - start) for t in times]
    profiles = [phases[phase]["values"].get(f"profile_{who}") for phase, who in (("train", "ours"), ("peer", "peer"))]
    return dict(steady_ms_ours=steady[0], steady_ms_peer=steady[1], steady_window=window,
                steady_ms_ratio=steady[0] / steady[1] if all(steady) else None,
                peak_allocated_ratio=ratio("peak_allocated_mib"),
                peak_reserved_ratio=ratio("peak_reserved_mib"), steps_ours=ours.get("steps_done"),
                steps_peer=peer.get("steps_done"), flags_ours=ours.get("flags"),
                **{f"{key}_{who}": run.get(key) for key in ("peak_allocated_mib", "peak_reserved_mib",
                                                            "val_loss_start", "val_loss_end", "val_end_step")
                   for who, run in (("ours", ours), ("peer", peer))},
                stages=compare_stages(ours, peer, times),
                profiles=profiles if all(p and p["device_ms_per_step"] for p in profiles) else None)


def compare_stages(ours, peer, times):
    """Per stage, both runs' steady ms/step over the steps both timed (stage_steady with both),
    where both have the same stages (the same steps and extension); else None."""
    if not ours.get("stages") or [s["steps"] for s in ours["stages"]] != [s["steps"] for s in peer.get("stages") or []]:
        return None
    rows = []
    for stage in ours["stages"]:
        first, end = stage["steps"][0] - 1, stage["steps"][1]
        both = [stage_steady(t, first, end, ours["steady_from"], other) for t, other in (times, times[::-1])]
        rows.append(dict(stage=stage["stage"], steps=stage["steps"], micro_batch=stage.get("micro_batch"),
                         window=stage.get("window"), timed=both[0]["timed"], ms_ours=both[0]["ms"],
                         ms_peer=both[1]["ms"], ratio=both[0]["ms"] / both[1]["ms"] if both[0]["ms"] and both[1]["ms"]
                         else None))
    return rows


def profile_rows(profiles):
    """[family, ours ms/step, peer ms/step, ours - peer] for every kernel family either profile has,
    then the host syncs per step."""
    ours, peer = (p["device_ms_per_step"] for p in profiles)
    families = list(ours) + [f for f in peer if f not in ours]
    rows = []
    for family in families:
        a, b = (ours.get(family) or [None])[0], (peer.get(family) or [None])[0]
        rows.append([family, a, b, None if a is None or b is None else a - b])
    syncs = [p["host_syncs_per_step"] for p in profiles]
    rows.append(["host syncs per step", *syncs, None if None in syncs else syncs[0] - syncs[1]])
    return rows


def device_slug(report):
    name = (report.get("meta") or {}).get("device") or "unknown-device"
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")


def render_markdown(report):
    meta = report["meta"]
    out = [f"# GPU proof: {meta.get('device')}, {report['created'][:10]}", ""]
    if report.get("cpu_smoke"):
        out += ["**CPU smoke run**: tiny sizes, fp32, Triton interpreted; no figure here is a GPU measurement.", ""]
    sha, git = meta.get("train_gpt_sha256") or "?", meta.get("git_commit") or "?"
    code = (f"train_gpt.py sha256 `{sha[:16]}` (git {git[:12]})" if not sha.startswith("several")
            else "train_gpt.py as each command names")
    out += [f"Made by `bench/gpu_proof.py` from {code}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
            f"CUDA {meta.get('torch_cuda')}. Commands:", ""]
    out += [f"    {c}" for c in report["commands"]] + [""]
    out += ["| phase | status | seconds | checks passed | checks failed | errors |", "|---|---|---|---|---|---|"]
    for name, p in report["phases"].items():
        status = p["status"] + (f" ({p['skipped']})" if p.get("skipped") else "")
        out.append(f"| {name} | {status} | {fmt(p.get('seconds'))} | {p['checks']['passed']} | "
                   f"{p['checks']['failed']} | {len(p['errors'])} |")
    out.append("")
    comp = report.get("comparison")
    if comp:
        window = (f"steps {comp['steady_window'][0]}..{comp['steady_window'][1]}, both" if comp.get("steady_window")
                  else f"steps {STEADY_FROM}..N, each its own N")
        flags = f"; ours with `{comp['flags_ours']}`" if comp.get("flags_ours") else ""
        out += [f"## Ours vs the public record script (same GPU, same data{flags})", "",
                "| figure | ours | peer | ours / peer |", "|---|---|---|---|",
                f"| steady ms/step ({window}) | {fmt(comp['steady_ms_ours'])} | "
                f"{fmt(comp['steady_ms_peer'])} | {fmt(comp['steady_ms_ratio'])} |",
                f"| peak memory allocated, MiB | {fmt(comp.get('peak_allocated_mib_ours'))} | "
                f"{fmt(comp.get('peak_allocated_mib_peer'))} | {fmt(comp['peak_allocated_ratio'])} |",
                f"| peak memory reserved, MiB | {fmt(comp.get('peak_reserved_mib_ours'))} | "
                f"{fmt(comp.get('peak_reserved_mib_peer'))} | {fmt(comp['peak_reserved_ratio'])} |"]
        for key, name in (("val_loss_start", "val loss at step 0"), ("val_loss_end", "val loss at the end")):
            if comp.get(f"{key}_ours") is not None or comp.get(f"{key}_peer") is not None:
                at = "" if key == "val_loss_start" else (f" (steps {fmt(comp.get('val_end_step_ours'))} and "
                                                          f"{fmt(comp.get('val_end_step_peer'))})")
                out.append(f"| {name}{at} | {fmt(comp.get(key + '_ours'))} | {fmt(comp.get(key + '_peer'))} | |")
        out.append("")
        if comp.get("stages"):
            out += [f"Steady ms/step per stage, over the steps both timed (each stage's from its {STAGE_SKIP + 1}th, "
                    f"and from step {STEADY_FROM + 1}, after the profile's window; stages as ours and the record's "
                    "schedules make them):", "",
                    "| stage | steps | micro-batch tokens | long window (blocks) | timed steps | ours ms/step | "
                    "peer ms/step | ours / peer |", "|---|---|---|---|---|---|---|---|"]
            for st in comp["stages"]:
                timed = "{}..{}".format(st["timed"][0] + 1, st["timed"][1]) if st.get("timed") else "none"
                out.append(f"| {st['stage']} | {st['steps'][0]}..{st['steps'][1]} | {fmt(st.get('micro_batch'))} | "
                           f"{fmt(st.get('window'))} | {timed} | {fmt(st['ms_ours'])} | {fmt(st['ms_peer'])} | "
                           f"{fmt(st['ratio'])} |")
            out.append("")
        if comp.get("profiles"):
            first, last = comp["profiles"][0]["steps"]
            opened = ("both windows open and close at a step line: the same steps" if
                      comp["profiles"][1].get("steps_by") == "log" else "the peer's window opens after its Adam "
                      "step, before its Muon step: the same work, opened earlier")
            out += [f"Device time per step by kernel family over timed steps {first}..{last} (bench/profile_step.py; "
                    f"{opened}):", "",
                    "| kernel family | ours ms/step | peer ms/step | ours - peer |", "|---|---|---|---|"]
            out += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in profile_rows(comp["profiles"])] + [""]
    for name, p in report["phases"].items():
        out += [f"## {name}: {p['status']}", ""]
        if p.get("skipped"):
            out += [f"skipped: {p['skipped']}", ""]
        values = {k: v for k, v in p["values"].items() if not isinstance(v, dict) or name == "kernels"}
        for key, value in values.items():
            out.append(f"- {key}: {fmt(value) if isinstance(value, float) else value}")
        if values:
            out.append("")
        for note in p["notes"]:
            out += [f"- {note}"]
        if p["notes"]:
            out.append("")
        for table in p["tables"]:
            out += [f"**{table['title']}**", "", "| " + " | ".join(table["columns"]) + " |",
                    "|" + "---|" * len(table["columns"])]
            for row in table["rows"]:
                out.append("| " + " | ".join(fmt(x) for x in row) + " |")
            out.append("")
        for error in p["errors"]:
            text = "\n".join(error["traceback"].rstrip().splitlines()[-40:])
            out += [f"Error in {error['check']}:", "", "```", text, "```", ""]
    return "\n".join(out) + "\n"


def write_report(out, report, copy=None):
    """report.json and report.md (and report.json again at copy), each written whole or not at all
    (a signal may come mid-write)."""
    os.makedirs(out, exist_ok=True)
    as_json = json.dumps(report, indent=1, default=str)
    for path, text in ((os.path.join(out, "report.json"), as_json), (os.path.join(out, "report.md"),
                       render_markdown(report))) + (((copy, as_json),) if copy else ()):
        folder, name = os.path.split(os.path.abspath(path))
        with open(os.path.join(folder, f".{name}.tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(folder, f".{name}.tmp"), path)


def load_report(path):
    """A report.json of this script; ValueError naming the file if it is not one."""
    try:
        with open(path) as f:
            report = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not a report.json of gpu_proof.py ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("meta"), dict) \
            or not isinstance(report.get("phases"), dict) or not isinstance(report.get("commands"), list) \
            or not isinstance(report.get("created"), str):
        raise ValueError(f"{path}: not a report.json of gpu_proof.py (no meta, phases, commands and created)")
    return report


def merge_reports(paths):
    """One report from several (say one per command): phases of later reports replace earlier ones."""
    reports = [load_report(p) for p in paths]
    devices = {r["meta"].get("device") for r in reports if r["meta"].get("device")}
    if len(devices) > 1:
        raise ValueError(f"the reports come from different devices: {sorted(devices)}")
    phases, commands = {}, []
    # A fix between commands means their phases ran different code: then each command names its own.
    shas = {r["meta"].get("train_gpt_sha256") for r in reports} - {None}
    mixed = len(shas) > 1 or any(s.startswith("several") for s in shas)
    for r in reports:
        for name, phase in r["phases"].items():
            if phase["status"] == "skipped" and name in phases:   # (a lease's --total left it no time)
                continue
            if name == "train" and adds_runs(phases.get(name), phase):
                phase = combine_train(phases[name], phase)
            phases[name] = phase
        sha, git = r["meta"].get("train_gpt_sha256") or "?", r["meta"].get("git_commit") or "?"
        commands += [f"{c}    # train_gpt.py sha256 {sha[:16]}, git {git[:12]}" if mixed and "# train_gpt.py" not in c
                     else c for c in r["commands"]]
    phases = {name: phases[name] for name in PHASES if name in phases}
    merged = build_report(phases, commands, any(r.get("cpu_smoke") for r in reports))
    for r in reports:   # meta of a report whose env phase was not merged in
        for key, value in r["meta"].items():
            merged["meta"][key] = merged["meta"].get(key) or value
    if mixed:
        merged["meta"]["train_gpt_sha256"] = merged["meta"]["git_commit"] = "several (see the commands)"
    merged["created"] = min(r["created"] for r in reports)
    return merged


STATUS_ORDER = ("ok", "skipped", "partial", "failed", "timeout", "interrupted", "crashed")


def adds_runs(first, later):
    """A later train phase adds to an earlier one whose main run succeeded when it ran other runs
    only (other ns_methods or flags); otherwise (a re-run after a fix, say) it replaces it."""
    main = (first or {}).get("values", {}).get("main")
    name = (main or {}).get("name") or (main or {}).get("ns_method")
    return bool(main) and main.get("exit") == 0 and f"run_{name}" not in later["values"]


def combine_train(first, later):
    """Train runs of two commands (say, an ns_method the first one's budget left out): all runs
    listed, the first command's main run kept as the main run."""
    combined = json.loads(json.dumps(first))
    # the profile beside the comparison is the main run's (the later one's stays in its own table)
    combined["values"].update({k: v for k, v in later["values"].items() if k not in ("main", "profile_ours")})
    for table in later["tables"]:
        same = [t for t in combined["tables"] if t["title"] == table["title"] and t["columns"] == table["columns"]]
        if same:   # the later main run joins as what it is beside the first: a variant or an ns_method
            flags = table["columns"].index("flags") if "flags" in table["columns"] else None
            same[0]["rows"] += [[row[0] if row[0] != "main" else "variant" if flags is not None and row[flags]
                                 else "ns_method"] + row[1:] for row in table["rows"]]
        else:
            combined["tables"].append(table)
    for key in ("notes", "errors"):
        combined[key] += [x for x in later[key] if x not in combined[key]]
    for key in ("passed", "failed"):
        combined["checks"][key] += later["checks"][key]
    combined["seconds"] = (first.get("seconds") or 0) + (later.get("seconds") or 0)
    combined["status"] = max(first["status"], later["status"], key=STATUS_ORDER.index)
    return combined


def main(argv=None):
    try:
        return proof_main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt as e:   # the phase's worker and its trainers were ended (run_phase_process)
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"gpu_proof.py: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum


def proof_main(argv):
    signal.signal(signal.SIGTERM, raise_interrupted)   # the worker installs its own
    opts = parse_args(argv)
    if opts.worker:
        return worker_main(opts.worker, opts.out)
    if opts.merge:
        try:
            report = merge_reports(opts.merge)
        except (ValueError, KeyError, OSError) as e:
            print(f"gpu_proof.py: error: --merge: {e}", file=sys.stderr)
            return 2
        proofs = os.path.join(REPO_ROOT, "records", "gpu_proof")
        out = opts.out or os.path.join(proofs, f"{report['created'][:10]}_{device_slug(report)}")
        inside = os.path.commonpath([os.path.realpath(out), os.path.realpath(proofs)]) == os.path.realpath(proofs)
        if report.get("cpu_smoke") and inside:   # its newest folder is the latest GPU proof
            smoke = next(p for p in opts.merge if load_report(p).get("cpu_smoke"))
            print(f"gpu_proof.py: error: --merge: {smoke} is a --cpu-smoke report, no GPU proof: records/gpu_proof "
                  "holds GPU proofs only; give --out DIR outside it", file=sys.stderr)
            return 2
        if os.path.exists(os.path.join(out, "report.json")):
            print(f"gpu_proof.py: error: --out={out}: report.json exists; choose a new folder", file=sys.stderr)
            return 2
        write_report(out, report)
        print(f"wrote {os.path.join(out, 'report.md')}")
        return 0
    return run_proof(opts)


if __name__ == "__main__":
    sys.exit(main())
