"""Tests for records/compare.py.

Synthetic logs (written here, with known losses and times) check the parser, the
exclusion rules and the statistics against scipy computed directly. The public
record logs in <repo>/../shared/reference_logs, when present, check the whole
tool on real data; they are copied to a temporary folder first because compare.py
writes its outputs next to the logs.
"""
import re
import shutil
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "records"))

import compare  # noqa: E402

REFERENCE_LOGS = REPO.parent / "shared" / "reference_logs"
SEP = "=" * 100
H100 = "NVIDIA H100 80GB HBM3"

# The trainer's source code heads every log; it can contain text shaped like
# training output, and even a separator line, none of which may be parsed.
FAKE_SOURCE = f"""import os
# example output, kept in the source as documentation:
# step:20/20 val_loss:9.9999 train_time:1ms step_avg:1.00ms
LOG_EXAMPLE = '''
step:0/20 val_loss:10.0000 train_time:0ms step_avg:0.00ms
step:20/20 val_loss:9.9999 train_time:1ms step_avg:1.00ms
peak memory allocated: 1 MiB reserved: 2 MiB
'''
print("{SEP}")
{SEP}
world_size=1 device=cpu
"""


def nvidia_smi(gpu: str = H100, count: int = 8, driver: str = "570.148.08", date: str = "Sun Jul 13 01:45:26 2025") -> str:
    rows = [
        f"{date}       ",
        "+" + "-" * 89 + "+",
        f"| NVIDIA-SMI {driver}             Driver Version: {driver}     CUDA Version: 12.8     |",
        "|-----------------------------------------+------------------------+----------------------+",
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "|=========================================+========================+======================|",
    ]
    for i in range(count):
        rows += [
            f"|   {i}  {gpu:<28}On  |   00000000:6{i}:00.0 Off |                    0 |",
            "| N/A   32C    P0            116W /  700W |    5856MiB /  81559MiB |      4%      Default |",
            "+-----------------------------------------+------------------------+----------------------+",
        ]
    rows += ["| Processes:" + " " * 78 + "|", "|" + "=" * 89 + "|"]
    rows += [
        f"|    {i}   N/A  N/A           9168{i}      C   /usr/bin/python3                       1508MiB |"
        for i in range(count)
    ]
    rows += ["+" + "-" * 89 + "+", ""]
    return "\n".join(rows)


def make_log(
    final_loss: float = 3.2790,
    final_ms: int = 170_000,
    steps: int = 20,
    style: str = "project",
    gpu: str = H100,
    gpu_count: int = 8,
    cpu: str | None = None,
    driver: str = "570.148.08",
    date: str = "Sun Jul 13 01:45:26 2025",
    run_name: str = "myidea",
    target: float | None = 3.28,
    source: str = FAKE_SOURCE,
    python: str = "3.11.7",
    finished: bool = True,
    peak: bool = True,
) -> str:
    """A log in the project's format ("project") or the public one ("public"),
    validated every steps/4 steps, its losses falling linearly to final_loss."""
    if style == "project":
        torch_line = "Running PyTorch 2.13.0+cpu (CPU build)" if cpu else "Running PyTorch 2.13.0+cu128 compiled for CUDA 12.8"
        versions = [f"Running Python {python} (main, Jun  1 2025) [GCC 12.2.0]", torch_line, "Running Triton version 3.9.0"]
    else:
        versions = [
            f"Running Python {python} (main, May 27 2025, 17:12:29) [GCC 11.4.0]",
            "Running PyTorch 2.8.0.dev20250524+cu126 compiled for CUDA 12.6",
        ]
    header = versions + [f"CPU: {cpu}" if cpu else nvidia_smi(gpu, gpu_count, driver, date)]
    if style == "project":
        header += ["preset=speedrun", f"run_name={run_name}"]
        header += [f"target_val_loss={target}"] if target is not None else []
        header += [f"num_iterations={steps}", "world_size=8 device=cuda"]
    body = ["embed.weight: torch.Size([50304, 768]) torch.bfloat16", "Resetting Model"]
    val_every = max(steps // 4, 1)
    last = steps if finished else steps - 1
    for step in range(last + 1):
        ms = final_ms * step // steps
        if step:
            body.append(f"step:{step}/{steps} train_time:{ms}ms step_avg:{ms / step:.2f}ms")
        if step % val_every == 0 or step == steps:
            loss = 10.8 + (final_loss - 10.8) * step / steps
            body.append(f"step:{step}/{steps} val_loss:{loss:.4f} train_time:{ms}ms step_avg:{ms / max(step, 1):.2f}ms")
    if peak and finished:
        body.append("peak memory allocated: 33278 MiB reserved: 48994 MiB")
    return "\n".join([source.rstrip("\n"), SEP, *header, SEP, *body]) + "\n"


def write_logs(folder: Path, texts: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for text in texts:
        path = folder / f"{uuid.uuid4()}.txt"
        path.write_text(text)
        paths.append(path)
    return paths


LOSSES = [3.2771, 3.2784, 3.2779, 3.2790, 3.2768, 3.2781]
TIMES = [170_100, 170_450, 169_900, 170_300, 170_050, 170_200]
BASE_LOSSES = [3.2782, 3.2795, 3.2769, 3.2788, 3.2777]
BASE_TIMES = [171_300, 171_100, 171_600, 171_250, 171_400]


@pytest.fixture
def good_runs(tmp_path):
    folder = tmp_path / "2026-01-01_myidea"
    write_logs(folder, [make_log(l, t) for l, t in zip(LOSSES, TIMES)])
    return folder


@pytest.fixture
def baseline_runs(tmp_path):
    folder = tmp_path / "2026-01-01_baseline"
    write_logs(folder, [make_log(l, t, run_name="baseline") for l, t in zip(BASE_LOSSES, BASE_TIMES)])
    return folder


# ---------------------------------------------------------------- parsing

def test_parse_project_format_ignores_source_code():
    run = compare.parse_log_text(make_log(3.2771, 171_743), run_id="abc")
    assert run.usable, run.problems
    assert run.run_id == "abc"
    assert run.total_steps == 20 and run.last_step == 20
    assert run.final_val_loss == 3.2771 and run.train_time_ms == 171_743
    assert run.val_curve[0] == (0, 0, 10.8)
    assert run.val_curve[-1] == (20, 171_743, 3.2771)
    assert [step for step, _, _ in run.val_curve] == [0, 5, 10, 15, 20]
    assert (run.peak_mem_allocated_mib, run.peak_mem_reserved_mib) == (33278, 48994)
    assert run.python_version == "3.11.7"
    assert (run.torch_version, run.cuda_version, run.triton_version) == ("2.13.0+cu128", "12.8", "3.9.0")
    assert run.hardware == f"8x {H100}"
    assert run.machine == "driver 570.148.08, GPUs at " + " ".join(f"00000000:6{i}:00.0" for i in range(8))
    assert run.started == datetime(2025, 7, 13, 1, 45, 26)
    assert run.run_name == "myidea" and run.target_val_loss == 3.28
    # the source code's "world_size=1 device=cpu" must not leak into the header
    assert run.config["world_size"] == "8" and run.config["device"] == "cuda"
    assert run.config["preset"] == "speedrun" and run.config["num_iterations"] == "20"


def test_parse_public_format():
    run = compare.parse_log_text(make_log(3.2803, 173_291, steps=1750, style="public", python="3.10.12"))
    assert run.usable, run.problems
    assert (run.total_steps, run.final_val_loss, run.train_time_ms) == (1750, 3.2803, 173_291)
    assert (run.python_version, run.torch_version, run.cuda_version) == ("3.10.12", "2.8.0.dev20250524+cu126", "12.6")
    assert run.triton_version is None and run.run_name is None and run.target_val_loss is None
    assert run.config == {}
    assert run.hardware == f"8x {H100}"


def early_2025_public_log(final_loss: float = 3.2772, final_ms: int = 201_373) -> str:
    """A public record log as written in January 2025 (modded-nanogpt records/011225_*): the
    header, a separator, the data files, a separator, the training lines, and a closing
    "peak memory consumption" line without the reserved memory."""
    text = make_log(final_loss, final_ms, style="public", python="3.10.12")
    source_and_header, body = text.rsplit(SEP + "\n", 1)
    data_files = ("Training dataloader files: ['data/fineweb10B/fineweb_train_000001.bin']\n"
                  "Validation dataloader files: ['data/fineweb10B/fineweb_val_000000.bin']\n")
    body = body.replace("peak memory allocated: 33278 MiB reserved: 48994 MiB", "peak memory consumption: 32619 MiB")
    return source_and_header + SEP + "\n" + data_files + SEP + "\n" + body


def test_parse_early_2025_public_format(tmp_path):
    """Such logs were excluded as "truncated: no 'peak memory' line" with unknown hardware."""
    run = compare.parse_log_text(early_2025_public_log())
    assert run.usable, run.problems
    assert (run.final_val_loss, run.train_time_ms) == (3.2772, 201_373)
    assert (run.peak_mem_allocated_mib, run.peak_mem_reserved_mib) == (32619, None)
    assert run.hardware == f"8x {H100}" and run.python_version == "3.10.12"
    folder = tmp_path / "runs"
    write_logs(folder, [early_2025_public_log(l, t) for l, t in zip(LOSSES, TIMES)])
    assert compare.main([str(folder)]) == 0
    md = (folder / "statistics.md").read_text()
    assert "| runs used | 6 of 6 |" in md and "| 32619 / n/a | yes |" in md


def test_parse_cpu_header_and_gpu_count():
    cpu_run = compare.parse_log_text(make_log(cpu="AMD EPYC 7B13 x2"))
    assert cpu_run.hardware == "CPU: AMD EPYC 7B13 x2"
    assert (cpu_run.torch_version, cpu_run.cuda_version) == ("2.13.0+cpu", None)
    one_gpu = compare.parse_log_text(make_log(gpu="NVIDIA H200", gpu_count=1))
    assert one_gpu.hardware == "1x NVIDIA H200"


def test_parse_the_trainers_own_lines_where_nvidia_smi_or_triton_is_missing():
    """train_gpt.py names rank 0's GPU in one line where nvidia-smi cannot run, and says Triton is
    not installed where it is not; a separator may carry trailing spaces (an editor's)."""
    text = make_log().replace(nvidia_smi(H100, 8, "570.148.08", "Sun Jul 13 01:45:26 2025"),
                              f"GPU: {H100} (nvidia-smi unavailable)")
    text = text.replace("Running Triton version 3.9.0", "Running Triton version not installed")
    run = compare.parse_log_text(text.replace(SEP + "\n", SEP + "  \n"))
    assert run.usable, run.problems
    assert run.hardware == f"8x {H100}" and run.triton_version is None and run.software.endswith("Triton n/a")


def test_parse_single_separator_has_no_header():
    text = make_log()
    only_training = text[text.rindex(SEP):]
    run = compare.parse_log_text(only_training)
    assert run.usable, run.problems
    assert run.final_val_loss == 3.2790 and run.hardware is None and run.python_version is None


def test_garbled_lines_do_not_crash():
    text = make_log().replace("val_loss:8.9198", "val_loss:-")
    assert [step for step, _, _ in compare.parse_log_text(text).val_curve] == [0, 10, 15, 20]
    run = compare.parse_log_text(text.replace("val_loss:3.2790", "val_loss:3.27.90"))
    assert not run.usable and "unfinished" in run.problems[0]


def test_missing_header_counts_as_unknown_hardware(tmp_path):
    folder = tmp_path / "runs"
    text = make_log(3.2700)
    write_logs(folder, [make_log(3.2790), make_log(3.2780), text[text.rindex(SEP):]])
    [warning] = compare.load_folder(folder).warnings
    assert f"hardware unknown differs from the folder's majority (8x {H100})" in warning


def test_every_truncation_is_caught_and_never_crashes():
    text = make_log()
    # cutting only the final newline leaves a complete log
    for cut in range(len(text) - 1):
        run = compare.parse_log_text(text[:cut])
        assert not run.usable, f"cut at {cut} of {len(text)} accepted"


@pytest.mark.parametrize(
    "text, problem",
    [
        ("no separator at all\nstep:20/20 val_loss:3.0 train_time:1ms\n", "no line of 100 '='"),
        (make_log(finished=False), "unfinished: no validation line at step 20/20 (last step logged: 19)"),
        (make_log(peak=False), "truncated: no 'peak memory' line"),
        (make_log() + make_log().split(SEP)[-1], "several runs in one file"),
        (make_log(steps=20) + make_log(steps=24).split(SEP)[-1], "disagree on the step count (20, 24)"),
        (make_log(3.2700) + make_log(), "2 'Running Python' lines: several runs in one file?"),
        (make_log().replace("val_loss:3.2790", "val_loss:nan"), "final validation loss is nan"),
    ],
    ids=["no-separator", "unfinished", "no-peak-memory", "two-runs", "two-step-counts", "two-whole-logs", "nan-loss"],
)
def test_parse_problems(text, problem):
    run = compare.parse_log_text(text)
    assert not run.usable
    assert any(problem in p for p in run.problems), run.problems


# ---------------------------------------------------------------- folders

def test_folder_excludes_bad_runs_with_warnings(tmp_path):
    folder = tmp_path / "runs"
    good = write_logs(folder, [make_log(l, t) for l, t in zip(LOSSES, TIMES)])
    bad = dict(zip(
        ["unfinished", "truncated", "other_gpu", "other_steps"],
        write_logs(folder, [
            make_log(finished=False),
            make_log(3.2700, 170_000)[:-40],
            make_log(3.2600, 160_000, gpu="NVIDIA A100-SXM4-80GB"),
            make_log(3.2500, 150_000, steps=24),
        ]),
    ))
    copy = folder / f"{uuid.uuid4()}.txt"
    shutil.copyfile(good[0], copy)
    # same training output under a different source header: a copied run, not a new one
    same_run = folder / f"{uuid.uuid4()}.txt"
    same_run.write_text(make_log(LOSSES[1], TIMES[1], source="# edited source\n"))

    result = compare.load_folder(folder)
    assert len(result.runs) == len(good) + len(bad) + 2
    expected = {
        "unfinished": "unfinished",
        "truncated": "truncated",
        "other_gpu": f"hardware 8x NVIDIA A100-SXM4-80GB differs from the folder's majority (8x {H100})",
        "other_steps": "step count 24 differs from the folder's majority (20)",
    }
    for kind, path in bad.items():
        [warning] = [w for w in result.warnings if path.name in w.split(":")[0]]
        assert "excluded" in warning and expected[kind] in warning, warning
    # of each duplicate pair the first file by name is kept, the other excluded
    for pair, reason in [((good[0], copy), "identical content"), ((good[1], same_run), "identical training output")]:
        kept, dropped = sorted(pair)
        assert kept in [r.path for r in result.usable]
        [warning] = [w for w in result.warnings if dropped.name in w.split(":")[0]]
        assert f"excluded: duplicate: {reason} to {kept.name}" in warning
    usable_losses = sorted(r.final_val_loss for r in result.usable)
    assert usable_losses == sorted(LOSSES) and len(result.warnings) == 6
    assert result.hardware == f"8x {H100}" and result.total_steps == 20


def test_folder_split_evenly_has_no_majority(tmp_path):
    folder = tmp_path / "split"
    write_logs(folder, [make_log(3.27, 100), make_log(3.28, 200, gpu="NVIDIA H200")])
    result = compare.load_folder(folder)
    assert not result.usable
    assert all("split evenly" in w for w in result.warnings)


def test_software_difference_warns_but_keeps(tmp_path):
    folder = tmp_path / "runs"
    write_logs(folder, [make_log(3.277), make_log(3.278), make_log(3.279, python="3.12.7")])
    result = compare.load_folder(folder)
    assert len(result.usable) == 3
    [warning] = result.warnings
    assert "different software (Python 3.12.7" in warning and warning.endswith("kept")


@pytest.mark.parametrize("kind, message", [
    ("missing", "no such folder"),
    ("file", "not a folder"),
    ("empty", "no *.txt run logs in this folder"),
])
def test_load_folder_errors(tmp_path, kind, message):
    path = tmp_path / kind
    if kind == "file":
        path.write_text("not a folder")
    elif kind == "empty":
        path.mkdir()
    with pytest.raises(compare.FolderError) as error:
        compare.load_folder(path)
    assert str(error.value) == f"{path}: {message}"


def test_checkpoints_beside_the_logs_are_ignored(tmp_path):
    """train_gpt.py --save_checkpoint writes <run_id>.pt beside <run_id>.txt; only logs count."""
    folder = tmp_path / "2026-01-01_myidea"
    logs = write_logs(folder, [make_log(l, t) for l, t in zip(LOSSES, TIMES)])
    for log in logs:
        log.with_suffix(".pt").write_bytes(b"PK\x03\x04 not a log")
    result = compare.load_folder(folder)
    assert len(result.runs) == len(logs) and len(result.usable) == len(logs) and result.warnings == []
    only_checkpoints = tmp_path / "only"
    only_checkpoints.mkdir()
    (only_checkpoints / "x.pt").write_bytes(b"PK")
    with pytest.raises(compare.FolderError, match="no \\*.txt run logs"):
        compare.load_folder(only_checkpoints)


# ---------------------------------------------------------------- statistics

def runs_with(losses, times):
    return [compare.parse_log_text(make_log(l, t)) for l, t in zip(losses, times)]


def test_summary_equals_scipy():
    summary = compare.summarize(runs_with(LOSSES, TIMES), 3.28)
    assert summary.n == len(LOSSES)
    assert summary.loss_mean == pytest.approx(np.mean(LOSSES))
    assert summary.loss_std == pytest.approx(np.std(LOSSES, ddof=1))
    assert summary.loss_p == pytest.approx(stats.ttest_1samp(LOSSES, 3.28, alternative="less").pvalue)
    assert summary.time_mean_ms == pytest.approx(np.mean(TIMES))
    assert summary.time_std_ms == pytest.approx(np.std(TIMES, ddof=1))
    assert summary.time_median_ms == np.median(TIMES)
    assert (summary.time_min_ms, summary.time_max_ms) == (min(TIMES), max(TIMES))


def test_comparison_equals_scipy():
    result = compare.compare(runs_with(LOSSES, TIMES), runs_with(BASE_LOSSES, BASE_TIMES))
    welch = lambda a, b, **kw: stats.ttest_ind(a, b, equal_var=False, **kw).pvalue
    assert result.time_diff_ms == pytest.approx(np.mean(TIMES) - np.mean(BASE_TIMES))
    assert result.time_p_two_sided == pytest.approx(welch(TIMES, BASE_TIMES))
    assert result.time_p_faster == pytest.approx(welch(TIMES, BASE_TIMES, alternative="less"))
    assert result.loss_diff == pytest.approx(np.mean(LOSSES) - np.mean(BASE_LOSSES))
    assert result.loss_p_two_sided == pytest.approx(welch(LOSSES, BASE_LOSSES))
    assert result.loss_p_lower == pytest.approx(welch(LOSSES, BASE_LOSSES, alternative="less"))
    assert result.speedup == pytest.approx(np.mean(BASE_TIMES) / np.mean(TIMES))


def test_undefined_statistics_are_none():
    single = compare.summarize(runs_with([3.27], [100]), 3.28)
    assert (single.loss_std, single.loss_p, single.time_std_ms) == (None, None, None)
    constant = compare.summarize(runs_with([3.27, 3.27], [100, 100]), 3.28)
    assert constant.loss_std == 0 and constant.loss_p is None
    versus_single = compare.compare(runs_with([3.27], [100]), runs_with([3.27, 3.28], [110, 120]))
    assert versus_single.time_p_two_sided is None and versus_single.speedup == pytest.approx(1.15)


def test_target_resolution(tmp_path):
    stated = tmp_path / "stated"
    write_logs(stated, [make_log(target=3.5), make_log(3.27, target=3.5)])
    folder = compare.load_folder(stated)
    assert compare.resolve_target(None, [folder])[0] == 3.5
    assert compare.resolve_target(3.3, [folder])[:2] == (3.3, "--target")
    mixed = tmp_path / "mixed"
    write_logs(mixed, [make_log(target=3.5), make_log(3.27, target=3.4)])
    target, source, warnings = compare.resolve_target(None, [compare.load_folder(mixed)])
    assert (target, source) == (3.28, "default") and "different target_val_loss" in warnings[0]
    public = tmp_path / "public"
    write_logs(public, [make_log(style="public")])
    assert compare.resolve_target(None, [compare.load_folder(public)])[0] == 3.28


# ---------------------------------------------------------------- command line

def test_main_writes_statistics_and_plot(good_runs, baseline_runs, capsys):
    write_logs(good_runs, [make_log(finished=False)])
    logs_before = {p: p.read_bytes() for p in good_runs.glob("*.txt")}
    assert compare.main([str(good_runs), str(baseline_runs)]) == 0

    md = (good_runs / "statistics.md").read_text()
    summary = compare.summarize(runs_with(LOSSES, TIMES), 3.28)
    assert "# Statistics: 2026-01-01_myidea" in md
    assert "| runs used | 6 of 7 | 5 of 5 |" in md
    assert f"| final val loss mean | {summary.loss_mean:.4f} |" in md
    assert f"| p (mean loss < 3.28) | {summary.loss_p:.3g} |" in md
    assert "Speedup (baseline mean time / runs mean time)" in md
    assert "- faster than the baseline: yes" in md
    for path in logs_before:
        assert path.stem in md
    warnings_section = md.split("## Warnings")[1].split("##")[0]
    assert warnings_section.count("\n- ") == 1 and "excluded: unfinished" in warnings_section
    assert "hardware 8x NVIDIA H100 80GB HBM3: 6 runs" in md
    assert "software Python 3.11.7, PyTorch 2.13.0+cu128 (CUDA 12.8), Triton 3.9.0: 6 runs" in md
    assert (good_runs / "val_loss_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (baseline_runs / "statistics.md").exists()
    assert {p: p.read_bytes() for p in good_runs.glob("*.txt")} == logs_before

    out = capsys.readouterr().out
    assert "runs used" in out and "speedup" in out and "warning:" in out


def test_main_single_run_reports_na(tmp_path, capsys):
    folder = tmp_path / "one"
    write_logs(folder, [make_log()])
    assert compare.main([str(folder)]) == 0
    md = (folder / "statistics.md").read_text()
    assert "| final val loss std | n/a |" in md
    assert "| p (mean loss < 3.28) | n/a (a t-test needs at least 2 runs) |" in md
    assert "undetermined (p n/a: a t-test needs at least 2 runs)" in md and "no baseline folder given" in md
    # one run against one: a ratio, and no evidence either way
    write_logs(tmp_path / "other", [make_log(3.279, 100_000)])
    assert compare.main([str(folder), str(tmp_path / "other")]) == 0
    verdict = "faster than the baseline: undetermined (p n/a: a t-test needs at least 2 runs)"
    out = capsys.readouterr().out
    assert f"\n{verdict}\n" in out and " s (Welch p two-sided n/a, p faster n/a)" in out  # no interval either


def test_main_warns_on_hardware_mismatch_with_baseline(good_runs, tmp_path):
    other = tmp_path / "other_machine"
    write_logs(other, [make_log(3.278, 150_000, gpu="NVIDIA H200"), make_log(3.279, 151_000, gpu="NVIDIA H200")])
    assert compare.main([str(good_runs), str(other)]) == 0
    assert "not a same-machine comparison" in (good_runs / "statistics.md").read_text()


def test_baseline_warnings(good_runs, baseline_runs, tmp_path):
    runs = compare.load_folder(good_runs)
    assert compare.baseline_warnings(runs, compare.load_folder(baseline_runs)) == []
    elsewhere = tmp_path / "elsewhere"
    write_logs(elsewhere, [
        make_log(3.278, 150_000, driver="580.159.04", date="Mon Jul 21 09:00:00 2025", python="3.12.3")
        for _ in range(2)
    ])
    found = compare.baseline_warnings(runs, compare.load_folder(elsewhere))
    assert len(found) == 3
    assert "another driver or other GPU bus ids" in found[0] and "probably not the same machine" in found[0]
    assert "software differs between runs (Python 3.11.7" in found[1]
    assert "the baseline ran 8.3 days apart from the runs" in found[2]


def test_the_same_day_check_says_where_it_cannot_be_made(tmp_path):
    """Logs without a date line (CPU logs of train_gpt.py before it wrote one) cannot be checked
    for the same day: the warnings say so, naming the folder, rather than passing in silence."""
    def cpu_runs(name, final_ms, date=None):
        write_logs(tmp_path / name, [make_log(3.278, final_ms + i, cpu="AMD EPYC 7B13 x2") for i in range(2)])
        for log in (tmp_path / name).iterdir() if date else ():   # the line train_gpt.py writes before "CPU: ..."
            log.write_text(log.read_text().replace("CPU: ", f"{date}\nCPU: "))
        return compare.load_folder(tmp_path / name)
    dated = cpu_runs("dated", 150_000, "Fri Nov 27 01:45:26 2026")
    assert [r.started for r in dated.runs] == [datetime(2026, 11, 27, 1, 45, 26)] * 2
    assert compare.baseline_warnings(dated, cpu_runs("undated", 151_000)) == [
        "no start time in the logs of undated (nvidia-smi's date line, which train_gpt.py writes"
        " on every device since 2026-11-27): the same-day check was not made"]
    assert compare.baseline_warnings(dated, cpu_runs("same_day", 151_000, "Fri Nov 27 09:45:26 2026")) == []
    assert "2.0 days apart" in compare.baseline_warnings(dated, cpu_runs("later", 151_000, "Sun Nov 29 01:45:26 2026"))[0]


def test_main_fails_without_usable_runs(tmp_path, capsys):
    folder = tmp_path / "broken"
    write_logs(folder, [make_log(finished=False), make_log(peak=False)])
    assert compare.main([str(folder)]) == 1
    err = capsys.readouterr().err
    assert f"compare.py: error: {folder}: no usable run among 2 log(s)" in err
    assert not (folder / "statistics.md").exists()


def test_a_folder_that_cannot_take_the_results_still_gets_the_figures_printed(good_runs, tmp_path, capsys):
    """The public logs' folders are read-only: the table and warnings come first, then one line
    naming the folder; --out writes the files elsewhere."""
    (good_runs / "statistics.md").mkdir()  # stands in for a folder that refuses the file
    assert compare.main([str(good_runs)]) == 1
    out, err = capsys.readouterr()
    assert "p (mean loss < 3.28)" in out
    assert err == (f"compare.py: error: {good_runs}: cannot write statistics.md and val_loss_vs_time.png "
                   "(Is a directory); --out DIR writes them elsewhere\n")
    refusing = tmp_path / "refusing"  # --out given and refused too: no hint to give --out
    (refusing / "statistics.md").mkdir(parents=True)
    assert compare.main([str(good_runs), "--out", str(refusing)]) == 1
    assert capsys.readouterr().err == (f"compare.py: error: {refusing}: cannot write statistics.md and "
                                       "val_loss_vs_time.png (Is a directory)\n")
    elsewhere = tmp_path / "results" / "new"
    assert compare.main([str(good_runs), "--out", str(elsewhere)]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {elsewhere / 'statistics.md'} and {elsewhere / 'val_loss_vs_time.png'}\n")
    assert "p (mean loss < 3.28)" in (elsewhere / "statistics.md").read_text()
    assert (elsewhere / "val_loss_vs_time.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in good_runs.iterdir() if not p.name.endswith(".txt")) == ["statistics.md"]


def test_an_out_that_is_a_file_is_refused_before_the_table(good_runs, tmp_path, capsys):
    """A file where --out names a folder is a typo, not a folder that refuses the write: one line
    naming --out, before the table is printed, and the file is left as it was."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out, problem in ((afile, "not a folder"), (afile / "sub", f"{afile} is not a folder")):
        with pytest.raises(SystemExit) as exit_:
            compare.main([str(good_runs), "--out", str(out)])
        assert exit_.value.code == 2
        assert capsys.readouterr() == ("", f"compare.py: error: --out={out}: {problem}\n")
    assert afile.read_text() == "mine"
    assert not (good_runs / "statistics.md").exists()


def test_statistics_of_ours_are_replaced_a_file_a_person_wrote_is_kept(good_runs, tmp_path, capsys):
    """statistics.md is compare.py's output, made again from the logs at every run; a file of that
    name without its mark is someone's and stays. An empty --out (an unset variable) is refused
    rather than taken for the current folder."""
    assert compare.main([str(good_runs)]) == 0
    ours = (good_runs / "statistics.md").read_text()
    (good_runs / "statistics.md").write_text(ours.replace("| 6 of 6 |", "| old |"))
    assert compare.main([str(good_runs)]) == 0 and (good_runs / "statistics.md").read_text() == ours
    (good_runs / "statistics.md").write_text("my notes")
    capsys.readouterr()
    assert compare.main([str(good_runs)]) == 1
    assert capsys.readouterr().err == (f"compare.py: error: {good_runs / 'statistics.md'}: exists and was not "
                                       "written by compare.py; move it, or write elsewhere with --out DIR\n")
    assert (good_runs / "statistics.md").read_text() == "my notes"
    with pytest.raises(SystemExit) as exit_:
        compare.main([str(good_runs), "--out", ""])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "compare.py: error: --out='': an empty path (an unset variable?); name a folder\n"


def test_main_fails_on_missing_baseline_and_self_comparison(good_runs, tmp_path, capsys):
    assert compare.main([str(good_runs), str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.strip() == f"compare.py: error: {tmp_path / 'nope'}: no such folder"
    assert compare.main([str(good_runs), str(good_runs)]) == 1
    assert "the baseline is the runs folder itself" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs the git checkout")
def test_what_compare_writes_beside_ignored_logs_is_ignored_too():
    """Logs are git-ignored so that local experiments do not pile up (a submission adds its files
    with git add -f); the statistics.md and plot made from them would otherwise leave each local
    run folder untracked in git status. Committed files (the GPU proofs, the A/B reports) stay
    outside the patterns."""
    def ignored(paths):
        done = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], input="\n".join(paths),
                              capture_output=True, text=True, cwd=REPO)
        return done.stdout.split()
    generated = [f"records/2026-01-01_myidea/{name}" for name in
                 ("statistics.md", "val_loss_vs_time.png", "0f6c2b1e-7a3d-4c55-9b1a-2d8e4f0a9c31.txt")]
    assert ignored(generated) == generated
    assert ignored(["records/2026-01-01_myidea/README.md", "records/compare.py", "records/README.md"]) == []
    committed = subprocess.run(["git", "ls-files", "records"], capture_output=True, text=True, cwd=REPO).stdout.split()
    assert committed and ignored(committed) == []


def test_cli_subprocess(good_runs, tmp_path):
    script = REPO / "records" / "compare.py"
    ok = subprocess.run([sys.executable, str(script), str(good_runs), "--target", "3.3"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "p (mean loss < 3.3)" in ok.stdout
    assert "Target: 3.3 (--target)" in (good_runs / "statistics.md").read_text()
    nan = subprocess.run([sys.executable, str(script), str(good_runs), "--target", "nan"], capture_output=True,
                         text=True, timeout=120)
    assert (nan.returncode, nan.stderr) == (2, "compare.py: error: --target=nan: expected a finite loss\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    failed = subprocess.run([sys.executable, str(script), str(empty)], capture_output=True, text=True, timeout=120)
    assert failed.returncode != 0
    assert failed.stderr.strip() == f"compare.py: error: {empty}: no *.txt run logs in this folder"


# ---------------------------------------------------------------- real public logs

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if not REFERENCE_LOGS.is_dir():
        pytest.skip(f"{REFERENCE_LOGS} not present (only in the project's shared workspace)")
    copy = tmp_path_factory.mktemp("reference_logs")
    for folder in REFERENCE_LOGS.iterdir():
        if folder.is_dir():
            shutil.copytree(folder, copy / folder.name)
    return copy


def test_reference_bos_align(reference):
    folder = compare.load_folder(reference / "2025-07-12_BosAlign")
    assert len(folder.usable) == len(folder.runs) == 21
    summary = compare.summarize(folder.usable, 3.28)
    assert round(summary.loss_mean, 4) == 3.2790
    assert summary.loss_p < 0.01
    assert folder.total_steps == 1750 and folder.hardware == f"8x {H100}"
    # checked by hand in the log: the one run with newer software, kept
    odd = next(r for r in folder.runs if r.run_id.startswith("c1fd8a38"))
    assert (odd.final_val_loss, odd.train_time_ms, odd.python_version) == (3.2771, 171_743, "3.12.7")
    [warning] = folder.warnings
    assert warning.startswith("2025-07-12_BosAlign/c1fd8a38") and warning.endswith("kept")


def test_reference_fp8_pr_against_baseline(reference, capsys):
    pr_dir = reference / "2026-07-17_FP8DownProjection_this_pr"
    base_dir = reference / "2026-07-17_FP8DownProjection_baseline"
    pr, base = compare.load_folder(pr_dir), compare.load_folder(base_dir)
    assert len(pr.usable) == len(base.usable) == 13 and not pr.warnings and not base.warnings
    assert pr.total_steps == base.total_steps == 1390
    assert pr.hardware == base.hardware == f"8x {H100}"
    first = next(r for r in pr.runs if r.run_id.startswith("11cb620c"))
    assert (first.final_val_loss, first.train_time_ms, first.triton_version) == (3.2775, 79_532, "3.6.0")
    assert (first.peak_mem_allocated_mib, first.peak_mem_reserved_mib) == (30220, 38672)
    assert len(first.val_curve) == 7  # steps 0, 250, ..., 1250, 1390
    pr_summary, base_summary = compare.summarize(pr.usable, 3.28), compare.summarize(base.usable, 3.28)
    assert pr_summary.time_mean_ms == pytest.approx(79_684.92, abs=0.01)
    assert base_summary.time_mean_ms == pytest.approx(80_728.62, abs=0.01)
    assert pr_summary.loss_p < 0.01 and base_summary.loss_p < 0.01
    result = compare.compare(pr.usable, base.usable)
    assert result.speedup == pytest.approx(1.0131, abs=1e-4)
    assert result.time_p_faster < 1e-6  # about 1 s faster with ~0.2 s spread
    assert result.loss_p_two_sided > 0.5  # same loss within noise
    # the 95% interval of the time difference: Welch's, by hand; wholly below 0 (faster)
    a, b = (np.array([r.train_time_ms for r in f.usable]) for f in (pr, base))
    var_a, var_b = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    dof = (var_a + var_b) ** 2 / (var_a ** 2 / (len(a) - 1) + var_b ** 2 / (len(b) - 1))
    half = stats.t.ppf(0.975, dof) * np.sqrt(var_a + var_b)
    assert result.time_diff_interval_ms == pytest.approx((result.time_diff_ms - half, result.time_diff_ms + half))
    assert result.time_diff_interval_ms[1] < 0 < result.loss_diff_interval[1] and result.loss_diff_interval[0] < 0

    assert compare.baseline_warnings(pr, base) == []
    # the 2025 record as "baseline": same GPU model, but another machine, year and software
    older = compare.baseline_warnings(pr, compare.load_folder(reference / "2025-07-12_BosAlign"))
    assert ["probably not the same machine" in older[0], "software differs" in older[1]] == [True, True]
    assert older[2].startswith("step count differs between runs (1390) and baseline (1750)")
    assert "369.5 days apart" in older[3] and len(older) == 4

    assert compare.main([str(pr_dir), str(base_dir)]) == 0
    md = (pr_dir / "statistics.md").read_text()
    assert "| runs used | 13 of 13 | 13 of 13 |" in md and "1.0131x" in md
    assert f"time diff {result.time_diff_ms / 1000:+.3f} s (95% interval " in capsys.readouterr().out
    low, high = (x / 1000 for x in result.time_diff_interval_ms)
    assert f"| train time (s) | {result.time_diff_ms / 1000:+.3f} | {low:+.3f} .. {high:+.3f} |" in md


# ------------------------------------------------- runs that ended early, mixed configurations

PEAK_LINE = "peak memory allocated: 33278 MiB reserved: 48994 MiB\n"


@pytest.mark.parametrize("ending, problem", [
    ("interrupted at step 19/20 (SIGINT)", "interrupted at step 19/20 (SIGINT)"),
    ("interrupted at step 10/20 (SIGTERM)", "interrupted at step 10/20 (SIGTERM)"),
    ("interrupted at step 11/20 (SIGINT twice: stopped mid-step)", "interrupted at step 11/20 (SIGINT twice: "
     "stopped mid-step)"),
    ("interrupted at step 11/20 (SIGINT then SIGTERM: stopped mid-step)", "interrupted at step 11/20 (SIGINT then "
     "SIGTERM: stopped mid-step)"),
    ("diverged at step 13/20: train loss is nan (stopped at step 19)",
     "diverged at step 13/20: train loss is nan (stopped at step 19)"),
    ("stopping early at step 19/20: training data ran out after 7 windows", "stopping early at step 19/20"),
    ("failed at step 19/20: RuntimeError: CUDA error: an illegal memory access was encountered",
     "failed at step 19/20: RuntimeError: CUDA error: an illegal memory access was encountered"),
    ("rank 0: failed at step 19/20: DistBackendError: NCCL communicator was aborted",
     "rank 0: failed at step 19/20: DistBackendError: NCCL communicator was aborted"),
])
def test_runs_that_ended_early_are_named_as_such(tmp_path, ending, problem):
    """The trainer's own last lines (train_gpt.py) say why a run stopped; the exclusion says it too."""
    text = make_log(finished=False) + ending + "\n" + PEAK_LINE
    run = compare.parse_log_text(text)
    assert run.problems == [problem]
    folder = tmp_path / "runs"
    [path] = write_logs(folder, [text])
    write_logs(folder, [make_log(3.2771), make_log(3.2781)])
    [warning] = compare.load_folder(folder).warnings
    assert warning.startswith(f"runs/{path.name}: excluded: {problem}")


TRACEBACK = """Traceback (most recent call last):
  File "train_gpt.py", line 2491, in train
    val_loss = validate(step)
RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB
"""


def before_first_step(text: str) -> str:
    """A log cut where the trainer writes its first step line: header and set-up output only."""
    return text[: text.index("\nstep:", text.rindex(SEP)) + 1]


@pytest.mark.parametrize("ending", [
    "interrupted at step 0/20 (SIGINT)",  # Ctrl-C during compilation or warmup (train_gpt.py main())
    "interrupted at step 0/20 (SIGTERM)",
    TRACEBACK + "failed at step 0/20: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
    TRACEBACK + "rank 0: failed at step 0/20: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
], ids=["sigint-in-warmup", "sigterm-in-warmup", "crash-in-first-validation", "crash-on-rank-0"])
def test_runs_that_ended_before_their_first_step_are_named_as_such(tmp_path, ending):
    """Stopped before its first step line (a signal during compilation or warmup, or at the check
    before the first validation; a crash in that validation), the trainer still ends the log with
    its line saying why (tests/test_failures.py checks those lines): that line is the exclusion,
    not "no step lines"."""
    text = before_first_step(make_log()) + "Compiling model and warming up kernels\n" + ending + "\n" + PEAK_LINE
    assert "step:" not in text.split(SEP)[-1]
    assert compare.parse_log_text(text).problems == [ending.splitlines()[-1]]
    folder = tmp_path / "runs"
    [path] = write_logs(folder, [text])
    write_logs(folder, [make_log(3.2771), make_log(3.2781)])
    [warning] = compare.load_folder(folder).warnings
    assert warning == f"runs/{path.name}: excluded: {ending.splitlines()[-1]}"


def test_an_unknown_last_line_before_peak_memory_is_quoted():
    """A bad shard mid-run ends the log with the DataError's own line (a file name and what is wrong)
    and then 'peak memory': the exclusion quotes it rather than only saying "unfinished"."""
    error = "data/fineweb_train_000003.bin: truncated: read 10 of 100000000 tokens"
    text = make_log(finished=False) + error + "\n" + PEAK_LINE
    assert compare.parse_log_text(text).problems == [
        f"unfinished: no validation line at step 20/20 (last step logged: 19); the run ended with: {error}"]
    early = before_first_step(make_log()) + error + "\n" + PEAK_LINE
    assert compare.parse_log_text(early).problems == [
        f"no step lines after the last separator; the run ended with: {error}"]
    # killed without its last lines: nothing to quote
    assert compare.parse_log_text(make_log(finished=False)).problems == [
        "unfinished: no validation line at step 20/20 (last step logged: 19)"]
    assert compare.parse_log_text(before_first_step(make_log())).problems == [
        "no step lines after the last separator (run never started, or log truncated)"]


def test_a_diverged_final_validation_is_named(tmp_path):
    text = make_log().replace("val_loss:3.2790", "val_loss:nan").replace(
        PEAK_LINE, "diverged at step 20/20: val_loss is nan\n" + PEAK_LINE)
    assert compare.parse_log_text(text).problems == ["diverged at step 20/20: val_loss is nan"]


def with_settings(text: str, **settings) -> str:
    """A project-format log whose header states extra key=value settings (or other values)."""
    for key, value in settings.items():
        if f"\n{key}=" in text:
            text = re.sub(rf"\n{key}=[^\n]*", f"\n{key}={value}", text)
        else:
            text = text.replace("\npreset=speedrun\n", f"\npreset=speedrun\n{key}={value}\n")
    return text


def test_mixed_configurations_in_a_folder_are_warned_about(tmp_path):
    folder = tmp_path / "runs"
    write_logs(folder, [with_settings(make_log(3.2771), muon_lr=0.05, seed=0),
                        with_settings(make_log(3.2781), muon_lr=0.05, seed=1, run_name="other"),
                        with_settings(make_log(3.2791), muon_lr=0.04, seed=2, log_dir="/elsewhere")])
    result = compare.load_folder(folder)
    assert len(result.usable) == 3  # kept: the warning says what differs
    [warning] = [w for w in result.warnings if "configuration" in w]
    assert "muon_lr (0.05: 2 runs, 0.04: 1 run)" in warning
    for ignored in ("seed", "run_name", "log_dir"):
        assert ignored not in warning.split("configuration:")[1]


def test_values_derived_from_the_configuration_are_no_difference_of_their_own(tmp_path):
    """The trainer's header ends with what it computed from the settings (parameters, optimizer
    state, accumulation steps): a changed setting changes them too, but only the setting is listed."""
    derived = dict(parameters=123_456_789, optimizer_state_bytes_per_rank=1_000, grad_accum_steps=1)
    folder = tmp_path / "runs"
    write_logs(folder, [with_settings(make_log(3.2771), normuon=False, **derived),
                        with_settings(make_log(3.2781), normuon=False, **derived),
                        with_settings(make_log(3.2791), normuon=True, **dict(
                            derived, optimizer_state_bytes_per_rank=2_000, grad_accum_steps=2, parameters=1))])
    [warning] = [w for w in compare.load_folder(folder).warnings if "configuration" in w]
    assert warning == ("runs: the runs differ in configuration: normuon (False: 2 runs, True: 1 run); kept, but "
                       "their statistics mix configurations")
    runs_dir, base_dir = tmp_path / "same", tmp_path / "base"
    write_logs(runs_dir, [with_settings(make_log(l, t), num_layers=11, seed=i, **derived)
                          for i, (l, t) in enumerate(zip(LOSSES, TIMES))])
    write_logs(base_dir, [with_settings(make_log(l, t, run_name="baseline"), num_layers=12,
                                        **dict(derived, parameters=130_000_000, optimizer_state_bytes_per_rank=1_100))
                          for l, t in zip(BASE_LOSSES, BASE_TIMES)])
    found = compare.baseline_warnings(compare.load_folder(runs_dir), compare.load_folder(base_dir))
    [warning] = [w for w in found if "configuration" in w]
    assert warning.startswith("configuration differs between runs and baseline: num_layers (11 vs 12); ")


def test_same_configuration_gives_no_warning(tmp_path):
    folder = tmp_path / "runs"
    write_logs(folder, [with_settings(make_log(l), muon_lr=0.05, seed=i, train_files=f"/data{i}/x.bin")
                        for i, l in enumerate(LOSSES[:3])])
    assert compare.load_folder(folder).warnings == []
    # checkpoints are written with the clock stopped: saving them is no other configuration
    write_logs(tmp_path / "saved", [with_settings(make_log(l), seed=i, save_checkpoint=i == 0,
                                                  checkpoint_every=40 * (i == 0), dist_timeout_s=900 + i)
                                    for i, l in enumerate(LOSSES[:3])])
    assert compare.load_folder(tmp_path / "saved").warnings == []


def test_configuration_differing_from_the_baseline_is_listed(tmp_path):
    runs_dir, base_dir = tmp_path / "runs", tmp_path / "base"
    write_logs(runs_dir, [with_settings(make_log(l, t), muon_lr=0.04, num_layers=11, seed=i)
                          for i, (l, t) in enumerate(zip(LOSSES, TIMES))])
    write_logs(base_dir, [with_settings(make_log(l, t, run_name="baseline"), muon_lr=0.05, num_layers=12)
                          for l, t in zip(BASE_LOSSES, BASE_TIMES)])
    found = compare.baseline_warnings(compare.load_folder(runs_dir), compare.load_folder(base_dir))
    [warning] = [w for w in found if "configuration" in w]
    assert "muon_lr (0.04 vs 0.05), num_layers (11 vs 12)" in warning
    assert "seed" not in warning and "run_name" not in warning


# ------------------------------------------------- a baseline of other work

def test_a_baseline_of_another_step_count_gives_a_time_ratio_not_a_speedup(tmp_path, capsys):
    """A 120-step CPU run against a 1695-step H100 record is no speedup of 1.2x: other step counts
    (or targets) are warned about, and the time ratio is not called a speedup."""
    runs_dir, base_dir = tmp_path / "runs", tmp_path / "base"
    write_logs(runs_dir, [make_log(l, t, steps=20) for l, t in zip(LOSSES, TIMES)])
    write_logs(base_dir, [make_log(l, t, steps=24, run_name="baseline") for l, t in zip(BASE_LOSSES, BASE_TIMES)])
    assert compare.main([str(runs_dir), str(base_dir)]) == 0
    out = capsys.readouterr().out
    ratio = np.mean(BASE_TIMES) / np.mean(TIMES)
    assert f"time ratio {ratio:.4f}x (not a speedup at equal work: runs 20 steps, baseline 24); time diff" in out
    assert not re.search(r"^speedup|\bspeedup \d", out, re.M)
    assert ("warning: step count differs between runs (20) and baseline (24): the times are of different"
            " amounts of training") in out
    md = (runs_dir / "statistics.md").read_text()
    assert (f"Time ratio (baseline mean time / runs mean time): {ratio:.4f}x; not a speedup at equal work"
            " (runs 20 steps, baseline 24)") in md and "Speedup" not in md
    assert "- faster than the baseline: yes (p = " in md
    assert "but with other step counts (runs 20 steps, baseline 24) that counts only if both reach the target" in md
    assert "- step count differs between runs (20) and baseline (24)" in md


def test_a_baseline_of_the_same_step_count_keeps_the_speedup(good_runs, baseline_runs, capsys):
    assert compare.main([str(good_runs), str(baseline_runs)]) == 0
    out = capsys.readouterr().out
    assert f"speedup {np.mean(BASE_TIMES) / np.mean(TIMES):.4f}x; time diff" in out
    assert "\nfaster than the baseline: yes (p = " in out  # the headline's ratio comes with its verdict
    assert "time ratio" not in out and "step count differs" not in out and "target_val_loss differs" not in out
    md = (good_runs / "statistics.md").read_text()
    assert "Speedup (baseline mean time / runs mean time)" in md and "other step counts" not in md


def test_a_baseline_with_another_target_is_warned_about(tmp_path):
    runs_dir, base_dir, public_dir = tmp_path / "runs", tmp_path / "base", tmp_path / "public"
    write_logs(runs_dir, [make_log(l, t, target=6.0) for l, t in zip(LOSSES, TIMES)])
    write_logs(base_dir, [make_log(l, t, target=3.28) for l, t in zip(BASE_LOSSES, BASE_TIMES)])
    write_logs(public_dir, [make_log(l, t, style="public") for l, t in zip(BASE_LOSSES, BASE_TIMES)])
    runs = compare.load_folder(runs_dir)
    [warning] = [w for w in compare.baseline_warnings(runs, compare.load_folder(base_dir)) if w.startswith("target_val_loss differs")]
    assert warning == "target_val_loss differs between runs (6) and baseline (3.28): they are not trained to the same loss"
    [warning] = [w for w in compare.baseline_warnings(runs, compare.load_folder(public_dir)) if w.startswith("target_val_loss differs")]
    assert "baseline (3.28, the default: not stated)" in warning
    # the public logs state no target: the record's 3.28 is no difference
    same = tmp_path / "same"
    write_logs(same, [make_log(l, t) for l, t in zip(LOSSES, TIMES)])
    assert not [w for w in compare.baseline_warnings(compare.load_folder(same), compare.load_folder(public_dir))
                if w.startswith("target_val_loss differs")]


def test_a_run_in_both_folders_is_warned_about(good_runs, baseline_runs):
    """A log copied into the baseline folder too (or the runs' logs used as a baseline) makes the
    comparison partly a run against itself."""
    copied = sorted(good_runs.glob("*.txt"))[0]
    shutil.copy(copied, baseline_runs / "copy.txt")
    found = compare.baseline_warnings(compare.load_folder(good_runs), compare.load_folder(baseline_runs))
    assert found == [f"1 run in both folders (identical training output, e.g. 2026-01-01_myidea/{copied.name}"
                     " and 2026-01-01_baseline/copy.txt); the comparison is not between independent runs"]


def test_runs_of_different_code_versions_are_warned_about(tmp_path):
    """A run made after an edit to the training script is pooled with the others: say so."""
    folder = tmp_path / "runs"
    edited = FAKE_SOURCE.replace("import os", "import os  # bound factor 0.4")
    write_logs(folder, [make_log(l) for l in LOSSES[:3]] + [make_log(LOSSES[3], source=edited)])
    result = compare.load_folder(folder)
    assert len(result.usable) == 4
    [warning] = result.warnings
    [odd] = [p.name for p in folder.glob("*.txt") if "bound factor 0.4" in p.read_text()]
    assert "2 different versions of the training script" in warning and "(the source each log starts with: " \
        f"3 runs; 1 run: {odd})" in warning  # which log to diff
    # a log whose source was stripped (the public ones) is not compared with those that hold it
    stripped = make_log(LOSSES[4], source="(source code of the training script omitted from this copy)")
    write_logs(tmp_path / "mixed", [make_log(l) for l in LOSSES[:2]] + [stripped])
    assert compare.load_folder(tmp_path / "mixed").warnings == []


def test_repeats_of_one_deterministic_run_are_warned_about(tmp_path):
    """CPU runs of one seed are identical: their std of 0 is not a measurement of the spread."""
    folder = tmp_path / "runs"
    write_logs(folder, [make_log(3.2771, final_ms=t) for t in TIMES[:3]])  # the times differ, the losses not
    [warning] = compare.load_folder(folder).warnings
    assert "all 3 runs have the same validation losses" in warning and "vary --seed" in warning
    # with step 0 and the final validation only, equal losses may be chance: no warning
    write_logs(tmp_path / "final_only", [make_log(3.2771, final_ms=t, steps=1) for t in TIMES[:3]])
    assert compare.load_folder(tmp_path / "final_only").warnings == []


def test_a_run_resumed_from_another_runs_checkpoint_is_not_a_second_run(tmp_path):
    """--resume records/<date>_x/<run_id>.pt continues run_id's run: with both logs in the folder,
    its steps after the checkpoint would count twice. Alone, it is kept with a warning."""
    folder = tmp_path / "runs"
    [original] = write_logs(folder, [with_settings(make_log(LOSSES[0]), seed=0)])
    resumed_text = with_settings(make_log(LOSSES[0] + 0.0002), seed=0, resume=f"records/x/{original.stem}.pt")
    [resumed] = write_logs(folder, [resumed_text])
    write_logs(folder, [with_settings(make_log(loss), seed=i) for i, loss in enumerate(LOSSES[1:3], 1)])
    loaded = compare.load_folder(folder)
    assert resumed.name not in {r.name for r in loaded.usable} and len(loaded.usable) == 3
    assert loaded.warnings == [f"runs/{resumed.name}: excluded: duplicate: resumes {original.name} from its checkpoint"]
    original.unlink()
    loaded = compare.load_folder(folder)
    assert len(loaded.usable) == 3 and loaded.warnings == [
        f"runs/{resumed.name}: resumed from records/x/{original.stem}.pt; kept, but its set-up and warmup ran twice: "
        "not a record run"]


def test_runs_of_one_seed_are_warned_about(tmp_path):
    """The record seeds nothing, so its runs start from different weights; ours from --seed's."""
    write_logs(tmp_path / "one_seed", [with_settings(make_log(loss), seed=0) for loss in LOSSES[:3]])
    [warning] = compare.load_folder(tmp_path / "one_seed").warnings
    assert warning.startswith("one_seed: all 3 runs used seed 0: they start from the same weights") and \
        warning.endswith("vary --seed")
    write_logs(tmp_path / "seeds", [with_settings(make_log(loss), seed=i) for i, loss in enumerate(LOSSES[:3])])
    assert compare.load_folder(tmp_path / "seeds").warnings == []


def test_the_plot_shows_every_validation_after_step_0():
    """CPU runs end near 5.7: a top fixed near the final loss showed only the last point."""
    run = compare.parse_log_text(make_log(5.68, steps=120))
    bottom, top = compare.loss_axis_limits([run], 6.0)
    later = [loss for step, _, loss in run.val_curve if step > 0]
    assert max(later) > 8 and bottom < min(later) and max(later) < top < 10.8
    # runs that reach the target region are seen from 4.0 down, as the speedrun's always were
    speedrun = compare.parse_log_text(make_log(3.2790))
    assert max(loss for step, _, loss in speedrun.val_curve if step > 0) > 5
    bottom, top = compare.loss_axis_limits([speedrun], 3.28)
    assert bottom < 3.2790 and 4.0 < top < 4.05


def test_settings_only_some_logs_record_are_a_version_difference_not_a_configuration_one(tmp_path):
    """A setting added to the header since some logs were written (as effective_threads was) is
    reported as such, not as a changed knob with an "(absent)" value."""
    folder = tmp_path / "mixed"
    write_logs(folder, [with_settings(make_log(3.2771), seed=0, effective_threads=2),
                        with_settings(make_log(3.2781), seed=1, effective_threads=2),
                        with_settings(make_log(3.2791), seed=2)])
    warnings = compare.load_folder(folder).warnings
    assert not [w for w in warnings if "configuration" in w]
    [warning] = [w for w in warnings if "effective_threads" in w]
    assert warning.startswith("mixed: settings only some of the logs record: effective_threads (2 of 3); ")
    # the logs that record a setting still disagree where they do: that is a configuration difference
    write_logs(tmp_path / "disagree", [with_settings(make_log(3.2771), seed=0, muon_update_scale="2025"),
                                       with_settings(make_log(3.2781), seed=1, muon_update_scale="moonlight"),
                                       with_settings(make_log(3.2791), seed=2)])
    [warning] = compare.load_folder(tmp_path / "disagree").warnings
    assert warning.startswith("disagree: the runs differ in configuration: muon_update_scale "
                              "(2025: 1 run, moonlight: 1 run; 1 without it); ")
    runs_dir, base_dir = tmp_path / "runs", tmp_path / "base"
    write_logs(runs_dir, [with_settings(make_log(l, t), seed=i, effective_threads=2, muon_lr=0.04)
                          for i, (l, t) in enumerate(zip(LOSSES, TIMES))])
    write_logs(base_dir, [with_settings(make_log(l, t, run_name="baseline"), seed=i, muon_lr=0.05, old_knob=1)
                          for i, (l, t) in enumerate(zip(BASE_LOSSES, BASE_TIMES))])
    found = compare.baseline_warnings(compare.load_folder(runs_dir), compare.load_folder(base_dir))
    [configuration] = [w for w in found if "configuration" in w]
    assert configuration.startswith("configuration differs between runs and baseline: muon_lr (0.04 vs 0.05); ")
    [versions] = [w for w in found if "effective_threads" in w]
    assert versions.startswith("only the runs' logs record effective_threads; only the baseline's record old_knob: ")
    assert "(absent)" not in " ".join(found + warnings)
