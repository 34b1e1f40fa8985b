"""A/B of trainer options: K seeds of each configuration, mean, sd and Welch p against the first.

Each configuration is a label and trainer flags, e.g.
    python bench/ab.py --config base="--ns_method newton_schulz" --config aol="--ns_method aol" --out /tmp/ab
The first configuration is the baseline. Every run is `train_gpt.py COMMON FLAGS --seed S` as its
own process (seeds 0..K-1, --threads T each, at most --parallel at a time), logging to
DIR/logs/<date>_ab_<label>/ (a folder per configuration, as records/compare.py reads them); the
final val loss and the val-loss curve are read back from those logs with records/compare.py's
parser, and its statistics give the Welch p-values.
Writes DIR/ab.md (the table, also printed), DIR/ab.json and DIR/ab.png (val loss vs step).

The default COMMON is the cpu preset (4 blocks, width 128, 120 steps of 1024 tokens, on the
embedded sample unless FineWeb is downloaded) validated every 20 steps. On the 2-core VM, two runs
of one thread each took 1.3 s per step (2026-11-23), about 3 minutes a run: 4 seeds of 3
configurations in about 20 minutes.
"""

import collections
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "records"))
sys.path.insert(0, str(REPO_ROOT / "data"))

import compare  # noqa: E402
from cli_util import OneLineArgumentParser, positive_int  # noqa: E402

DEFAULT_COMMON = "--preset cpu --num_iterations 120 --val_every 20"
# Set by this script for each run; a configuration may not set them.
OWN_FLAGS = ("seed", "run_name", "log_dir", "threads")
LABEL_RE = re.compile(r"^[A-Za-z0-9._-]+$")
RUNNING = set()                  # the trainer processes running now
STARTING = threading.Lock()      # held while one starts, and while interruption ends them all
STOPPED = threading.Event()      # set on Ctrl-C (or SIGTERM): no run starts any more


def fail(message):
    """A bad argument in one line, as argparse says it: `ab.py: error: ...`, exit status 2."""
    print(f"ab.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def split_flags(flags, where):
    """Trainer flags as argv; one line naming `where` if they do not split or set a flag ab.py owns."""
    try:
        argv = shlex.split(flags)
    except ValueError as e:
        fail(f"{where}: cannot split the flags ({e})")
    for token in argv:
        name = token[2:].partition("=")[0].replace("-", "_") if token.startswith("--") else ""
        if name in OWN_FLAGS:
            fail(f"{where}: sets --{name}, which ab.py sets for every run")
    return argv


def parse_configs(texts):
    """['label=flags', ...] -> [(label, [flag, ...])], or a one-line error."""
    configs = []
    for text in texts:
        label, sep, flags = text.partition("=")
        if not sep or not LABEL_RE.match(label):
            fail(f"--config {text!r}: expected LABEL=\"FLAGS\" with a label of letters, digits, '.', '_', '-'")
        if label in [c[0] for c in configs]:
            fail(f"--config {label}: the label is used twice")
        configs.append((label, split_flags(flags, f"--config {label}")))
    return configs


def trainer_config(argv):
    """The trainer's own check, in this process, before any run starts: (the configuration as the
    run's log header will state it, {field: str(value)}, None) or (None, what is wrong)."""
    import dataclasses

    import train_gpt
    from harness import config as cfg

    try:
        args = cfg.parse_config(argv, dict(os.environ))
    except train_gpt.ConfigError as e:
        return None, str(e)
    except cfg.HelpRequested:
        return None, "--help is not a training flag"
    return {f.name: str(getattr(args, f.name)) for f in dataclasses.fields(args)}, None


def check_trainer_flags(configs, common):
    """{label: configuration} of every configuration with the common flags; one line naming the
    option to blame for the first that fails (--common where the common flags fail alone)."""
    expected = {}
    for label, argv in configs:
        expected[label], problem = trainer_config(common + argv)
        if problem:  # the common flags' own failure is theirs; one the configuration brings is its own
            fail(f"--common: {problem}" if trainer_config(common)[1] == problem else f"--config {label}: {problem}")
    return expected


def label_folder(out, label):
    """Where the trainer puts a configuration's logs today (train_gpt.run_folder): made before a run
    starts, so that a trainer's check of its log folder never removes it under another."""
    import types

    import train_gpt
    from harness import config as cfg

    folder = Path(train_gpt.run_folder(types.SimpleNamespace(log_dir=str(out / "logs"), run_name=f"ab_{label}")))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_logs(out, label, seed, since=0.0):
    """[(path, parsed log)] of seed `seed` of configuration `label` in out/logs, written at or
    after `since`, oldest first (log names are random uuids, so only the time orders them). The
    seeds of a configuration share its folder (<date>_ab_<label>, as records/compare.py reads a set
    of runs; an A/B of an earlier ab.py has one per seed, <date>_ab_<label>_s<seed>)."""
    folder = re.compile(rf"\d{{4}}-\d{{2}}-\d{{2}}_ab_{re.escape(label)}(_s{seed})?")
    found = []
    for path in (out / "logs").glob("*/*.txt"):
        if not folder.fullmatch(path.parent.name) or path.stat().st_mtime < since:
            continue
        if (run := compare.parse_log(path)) is not None and run.config.get("seed") == str(seed):
            found.append((path.stat().st_mtime, str(path), run))
    return [(Path(path), run) for _, path, run in sorted(found, key=lambda item: item[:2])]


def trainer_code_hash():
    """The code_hash records/compare.py reads from a log of this train_gpt.py (the log starts with
    the code that runs, train_gpt.logged_code(), and a newline)."""
    import train_gpt
    return compare._sha1("\n".join((train_gpt.logged_code() + "\n").splitlines()))


def finished_run(out, label, seed, expected, code_hash=None):
    """--resume: the earlier complete run of this job in out/logs, or None if there is none; with
    code_hash, one made by that train_gpt.py source only ({"stale": True} where the only ones were
    made by another: a run of an edited trainer is no run of this one). One line if it was made
    with other settings than `expected` (names, seeds and paths aside)."""
    logs = [(path, run) for path, run in run_logs(out, label, seed) if run.usable]
    if not logs:
        return None
    run = logs[-1][1]
    differing = [f"{key} ({run.config[key]} vs {value})" for key, value in expected.items()
                 if key in run.config and key not in compare.IGNORED_CONFIG | set(OWN_FLAGS)
                 and run.config[key] != value]
    if differing:
        fail(f"--resume: {run.path} was run with other settings than --config {label} now has: "
             f"{', '.join(differing)}; use a new --out")
    if code_hash is not None:
        if not (current := [run for _, run in logs if run.code_hash == code_hash]):
            return dict(stale=[path for path, _ in logs])
        run = current[-1]
    return dict(label=label, seed=seed, run=run, problem=None, seconds=0.0, log=str(run.path), reused=True)


def run_one(job, out, threads):
    label, argv, seed = job
    command = [sys.executable, str(REPO_ROOT / "train_gpt.py"), *argv, f"--seed={seed}",
               f"--run_name=ab_{label}", f"--log_dir={out / 'logs'}", f"--threads={threads}"]
    started = time.time()
    label_folder(out, label)
    console_path = out / "logs" / f"ab_{label}_s{seed}.out"
    with open(console_path, "w") as console:
        with STARTING:
            if STOPPED.is_set():
                return None
            proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=console, stderr=subprocess.STDOUT)
            RUNNING.add(proc)
        code = proc.wait()
        RUNNING.discard(proc)
    logs = run_logs(out, label, seed, since=started - 1)  # this run's, not an earlier interrupted one's
    log, run = logs[-1] if logs else (None, None)
    problem = None
    if run is None:
        last = console_path.read_text().strip().splitlines()
        problem = f"no log (exit status {code}: {last[-1] if last else 'no output'})"
    elif not run.usable:
        problem = "; ".join(run.problems)
    elif code != 0:
        problem = f"exit status {code}"
    return dict(label=label, seed=seed, run=run, problem=problem, seconds=time.time() - started,
                log=str(log) if log else None)


def end_runs(pool):
    """On Ctrl-C: no further run starts, the running ones are ended (SIGTERM: each stops at its next
    check; SIGKILL 10 s later), and the pool's threads return."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)   # a second Ctrl-C must not leave a run going
    with STARTING:
        STOPPED.set()
        running = list(RUNNING)
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in running:
        proc.terminate()
    deadline = time.time() + 10
    for proc in running:
        try:
            proc.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


def detectable_difference(sd, n):
    """The smallest mean paired difference that would reach p = 0.05 (two-sided paired t-test) with
    this sd of the per-seed differences over n seeds: t(0.975, n-1) x sd / sqrt(n)."""
    if sd is None or n < 2:
        return None
    from scipy import stats

    return float(stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n))


def paired(results, label, base_label):
    """Seed s of every configuration starts from the same weights and sees the same data (the seed
    sets only the initialization), so the per-seed difference to the baseline removes most of the
    seed-to-seed spread: its mean, sd and the paired t-test's two-sided and one-sided ('higher':
    this configuration worse) p over the seeds both have."""
    by_seed = {}
    for r in results:
        if r["problem"] is None and r["label"] in (label, base_label):
            by_seed.setdefault(r["seed"], {})[r["label"]] = r["run"].final_val_loss
    pairs = [(v[label], v[base_label]) for _, v in sorted(by_seed.items()) if len(v) == 2]
    if not pairs:
        return dict(n_paired=0, paired_diff=None, paired_sd=None, detectable=None, p_paired=None, p_paired_higher=None)
    ours, base = (list(x) for x in zip(*pairs))
    diffs = np.subtract(ours, base)
    sd = float(np.std(diffs, ddof=1)) if len(pairs) >= 2 else None
    spread = sd is not None and sd > 0
    return dict(n_paired=len(pairs), paired_diff=float(diffs.mean()), paired_sd=sd,
                detectable=detectable_difference(sd, len(pairs)),
                p_paired=compare._p_value("ttest_rel", ours, base) if spread else None,
                p_paired_higher=compare._p_value("ttest_rel", ours, base, alternative="greater") if spread else None)


def statistics(configs, results):
    """Per configuration: n, mean, sd, Welch p against the first (records/compare.py's), and the
    paired-by-seed difference and p."""
    usable = {label: [r["run"] for r in results if r["label"] == label and r["problem"] is None]
              for label, _ in configs}
    base_label = configs[0][0]
    rows = []
    for label, argv in configs:
        runs = usable[label]
        row = dict(label=label, flags=shlex.join(argv), n=len(runs), mean=None, sd=None, diff=None,
                   p_two_sided=None, p_lower=None, p_higher=None)
        if runs:
            summary = compare.summarize(runs, runs[0].target_val_loss or compare.DEFAULT_TARGET)
            row.update(mean=summary.loss_mean, sd=summary.loss_std)
        if label != base_label and runs and usable[base_label]:
            c = compare.compare(runs, usable[base_label])
            row.update(diff=c.loss_diff, p_two_sided=c.loss_p_two_sided, p_lower=c.loss_p_lower,
                       p_higher=None if c.loss_p_lower is None else 1.0 - c.loss_p_lower)
        if label != base_label:
            row.update(paired(results, label, base_label))
        rows.append(row)
    return rows


def finite(x):
    """JSON has no NaN: a loss that is not finite is written as null."""
    return x if x is not None and math.isfinite(x) else None


def fmt(x, digits=4):
    return "n/a" if x is None else f"{x:.{digits}f}"


def train_seconds(result):
    """The training time the run's log states (validation excluded), reused runs included."""
    run = result["run"]
    return None if run is None or run.train_time_ms is None else run.train_time_ms / 1000


def markdown(rows, common, results):
    lines = [f"Common flags: `{common}`; the first row is the baseline. p: Welch t-test on the final val "
             "loss (two-sided; 'lower'/'higher': one-sided, this configuration's mean below/above the "
             "baseline's). Paired: the same seed's runs differ only in the configuration (the seed sets "
             "the initialization; the data is the same), so the per-seed differences are tested too "
             "(paired t-test; 'higher': worse than the baseline). Detectable: the smallest mean paired "
             "difference that would reach p = 0.05 with this sd and number of seeds.", ""]

    def signed(x):
        return fmt(x) if x is None else f"{x:+.4f}"

    lines += compare._md_table(
        ["config", "flags", "n", "mean val loss", "sd", "vs baseline", "p", "p lower", "p higher",
         "paired diff (sd)", "paired p", "paired p higher", "detectable"],
        [(r["label"], f"`{r['flags']}`" if r["flags"] else "", r["n"], fmt(r["mean"]), fmt(r["sd"]),
          "" if i == 0 else signed(r["diff"]),
          "" if i == 0 else compare._fmt_p(r["p_two_sided"]), "" if i == 0 else compare._fmt_p(r["p_lower"]),
          "" if i == 0 else compare._fmt_p(r["p_higher"]),
          "" if i == 0 else f"{signed(r['paired_diff'])} ({fmt(r['paired_sd'])})",
          "" if i == 0 else compare._fmt_p(r["p_paired"]), "" if i == 0 else compare._fmt_p(r["p_paired_higher"]),
          "" if i == 0 else fmt(r["detectable"]))
         for i, r in enumerate(rows)])
    lines += ["", "Runs:", ""]
    lines += compare._md_table(
        ["config", "seed", "final val loss", "train seconds", "problem"],
        [(r["label"], r["seed"], fmt(r["run"].final_val_loss if r["run"] else None), fmt(train_seconds(r), 0),
          r["problem"] or "") for r in results])
    return "\n".join(lines) + "\n"


def report_warnings(configs, results):
    """Lines for the report: runs made by more than one train_gpt.py source (--report-only over
    runs of an edited trainer), and a configuration whose logs lie in several folders (an A/B
    that ran over midnight: records/compare.py reads one folder at a time)."""
    lines = []
    versions = collections.Counter(r["run"].code_hash for r in results if r["run"] and r["run"].code_hash)
    if len(versions) > 1:
        common = versions.most_common(1)[0][0]
        odd = ", ".join(f"{r['label']} seed {r['seed']}" for r in results
                        if r["run"] and r["run"].code_hash not in (None, common))
        lines.append(f"warning: the runs were made by {len(versions)} versions of train_gpt.py (the source each log "
                     f"starts with); unlike the most common: {odd}. Their statistics mix code versions.")
    for label, _ in configs:
        folders = sorted({Path(r["log"]).parent.name for r in results if r["label"] == label and r["log"]})
        if len(folders) > 1:
            lines.append(f"warning: the logs of {label} lie in {len(folders)} folders ({', '.join(folders)}); "
                         "records/compare.py reads one folder at a time")
    return "".join(f"\n{line}\n" for line in lines)


def plot(curves, path):
    """curves: {label: [[(step, val_loss), ...] per run]}, in the configurations' order. Two panels:
    every step, and the last half zoomed, where configurations differ by hundredths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (whole, zoom) = plt.subplots(1, 2, figsize=(14, 6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    finals, late = [], {}
    last_step = max((step for runs in curves.values() for run in runs for step, _ in run), default=0)
    for i, (label, runs) in enumerate(curves.items()):
        # more configurations than colours: the next ones dashed, then dotted, so no two look alike
        style = dict(color=colours[i % len(colours)], linestyle=["-", "--", ":", "-."][i // len(colours) % 4])
        by_step = {}
        for run in runs:
            for ax in (whole, zoom):
                ax.plot([s for s, _ in run], [loss for _, loss in run], alpha=0.35, linewidth=1, **style)
            for step, loss in run:
                by_step.setdefault(step, []).append(loss)
            finals += [loss for _, loss in run[-1:] if math.isfinite(loss)]
        steps = sorted(by_step)
        means = [float(np.mean(by_step[s])) for s in steps]
        for ax in (whole, zoom):
            ax.plot(steps, means, linewidth=2, marker=".", label=f"{label} (mean of {len(runs)})", **style)
        if steps:
            late[label] = (means[-1], [loss for s in steps if 2 * s >= last_step for loss in by_step[s]
                                       if math.isfinite(loss)])
    if finals:  # the first validation (~10.8) would flatten the part that differs
        whole.set_ylim(top=max(finals) + max(0.5, 5 * (max(finals) - min(finals))))
    off_scale = []
    reached = [final for final, _ in late.values() if math.isfinite(final)]
    if late:  # the zoom fits the configurations near the best; one far behind (an outlier) runs off its top
        best = min(reached, default=math.inf)
        cutoff = best + max(0.02, 4 * float(np.median([final - best for final in reached]))) if reached else best
        off_scale = [label for label, (final, _) in late.items() if not final <= cutoff]  # NaN: a run diverged
        shown = [loss for label, (_, losses) in late.items() if label not in off_scale for loss in losses]
        zoom.set_xlim(last_step / 2 - 0.02 * last_step, last_step * 1.02)
        if shown:
            margin = max(0.01, 0.05 * (max(shown) - min(shown)))
            zoom.set_ylim(min(shown) - margin, max(shown) + margin)
    whole.set_title("Validation loss vs step, per configuration")
    zoom.set_title("The last half of the steps, zoomed" + (f" ({', '.join(off_scale)}: above)" if off_scale else ""))
    for ax in (whole, zoom):
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.grid(True, alpha=0.3)
    zoom.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], metavar='LABEL="FLAGS"',
                        help="a configuration (repeat; the first is the baseline)")
    parser.add_argument("--seeds", type=positive_int, default=4, help="seeds 0..K-1 of each configuration")
    parser.add_argument("--common", default=DEFAULT_COMMON, help=f"flags of every run (default: {DEFAULT_COMMON})")
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads per run")
    parser.add_argument("--parallel", type=positive_int, default=None,
                        help="runs at a time (default: cores // threads, at least 1)")
    parser.add_argument("--out", required=True, help="a new or empty folder for the logs and the report")
    parser.add_argument("--resume", action="store_true",
                        help="--out may hold an earlier A/B: its complete runs of the same settings are reused "
                             "(to finish an interrupted A/B, or add configurations or seeds to one); the report is rewritten")
    parser.add_argument("--report-only", action="store_true",
                        help="start no run: write the report from the finished runs in --out (an A/B cut short)")
    args = parser.parse_args(argv)
    if args.report_only and not (Path(args.out) / "logs").is_dir():
        fail(f"--report-only: {args.out} holds no A/B logs")
    args.resume = args.resume or args.report_only

    if not args.config:
        fail("--config: give at least one LABEL=\"FLAGS\" (the first is the baseline)")
    configs = parse_configs(args.config)
    common = split_flags(args.common, "--common")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not args.resume)):
        fail(f"--out {out}: exists and is not an empty folder (nothing there is overwritten; choose a new one, "
             "or --resume to reuse its runs)")
    expected = check_trainer_flags(configs, common)
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--out {out}: cannot create it ({e.strerror or e})")
    import train_gpt
    from harness import config as cfg
    parallel = args.parallel or max(1, train_gpt.usable_cpus() // args.threads)

    # seed-major order, so that an interrupted A/B has as many runs of every configuration
    jobs = [(label, common + argv, seed) for seed in range(args.seeds) for label, argv in configs]
    results = []
    if args.resume:
        # --report-only reports what is there, of any code (the report names a mix); --resume runs
        # again what another train_gpt.py made
        code_hash = None if args.report_only else trainer_code_hash()
        earlier = [finished_run(out, label, seed, dict(expected[label], seed=str(seed)), code_hash)
                   for label, _, seed in jobs]
        results = [r for r in earlier if r is not None and "stale" not in r]
        reused = {(r["label"], r["seed"]) for r in results}
        jobs = [job for job in jobs if (job[0], job[2]) not in reused]
        stale = [path for r in earlier if r is not None for path in r.get("stale", [])]
        for path in stale:  # out of the configuration's folder, which compare.py reads as its runs
            moved = out / "logs" / "replaced" / path.parent.name / path.name
            moved.parent.mkdir(parents=True, exist_ok=True)
            path.rename(moved)
        print(f"--resume: {len(reused)} finished runs reused" + (
            f"; {len(stale)} made by another train_gpt.py run again (their logs moved to {out / 'logs' / 'replaced'})"
            if stale else ""), flush=True)
    if args.report_only:
        if not results:
            fail(f"--report-only: {out} holds no finished run of these configurations and seeds")
        print(f"--report-only: {len(jobs)} runs not finished are left out of the report", flush=True)
        jobs = []
    print(f"{len(jobs)} runs ({len(configs)} configurations x {args.seeds} seeds), {parallel} at a time, "
          f"{args.threads} thread(s) each; logs in {out / 'logs'}", flush=True)
    with ThreadPoolExecutor(parallel) as pool:
        try:
            for done, result in enumerate(pool.map(lambda job: run_one(job, out, args.threads), jobs), start=1):
                loss = result["run"].final_val_loss if result["run"] else None
                print(f"[{done}/{len(jobs)}] {result['label']} seed {result['seed']}: "
                      f"{result['problem'] or f'final val loss {fmt(loss)}'} ({result['seconds']:.0f} s)", flush=True)
                results.append(result)
        except KeyboardInterrupt:
            end_runs(pool)
            raise

    order = {(label, seed): i for i, (label, seed) in
             enumerate((label, seed) for seed in range(args.seeds) for label, _ in configs)}
    results.sort(key=lambda r: order[(r["label"], r["seed"])])
    rows = statistics(configs, results)
    report = markdown(rows, args.common, results) + report_warnings(configs, results)
    (out / "ab.md").write_text(report)
    (out / "ab.json").write_text(json.dumps(dict(
        common=args.common, seeds=args.seeds, threads=args.threads, parallel=parallel,
        configs=rows,
        runs=[dict(label=r["label"], seed=r["seed"], log=r["log"], problem=r["problem"],
                   seconds=None if r.get("reused") else round(r["seconds"], 1), train_seconds=train_seconds(r),
                   final_val_loss=finite(r["run"].final_val_loss) if r["run"] else None,
                   code_sha1=r["run"].code_hash if r["run"] else None,
                   val_curve=[[step, finite(loss)] for step, _, loss in r["run"].val_curve] if r["run"] else [])
              for r in results]), indent=1, allow_nan=False) + "\n")
    plot({label: [[(step, loss) for step, _, loss in r["run"].val_curve]
                   for r in results if r["label"] == label and r["problem"] is None] for label, _ in configs},
         out / "ab.png")
    print()
    print(report, end="")
    print(f"wrote {out / 'ab.md'}, {out / 'ab.json'}, {out / 'ab.png'}")
    failed = [r for r in results if r["problem"] is not None]
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)   # ends the runs as Ctrl-C does
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT
        print(f"ab.py: interrupted ({signal.Signals(signum).name}); finished runs can be reused with --resume",
              file=sys.stderr)
        sys.exit(128 + signum)
