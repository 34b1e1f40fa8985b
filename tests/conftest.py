"""Shared test set-up: import paths, the Triton interpreter on CPU, small synthetic shards."""

import os
import re
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "data", ROOT / "records"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# The suite runs on the CPU on every machine, GPUs or not, so that it gives the same results
# everywhere: GPUs are hidden before torch can see them, and Triton kernels run in its
# interpreter, which must be chosen before any kernel is defined, i.e. before train_gpt is
# imported. The GPU paths (compiled kernels in bf16, FlexAttention, FP8, compile) are checked
# by bench/gpu_proof.py. Subprocesses (train_gpt.py, run.sh) inherit both.
os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["HIP_VISIBLE_DEVICES"] = ""   # NVIDIA, AMD
os.environ["TRITON_INTERPRET"] = "1"
# No test may wait on the Hugging Face hub (the downloader's tests use a local fake hub).
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest -n W (pytest-xdist) each worker, and every process it starts, keeps to its own share of
# the CPUs (torch's threads then match it: more threads than cores make its OpenMP regions wait).
if "PYTEST_XDIST_WORKER" in os.environ and "TESTS_CPUS_PINNED" not in os.environ and hasattr(os, "sched_setaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    _workers, _index = int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), int(os.environ["PYTEST_XDIST_WORKER"][2:])
    if _workers <= len(_cpus):
        os.sched_setaffinity(0, _cpus[_index::_workers])
    os.environ["TESTS_CPUS_PINNED"] = "1"  # a process the worker starts imports this again: its share stays
torch.set_num_threads(min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))

from shards import BOS, write_shard  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a fresh process, a launcher or a long run; "
                                       "`-m \"not slow\"` is the fast tier (README, Test)")
    # torch's own import of inductor (torch.utils.mkldnn) uses torch.jit.script_method: not ours to fix
    config.addinivalue_line("filterwarnings",
                            "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def effective_block_mask(block_mask, T):
    """What FlexAttention's fused GPU kernel computes from a BlockMask over T queries and keys (its
    eager form on CPU ignores the block lists): each query block visits the first kv_num_blocks of
    its kv_indices, where mask_mod decides, and the first full_kv_num_blocks of its
    full_kv_indices, whose keys it takes whole; every other block is skipped (a count below zero
    visits none)."""
    block_size = block_mask.BLOCK_SIZE[0]
    allowed = torch.zeros(T, T, dtype=torch.bool)
    pos = torch.arange(T)
    mask_mod = block_mask.mask_mod(0, 0, pos[:, None], pos[None, :])
    kinds = ((block_mask.kv_num_blocks, block_mask.kv_indices, "partial"),
             (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, "full"))
    for counts, indices, kind in kinds:
        for qb in range(T // block_size):
            for j in range(int(counts[0, 0, qb])):
                kb = int(indices[0, 0, qb, j])
                rows, cols = slice(qb * block_size, (qb + 1) * block_size), slice(kb * block_size, (kb + 1) * block_size)
                allowed[rows, cols] = True if kind == "full" else mask_mod[rows, cols]
    return allowed


def synthetic_documents(rng, total_tokens, min_len=5, max_len=300, vocab=50000):
    """A token stream of BOS-prefixed documents with Zipf-like token frequencies."""
    out = []
    while len(out) < total_tokens:
        length = int(rng.integers(min_len, max_len))
        out.append(BOS)
        out.extend(np.minimum(rng.zipf(1.2, length), vocab - 1).tolist())
    return np.array(out[:total_tokens], dtype=np.int64)


@pytest.fixture
def make_shards(tmp_path):
    """make_shards(train_sizes=[...], val_size=N, seed=0) -> (train_glob, val_glob, streams)."""
    def make(train_sizes=(40_000,), val_size=20_000, seed=0, prefix="syn", max_len=300):
        rng = np.random.default_rng(seed)
        folder = tmp_path / f"{prefix}_data"
        folder.mkdir(exist_ok=True)
        val = synthetic_documents(rng, val_size, max_len=max_len)
        write_shard(folder / f"{prefix}_val_000000.bin", val)
        trains = []
        for i, size in enumerate(train_sizes, start=1):
            tokens = synthetic_documents(rng, size, max_len=max_len)
            write_shard(folder / f"{prefix}_train_{i:06d}.bin", tokens)
            trains.append(tokens)
        return str(folder / f"{prefix}_train_*.bin"), str(folder / f"{prefix}_val_*.bin"), (trains, val)
    return make


# A model small enough for a CPU test, with every architectural feature switched on: the speedrun
# preset's (the 2026-01-19 record's) at 4 blocks of width 32, one training sequence length.
TINY = dict(
    preset="cpu", num_layers=4, model_dim=32, num_heads=2, head_dim=16, train_seq_len=128, val_seq_len=128,
    train_seq_len_schedule="", train_max_doc_len=64, attn_block_size=32, window_pattern="SSSL",
    window_schedule="1,2,3", window_final_blocks=3, window_validate_final_blocks=4, attention_free_layers="2",
    num_value_embeds=1, value_embed_layers="0..0", paired_head_layers="0", skip_layers="0,3", backout_layer=1,
    bigram_vocab_size=300, val_tokens=512, micro_batches=1, num_iterations=4, extension_steps=1,
    muon_momentum_cooldown_steps=1, val_every=2, warmup_steps=0, compile=False, compile_adam=False, fp8_head=False,
)


# A run's last console line: how it ended, and where its log is.
SUMMARY = re.compile(r"(val_loss \d+\.\d{4} (reached|missed) the target \S+|stopped at step \d+/\d+: target \S+ not reached"
                     r"( \(last val_loss \S+ at step \d+\))?)(; train time \d+\.\d s)?; log /\S+\.txt")


def before_summary(out):
    """The console's lines before its last, which says how the run ended (checked here)."""
    *lines, last = out.strip().splitlines()
    assert SUMMARY.fullmatch(last), last
    return lines


def tiny_argv(**overrides):
    values = dict(TINY, **overrides)
    return [f"--{k}={v}" for k, v in values.items()]


def perturbed_tiny_model(scale=0.02, **overrides):
    """(args, hw, model) for TINY with overrides, every parameter nudged off its initial value
    (zero-initialized projections and head would otherwise block most gradients)."""
    import train_gpt
    from harness import config as cfg
    args = train_gpt.Hyperparameters(**dict(TINY, **overrides))
    cfg.check_config(args, 1, False)
    hw = train_gpt.Hardware.detect(args)
    torch.manual_seed(0)
    model = train_gpt.GPT(args, hw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return args, hw, model


def processes_naming(text):
    """{pid: command line} of the live processes whose command line holds text (zombies have an
    empty one): what a script left running."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found[int(pid)] = cmdline
    return found


def sigint_as_at_a_terminal():
    """preexec_fn: Ctrl-C's default for the child, which inherits SIG_IGN where the tests were
    started in the background (Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_when_training(proc, marker, signum):
    """Wait (60 s at most) until a train_gpt.py process whose command line holds marker runs, send
    signum to proc alone and wait for proc to end; then kill whatever it left behind. Returns
    (stdout, stderr, seconds proc took to end, command lines running when signalled, pids left)."""
    try:
        deadline = time.time() + 60
        while not any("train_gpt.py" in c for c in processes_naming(marker).values()) and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        running = list(processes_naming(marker).values())
        assert any("train_gpt.py" in c for c in running), "no trainer started"
        proc.send_signal(signum)
        sent = time.time()
        stdout, stderr = proc.communicate(timeout=30)
        ended_in = time.time() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
        deadline = time.time() + 5
        while processes_naming(marker) and time.time() < deadline:
            time.sleep(0.1)
        left = processes_naming(marker)
        for pid in left:   # not to outlive a failed test
            os.kill(pid, signal.SIGKILL)
    return stdout, stderr, ended_in, running, left
