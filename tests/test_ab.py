"""bench/ab.py end to end on the tiny model: 2 configurations x 2 seeds of 4 steps; the table, the
JSON and the plot exist, and the statistics are those of the logs' own final val losses."""

import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import compare
from bench import ab as ab_module
from conftest import ROOT, sigint_as_at_a_terminal, signal_when_training, tiny_argv

pytestmark = pytest.mark.slow  # launches fresh processes: the full suite only (README, Test)

AB = str(ROOT / "bench" / "ab.py")
VAL_RE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) ")


def seed_log(out, label, seed):
    """The one log of seed `seed` of configuration `label` (the seeds share its folder)."""
    (log,) = [log for log in (out / "logs").glob(f"*_ab_{label}/*.txt") if f"\nseed={seed}\n" in log.read_text()]
    return log


def final_loss(log):
    finals = [float(m.group(3)) for line in log.read_text().splitlines()
              if (m := VAL_RE.match(line)) and m.group(1) == m.group(2)]
    assert len(finals) == 1, log
    return finals[0]


def test_ab_end_to_end(make_shards, tmp_path):
    train_glob, val_glob, _ = make_shards()
    common = shlex.join(tiny_argv(train_files=train_glob, val_files=val_glob, num_iterations=4, val_every=2))
    out = tmp_path / "ab"
    done = subprocess.run([sys.executable, AB, "--config", "base=--muon_lr 0.05", "--config", "low=--muon_lr=0.01",
                           "--seeds", "2", "--parallel", "2", "--common", common, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("ab.md", "ab.json", "ab.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    losses = {}
    for label in ("base", "low"):
        for seed in (0, 1):
            log = seed_log(out, label, seed)
            text = log.read_text()
            assert f"seed={seed}" in text and f"muon_lr={0.05 if label == 'base' else 0.01}" in text
            losses.setdefault(label, []).append(final_loss(log))
    assert losses["base"][0] != losses["base"][1]  # the seed reaches the run

    report = json.loads((out / "ab.json").read_text())
    base, low = report["configs"]
    assert (base["label"], low["label"], base["n"], low["n"]) == ("base", "low", 2, 2)
    for row, label in ((base, "base"), (low, "low")):
        assert row["mean"] == pytest.approx(np.mean(losses[label]), abs=1e-9)
        assert row["sd"] == pytest.approx(np.std(losses[label], ddof=1), abs=1e-9)
    welch = stats.ttest_ind(losses["low"], losses["base"], equal_var=False)
    assert low["p_two_sided"] == pytest.approx(welch.pvalue, rel=1e-9)
    assert low["diff"] == pytest.approx(np.mean(losses["low"]) - np.mean(losses["base"]), abs=1e-9)
    assert base["p_two_sided"] is None
    diffs = np.subtract(losses["low"], losses["base"])  # seed s against seed s
    assert low["n_paired"] == 2 and low["paired_diff"] == pytest.approx(diffs.mean(), abs=1e-9)
    assert low["paired_sd"] == pytest.approx(np.std(diffs, ddof=1), abs=1e-9)
    assert low["p_paired"] == pytest.approx(stats.ttest_rel(losses["low"], losses["base"]).pvalue, rel=1e-9)
    n = len(diffs)
    assert low["detectable"] == pytest.approx(stats.t.ppf(0.975, n - 1) * np.std(diffs, ddof=1) / n ** 0.5, rel=1e-9)
    assert low["p_paired_higher"] == pytest.approx(
        stats.ttest_rel(losses["low"], losses["base"], alternative="greater").pvalue, rel=1e-9)
    assert {(r["label"], r["seed"]) for r in report["runs"]} == {(c, s) for c in ("base", "low") for s in (0, 1)}
    assert all(r["val_curve"][-1] == [4, r["final_val_loss"]] for r in report["runs"])

    table = (out / "ab.md").read_text()
    assert f"| low | `--muon_lr=0.01` | 2 | {np.mean(losses['low']):.4f} |" in table
    assert f"Common flags: `{common}`" in table
    assert table in done.stdout
    # a configuration's logs are one folder, as records/compare.py reads a set of runs
    (low_dir,), (base_dir,) = ((out / "logs").glob(f"*_ab_{label}") for label in ("low", "base"))
    compared = subprocess.run([sys.executable, str(ROOT / "records" / "compare.py"), str(low_dir), str(base_dir),
                               "--out", str(tmp_path / "compared")], capture_output=True, text=True, timeout=120)
    assert compared.returncode == 0, compared.stderr
    assert "runs: " in compared.stdout and "run_name" not in compared.stdout
    assert f"{np.mean(losses['low']):.4f}" in compared.stdout


@pytest.mark.parametrize("argv, message", [
    ([], "--config: give at least one"),
    (["--config", "a=--muon_lr fast"], "--config a: --muon_lr='fast': expected float"),
    (["--config", "a=--seed 3"], "--config a: sets --seed, which ab.py sets"),
    (["--config", "a=", "--config", "a=--normuon true"], "--config a: the label is used twice"),
    (["--config", "a b=--normuon true"], "expected LABEL=\"FLAGS\""),
    (["--config", "a=", "--seeds", "0"], "--seeds: expected a positive integer"),
    (["--config", "a=", "--common", "--preset gpu"], "--common: --preset='gpu': expected one of"),
    (["--config", "a=--save_checkpoint true", "--config", "b=--save_checkpoint true --muon_lrr 0.1",
      "--common", "--preset cpu --checkpoint_every 10"], "--config b: unknown option --muon_lrr"),
])
def test_bad_arguments_fail_in_one_line_before_any_run(tmp_path, argv, message):
    out = tmp_path / "ab"
    done = subprocess.run([sys.executable, AB, *argv, "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("ab.py: error: "), done.stderr   # argparse's or ours
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the processes in /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_ab_and_its_runs_in_one_line(make_shards, tmp_path, signum):
    train_glob, val_glob, _ = make_shards()
    common = shlex.join(tiny_argv(train_files=train_glob, val_files=val_glob, num_iterations=10_000, val_every=0))
    out = tmp_path / "ab"
    proc = subprocess.Popen([sys.executable, AB, "--config", "a=", "--seeds", "3", "--parallel", "1",
                             "--common", common, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=sigint_as_at_a_terminal)
    stdout, stderr, _, _, left = signal_when_training(proc, str(out), signum)  # to ab.py alone: it ends its run
    assert proc.returncode == 128 + signum, stderr
    name = signal.Signals(signum).name
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == \
        f"ab.py: interrupted ({name}); finished runs can be reused with --resume"
    assert not left
    assert [p.name for p in (out / "logs").glob("*.out")] == ["ab_a_s0.out"]   # no later run started


def test_an_existing_report_is_never_overwritten(tmp_path):
    out = tmp_path / "ab"
    out.mkdir()
    (out / "ab.md").write_text("earlier results\n")
    done = subprocess.run([sys.executable, AB, "--config", "a=", "--out", str(out)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "exists and is not an empty folder" in done.stderr
    assert (out / "ab.md").read_text() == "earlier results\n"
    assert sorted(p.name for p in Path(out).iterdir()) == ["ab.md"]


def test_resume_reuses_finished_runs_and_refuses_changed_flags(make_shards, tmp_path):
    """--resume adds a configuration and a seed to an earlier A/B without re-running what it has;
    the same label with other flags is refused in one line, before any run."""
    train_glob, val_glob, _ = make_shards()
    common = shlex.join(tiny_argv(train_files=train_glob, val_files=val_glob, num_iterations=2, val_every=2))
    out = tmp_path / "ab"

    def ab(*argv):
        return subprocess.run([sys.executable, AB, *argv, "--common", common, "--out", str(out)],
                              capture_output=True, text=True, timeout=120)

    first = ab("--config", "base=--muon_lr 0.05", "--seeds", "1")
    assert first.returncode == 0, first.stdout + first.stderr
    base_log = seed_log(out, "base", 0)
    refused = ab("--config", "base=--muon_lr 0.05", "--seeds", "1")
    assert refused.returncode != 0 and "--resume" in refused.stderr

    before = sorted((out / "logs").iterdir())
    partial = ab("--config", "base=--muon_lr 0.05", "--config", "low=--muon_lr 0.01", "--seeds", "2", "--report-only")
    assert partial.returncode == 0, partial.stdout + partial.stderr
    assert "3 runs not finished are left out" in partial.stdout
    assert [(r["label"], r["seed"]) for r in json.loads((out / "ab.json").read_text())["runs"]] == [("base", 0)]
    assert sorted((out / "logs").iterdir()) == before  # no run started

    # An earlier, interrupted run of low seed 1 whose log name sorts after any uuid: the rerun's
    # own log is read, not it.
    interrupted = out / "logs" / f"{datetime.date.today().isoformat()}_ab_low" / "ffffffff.txt"
    interrupted.parent.mkdir()
    interrupted.write_text(base_log.read_text().split("step:2/")[0].replace("\nseed=0\n", "\nseed=1\n"))
    os.utime(interrupted, (1e9, 1e9))

    more = ab("--config", "base=--muon_lr 0.05", "--config", "low=--muon_lr 0.01", "--seeds", "2", "--resume")
    assert more.returncode == 0, more.stdout + more.stderr
    assert all(r["problem"] is None for r in json.loads((out / "ab.json").read_text())["runs"])
    assert "1 finished runs reused" in more.stdout and "3 runs (2 configurations x 2 seeds)" in more.stdout
    assert seed_log(out, "base", 0) == base_log
    report = json.loads((out / "ab.json").read_text())
    assert [(r["label"], r["seed"]) for r in report["runs"]] == [("base", 0), ("low", 0), ("base", 1), ("low", 1)]
    assert report["runs"][0]["final_val_loss"] == final_loss(base_log)
    train_ms = re.search(r"^step:2/2 val_loss:\S+ train_time:(\d+)ms", base_log.read_text(), re.M).group(1)
    assert report["runs"][0]["seconds"] is None and report["runs"][0]["train_seconds"] == int(train_ms) / 1000
    assert all(r["seconds"] > 0 and r["train_seconds"] > 0 for r in report["runs"][1:])
    assert report["configs"][1]["n_paired"] == 2

    changed = ab("--config", "base=--muon_lr 0.02", "--seeds", "1", "--resume")
    assert changed.returncode != 0
    assert "muon_lr (0.05 vs 0.02)" in changed.stderr and len(changed.stderr.strip().splitlines()) == 1


def edited_trainer(log):
    """The log as an edited train_gpt.py would have written it: another source at its top."""
    log.write_text("# an edit\n" + log.read_text())


def test_resume_runs_again_what_another_train_gpt_made_and_the_report_names_a_mix(make_shards, tmp_path):
    train_glob, val_glob, _ = make_shards()
    common = shlex.join(tiny_argv(train_files=train_glob, val_files=val_glob, num_iterations=2, val_every=2))
    out = tmp_path / "ab"

    def ab(*argv):
        return subprocess.run([sys.executable, AB, "--config", "base=", *argv, "--common", common, "--out", str(out)],
                              capture_output=True, text=True, timeout=120)
    first = ab("--seeds", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    log_0, log_1 = (seed_log(out, "base", seed) for seed in (0, 1))
    assert compare.parse_log(log_0).code_hash == ab_module.trainer_code_hash()
    assert "warning" not in (out / "ab.md").read_text()
    edited_trainer(log_0)
    changed = subprocess.run([sys.executable, AB, "--config", "base=--muon_lr 0.02", "--seeds", "2", "--resume",
                              "--common", common, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert changed.returncode != 0 and "vs 0.02); use a new --out" in changed.stderr  # refused, not run again

    again = ab("--seeds", "2", "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "--resume: 1 finished runs reused; 1 made by another train_gpt.py run again" in again.stdout
    # the old log leaves the configuration's folder, which compare.py would read as one more run
    assert (out / "logs" / "replaced" / log_0.parent.name / log_0.name).exists() and not log_0.exists()
    assert seed_log(out, "base", 0) != log_0
    assert "warning" not in (out / "ab.md").read_text()  # both runs in the report are of this train_gpt.py
    log_0 = seed_log(out, "base", 0)

    edited_trainer(log_1)  # --report-only takes what is there, and says it mixes code versions
    report = ab("--seeds", "2", "--report-only")
    assert report.returncode == 0, report.stdout + report.stderr
    warning = ("warning: the runs were made by 2 versions of train_gpt.py (the source each log starts with); "
               "unlike the most common: ")
    assert warning in (out / "ab.md").read_text() and warning in report.stdout
    codes = [r["code_sha1"] for r in json.loads((out / "ab.json").read_text())["runs"]]
    assert len(set(codes)) == 2 and codes[0] == ab_module.trainer_code_hash()

    # An A/B of the earlier ab.py (a folder per seed) is read; another label's folder is not.
    old_layout = log_1.parent.parent / f"{log_1.parent.name}_s1"
    old_layout.mkdir()
    log_1.rename(old_layout / log_1.name)
    other = log_0.parent.parent / log_0.parent.name.replace("_ab_base", "_ab_other_ab_base")  # label other_ab_base's
    other.mkdir()
    (other / "copy.txt").write_text(log_0.read_text())
    report = ab("--seeds", "2", "--report-only")
    assert report.returncode == 0, report.stdout + report.stderr
    runs = json.loads((out / "ab.json").read_text())["runs"]
    assert [Path(r["log"]) for r in runs] == [log_0, old_layout / log_1.name]
    assert "lie in 2 folders" in (out / "ab.md").read_text()


def test_report_only_without_finished_runs_keeps_the_report_there(tmp_path):
    out = tmp_path / "ab"
    (out / "logs").mkdir(parents=True)
    (out / "ab.md").write_text("earlier results\n")
    done = subprocess.run([sys.executable, AB, "--config", "a=", "--out", str(out), "--report-only"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        f"ab.py: error: --report-only: {out} holds no finished run of these configurations and seeds"]
    assert (out / "ab.md").read_text() == "earlier results\n"


def test_plot_tells_every_configuration_apart_and_zooms_past_an_outlier(tmp_path, monkeypatch):
    """12 configurations (more than matplotlib's 10 colours) near each other and one far behind: every
    mean curve has its own colour and line style, and the zoomed panel fits the 12, not the outlier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    curves = {f"c{i}": [[(0, 10.8), (60, 6.0 + 0.01 * i), (120, 5.6 + 0.01 * i)],
                        [(0, 10.8), (60, 6.02 + 0.01 * i), (120, 5.61 + 0.01 * i)]] for i in range(12)}
    curves["far"] = [[(0, 10.8), (60, 6.6), (120, float("nan"))], [(0, 10.8), (60, 6.5), (120, 6.2)]]
    ab_module.plot(curves, tmp_path / "ab.png")

    assert (tmp_path / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    whole, zoom = figures[0].axes
    means = [line for line in zoom.get_lines() if line.get_label() and not line.get_label().startswith("_")]
    assert len(means) == 13 and len({(line.get_color(), line.get_linestyle()) for line in means}) == 13
    low, high = zoom.get_ylim()
    assert 5.55 < low < 5.6 and 6.13 < high < 6.3  # the 12's last half (6.0..6.13 at step 60), not far's 6.6
    assert zoom.get_xlim()[0] > 50 and "far" in zoom.get_title()
    assert whole.get_ylim()[1] > 6.2  # every step: the outlier in view
