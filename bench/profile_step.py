"""Profile a few training steps of train_gpt.py with torch.profiler.

Runs the trainer in this process with the trainer options given after `--`, starts the profiler
after optimizer step A and stops it after step B (`--steps A:B`, so steps A+1..B are recorded),
and writes to --out (the trainer's log too, in --out/logs, unless its options or LOG_DIR set log_dir):
- kernels.txt: operators and kernels sorted by device time (CUDA) or CPU time, with call counts;
- categories.txt: device (or CPU) time per step grouped into GEMMs, FlexAttention, inductor
  kernels, ATen element-wise kernels, and the rest, the span per step, and the time the GPU sat
  idle inside it, split into gaps under 10 us (launch latency between kernels) and longer ones;
- trace.json.gz: the Chrome trace (open in chrome://tracing or Perfetto);
- syncs.txt: on CUDA, the host syncs inside the window (torch.cuda.set_sync_debug_mode("warn")),
  counted by the Python line that caused them; a step without any lets the host run ahead;
- profile.json: the figures of categories.txt and the sync count, for other scripts.
On one GPU, A must be past the trainer's warmup and the first compilations to profile the steady
state (the speedrun preset warms up before its clock starts, so A = 12 of an 18-step run works).

`--script PATH` profiles another training script instead (the public record's, say), run as
__main__ with the arguments after `--` and its own folder first on sys.path (as `python PATH`).
Its steps are counted by a global torch.optim step hook on the first optimizer that steps, so they
include any warmup steps it takes (the 2025 record script takes 10 before its clock starts: its
step 12 is our A = 22); with `--steps-by log`, by its console's `step:N/M train_time:` lines
instead, the speedrun's line format, timed steps only (the 2026 record's optimizer is no
torch.optim one).

Usage: python bench/profile_step.py --out DIR [--steps 12:15] -- --preset speedrun --num_iterations 18 ...
       python bench/profile_step.py --out DIR --steps 22:25 --script peers/SCRIPT.py
       python bench/profile_step.py --out DIR --steps 12:15 --steps-by log --script peers/RECORD/train_gpt.py
"""

import collections
import gzip
import json
import os
import re
import runpy
import sys
import warnings

# Kineto leaves CUPTI attached after a profile unless told to tear it down, and that slows every
# later launch (pytorch/pytorch#144455): the steps timed after the window must run as unprofiled.
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import train_gpt  # noqa: E402
from harness import config as cfg  # noqa: E402
from data.cli_util import OneLineArgumentParser  # noqa: E402


def step_range(text):
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"expected A:B with integers A < B, got {text!r}") from None
    if not 1 <= first < last:  # step A's hook starts the profiler: there is no hook before step 1
        raise ValueError(f"expected A:B with 1 <= A < B, got {text!r}")
    return first, last


def kernel_category(name):
    """Coarse families of device kernels, by the names CUDA libraries, inductor and ATen give them."""
    if "flex_attention" in name:
        return "FlexAttention"
    if name.startswith(("_gram_kernel", "_sym_poly_kernel", "_poly_apply_kernel")):
        return "orthogonalization (Triton)"
    if name.removeprefix("void ").startswith(("nvjet", "sm90_", "sm80_", "cutlass", "ampere_", "cublas")) \
            or "gemm" in name.lower():
        return "GEMM (cuBLAS/CUTLASS)"
    if name.startswith("triton_"):
        return "inductor kernels"
    if "nccl" in name.lower():
        return "NCCL"
    if "elementwise_kernel" in name:
        return "ATen element-wise"
    return "other"


DEVICE_ACTIVITY = ("kernel", "gpu_memset", "gpu_memcpy")   # what keeps a GPU busy in a Kineto trace
LAUNCH_GAP_US = 10


def device_time_per_step(trace, steps):
    """{category: (ms per step, calls per step)} of the trace's device kernels, with "all kernels",
    the span from the first kernel to the last and the idle time in it (ms and gaps per step, short
    and long); None for a trace without kernels (CPU run)."""
    device = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in DEVICE_ACTIVITY]
    kernels = [e for e in device if e["cat"] == "kernel"]
    if not kernels:
        return None
    per = collections.Counter()
    calls = collections.Counter()
    for e in kernels:
        per[kernel_category(e["name"])] += e["dur"]
        calls[kernel_category(e["name"])] += 1
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    figures = {name: (us / 1e3 / steps, calls[name] / steps) for name, us in per.most_common()}
    figures["all kernels"] = (sum(per.values()) / 1e3 / steps, None)
    figures["span (first to last kernel)"] = ((end - start) / 1e3 / steps, None)
    # Where the idle time is: many tiny gaps are launch latency between back-to-back kernels
    # (fewer, fused kernels help); long ones are the GPU waiting on the host or on a sync.
    # Clipped to the span: a copy before the first kernel (the step's input) or after the last is no idle time in it.
    busy = sorted((max(e["ts"], start), min(e["ts"] + e["dur"], end)) for e in device
                  if e["ts"] <= end and e["ts"] + e["dur"] >= start)  # every kernel is in it, also one of 0 us
    short, long_ = [], []
    covered = busy[0][1]
    for begin, finish in busy[1:]:
        if begin > covered:
            (short if begin - covered < LAUNCH_GAP_US else long_).append(begin - covered)
        covered = max(covered, finish)
    for name, gaps in ((f"idle, gaps < {LAUNCH_GAP_US} us", short), (f"idle, gaps >= {LAUNCH_GAP_US} us", long_)):
        figures[name] = (sum(gaps) / 1e3 / steps, len(gaps) / steps)
    return figures


def summarize(figures):
    """device_time_per_step's figures as a table."""
    if figures is None:
        return "no device kernels in the trace (CPU run): see kernels.txt for CPU time\n"
    lines = [f"{'category':28} {'ms/step':>9} {'calls/step':>11}"]
    for name, (ms, calls) in figures.items():
        lines.append(f"{name:28} {ms:9.1f}" + (f" {calls:11.1f}" if calls is not None else ""))
    return "\n".join(lines) + "\n"


SYNC_WARNING = "called a synchronizing CUDA operation"   # torch.cuda.set_sync_debug_mode("warn")'s text


class SyncCounter:
    """While entered, counts the sync-debug warnings by the Python line that caused them and hides
    them; every other warning goes on as it would have (filters, once-per-line, showwarning)."""

    def __init__(self):
        self.where = collections.Counter()
        self._saved = warnings.catch_warnings()   # restores the filters and showwarning on exit

    def __enter__(self):
        self._saved.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        show = warnings.showwarning

        def count_or_show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                self.where[f"{filename}:{lineno}"] += 1
            else:
                show(message, category, filename, lineno, file, line)
        warnings.showwarning = count_or_show
        return self

    def __exit__(self, *exc):
        self._saved.__exit__(*exc)

    def report(self, steps):
        """(syncs per step, the text of syncs.txt)."""
        total = sum(self.where.values())
        lines = [f"{total} host syncs in {steps} steps ({total / steps:.1f} per step), by the Python line "
                 "that made them:"]
        lines += [f"{n:6d}  {place}" for place, n in self.where.most_common()]
        return total / steps, "\n".join(lines) + "\n"


STEP_LINE = re.compile(r"step:(\d+)/\d+ train_time:")


class StepLines:
    """The script's stdout, calling on_step(N, None, None) after it wrote a line step:N/M train_time:."""

    def __init__(self, stream, on_step):
        self.stream, self.on_step, self.pending = stream, on_step, ""

    def write(self, text):
        written = self.stream.write(text)
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if found := STEP_LINE.match(line):
                self.stream.flush()
                self.on_step(int(found[1]), None, None)
        return written

    def __getattr__(self, name):
        return getattr(self.stream, name)


def run_script(path, argv, on_step, by_log=False):
    """Run a training script as __main__, calling on_step(step, None, optimizer) after each step of
    the first torch.optim optimizer that steps (a script with several optimizers steps each once),
    or (by_log) after each of its step lines."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    counted = {}

    def after_step(optimizer, args, kwargs):
        counted.setdefault("optimizer", optimizer)
        if optimizer is counted["optimizer"]:
            counted["steps"] = counted.get("steps", 0) + 1
            on_step(counted["steps"], None, optimizer)

    handle = None if by_log else register_optimizer_step_post_hook(after_step)
    saved_argv, saved_stdout, folder = sys.argv, sys.stdout, os.path.dirname(os.path.abspath(path))
    sys.argv = [path] + list(argv)
    sys.path.insert(0, folder)   # its own modules by name, as `python path` finds them
    if by_log:
        sys.stdout = StepLines(sys.stdout, on_step)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, sys.stdout = saved_argv, saved_stdout
        if folder in sys.path:
            sys.path.remove(folder)
        if handle is not None:
            handle.remove()
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, trainer = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for kernels.txt, categories.txt and trace.json.gz")
    p.add_argument("--steps", default="12:15", help="profile after optimizer step A up to step B (A:B)")
    p.add_argument("--script", help="profile this training script (run as __main__) instead of train_gpt.py")
    p.add_argument("--steps-by", choices=("optimizer", "log"), default="optimizer",
                   help="--script's steps: its first torch.optim optimizer's steps, or its step:N/M train_time: lines")
    opts = p.parse_args(ours)
    try:
        first, last = step_range(opts.steps)
    except ValueError as e:
        p.error(f"--steps: {e}")
    if opts.script and not os.path.isfile(opts.script):
        p.error(f"--script={opts.script}: no such file")
    if not opts.script:  # the trainer's own steps: a window past its last step would profile nothing
        # Its log goes beside the profile unless told otherwise: a short profiled run in records/
        # would stand beside real runs there and split records/compare.py's step counts.
        # First, as one token: the trainer keeps an option's last value, so the user's still wins.
        if "LOG_DIR" not in os.environ:
            trainer = [f"--log_dir={os.path.join(opts.out, 'logs')}", *trainer]
        try:
            args = cfg.parse_config(trainer, os.environ, train_gpt.Ranks.from_env(os.environ).world_size)
        except train_gpt.ConfigError as e:
            p.error(f"trainer options: {e}")
        except cfg.HelpRequested:
            args = None  # the trainer prints its help
        if args is not None and last > args.num_iterations:
            p.error(f"--steps={opts.steps}: the run ends at step {args.num_iterations} (--num_iterations); "
                    f"choose B <= {args.num_iterations}")
    if os.path.exists(os.path.join(opts.out, "kernels.txt")):
        p.error(f"--out={opts.out}: kernels.txt exists; choose a new folder")
    os.makedirs(opts.out, exist_ok=True)
    state = {}

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def start():
        sync()
        # the activities are chosen when the window opens, inside the run the script has set up
        cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
        state["prof"] = profile(activities=[ProfilerActivity.CPU] + cuda)
        state["prof"].__enter__()
        if torch.cuda.is_available():   # after the profiler's own start-up syncs
            state["syncs"] = SyncCounter().__enter__()
            torch.cuda.set_sync_debug_mode("warn")

    def stop(finished=True):
        """Ends the window (finished=False: the run ended inside it, perhaps on a CUDA fault that a
        synchronize would raise again)."""
        if "syncs" in state:
            torch.cuda.set_sync_debug_mode(0)
            state["syncs"].__exit__(None, None, None)
        if "prof" in state:
            if finished:
                sync()
            state.pop("prof").__exit__(None, None, None)

    def on_step(step, model, optimizer):
        if step == first:
            start()
        elif step == last and "prof" in state:
            prof = state["prof"]
            stop()
            counter = state.pop("syncs", None)
            sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            with open(os.path.join(opts.out, "kernels.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by=sort, row_limit=80))
            raw = os.path.join(opts.out, "trace.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
                dst.write(src.read())
            with open(raw) as f:
                trace = json.load(f)
            os.remove(raw)
            steps = last - first
            figures = device_time_per_step(trace, steps)
            summary = summarize(figures)
            syncs_per_step, syncs = counter.report(steps) if counter else (None, None)
            with open(os.path.join(opts.out, "categories.txt"), "w") as f:
                f.write(summary)
            if syncs is not None:
                with open(os.path.join(opts.out, "syncs.txt"), "w") as f:
                    f.write(syncs)
            with open(os.path.join(opts.out, "profile.json"), "w") as f:
                json.dump(dict(steps=[first + 1, last], device_ms_per_step=figures, host_syncs_per_step=syncs_per_step,
                               script=opts.script or "train_gpt.py",
                               steps_by=opts.steps_by if opts.script else "train_gpt.py's steps"), f, indent=1)
            print(f"[profile_step] steps {first + 1}..{last} written to {opts.out}\n{summary}{syncs or ''}", flush=True)

    try:
        if opts.script:
            status = run_script(opts.script, trainer, on_step, by_log=opts.steps_by == "log")
        else:
            trainer_train = train_gpt.train

            def train(*args, **kwargs):
                return trainer_train(*args, **dict(kwargs, on_step=on_step))

            train_gpt.train = train   # main() looks train up in the module when it runs
            try:
                status = train_gpt.main(trainer)
            finally:
                train_gpt.train = trainer_train
    finally:
        stop(finished=False)  # the run ended inside the window: a profiler left running crashes the exit
    if not os.path.exists(os.path.join(opts.out, "kernels.txt")):
        print(f"[profile_step] the run ended before step {last}: nothing profiled", file=sys.stderr)
        return status or 1
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
