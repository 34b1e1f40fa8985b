"""train_gpt.py: train a GPT-2-small-class model on FineWeb as fast as possible; run it with ./run.sh.

Sections follow the data: 1 configuration, 2 hardware and ranks, 3 collectives, 4 orthogonalization
(Triton kernels, torch twin), 5 optimizers, 6 model, 7 data, 8 training and its log, 9 launch.
harness/ beside it holds what a forker does not edit (option checks and --help, signals and failure
reports, checkpoints, sampling), loaded only when used; a copy of this file alone still trains."""

import signal

if __name__ == "__main__":  # Ctrl-C while torch loads ends the program quietly, as any command
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import contextlib
import ctypes
import dataclasses
import datetime
import functools
import gc
import glob
import importlib
import math
import os
import platform
import resource
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:  # Triton is optional: without it the PyTorch orthogonalizer serves everywhere.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = tl = None
TRITON_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # read by Triton at import: kernels run on CPU

BOS_TOKEN = 50256  # GPT-2's <|endoftext|>; every document in a shard starts with it


# -----------------------------------------------------------------------------------------------
# 1. Configuration
#
# Defaults are the 8xH100 speedrun: the public record of 2026-01-19 ("Bigram Hash Embedding", 1600
# steps, val loss 3.2776 over 6 runs in 98.4 s), its model, data order, schedules and optimizer
# formulas. Our own ideas are flags that are off; so are the older records' ways, where an option
# still has them (marked 2025: the record of 2025-08-23). Where the record's way needs what is not
# shipped here (FlashAttention-3 from the hub, Hopper's TMA kernel), ours is the default and the
# alternatives are flags (README: departures). Each field's comment is its --help text.

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
    train_seq_len: int = 48 * 1024      # tokens per rank per micro-batch (after train_seq_len_schedule: the extension's)
    train_seq_len_schedule: str = "16384,32768,49152"  # train_seq_len per equal part of the scheduled steps ("": fixed)
    train_max_doc_len: int = 2048       # micro-batches pack documents cut at this length; 0: windows from a BOS (2025)
    val_seq_len: int = 4 * 64 * 1024    # tokens per rank per validation step
    micro_batches: int = 8              # micro-batches per step over all ranks; world size must divide it
    # model
    vocab_size: int = 50304             # 50257 padded to a multiple of 128
    num_layers: int = 11                # transformer blocks
    model_dim: int = 768                # residual stream width
    num_heads: int = 6                  # attention heads per block
    head_dim: int = 128                 # num_heads x head_dim must equal model_dim
    mlp_ratio: int = 4                  # MLP hidden width = mlp_ratio x model_dim
    attention_free_layers: str = "6"    # comma-separated block indices that have only an MLP
    num_value_embeds: int = 3           # value embeddings (without value_embed_layers: into blocks 0..N-1 and the last N)
    value_embed_layers: str = "12......012"  # per block, its value embedding's index or "." for none
    bigram_vocab_size: int = 5 * 50304  # rows of the hashed embedding of each (previous, own) token pair, added at
                                        # every block (0: none)
    smear: bool = True                  # each token's embedding takes a gated share of the one before
    skip_layers: str = "3,6"            # FROM,TO: block FROM's output joins block TO's input by a gate ("": U-net, 2025)
    backout_layer: int = 7              # a learned share of this block's output is taken from the last (-1: none)
    resid_lambda_init: float = 1.1      # each block's input is a*x + b*x0 + c*bigram, a starting here
    init: str = "2026"                  # q,k,v std dim^-0.5, value embeddings 0, head N(0, 0.005), embed a copy (2025)
    attn_scale: float = 0.1             # attention logit scale (instead of 1/sqrt(head_dim)); YaRN raises it
    rotary_base: float = 1024.0         # rotary frequencies (1/base)^linspace(0, 1)
    yarn: bool = True                   # rotary on adjacent dim pairs, bf16 tables; a long-window change stretches it
                                        # and raises attn_scale (false: pairs (i, i + head_dim/2), fp32, 2025)
    logit_softcap: float = 15.0         # the cap's width is half this: height*sigmoid((z + shift)/7.5)
    logit_cap_height: float = 23.0      # ... its height (0: 2 x logit_softcap; with logit_cap_shift 0, 2025's 30*sigmoid(z/7.5))
    logit_cap_shift: float = 5.0        # ... its shift
    mtp: bool = True                    # also predict 2 and 3 tokens ahead, weights [1, .5, .25 -> 0] by thirds
    attn_block_size: int = 128          # the unit of attention windows, in tokens (FlexAttention's block)
    window_pattern: str = "SSSLSSSSSSL"  # per block: L long window, S short window (= long/2)
    window_schedule: str = "3,7,11"     # long window in blocks per equal part of the scheduled steps ("": grown)
    window_growth_tokens: int = 1728    # without window_schedule: long window = this x step/num_iterations, in whole
                                        # blocks, extension steps included (2025)
    window_final_blocks: int = 13       # with window_schedule, the long window over the extension steps (0: its last)
    window_validate_final_blocks: int = 20  # long window of the last validation (0: the last step's); short: the step's
    value_gates: bool = True            # v + 2 sigmoid(W x[:12]) x value embedding per head, scales on W_qkv and W_o
    key_offset: bool = True             # long-window layers: keys' stationary dims come from the token before (--yarn)
    paired_head_layers: str = "0,2,5,9"  # layers whose heads attend in pairs, one sequence of twice the length (--yarn)
    token_windows: bool = True          # a window of w blocks reaches w x attn_block_size tokens back; false: w blocks
    attn_backend: str = "flex"          # CUDA attention: flex (FlexAttention) or varlen (torch's FlashAttention-2, the
                                        # record's call without its hub download; token windows); CPU: dense SDPA
    fp8_head: bool = True               # FP8 lm_head where the GPU supports it (off on CPU and pre-Ada GPUs)
    fp8_scales: str = "2026"            # its operands' scales: 2026 (100, 1.6, 0.75 /448) or bounded (cannot overflow)
    bf16_embeds: bool = True            # embeddings, value embeddings and bigram table in bf16
    bf16_weights: bool = True           # gates, head bf16; Muon's fp32 matrices read truncated to bf16, update and traffic bf16
    compile: bool = True                # torch.compile the model (--compile_scope: in how many graphs), the orthogonalizer
    compile_scope: str = "model"        # model: one graph, as the record; blocks: each block and the head alone
    compile_adam: bool = True           # compile Adam's update, bf16 rounded where stored only, as the record
    # optimization
    num_iterations: int = 1600          # training steps
    extension_steps: int = 40           # the last N of them run past the schedules: lr at final_lr_frac, final window
    lr_plateaus: str = "1,1.52,1.73"    # lr factor before the cooldown, per equal part of the scheduled steps
    cooldown_frac: float = 0.55         # lr constant, then linear decay over this final fraction of the scheduled steps
    final_lr_frac: float = 0.1          # lr multiplier reached at the last scheduled step
    adam_lr: float = 0.008              # Adam learning rate, times the kind's multiplier
    adam_table: str = "2026"            # 2026: betas and multipliers per kind (ADAM_2026), fp32 moments; 2025: the next 5
    adam_beta1: float = 0.8             # (2025 table; 2026: the block matrices' on Adam) Adam first-moment decay
    adam_beta2: float = 0.95            # (2025 table; 2026: the block matrices' on Adam) Adam second-moment decay
    embed_lr_mult: float = 75.0         # (2025 table) embeddings train at adam_lr * this
    head_lr_mult: float = 1.0           # (2025 table) lm_head trains at adam_lr * this
    scalar_lr_mult: float = 5.0         # (2025 table) scalar parameters train at adam_lr * this
    adam_eps: float = 1e-10             # Adam epsilon
    adam_weight_decay: float = 0.005    # x the kind's multiplier x lr^2: cautious decay where the step shrinks p
    adam_every: int = 2                 # Adam steps on every N-th step only, with the gradients summed since
    embed_split_frac: float = 2 / 3     # the token embedding is the head's weights until this part of the scheduled
                                        # steps (its first Adam step from there), then a copy trained apart (0: untied)
    adam_shard_min_numel: int = 65536   # Adam matrices this big are row-sharded; the rest: one all-reduced fp32 vector
    muon_lr: float = 0.023              # Muon learning rate of the block matrices
    muon_momentum_start: float = 0.85   # Muon momentum at step 0 ...
    muon_momentum_end: float = 0.95     # ... rising linearly to this
    muon_momentum_warmup_steps: int = 300  # ... over this many steps
    muon_momentum_cooldown_steps: int = 50  # ... and back down to muon_momentum_start over the last N (0: none, 2025's warmup form)
    muon_bucket_matrices: int = 8       # matrices per gradient reduce-scatter (rounded up to a multiple of world size)
    matrix_optimizer: str = "muon"      # muon, or adam: block matrices on Adam too (the baseline for Muon)
    matrix_lr_mult: float = 1.0         # with matrix_optimizer=adam the block matrices train at adam_lr * this
    ns_method: str = "polar_express"    # polar_express (the record's), newton_schulz (2025) or aol (Turbo-Muon)
    ns_coeffs: str = ""                 # "a,b,c;a,b,c;...": replaces ns_method's table, one quintic per step
    ns_backend: str = "auto"            # triton on CUDA, torch elsewhere; or force one
    ce_backend: str = "auto"            # the multi-token loss: triton (the record's fused kernels) on CUDA, or torch
    mlp_backend: str = "auto"           # the MLP: triton (the record's GEMM with relu^2 fused) on CUDA, or torch
    muon_update_scale: str = "aspect"   # update x muon_lr*(long side/short side)^0.5 (aspect), x muon_lr*max(1,
                                        # rows/cols)^0.5 (2025), or x adam_lr*0.2*max(rows, cols)^0.5 (moonlight)
    mlp_proj_lr_mult: float = 2.0       # the MLP's output matrices' Muon lr x this
    normuon: bool = True                # NorMuon variance normalization after orthogonalization
    normuon_beta2: float = 0.95         # NorMuon second-moment decay
    weight_decay: float = 1.2           # Muon weight decay (decoupled; muon_decay says what scales it)
    muon_decay: str = "lr2"             # its coefficient: weight_decay x lr x the matrix's lr (lr2), or x lr (lr)
    cautious_wd: bool = True            # decay only entries where update and parameter agree in sign
    overlap_comms: bool = True          # launch gradient reduce-scatters from backward hooks
    # loop
    val_every: int = 250                # validate every N steps (0: only at the end)
    warmup_steps: int = 10              # 0: no untimed warmup; else (without warmup_at_transitions) this many steps
    warmup_at_transitions: bool = True  # warm up on steps 0-2 and around each window or batch change, validating too
    check_every: int = 10               # steps between checks for a non-finite loss or a stop signal (one host-GPU sync)
    device: str = "auto"                # auto, cuda or cpu
    threads: int = 0                    # CPU threads per process (0: usable cores / local processes); orders sums
    dist_timeout_s: int = 900           # a dead rank raises after this long instead of hanging
    # checkpoints and sampling (harness/checkpoints.py, harness/sample.py)
    save_checkpoint: bool = False       # write <run_id>.pt beside the log at the end of training
    checkpoint_every: int = 0           # ... and every N steps (0: only at the end; a multiple of adam_every)
    resume: str = ""                    # continue the run saved in this checkpoint
    sample: str = ""                    # print a continuation of --prompt from this checkpoint, then exit
    prompt: str = ""                    # the text --sample continues
    max_new_tokens: int = 200           # tokens --sample writes at most
    temperature: float = 0.8            # 0: always the most likely token
    top_k: int = 50                     # sample among the k most likely tokens (0: among all)

# cpu: the record's architecture at 4 blocks of width 128 on short sequences; trains in 2 minutes on 2 cores.
PRESETS = {
    "speedrun": {},
    "cpu": dict(
        target_val_loss=6.0,  # a smoke-test bar, not a record
        val_tokens=16 * 1024, train_seq_len=1024, train_seq_len_schedule="512,768,1024", train_max_doc_len=256,
        val_seq_len=1024, micro_batches=1, num_layers=4, model_dim=128, num_heads=2, head_dim=64,
        attention_free_layers="", num_value_embeds=2, value_embed_layers="1.01", bigram_vocab_size=50304,
        skip_layers="1,2", backout_layer=2, paired_head_layers="0", window_pattern="SSSL", attn_block_size=64,
        window_schedule="1,3,5", window_final_blocks=6, window_validate_final_blocks=8, compile=False,
        compile_adam=False, bf16_weights=False, num_iterations=120, extension_steps=4, val_every=40, warmup_steps=2,
        adam_lr=0.016,  # twice the record's: at this width 120 steps reach 5.67 where 0.008 reaches 5.87
        warmup_at_transitions=False, muon_momentum_warmup_steps=50, muon_momentum_cooldown_steps=4,
        dist_timeout_s=120, check_every=1,  # a host sync costs nothing on CPU, and steps are long
    ),
}
# Without FineWeb downloaded, the cpu preset trains on the embedded sample. Both lie in this repository.
FINEWEB_FILES = (Hyperparameters.train_files, Hyperparameters.val_files)
SAMPLE_FILES = ("data/sample/sample_train_*.bin", "data/sample/sample_val_*.bin")
REPO_DIR = os.path.dirname(os.path.abspath(__file__))

def trains_on_sample(args):  # the cpu preset with both data options unset, and FineWeb not downloaded
    return (args.preset == "cpu" and (args.train_files, args.val_files) == FINEWEB_FILES
            and not all(glob.glob(os.path.join(REPO_DIR, p)) for p in FINEWEB_FILES))

NS_METHODS, NS_BACKENDS = ("newton_schulz", "polar_express", "aol"), ("torch", "triton")

def uses_cuda(args, cuda_available):
    return args.device == "cuda" or (args.device == "auto" and cuda_available)

class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the field."""

def say(text, file=None, end="\n"):  # print(), where a console that has gone (`| head`, a closed terminal) is no error
    file = file or sys.stdout
    try:
        print(text, file=file, end=end, flush=True)
    except OSError:  # later output, and the flush at exit, go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), file.fileno())

def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

def parse_ns_coeffs(text: str) -> list | None:  # --ns_coeffs "a,b,c;a,b,c" -> [(a, b, c), ...]; None when empty
    if not text.strip():
        return None
    try:
        steps = [tuple(float(v) for v in step.split(",")) for step in text.split(";") if step.strip()]
    except ValueError:
        steps = []
    if not steps or any(len(step) != 3 or not all(map(math.isfinite, step)) for step in steps):
        raise ConfigError(f"--ns_coeffs={text!r}: expected finite a,b,c triples separated by ';'")
    return steps

def _layer_list(text):
    return [int(x) for x in text.split(",") if x.strip()]

def _numbers(text, kind=float):  # "1,1.52,1.73" -> [1.0, 1.52, 1.73]
    return [kind(x) for x in text.split(",") if x.strip()]

def run_folder(args):  # where a run's log (and checkpoint) goes; the default records/ is this repository's
    root = os.path.join(REPO_DIR, args.log_dir) if args.log_dir == Hyperparameters.log_dir else args.log_dir
    return os.path.join(root, f"{datetime.date.today().isoformat()}_{args.run_name}")

def check_config(args, world_size, cuda_available):
    """The shapes must fit together: harness/config.py says in one line where they do not."""
    config = harness("config")
    if config is not None:
        config.check_shapes(args, world_size, cuda_available)
    elif args.micro_batches % world_size:
        raise ConfigError(f"--micro_batches={args.micro_batches}: world size {world_size} must divide it")


# -----------------------------------------------------------------------------------------------
# 2. Hardware and ranks
#
# CPU and GPU run the same code except for what Hardware holds (and small branches on
# hw.device.type). Ranks come from torchrun's environment; without it, one process, no group.

def usable_cpus():  # the CPUs this process may run on (taskset, Slurm, a container's cpuset)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # (macOS)

@dataclass
class Hardware:
    device: torch.device
    compute_dtype: torch.dtype          # bf16 activations on GPU; fp32 on CPU, where bf16 is slow
    attention: str                      # "flex" (FlexAttention), "varlen" (FlashAttention-2) or "sdpa" (dense mask: CPU,
                                        # where FlexAttention has no backward and FlashAttention no kernel)
    fp8_head: bool
    ns_backend: str
    dist_backend: str
    ce_backend: str = "torch"           # the multi-token loss: "triton" (fused kernels) or "torch" (its twin)
    mlp_backend: str = "torch"          # the MLP: "triton" (relu^2 fused into the first GEMM) or "torch" (its twin)

    @staticmethod
    def detect(args, ranks=None):  # on CUDA: GPU number LOCAL_RANK of this machine
        ranks = ranks or Ranks()
        use_cuda = uses_cuda(args, torch.cuda.is_available())
        ns_backend, ce_backend, mlp_backend = (("triton" if use_cuda and triton is not None else "torch")
                                               if choice == "auto" else choice
                                               for choice in (args.ns_backend, args.ce_backend, args.mlp_backend))
        if not use_cuda:
            return Hardware(torch.device("cpu"), torch.float32, "sdpa", False, ns_backend, "gloo", ce_backend,
                            mlp_backend)
        device = torch.device("cuda", ranks.local_rank)
        fp8 = args.fp8_head and torch.cuda.get_device_capability(device) >= (8, 9)  # Ada, Hopper and newer
        return Hardware(device, torch.bfloat16, args.attn_backend, fp8, ns_backend, "nccl", ce_backend, mlp_backend)

def keep_freed_memory_on_cpu():
    """glibc returns the freed (tokens x vocab) logits to the kernel and page-faults them back each
    step, which doubled the cpu preset's step time: keep such blocks in the heap (glibc only)."""
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)      # M_MMAP_THRESHOLD: blocks below 1 GiB come from the heap
        libc.mallopt(-1, 2 ** 31 - 1)  # M_TRIM_THRESHOLD: and freeing them never shrinks it

@dataclass
class Ranks:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    is_master = property(lambda self: self.rank == 0)

    @staticmethod
    def from_env(environ):  # torchrun's variables; RANK, WORLD_SIZE over all machines, LOCAL_* on this one
        return Ranks(*(int(environ.get(name, default)) for name, default in
                       (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_WORLD_SIZE", 1))))

def init_process_group(args, ranks, hw):  # with a timeout: a dead rank raises instead of hanging
    if hw.device.type == "cuda":
        torch.cuda.set_device(hw.device)
    if ranks.world_size > 1:
        dist.init_process_group(hw.dist_backend, rank=ranks.rank, world_size=ranks.world_size,
                                timeout=datetime.timedelta(seconds=args.dist_timeout_s),
                                **(dict(device_id=hw.device) if hw.device.type == "cuda" else {}))

def leave_process_group(clean):
    """Destroy the group after a clean run; abort it after a crash or a mid-step stop: NCCL's destroy
    waits for collectives in flight that no peer may ever match."""
    if not dist.is_initialized():
        return
    if clean or dist.get_backend() != "nccl":
        dist.destroy_process_group()
    else:
        dist.distributed_c10d._abort_process_group()


# -----------------------------------------------------------------------------------------------
# 3. Collectives
#
# All gradient and parameter traffic: averaging reduce-scatters, all-gathers, one all-reduce for
# the small parameters; never called at world size 1. It counts the bytes each rank sends (ring:
# (W-1)/W of the payload, twice for an all-reduce) for comparison with the lower bound.

# torch 2.13 renamed the tensor-in/tensor-out collectives (the GPU images run 2.11).
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

class Collectives:
    def __init__(self, world_size):
        self.world_size, self.sent_bytes, self.calls = world_size, 0, 0
        self.wait_seconds = 0.0   # time spent blocked in wait(): communication not hidden by compute

    def _count(self, payload_bytes, rounds):
        self.calls += 1
        self.sent_bytes += rounds * payload_bytes * (self.world_size - 1) // self.world_size

    def reduce_scatter(self, out, inp):
        """out (n/W, ...) <- the average over ranks of this rank's slice of inp (n, ...). Async."""
        self._count(inp.numel() * inp.element_size(), 1)
        return _reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG, async_op=True)

    def all_gather(self, out, inp):  # out (W*n, ...) <- every rank's inp (n, ...), in rank order. Async
        self._count(out.numel() * out.element_size(), 1)
        return _all_gather_single(out, inp, async_op=True)

    def all_reduce_mean(self, tensor):
        self._count(tensor.numel() * tensor.element_size(), 2)
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=True)

    def wait(self, work):  # on CUDA this only makes the stream wait: wait_seconds measures host blocking on gloo only
        start = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - start


# -----------------------------------------------------------------------------------------------
# 4. Orthogonalization (Polar Express; Turbo-Muon's AOL an option)
#
# Each matrix of a stack becomes an approximation of its polar factor U V^T (G = U S V^T) by odd
# quintic steps X <- a X + (b A + c A^2) X, A = X X^T, on the wide orientation (A is m x m, m <= n).
# Methods: polar_express (the record's), newton_schulz (2025's), aol (Turbo-Muon, opt-in: AOL's row scaling
# from the first Gram bounds ||X||_2 <= 1 without a Frobenius norm, saving a step, but converges to
# the polar factor of diag(s) G). Every first step is "Gram, row scale s, iterate on diag(s) X".

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

# Four steps after AOL, chosen by loss (bench/README.md): Polar Express's first three, then one
# capped so that the largest singular value is 1 (bench/derive_aol_coeffs.py --lower 1e-3 --steps 4 --cap-final).
AOL_COEFFS_LOWER_BOUND = 1e-3
AOL_COEFFS = [
    (8.156554524902461, -22.483292925577953, 15.878769915207466),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (2.1272002635096783, -1.595067874749505, 0.3254997506575241),
]

# AOL's floor only guards all-zero rows; the Frobenius offsets are the published ones.
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
    """Per-row scale s (batch, m), fp32 (fp64 for fp64), with ||diag(s) X||_2 <= 1. AOL: s_i =
    1/sqrt(sum_j |A_ij|) (Schur test); Frobenius methods: 1/(safety*||X||_F + offset) for every row."""
    if method == "aol":
        row_abs_sum = A.to(_scale_dtype(A)).abs().sum(-1) if row_abs_sum is None else row_abs_sum
        return torch.rsqrt(row_abs_sum.to(_scale_dtype(A)).clamp_min(AOL_ROW_SUM_FLOOR))
    frobenius = A.diagonal(dim1=-2, dim2=-1).to(_scale_dtype(A)).sum(-1).sqrt()
    inv_norm = 1.0 / (FROBENIUS_SAFETY[method] * frobenius + FROBENIUS_OFFSET[method])
    return inv_norm[:, None].expand(A.shape[:2]).contiguous()

def orthogonalize_torch(G: torch.Tensor, method: str = "newton_schulz", coeffs: list | None = None,
                        round_through: torch.dtype | None = None) -> torch.Tensor:
    """PyTorch twin of orthogonalize_triton: same scaling, same steps, in G's dtype. round_through
    (e.g. bf16 with fp32 G) rounds every product and operand through it, as bf16 GEMMs with fp32
    accumulation do on GPU, without CPU's slow bf16 matmuls."""
    coeffs = _resolve_coeffs(method, coeffs)
    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t if round_through is None else t.to(round_through).to(t.dtype)
    X, tall = _as_wide_stack(rounded(G))
    for step, (a, b, c) in enumerate(coeffs):
        A = rounded(X @ X.mT)
        if step == 0:
            s = _first_step_row_scale(method, A)
            # Scale in fp32 and round once, as the kernels do when they load the tiles.
            A = rounded((A.to(s.dtype) * s[:, :, None] * s[:, None, :]).to(X.dtype))
            X = rounded((X.to(s.dtype) * s[:, :, None]).to(X.dtype))
        # baddbmm: one fp32 accumulation on GPU, as the kernels' epilogues. Not for a cubic step
        # (c = 0): on CPU, bf16 baddbmm with alpha=0 ignores beta on all but tiny stacks.
        B = rounded(b * A) if c == 0 else rounded(torch.baddbmm(A, A, A, beta=b, alpha=c))
        X = rounded(torch.baddbmm(X, B, X, beta=a, alpha=1.0))
    return (X.mT if tall else X).reshape(G.shape)

def orthogonalize(G: torch.Tensor, method: str = "newton_schulz", backend: str = "torch",
                  coeffs: list | None = None) -> torch.Tensor:
    """Approximate polar factor of G (m, n) or (..., m, n) in G's dtype; coeffs: (a, b, c) per step."""
    _check_choice("backend", backend, NS_BACKENDS)
    return (orthogonalize_triton if backend == "triton" else orthogonalize_torch)(G, method, coeffs)


# --- Triton kernels ------------------------------------------------------------------------------
# Three kernels per step, batched over the stack: gram A = X X^T and sym_poly B = b A + c A A
# compute upper tiles only and store each with its mirror; poly_apply X' = a X + B X. fp32
# accumulation, operands in the input dtype. The first step's scale s is applied as tiles load,
# so diag(s) X is never written. Any strides: a tall matrix is processed as its transposed view.

def _square_tile_configs():  # symmetric kernels pair tile (i, j) with (j, i): square tiles
    if TRITON_INTERPRETING:  # the interpreter cannot benchmark: exactly one config
        return [triton.Config({"BLOCK_M": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": block, "BLOCK_K": 64}, num_warps=warps, num_stages=stages)
            for block in (64, 128) for warps in (4, 8) for stages in (3, 4)]

def _rect_tile_configs():
    if TRITON_INTERPRETING:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64}, num_warps=warps, num_stages=stages)
            for bm, bn, warps in ((128, 128, 8), (128, 64, 4), (64, 128, 4), (64, 64, 4)) for stages in (3, 4)]

if triton is not None:

    @triton.jit
    def _upper_tile_pair(BLOCK_M: tl.constexpr):
        """This program's tile (row tile <= column tile) and whether it has a mirror to write."""
        # Column c holds ids c(c+1)/2 ... c(c+1)/2 + c: invert with a square root, nudged where
        # fp32 lands one off near perfect squares.
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
        # the mirror: a second store through swapped strides
        tile = tile.to(ptr.dtype.element_ty)
        mask = (rows[:, None] < size) & (cols[None, :] < size)
        tl.store(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, tile, mask=mask)
        if mirror:
            tl.store(ptr + rows[:, None] * stride_col + cols[None, :] * stride_row, tile, mask=mask)

    @triton.jit
    def _as_fp32(scalar):  # torch.compile passes Python floats as fp64 scalars: uncast, the math would be fp64
        return tl.cast(scalar, tl.float32)

    @triton.jit
    def _mma(left, right, acc, IEEE_FP32: tl.constexpr):
        # fp32 inputs would silently use TF32: full precision keeps them comparable with the twin
        if IEEE_FP32:
            acc = tl.dot(left, right, acc, input_precision="ieee")
        else:
            acc = tl.dot(left, right, acc)
        return acc

    @triton.autotune(configs=_square_tile_configs(), key=["m", "k"], reset_to_zero=["row_abs_sum_ptr"])
    @triton.jit
    def _gram_kernel(x_ptr, a_ptr, row_abs_sum_ptr, m, k, stride_xb, stride_xm, stride_xk,
                     stride_ab, stride_am, stride_an, stride_rb, WITH_ROW_ABS_SUM: tl.constexpr,
                     IEEE_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
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
            # AOL's row sums from the fp32 accumulator in this pass (no re-read of A); the atomics'
            # order varies at fp32 rounding level. The mirror's rows get this tile's column sums.
            abs_tile = tl.abs(acc)
            row_abs_sum_ptr += matrix * stride_rb
            tl.atomic_add(row_abs_sum_ptr + rows, tl.sum(abs_tile, axis=1), mask=rows < m)
            if off_diagonal:
                tl.atomic_add(row_abs_sum_ptr + cols, tl.sum(abs_tile, axis=0), mask=cols < m)

    @triton.autotune(configs=_square_tile_configs(), key=["m"])
    @triton.jit
    def _sym_poly_kernel(a_ptr, b_ptr, scale_ptr, m, coef_b, coef_c, stride_ab, stride_am, stride_an,
                         stride_bb, stride_bm, stride_bn, stride_sb, HAS_SCALE: tl.constexpr,
                         IEEE_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
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
        if HAS_SCALE:  # rounded like the dot operands: b*A and c*A@A see the same A
            a_tile = (a_tile.to(tl.float32) * row_scale[:, None] * col_scale[None, :]).to(a_ptr.dtype.element_ty)
        acc = _as_fp32(coef_c) * acc + _as_fp32(coef_b) * a_tile.to(tl.float32)
        _store_symmetric_tile(b_ptr, acc, rows, cols, stride_bm, stride_bn, m, off_diagonal)

    @triton.autotune(configs=_rect_tile_configs(), key=["m", "n"])
    @triton.jit
    def _poly_apply_kernel(b_ptr, x_ptr, out_ptr, scale_ptr, m, n, coef_a, stride_bb, stride_bm, stride_bk,
                           stride_xb, stride_xm, stride_xn, stride_ob, stride_om, stride_on, stride_sb,
                           HAS_SCALE: tl.constexpr, IEEE_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
        acc = _as_fp32(coef_a) * x_tile.to(tl.float32)
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
    if any(not t.is_cuda for t in tensors) and not TRITON_INTERPRETING:
        raise ValueError("backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if any(t.dtype not in (torch.bfloat16, torch.float16, torch.float32) for t in tensors):
        raise ValueError(f"backend 'triton' supports bf16, fp16 and fp32, got {[t.dtype for t in tensors]}")

def _as_stack(t: torch.Tensor) -> torch.Tensor:
    return t if t.ndim == 3 else t.unsqueeze(0)

def _upper_tile_pairs(size: int, block: int) -> int:
    tiles = triton.cdiv(size, block)
    return tiles * (tiles + 1) // 2

def gram_triton(X: torch.Tensor, with_row_abs_sum: bool = False, out: torch.Tensor | None = None):
    """A = X X^T for X (m, k) or (batch, m, k), any strides; with (A, sum_j |A_ij| in fp32)."""
    _require_triton(X)
    X3 = _as_stack(X)
    batch, m, k = X3.shape
    A = torch.empty(batch, m, m, dtype=X.dtype, device=X.device) if out is None else _as_stack(out)
    row_abs_sum = torch.zeros(batch, m, dtype=torch.float32, device=X.device) if with_row_abs_sum else A
    grid = lambda meta: (_upper_tile_pairs(m, meta["BLOCK_M"]), batch)
    _gram_kernel[grid](X3, A, row_abs_sum, m, k, *X3.stride(), *A.stride(), row_abs_sum.stride(0),
                       WITH_ROW_ABS_SUM=with_row_abs_sum, IEEE_FP32=X.dtype == torch.float32)
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
    _sym_poly_kernel[grid](A3, B, A3 if scale3 is None else scale3, m, float(b), float(c), *A3.stride(), *B.stride(),
                           0 if scale3 is None else scale3.stride(0), HAS_SCALE=scale3 is not None,
                           IEEE_FP32=A.dtype == torch.float32)
    return B if A.ndim == 3 else B[0]

def poly_apply_triton(B: torch.Tensor, X: torch.Tensor, a: float, row_scale: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """a X' + B X' with X' = diag(row_scale) X; B (.., m, m), X (.., m, n); out: any view not overlapping X or B."""
    _require_triton(B, X)
    B3, X3 = _as_stack(B), _as_stack(X)
    batch, m, n = X3.shape
    out3 = torch.empty(batch, m, n, dtype=X.dtype, device=X.device) if out is None else _as_stack(out)
    if not torch.compiler.is_compiling() and out3.data_ptr() in (X3.data_ptr(), B3.data_ptr()):
        raise ValueError("poly_apply_triton cannot write in place: every output tile reads a whole column panel of X")
    scale3 = None if row_scale is None else row_scale.float().reshape(batch, m).contiguous()
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]), batch)
    _poly_apply_kernel[grid](B3, X3, out3, X3 if scale3 is None else scale3, m, n, float(a), *B3.stride(), *X3.stride(),
                             *out3.stride(), 0 if scale3 is None else scale3.stride(0), HAS_SCALE=scale3 is not None,
                             IEEE_FP32=X.dtype == torch.float32)
    return out3 if X.ndim == 3 else out3[0]

def orthogonalize_triton(G: torch.Tensor, method: str = "newton_schulz", coeffs: list | None = None) -> torch.Tensor:
    """Kernel version of orthogonalize_torch (same algorithm); the result is contiguous in G's shape."""
    coeffs = _resolve_coeffs(method, coeffs)
    X, tall = _as_wide_stack(G)
    batch, m, n = X.shape
    result = torch.empty(G.shape, dtype=G.dtype, device=G.device)
    result_wide, _ = _as_wide_stack(result)
    # Two ping-pong buffers; the first step reads G through its strides, the last writes the result.
    iterates = [torch.empty(batch, m, n, dtype=G.dtype, device=G.device) for _ in range(min(2, len(coeffs) - 1))]
    A, B = (torch.empty(batch, m, m, dtype=G.dtype, device=G.device) for _ in range(2))
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
# NorMuon trains the block matrices; Adam (on every adam_every-th step) the embeddings, the head, the
# gates and the scalars. No DDP: in the last micro-step's backward, hooks launch each communication
# unit once its gradients are final, in one order on every rank: a Muon bucket (same-shape matrices
# reduce-scattered whole, each rank orthogonalizing its own, then all-gathered), a large Adam
# parameter (rows reduce-scattered) or the small parameters (one all-reduce). Zero padding fills
# stacks to a multiple of the world size.

@dataclass
class ParamSpec:
    name: str
    param: nn.Parameter
    optimizer: str        # "muon" or "adam"
    group: str            # matrix, or Adam's kind: embed, head, scalar (ADAM_2026's with --adam_table 2026)
    lr_mult: float = 1.0
    betas: tuple = (0.8, 0.95)  # Adam's
    wd_mult: float = 0.0  # Adam's weight decay: adam_weight_decay x this

# The 2026-01-19 record's Adam, by kind of parameter: (beta1, beta2, lr multiplier, weight decay multiplier)
ADAM_2026 = {"head": (0.5, 0.95, 1.0, 150.0), "embed": (0.5, 0.95, 1.0, 150.0),
             "value_embed": (0.75, 0.95, 75.0, 5.0),   # the value embeddings and the bigram embedding
             "gate": (0.9, 0.99, 1.0, 1.0),            # attention's and the value embeddings' gates
             "smear_gate": (0.9, 0.99, 0.01, 0.0), "skip_gate": (0.9, 0.99, 0.05, 0.0),
             "x0_lambda": (0.65, 0.95, 5.0, 0.0), "scalar": (0.9, 0.99, 5.0, 0.0)}

def adam_kind_2026(name):
    if name in ("lm_head_w", "smear_gate", "skip_gate"):
        return {"lm_head_w": "head"}.get(name, name)
    if name.startswith(("embed.", "value_embeds.", "bigram_embed.")):
        return "embed" if name.startswith("embed.") else "value_embed"
    return "gate" if name.endswith("gate_w") else "x0_lambda" if name.endswith("x0_lambda") else "scalar"

def param_specs(model, args):
    """Each parameter's optimizer and lr multiplier: Muon for block matrices, Adam for the rest."""
    specs = []
    L = len(model.blocks)
    def forward_position(item):  # where the forward pass first uses a parameter
        name = item[0]
        if name.startswith("blocks."):
            return int(name.split(".")[1])
        return {"lm_head_w": L, "skip_weights": L - L // 2}.get(name, -1)  # skips join the decoder blocks
    # forward order: the optimizer launches in reverse, from the head's gradient, backward's first
    lr_mults = dict(embed=args.embed_lr_mult, head=args.head_lr_mult, matrix=args.matrix_lr_mult, scalar=args.scalar_lr_mult)
    for name, p in sorted(model.named_parameters(), key=forward_position):
        group = ("embed" if name.startswith(("embed.", "value_embeds.", "bigram_embed.")) else "head" if name == "lm_head_w"
                 else "matrix" if p.ndim >= 2 else "scalar")
        if args.adam_table == "2026" and (group != "matrix" or name.endswith("gate_w")):  # gates: Adam's too
            beta1, beta2, lr_mult, wd_mult = ADAM_2026[adam_kind_2026(name)]
            specs.append(ParamSpec(name, p, "adam", adam_kind_2026(name), lr_mult, (beta1, beta2), wd_mult))
            continue
        muon = group == "matrix" and args.matrix_optimizer != "adam"
        muon_lr_mult = args.mlp_proj_lr_mult if name.endswith("mlp.proj_w") else 1.0
        specs.append(ParamSpec(name, p, "muon" if muon else "adam", group, muon_lr_mult if muon else lr_mults[group],
                               (args.adam_beta1, args.adam_beta2)))
    return specs

@dataclass
class MatrixSlot:
    """One matrix inside a parameter, as Muon sees it: wide orientation (rows <= cols)."""
    spec: ParamSpec
    index: int | None     # which matrix of a stacked (k, rows, cols) parameter; None for 2-D
    transposed: bool
    update_scale: str     # Hyperparameters.muon_update_scale: aspect, 2025 or moonlight

    def view(self, tensor):
        t = tensor if self.index is None else tensor[self.index]
        return t.mT if self.transposed else t

    @property
    def lr_scale(self):
        rows, cols = self.spec.param.shape[-2:]
        if self.update_scale == "moonlight":  # Liu et al. 2025: AdamW's typical update RMS, so Muon shares adam_lr
            return 0.2 * max(rows, cols) ** 0.5 * self.spec.lr_mult
        if self.update_scale == "aspect":  # the 2026 record's rule on its (hidden, dim) MLP storage, ours (dim, hidden)
            return (max(rows, cols) / min(rows, cols)) ** 0.5 * self.spec.lr_mult
        return max(1.0, rows / cols) ** 0.5 * self.spec.lr_mult

class CommUnit:
    """Parameters whose gradients travel together; launched once all of them are final."""
    def __init__(self, params):
        self.params, self.pending, self.work = list(dict.fromkeys(params)), set(), None

class MuonBucket(CommUnit):
    """Its tensors view its shape group's: grad_stack (padded, m, n), reduced (per_rank, m, n) this
    rank's share (grad_stack at world size 1), param_stack (padded, m, n) the gathered values."""
    def __init__(self, slots, world_size):
        super().__init__([s.spec.param for s in slots])
        self.slots = slots  # the bucket's matrices, then zero padding up to a multiple of world_size
        self.per_rank = -(-len(slots) // world_size)
        self.padded = self.per_rank * world_size
        self.grad_stack = self.reduced = self.param_stack = None

    def stack_grads(self):
        torch._foreach_copy_(list(self.grad_stack[:len(self.slots)]), [s.view(s.spec.param.grad) for s in self.slots])

class AdamShard(CommUnit):
    """A large Adam parameter whose rows are split over ranks."""
    def __init__(self, spec, world_size, device, adam_lr, weight_decay=0.0, moment_dtype=None):
        super().__init__([spec.param])
        self.spec, self.lr = spec, torch.tensor(adam_lr * spec.lr_mult, device=device)  # a tensor: not a graph constant
        rows = spec.param.shape[0]
        self.rows_per_rank = -(-rows // world_size)
        self.padded_rows = self.rows_per_rank * world_size
        padded_shape = (self.padded_rows, *spec.param.shape[1:])
        make = functools.partial(torch.zeros, device=device, dtype=spec.param.dtype)
        self.grad_buffer = self.param_buffer = None  # at world size 1 no rows are padded
        if self.padded_rows != rows:
            self.grad_buffer, self.param_buffer = make(padded_shape), make(padded_shape)
        # moments in the parameter's dtype as the 2025 record keeps them (bf16 for bf16 embeddings); fp32 in 2026's
        self.exp_avg = make((self.rows_per_rank, *spec.param.shape[1:]), dtype=moment_dtype or spec.param.dtype)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.decay = torch.tensor(adam_lr ** 2 * spec.lr_mult ** 2 * spec.wd_mult * weight_decay, device=device) \
            if spec.wd_mult * weight_decay else None

class SmallParams(CommUnit):
    """The parameters too small to shard with one pair of betas, updated as one flat fp32 vector:
    one Adam pass (the 2025 record's are all one; the 2026 record's two)."""
    def __init__(self, specs, adam_lr, device, weight_decay=0.0):
        super().__init__([s.param for s in specs])
        self.specs = specs
        self.numels = [s.param.numel() for s in specs]
        per_element = lambda values: torch.tensor(values).repeat_interleave(  # noqa: E731
            torch.tensor(self.numels, dtype=torch.long)).to(device)
        self.lr = per_element([adam_lr * s.lr_mult for s in specs])
        self.betas = specs[0].betas
        decays = [adam_lr ** 2 * s.lr_mult ** 2 * s.wd_mult * weight_decay for s in specs]
        self.decay = per_element(decays) if any(decays) else None
        self.exp_avg = torch.zeros(sum(self.numels), device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.flat = None

class ShardedMuonAdam:
    """Muon for matrices and Adam for the rest, with sharded state and overlapped communication. Per
    step: arm_for_final_backward() before the last micro-step's backward, step(), zero_grad()."""
    def __init__(self, specs, args, ranks, hw, collectives=None):
        self.args, self.world_size, self.rank, self.hw, self.specs = args, ranks.world_size, ranks.rank, hw, specs
        self.comm = collectives or Collectives(ranks.world_size)
        self.lr_factor, self.muon_momentum = 1.0, args.muon_momentum_start
        # set by the loop before each step: whether Adam steps now (--adam_every), whether the
        # embedding is the head's weights (--embed_split_frac): then it has no gradient and no step
        self.adam_step_now, self.embed_tied = True, False
        self.ns_coeffs = parse_ns_coeffs(args.ns_coeffs)
        # Gradients sum over micro-steps, ranks average: dividing by micro-steps per rank gives every
        # world size the record's 8-GPU gradient, while backward (the FP8 head) sees its scale.
        self.grad_scale = ranks.world_size / args.micro_batches
        self.adam_steps = 0
        device, W = hw.device, self.world_size
        self.adam_update = adam_apply  # or compiled, by compile_adam()
        self.orthogonalize = orthogonalize  # or compiled, by compile_orthogonalizer()
        # lr_factor x Adam's bias corrections per pair of betas, and lr_factor^2 for the decay: device
        # scalars, new each step without recompiling
        self.adam_scales = {s.betas: torch.ones((), device=device) for s in specs if s.optimizer == "adam"}
        self.decay_scale = torch.ones((), device=device)
        # Units in the order backward finishes their gradients: the head, the blocks from the last,
        # the embeddings and scalars; every rank issues the same collectives in the same order.
        order = {id(s.param): i for i, s in enumerate(specs)}
        muon_specs = [s for s in specs if s.optimizer == "muon"]
        slots = [MatrixSlot(s, i, s.param.size(-2) > s.param.size(-1), args.muon_update_scale)
                 for s in reversed(muon_specs) for i in ([None] if s.param.ndim == 2 else range(s.param.shape[0]))]
        by_shape = {}
        for slot in slots:
            by_shape.setdefault(tuple(slot.view(slot.spec.param).shape), []).append(slot)
        bucket_size = W * -(-args.muon_bucket_matrices // W)
        # The record's traffic under --bf16_weights on bf16 compute: gradients reduced in bf16, and the
        # matrices gathered as the bf16 the forward reads (their truncation); each rank keeps the fp32
        # masters of the matrices it owns (the record's mantissa). Else fp32: the forward reads all of w.
        self.muon_comm_dtype = torch.bfloat16 if args.bf16_weights and hw.compute_dtype == torch.bfloat16 \
            else torch.float32
        self.muon_groups = []   # per shape: the buckets and the state of this rank's matrices
        units = []
        for shape, shape_slots in by_shape.items():
            buckets = [MuonBucket(shape_slots[i:i + bucket_size], W) for i in range(0, len(shape_slots), bucket_size)]
            owned = sum(b.per_rank for b in buckets)
            padded = sum(b.padded for b in buckets)
            # (bf16 parameters, the 2025 table's Muon gates, travel in fp32: every rank rounds them alike)
            fp32_params = all(slot.spec.param.dtype == torch.float32 for slot in shape_slots)
            comm = dict(device=device, dtype=self.muon_comm_dtype if W > 1 and fp32_params else torch.float32)
            grad_stack = torch.zeros(padded, *shape, **comm)  # zero rows stay zero: padding
            group = dict(buckets=buckets, grad_stack=grad_stack,
                         reduced=torch.empty(owned, *shape, **comm) if W > 1 else grad_stack,
                         param_stack=torch.empty(padded, *shape, **comm) if W > 1 else None,
                         momentum=torch.zeros(owned, *shape, device=device),
                         # NorMuon: a statistic per row of square matrices, per column of the others' wide view
                         second_moment=torch.zeros(owned, *((shape[0], 1) if shape[0] == shape[1] else (1, shape[1])),
                                                   device=device) if args.normuon else None,
                         param_buffer=torch.zeros(owned, *shape, device=device))
            start = local = 0
            for b in buckets:  # each bucket works on its own slice of the group's tensors
                b.grad_stack = group["grad_stack"][start:start + b.padded]
                b.reduced = group["reduced"][local:local + b.per_rank]
                b.param_stack = group["param_stack"][start:start + b.padded] if W > 1 else None
                start, local = start + b.padded, local + b.per_rank
            group["owned"] = self._owned_slots(group)
            group["real"] = [i for i, slot in enumerate(group["owned"]) if slot is not None]
            # One number where the rank's matrices share it (attention's), else one per matrix (the
            # MLP's fc and proj, proj at mlp_proj_lr_mult), made once: no copy each step.
            scales = {slot.lr_scale for slot in group["owned"] if slot} or {0.0}  # or only padding
            group["lr_scale"] = scales.pop() if len(scales) == 1 else torch.tensor(
                [slot.lr_scale if slot else 0.0 for slot in group["owned"]], device=device)[:, None, None]
            self.muon_groups.append(group)
            units += buckets
        adam_specs = [s for s in specs if s.optimizer == "adam"]
        is_big = lambda s: s.param.ndim >= 2 and s.param.numel() >= args.adam_shard_min_numel  # noqa: E731
        small = [s for s in adam_specs if not is_big(s)]
        moment_dtype = torch.float32 if args.adam_table == "2026" else None
        self.adam_shards = [AdamShard(s, W, device, args.adam_lr, args.adam_weight_decay, moment_dtype)
                            for s in adam_specs if is_big(s)]
        self.smalls = [SmallParams([s for s in small if s.betas == betas], args.adam_lr, device, args.adam_weight_decay)
                       for betas in dict.fromkeys(s.betas for s in small)]
        self.state_small = {}
        for unit in self.smalls:
            parts = zip(unit.exp_avg.split(unit.numels), unit.exp_avg_sq.split(unit.numels))
            self.state_small.update({id(s.param): (m.view_as(s.param), v.view_as(s.param))
                                     for s, (m, v) in zip(unit.specs, parts)})
        units += self.adam_shards + self.smalls
        shard_of = {s.spec.name: s for s in self.adam_shards}
        self.embed_shard, self.head_shard = shard_of.get("embed.weight"), shard_of.get("lm_head_w")
        # While the embedding is the head's weights, the head's gradient is final only when the lookup's
        # is, as backward ends: then it launches last, not first (where every unit behind it would wait).
        tied_order = dict(order)
        if self.embed_shard and self.head_shard:
            tied_order[id(self.head_shard.spec.param)] = -1
        self.launch_orders = {tied: sorted(units, key=lambda unit: min(used[id(p)] for p in unit.params), reverse=True)
                              for tied, used in ((False, order), (True, tied_order))}
        self.units = self.launch_orders[False]
        self._armed, self._next_unit, self._units_of = False, 0, {}
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
            yield from (shard.exp_avg, shard.exp_avg_sq)
        for moments in self.state_small.values():
            yield from moments

    def state_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    def padding_bytes(self):  # bytes of the zero matrices and rows that fill stacks up to a multiple of the world size
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
        for s in self.specs:  # (Adam's gradients may be waiting for their step)
            s.param.grad = None

    # -- communication ------------------------------------------------------------------------------
    def arm_for_final_backward(self):  # call before the backward of the last micro-step: its gradients are final
        self.units = self.launch_orders[self.embed_tied]
        for unit in self.units:
            unit.pending = {id(p) for p in unit.params} if self._active(unit) else set()
        self._armed, self._next_unit = True, 0

    def _active(self, unit):  # whether the unit steps now: Muon's always, Adam's on its steps (not a tied embedding)
        return isinstance(unit, MuonBucket) or self.adam_step_now and not (self.embed_tied and unit is self.embed_shard)

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
            if self._active(unit):
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
            unit.local_grad = grad.new_empty(unit.exp_avg.shape)  # (the moments may be fp32, the gradient bf16)
            unit.work = self.comm.reduce_scatter(unit.local_grad, grad)
        else:
            unit.flat = torch.cat([s.param.grad.flatten() for s in unit.specs])
            unit.work = self.comm.all_reduce_mean(unit.flat)

    def compile_adam(self, backend="inductor"):
        """--compile_adam: one fused pass per tensor, bf16 rounded only where stored (as the 2026
        record's compiled step). One graph per kind of tensor."""
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.adam_update = torch.compile(adam_apply, dynamic=False, fullgraph=True, backend=backend)

    def compile_orthogonalizer(self, backend="inductor"):
        """--compile: one graph per stack shape, as the record compiles its Newton-Schulz. Eager, the
        Python between launches outlasts 8 GPUs' small stacks (3.3 ms per step vs 1.2 compiled on an
        H100, bench/gpu_proof.py). Dynamo cannot trace the Triton interpreter: there it stays eager."""
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
        gathers = [finish for group in self.muon_groups for finish in self._muon_update(group)]
        if self.adam_step_now:
            self.adam_steps += 1
            t = self.adam_steps
            for (b1, b2), scale in self.adam_scales.items():
                scale.fill_(self.lr_factor * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t))
            self.decay_scale.fill_(self.lr_factor ** 2)
            gathers += [finish for shard in self.adam_shards if self._active(shard)
                        for finish in self._adam_shard_update(shard)]
            for small in self.smalls:
                self._small_update(small)
        for finish in gathers:
            finish()

    def untie_embedding(self):
        """The split: the embedding becomes a copy of the head, with the head's Adam state (the
        2026 record's copy_lm_state_to_embed; here both are (vocab, dim), sharded alike)."""
        self.embed_shard.spec.param.data.copy_(self.head_shard.spec.param.data)
        self.embed_shard.exp_avg.copy_(self.head_shard.exp_avg)
        self.embed_shard.exp_avg_sq.copy_(self.head_shard.exp_avg_sq)

    def _muon_update(self, group):
        args, W = self.args, self.world_size
        buckets = group["buckets"]
        for b in buckets:
            if W == 1:
                b.stack_grads()
            else:
                self.comm.wait(b.work)
        grads = self._unaccumulate(group["reduced"].float())  # this rank's share, in bucket order (fp32)
        mine, momentum, mu = group["owned"], group["momentum"], self.muon_momentum
        momentum.lerp_(grads, 1 - mu)
        update = grads.lerp_(momentum, mu)  # Nesterov
        update = self.orthogonalize(update.to(self.hw.compute_dtype), args.ns_method, self.hw.ns_backend,
                                    self.ns_coeffs)
        # --bf16_weights, the record's precision: its Polar Express output stays bf16 and NorMuon scales it
        # in bf16 (its train_gpt.py, lines 712-719 and 775); the fp32 master takes it upcast. On CPU the
        # update is fp32 either way.
        update = update if args.bf16_weights else update.float()
        if group["second_moment"] is not None:
            update = normuon_normalize(update, group["second_moment"], args.normuon_beta2,
                                       -1 if group["second_moment"].size(-1) == 1 else -2)
        params = group["param_buffer"]
        if group["real"]:  # a rank may own only padding of a small group (e.g. 4 gates at world size 3)
            torch._foreach_copy_([params[i] for i in group["real"]],
                                 [mine[i].view(mine[i].spec.param) for i in group["real"]])
        lr = (args.adam_lr if args.muon_update_scale == "moonlight" else args.muon_lr) * self.lr_factor
        decay = lr * args.weight_decay * (lr * group["lr_scale"] if args.muon_decay == "lr2" else 1)
        new_params = muon_apply(params, update, lr * group["lr_scale"], decay, args.cautious_wd)
        if W == 1:
            torch._foreach_copy_([slot.view(slot.spec.param) for slot in mine], list(new_params))
            return []
        return self._gather_matrices(group, new_params)

    def _gather_matrices(self, group, new_params, stacks=None):
        """Every rank's updated matrices into every rank's parameters. In bf16 (the forward's reads,
        truncated) each rank then writes its own fp32 masters back over its share."""
        finishes, start = [], 0
        for b, stack in zip(group["buckets"], stacks or [b.param_stack for b in group["buckets"]]):
            mine = new_params[start:start + b.per_rank]
            start += b.per_rank
            sent = mine if stack.dtype == mine.dtype else bf16_truncation(mine).to(stack.dtype)
            work = self.comm.all_gather(stack, sent)
            def finish(b=b, work=work, stack=stack, mine=mine):
                self.comm.wait(work)
                torch._foreach_copy_([slot.view(slot.spec.param) for slot in b.slots], list(stack[:len(b.slots)]))
                if stack.dtype != mine.dtype:
                    own = b.slots[self.rank * b.per_rank:(self.rank + 1) * b.per_rank]
                    torch._foreach_copy_([slot.view(slot.spec.param) for slot in own], list(mine[:len(own)]))
            finishes.append(finish)
        return finishes

    @torch.no_grad()
    def gather_fp32_masters(self):
        """Before a checkpoint (every rank): with bf16 traffic a rank holds only its own matrices'
        fp32 masters; this gathers all of them in fp32 once, so that rank 0 saves every one."""
        for group in self.muon_groups:
            if group["param_stack"] is None or group["param_stack"].dtype == torch.float32:
                continue  # every rank holds every master already
            mine = torch.stack([slot.view(slot.spec.param) if slot else torch.zeros_like(group["param_buffer"][0])
                                for slot in group["owned"]])
            stacks = [torch.empty(b.param_stack.shape, device=mine.device) for b in group["buckets"]]
            for finish in self._gather_matrices(group, mine, stacks):
                finish()

    def _owned_slots(self, group):  # the slots this rank updates, in local order (None: padding)
        return [b.slots[i] if i < len(b.slots) else None for b in group["buckets"]
                for i in range(self.rank * b.per_rank, (self.rank + 1) * b.per_rank)]

    def _adam(self, param, grad, exp_avg, exp_avg_sq, lr, betas, decay):
        self.adam_update(param, grad, exp_avg, exp_avg_sq, lr, self.adam_scales[betas], *betas, self.args.adam_eps,
                         None if decay is None else decay * self.decay_scale)

    def _adam_shard_update(self, shard):
        p = shard.spec.param
        if self.world_size == 1:
            self._adam(p, self._unaccumulate(p.grad), shard.exp_avg, shard.exp_avg_sq, shard.lr, shard.spec.betas,
                       shard.decay)
            return []
        self.comm.wait(shard.work)
        rows = shard.rows_per_rank
        start = self.rank * rows
        full = shard.param_buffer if shard.param_buffer is not None else p
        if shard.param_buffer is not None:
            shard.param_buffer[:p.shape[0]].copy_(p)
        local = full[start:start + rows].clone()
        self._adam(local, self._unaccumulate(shard.local_grad), shard.exp_avg, shard.exp_avg_sq, shard.lr,
                   shard.spec.betas, shard.decay)
        work = self.comm.all_gather(full, local)
        def finish():
            self.comm.wait(work)
            if shard.param_buffer is not None:
                p.copy_(shard.param_buffer[:p.shape[0]])
        return [finish]

    def _small_update(self, small):
        params = [s.param for s in small.specs]
        if self.world_size > 1:
            self.comm.wait(small.work)
        grad = small.flat if self.world_size > 1 else torch.cat([p.grad.flatten() for p in params])
        flat = torch.cat([p.detach().flatten() for p in params])
        self._adam(flat, self._unaccumulate(grad), small.exp_avg, small.exp_avg_sq, small.lr, small.betas, small.decay)
        torch._foreach_copy_(params, [t.view_as(p) for t, p in zip(flat.split(small.numels), params)])

    def _unaccumulate(self, grad):  # the sum over this rank's micro-steps, in place, as their mean
        return grad.mul_(self.grad_scale) if self.grad_scale != 1 else grad

    def zero_grad(self):  # Adam's gradients wait for its next step (summed), on the steps it skips
        for s in self.specs:
            if self.adam_step_now or s.optimizer == "muon":
                s.param.grad = None

def bf16_truncation(t):  # fp32 values with their low 16 bits dropped: exactly the bf16 that as_compute reads
    return torch.bitwise_and(t.view(torch.int32), -65536).view(torch.float32)

def muon_apply(params, update, lr, decay, cautious):
    """p - lr*update (lr: a number, or one per matrix), with decoupled weight decay (cautious: only
    where update and parameter agree in sign, where the step already shrinks p). decay: likewise."""
    if isinstance(decay, torch.Tensor) or decay:
        mask = (update * params >= 0).to(params.dtype) if cautious else 1.0
        params = params - decay * params * mask
    if isinstance(lr, torch.Tensor):
        return params - lr * update
    return torch.add(params, update, alpha=-lr)  # the 2025 record's p.add_(v, alpha=-lr): one rounding (an FMA)

def normuon_normalize(update, second_moment, beta2, dim, eps=1e-10):
    """NorMuon as the 2026 record computes it: each row (dim -1) or column (dim -2) over the root of
    an EMA of its mean square, the Frobenius norm kept (the norms from the mean squares). Statistics
    in fp32; the scale rounded to update's dtype and applied in it (bf16: the record's)."""
    mean_sq = update.float().square().mean(dim=dim, keepdim=True)
    size = update.size(dim)
    norm = (mean_sq.sum(dim=(-2, -1), keepdim=True) * size).sqrt()
    second_moment.lerp_(mean_sq, 1 - beta2)
    step = second_moment.clamp_min(eps).rsqrt()
    new_norm = (mean_sq * size * step.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return update * (step * (norm / new_norm.clamp_min(eps))).type_as(update)

def adam_apply(param, grad, exp_avg, exp_avg_sq, lr, scale, beta1, beta2, eps, decay=None):
    """Adam as the record computes it: eps on the uncorrected sqrt(v), the bias corrections folded
    into scale = lr_factor x sqrt(1 - beta2^t) / (1 - beta1^t). decay (2026): cautious weight decay,
    lr^2 x weight decay, only where the step shrinks |p|."""
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    update = exp_avg.div(exp_avg_sq.sqrt().add_(eps)).mul_(lr * scale)
    if decay is not None:
        update.add_(param.float() * (update * param > 0) * decay)  # (in fp32 for a bf16 parameter too)
    param.sub_(update)


# -----------------------------------------------------------------------------------------------
# 6. Model
#
# Each block: x = a*x + b*x0 + c*bigram (x0 the smeared, normed embedding; bigram a hashed table of
# token pairs), attention (except attention-free blocks) and a ReLU^2 MLP on RMS-normed inputs; one
# gated skip, a backout before the head. Attention: merged qkvo weights scaled by two lambdas, QK-norm,
# rotary with YaRN on half the dims, the key offset, gated value embeddings, paired heads on some
# layers, a sigmoid gate per head, document-causal sliding-window masks. The head: FP8, a soft cap,
# the multi-token loss.

def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),))

def as_compute(w, dtype, truncate=False):
    """A weight in the activations' dtype. truncate (the 2026 record's bf16 weights with a 16-bit
    mantissa: its fp32 master read by dropping the low bits): toward zero, not to nearest, the
    gradient passing straight to w (w - (w - t) is t exactly: they share an exponent)."""
    if truncate and dtype == torch.bfloat16 and w.dtype == torch.float32:
        w = w - (w - bf16_truncation(w.detach())).detach()
    return w.to(dtype)

class Rotary(nn.Module):
    """Rotary embedding on half of each head's dims: head_dim/4 frequencies, each turning a pair of
    dims; the other half stationary. 2025: pairs (i, i + head_dim/2), fp32 tables. yarn (2026):
    pairs (2i, 2i + 1) and dims head_dim/2.. stationary, bf16 tables, and YaRN: a change of the long
    window scales its slow frequencies by old/new (the fast ones kept) and raises attn_scale. It
    holds the attention scale, and tables for 2 x max_seq_len positions (paired heads read two)."""
    def __init__(self, head_dim, max_seq_len, base=1024.0, attn_scale=0.12, yarn=False):
        super().__init__()
        self.head_dim, self.max_seq_len, self.base, self.initial_scale, self.yarn = \
            head_dim, max_seq_len, base, attn_scale, yarn
        for name in ("freqs", "cos", "sin"):  # moved with the model; rebuilt, not saved
            self.register_buffer(name, None, persistent=False)
        self.reset()

    def reset(self):  # the initial frequencies, scale and tables (after warmup, and before a run's first step)
        if self.cos is not None and not self.yarn:
            return
        device = self.cos.device if self.cos is not None else None
        quarter = self.head_dim // 4
        freqs = (1 / self.base) ** torch.linspace(0, 1, quarter, dtype=torch.float32, device=device)
        stationary = freqs.new_zeros(self.head_dim // 2 if self.yarn else quarter)
        self.freqs = torch.cat([freqs.repeat_interleave(2) if self.yarn else freqs, stationary])
        self.attn_scale, self.window = self.initial_scale, None
        self._tables()

    def _tables(self):
        positions = torch.arange(2 * self.max_seq_len if self.yarn else self.max_seq_len, dtype=torch.float32,
                                 device=self.freqs.device)
        theta = torch.outer(positions, self.freqs)
        # One element first: a process's first vectorized cos (MKL's VML) split over threads came out
        # inaccurate in a second thread's part (1.5e-4 at positions 512+), and runs then differed.
        theta[:1, :1].cos()
        cos, sin = theta.cos(), theta.sin()
        if self.yarn:  # (x[2i], x[2i+1]) -> (c x[2i] + s x[2i+1], c x[2i+1] - s x[2i]): odd columns' sines negated
            sin[:, 1::2] *= -1
            cos, sin = cos.bfloat16(), sin.bfloat16()
        if self.cos is None:
            self.cos, self.sin = cos, sin
        else:
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def follow(self, window_blocks, block_size, alpha=1, beta=32):
        """YaRN at a change of the long window (in blocks): a frequency that turns fewer than alpha
        times over the old window's tokens is scaled by old/new, one turning more than beta times is
        kept, those between are blended."""
        old, self.window = self.window, window_blocks
        if not self.yarn or old is None or old == window_blocks:
            return
        turns = block_size * old * self.freqs / (2 * torch.pi)
        ratio = old / window_blocks
        self.freqs *= ratio + torch.clamp((turns - alpha) / (beta - alpha), 0, 1) * (1 - ratio)
        self._tables()
        self.attn_scale *= 0.2 * math.log(window_blocks / old) + 1

    def forward(self, x, paired=False):
        """x: (B, T, H, head_dim). paired: heads 2j and 2j + 1 are turned as positions 2t and 2t + 1."""
        B, T, H, D = x.shape
        if not self.yarn:
            cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)
        if paired:
            x = x.view(B, T, H // 2, 2 * D)  # a row of the tables at 2t, then the row at 2t + 1
        rows = 2 * T if paired else T
        cos, sin = (table[:rows].view(T, -1)[None, :, None, :].float() for table in (self.cos, self.sin))
        x32 = x.float()
        swapped = x32.view(*x.shape[:-1], -1, 2).flip(-1).view(x.shape)
        return (cos * x32 + sin * swapped).type_as(x).view(B, T, H, D)


# --- attention masks: query q attends key k <= q in its document (from a BOS) and its window ----
# The window: k's block within the last w blocks up to q's (2025), or k at most w x block_size
# tokens before q (2026, FlashAttention's window_size=(w x block_size, 0)): w + 1 blocks reached.

def document_ids(tokens):
    return (tokens == BOS_TOKEN).cumsum(0)

def may_attend(q, k, docs, window_blocks, block_size, token_window=False):
    near = q - k <= window_blocks * block_size if token_window else q // block_size - k // block_size < window_blocks
    return (k <= q) & (docs[q] == docs[k]) & near

def sequence_document_ids(tokens, paired=False):  # paired heads: each token's two positions in one document
    docs = document_ids(tokens)
    return docs.repeat_interleave(2) if paired else docs

def dense_attention_mask(tokens, window_blocks, block_size, token_window=False, paired=False):  # booleans for SDPA
    docs = sequence_document_ids(tokens, paired)
    pos = torch.arange(docs.numel(), device=tokens.device)
    return may_attend(pos[:, None], pos[None, :], docs, window_blocks, block_size, token_window)

def flex_block_mask(tokens, window_blocks, block_size, token_window=False, paired=False):
    """The same mask as a FlexAttention BlockMask: full blocks skip the element-wise check."""
    from torch.nn.attention.flex_attention import BlockMask
    docs = sequence_document_ids(tokens, paired)
    n = docs.numel() // block_size
    blocks = torch.arange(n, device=tokens.device)
    first, last = docs.view(n, block_size)[:, 0], docs.view(n, block_size)[:, -1]
    q, k = blocks[:, None], blocks[None, :]
    in_window = (q - k < window_blocks + token_window) & (k <= q)
    share_doc = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    one_doc = (first[:, None] == last[:, None]) & (first[None, :] == last[None, :]) & (first[:, None] == first[None, :])
    any_allowed = in_window & share_doc
    full = any_allowed & one_doc & (k < q) & (q - k < window_blocks)
    partial = any_allowed & ~full
    window_tokens = window_blocks * block_size
    def mask_mod(b, h, q_idx, kv_idx):
        # Only the listed blocks are visited, all inside a block window: as in the 2025 record, no
        # window term there (with it, 86 ms/step on an H200 against 80). A token window's last block
        # is partly outside.
        allowed = (kv_idx <= q_idx) & (docs[q_idx] == docs[kv_idx])
        return allowed & (q_idx - kv_idx <= window_tokens) if token_window else allowed
    def ordered(mask):  # each query block's key blocks, nearest first, as the record visits them
        counts = mask.sum(dim=-1, dtype=torch.int32)
        indices = mask.to(torch.int8).argsort(dim=-1, stable=True).flip(-1).to(torch.int32)
        return counts[None, None].contiguous(), indices[None, None].contiguous()
    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod)

class VarlenMask(NamedTuple):  # FlashAttention's varlen arguments: cu_seqlens, max_seqlen, window_size=(window, 0)
    starts: torch.Tensor
    longest: int
    window: int

# varlen's bounds. FlashAttention-2 launches ceil(max_seqlen / 128) x heads blocks for every entry of
# cu_seqlens, padding included, so both stay as tight as is safe: in training the record's (T // 300
# entries rounded up to 128: FineWeb's median document is ~400 tokens), in validation what its windows
# hold (validation_document_bounds, found at set-up, before the first validation).
VARLEN_DOC_TOKENS, VARLEN_ROUNDING = 300, 128

def _round_up(n, multiple):
    return multiple * max(1, -(-int(n) // multiple))

def varlen_capacity(T):  # documents in a training micro-batch: the record's cu_seqlens entries less the first
    return _round_up(T // VARLEN_DOC_TOKENS, VARLEN_ROUNDING) - 1

def document_starts(tokens, max_doc_len, capacity=None):
    """Each document's start (a BOS, and position 0) then T, padded with T to capacity + 1 entries, so
    that no shape depends on the data (the record's padded cu_seqlens); max_doc_len bounds the documents'
    lengths. On device, no host sync: a micro-batch of more documents, or of a longer one, stops the run
    (FlashAttention would skip their tokens)."""
    T = tokens.numel()
    docs = document_ids(tokens)
    docs = docs - docs[0]  # the first document is number 0, a BOS at position 0 or not
    positions = torch.arange((capacity or varlen_capacity(T)) + 1, device=tokens.device)
    starts = torch.searchsorted(docs, positions, out_int32=True)  # document d's first position (T past the last)
    torch._assert_async((starts[-1] == T) & ((starts[1:] - starts[:-1]).max() <= max_doc_len),
                        "varlen attention: more documents in a micro-batch than its capacity, or one too long "
                        "(--attn_backend flex has no such bound)")
    return starts

def validation_document_bounds(tokens, seq_len):
    """(longest document, capacity) over the validation windows of seq_len tokens, a window cutting the
    documents it splits; rounded up (cu_seqlens to 128 entries): varlen's bounds for every validation batch."""
    n = (tokens.numel() - 1) // seq_len * seq_len
    edges = torch.unique(torch.cat([torch.nonzero(tokens[:n] == BOS_TOKEN).flatten(), torch.arange(0, n + 1, seq_len)]))
    longest, most = edges.diff().max().item(), torch.bincount(edges[:-1] // seq_len).max().item()
    return min(_round_up(longest, VARLEN_ROUNDING), seq_len), _round_up(most + 1, VARLEN_ROUNDING) - 1

def varlen_mask(tokens, window_blocks, block_size, max_doc_len, paired=False, capacity=None, starts=None):
    """The token-window mask as varlen_attn's arguments. window_blocks: an int (the kernel's argument).
    paired: over 2T positions, lengths doubled. starts: document_starts' (one call serves every kind)."""
    starts = document_starts(tokens, max_doc_len, capacity) if starts is None else starts
    return VarlenMask((1 + paired) * starts, (1 + paired) * max_doc_len, window_blocks * block_size)

def attention_masks(tokens, long_blocks, args, hw, short_blocks=None, kinds=("L", "S"), training=False,
                    eval_bounds=None):
    """Masks for the long and short windows (short: by default half the long one, at least a block);
    kinds "pL", "pS": over paired heads' sequence of 2T positions. varlen: windows as ints; documents
    no longer than train_max_doc_len in training when packed (the loader cuts them), else T; out of
    training, eval_bounds (validation_document_bounds') where given, else T and training's capacity."""
    if short_blocks is None:
        short_blocks = short_window_blocks(long_blocks)
    if hw.attention == "varlen":
        T = tokens.numel()
        longest, capacity = (min(args.train_max_doc_len or T, T), None) if training else eval_bounds or (T, None)
        build = functools.partial(varlen_mask, max_doc_len=longest, starts=document_starts(tokens, longest, capacity))
    else:
        build = functools.partial(flex_block_mask if hw.attention == "flex" else dense_attention_mask,
                                  token_window=args.token_windows)
    return {kind: build(tokens, long_blocks if kind[-1] == "L" else short_blocks, args.attn_block_size,
                        paired=kind[0] == "p") for kind in kinds}

def flex_attention_kernel():  # FlexAttention fuses only when compiled (else 55 GB of scores at 48k tokens)
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention(flex_attention)

@functools.cache
def _compiled_flex_attention(flex_attention):
    return torch.compile(flex_attention, dynamic=False)

def attend(q, k, v, mask, scale):  # q, k, v: (B, T, H, D) -> (B, T, H, D); mask: a BlockMask, VarlenMask or booleans
    if isinstance(mask, VarlenMask):  # one packed sequence (B = 1) of the documents; (W, 0): causal, W keys back
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn(q[0], k[0], v[0], mask.starts, mask.starts, mask.longest, mask.longest, scale=scale,
                           window_size=(mask.window, 0))[None]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if isinstance(mask, torch.Tensor):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        y = flex_attention_kernel()(q, k, v, block_mask=mask, scale=scale)
    return y.transpose(1, 2)


# --- attention, MLP and block --------------------------------------------------------------------
ATTN_GATE_DIMS = 12  # every gate (attention's, value embeddings', smear's, skip's) reads its input's first 12 dims

class CausalSelfAttention(nn.Module):
    def __init__(self, args, rotary, has_value_embed, key_offset=False, paired=False):
        super().__init__()
        dim, self.num_heads, self.head_dim = args.model_dim, args.num_heads, args.head_dim
        self.value_gates, self.key_offset, self.paired = args.value_gates, key_offset, paired
        self.truncate = args.bf16_weights
        bound = 3 ** 0.5 * (1.0 if args.init == "2026" else 0.5) * dim ** -0.5  # uniform with std 0.5/sqrt(dim) (2026: 1)
        qkvo = torch.empty(4, self.num_heads * self.head_dim, dim).uniform_(-bound, bound)
        qkvo[3].zero_()  # output projection starts at zero: attention adds nothing at first
        self.qkvo_w = nn.Parameter(qkvo)
        self.gate_w = nn.Parameter(torch.zeros(self.num_heads, ATTN_GATE_DIMS))  # sigmoid(0) = 0.5 on every head
        if self.value_gates:  # W_qkv and W_o scaled; v + 2 sigmoid(gate) x value_embed, 1 x at the start
            self.sa_lambdas = nn.Parameter(torch.tensor([0.5, 1.0]))
            self.ve_gate_w = nn.Parameter(torch.zeros(self.num_heads, ATTN_GATE_DIMS)) if has_value_embed else None
        else:  # v = l0*v + l1*value_embed in blocks that get a value embedding, v = l0*v elsewhere
            self.v_lambdas = nn.Parameter(torch.tensor([0.5, 0.5] if has_value_embed else [0.5]))
        self.rotary = rotary  # shared by all blocks: its tables are large at validation lengths; it holds the scale

    def forward(self, x, value_embed, mask):
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        w = as_compute(self.qkvo_w, x.dtype, self.truncate)
        w_qkv, w_o = (self.sa_lambdas[0] * w[:3], self.sa_lambdas[1] * w[3]) if self.value_gates else (w[:3], w[3])
        q, k, v = F.linear(x, w_qkv.flatten(0, 1)).view(B, T, 3, H, D).unbind(2)
        q, k = self.rotary(rms_norm(q), self.paired), self.rotary(rms_norm(k), self.paired)
        if self.key_offset:  # the stationary dims of each key from the token before (across documents): induction in one layer
            k = torch.cat([k[..., :D // 2], torch.cat([k[:, :1, :, D // 2:], k[:, :-1, :, D // 2:]], dim=1)], dim=-1)
        if not self.value_gates:
            v = self.v_lambdas[0] * v
            if value_embed is not None:
                v = v + self.v_lambdas[1] * value_embed.view_as(v)
        elif value_embed is not None:
            gate = 2 * torch.sigmoid(F.linear(x[..., :ATTN_GATE_DIMS], self.ve_gate_w.to(x.dtype)))
            v = v + gate.unsqueeze(-1) * value_embed.view_as(v)
        if self.paired:  # 2T positions: head j's query/key/value at t, then head H/2 + j's (as the record's views)
            q, k, v = (t.reshape(B, 2 * T, H // 2, D) for t in (q, k, v))
        y = attend(q, k, v, mask, self.rotary.attn_scale).reshape(B, T, H, D)
        y = y * torch.sigmoid(F.linear(x[..., :ATTN_GATE_DIMS], self.gate_w.to(x.dtype))).unsqueeze(-1)
        return F.linear(y.reshape(B, T, -1), w_o)

# --- the MLP: relu(x fc)^2 proj^T, its first GEMM with relu^2 fused (Triton), and its torch twin ----
# As the 2026-01-19 record's kernel (its triton_kernels.py, lines 259-391): one pass writes
# pre = x fc and post = relu(pre)^2, the fp32 accumulator rounded to x's dtype first and relu^2
# taken in that dtype (the twin's roundings); backward's dpre = 2 (g proj) relu(pre) is the same
# GEMM with the other epilogue.
# The other GEMMs are torch's. Any strides; fp32 accumulation, operands in the input dtype.

def relu_square_mlp_torch(x, fc, proj):  # fc, proj: (dim, hidden)
    return F.linear(F.relu(F.linear(x, fc.T)).square(), proj)

if triton is not None:
    @triton.autotune(configs=_rect_tile_configs(), key=["m", "n", "k", "FORWARD"])
    @triton.jit
    def _relu_square_matmul_kernel(a_ptr, b_ptr, out_ptr, aux_ptr, m, n, k, stride_am, stride_ak, stride_bk, stride_bn,
                                   stride_om, stride_on, stride_xm, stride_xn, FORWARD: tl.constexpr,
                                   IEEE_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr):
        # Consecutive programs share a row panel of A; int64 rows: 262144 validation rows x 3072 near 2^31
        rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        inner = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            left = _load_tile(a_ptr, rows, k0 + inner, stride_am, stride_ak, m, k)
            right = _load_tile(b_ptr, k0 + inner, cols, stride_bk, stride_bn, k, n)
            acc = _mma(left, right, acc, IEEE_FP32)
        mask = (rows[:, None] < m) & (cols[None, :] < n)
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        aux_ptrs = aux_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn
        dtype = out_ptr.dtype.element_ty
        product = acc.to(dtype)
        if FORWARD:  # product = pre; aux <- post
            tl.store(out_ptrs, product, mask=mask)
            post = tl.maximum(product, 0.0)
            tl.store(aux_ptrs, (post * post).to(dtype), mask=mask)
        else:  # product = g proj, aux = pre: out <- dpre
            pre = tl.load(aux_ptrs, mask=mask, other=0.0)
            tl.store(out_ptrs, (2 * product * tl.maximum(pre, 0.0)).to(dtype), mask=mask)

def relu_square_matmul_triton(a, b, pre=None):
    """a (M, K) @ b (K, N), any strides: (pre, relu(pre)^2); given pre, 2 (a @ b) relu(pre)."""
    _require_triton(a, b)
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    aux = torch.empty_like(out) if pre is None else pre
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))
    _relu_square_matmul_kernel[grid](a, b, out, aux, m, n, k, *a.stride(), *b.stride(), *out.stride(), *aux.stride(),
                                     FORWARD=pre is None, IEEE_FP32=a.dtype == torch.float32)
    return (out, aux) if pre is None else out

def register_mlp_ops():  # as register_fp8_ops: opaque to torch.compile, whose dynamo cannot trace the interpreter
    if hasattr(torch.ops.train_gpt, "relu_square_matmul"):
        return
    @torch.library.custom_op("train_gpt::relu_square_matmul", mutates_args=())
    def relu_square_matmul(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return relu_square_matmul_triton(a, b)
    relu_square_matmul.register_fake(lambda a, b: tuple(a.new_empty(a.shape[0], b.shape[1]) for _ in range(2)))
    @torch.library.custom_op("train_gpt::relu_square_matmul_grad", mutates_args=())
    def relu_square_matmul_grad(a: torch.Tensor, b: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return relu_square_matmul_triton(a, b, pre)
    relu_square_matmul_grad.register_fake(lambda a, b, pre: torch.empty_like(pre))

class FusedReLUSquareMLP(torch.autograd.Function):
    """relu_square_mlp_torch with the kernel's two epilogues (the record's FusedLinearReLUSquareFunction)."""
    @staticmethod
    def forward(ctx, x, fc, proj):
        if not torch.compiler.is_compiling():  # MLP() registers them too; not traceable
            register_mlp_ops()
        rows = x.reshape(-1, x.shape[-1])
        pre, post = torch.ops.train_gpt.relu_square_matmul(rows, fc)
        ctx.save_for_backward(rows, fc, proj, pre, post)
        return (post @ proj.T).view(*x.shape[:-1], proj.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, fc, proj, pre, post = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])
        dpre = torch.ops.train_gpt.relu_square_matmul_grad(grad_rows, proj, pre)
        return (dpre @ fc.T).view(*grad.shape[:-1], fc.shape[0]), rows.T @ dpre, grad_rows.T @ post

class MLP(nn.Module):
    def __init__(self, dim, hidden, truncate=False, backend="torch"):
        super().__init__()
        self.truncate, self.backend = truncate, backend
        if backend == "triton":
            register_mlp_ops()
        bound = 3 ** 0.5 * 0.5 * dim ** -0.5
        # both stored (dim, hidden): one Muon stack (the record's (hidden, dim), transposed; --muon_update_scale
        # aspect gives both its factor 2)
        self.fc_w = nn.Parameter(torch.empty(dim, hidden).uniform_(-bound, bound))
        self.proj_w = nn.Parameter(torch.zeros(dim, hidden))

    def forward(self, x):
        fc, proj = (as_compute(w, x.dtype, self.truncate) for w in (self.fc_w, self.proj_w))
        return (FusedReLUSquareMLP.apply if self.backend == "triton" else relu_square_mlp_torch)(x, fc, proj)

class Block(nn.Module):
    def __init__(self, args, layer, rotary, has_value_embed, mlp_backend="torch"):
        super().__init__()
        has_attention = layer not in _layer_list(args.attention_free_layers)
        self.window = args.window_pattern[layer]
        paired = layer in _layer_list(args.paired_head_layers)
        self.attn = CausalSelfAttention(args, rotary, has_value_embed, args.key_offset and self.window == "L",
                                        paired) if has_attention else None
        self.mask_kind = "p" * paired + self.window
        self.mlp = MLP(args.model_dim, args.mlp_ratio * args.model_dim, args.bf16_weights, mlp_backend)
        # x = a*x + b*x0: two parameters, as Adam treats them apart in the 2026 record. Scalars (0-dim):
        # a (1,) fp32 tensor would make bf16 activations fp32, a 0-dim one keeps their dtype
        self.resid_lambda, self.x0_lambda = nn.Parameter(torch.tensor(args.resid_lambda_init)), nn.Parameter(torch.tensor(0.0))
        self.bigram_lambda = nn.Parameter(torch.tensor(0.1)) if args.bigram_vocab_size else None

    def forward(self, x, x0, value_embed, masks, x0_bigram=None):
        x = self.resid_lambda * x + self.x0_lambda * x0
        if x0_bigram is not None:
            x = x + self.bigram_lambda * x0_bigram
        if self.attn is not None:
            x = x + self.attn(rms_norm(x), value_embed, masks[self.mask_kind])
        return x + self.mlp(rms_norm(x))


# --- FP8 head --------------------------------------------------------------------------------
# The head's matmul in float8 (e4m3 operands, e5m2 gradient) with static scales: the record's (2026),
# or (bounded) scales that cannot overflow: RMS-normed inputs |x_i| <= sqrt(dim), weights below
# 448 * 2^-9, logit gradients of the summed loss at most 1. A custom op, opaque to torch.compile as in the record; on CUDA each
# body is compiled whole (the gradient's scaling, rounding and transpose in one pass).

def fp8_head_scales(model_dim, kind="bounded"):  # (x_scale, w_scale, grad_scale): what the operands are divided by
    if kind == "2026":  # the 2026-01-19 record's (inputs to 100, weights to 1.6, gradients to 0.75)
        return 100 / 448, 1.6 / 448, 0.75 / 448
    return model_dim ** 0.5 / 448, 2 ** -9, 1 / 448

def _fp8_mm_forward(x, w, x_scale, w_scale):
    x8, w8 = x.div(x_scale).to(torch.float8_e4m3fn), w.div(w_scale).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x8, w8.T, out_dtype=torch.bfloat16, scale_a=x.new_tensor(x_scale, dtype=torch.float32),
                           scale_b=x.new_tensor(w_scale, dtype=torch.float32), use_fast_accum=True)
    return out, x8, w8

def _fp8_mm_backward(grad, x8, w8, x_scale, w_scale, grad_scale):
    scale = functools.partial(grad.new_tensor, dtype=torch.float32)
    g8 = grad.div(grad_scale).to(torch.float8_e5m2)
    grad_x = torch._scaled_mm(g8, w8.T.contiguous().T, out_dtype=torch.bfloat16, scale_a=scale(grad_scale),
                              scale_b=scale(w_scale), use_fast_accum=False)
    grad_w = torch._scaled_mm(g8.T.contiguous(), x8.T.contiguous().T, out_dtype=torch.float32,
                              scale_a=scale(grad_scale), scale_b=scale(x_scale), use_fast_accum=False)
    return grad_x, grad_w

@functools.cache
def _compiled(fn, backend="inductor"):
    """fn compiled, called below the ADInplaceOrView key: AOT autograd's first call excludes that
    (guarded) key, later calls do not, so the body would be captured twice."""
    compiled = torch.compile(fn, dynamic=False, backend=backend)
    @functools.wraps(fn)
    def below_inplace_or_view(*args):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return compiled(*args)
    return below_inplace_or_view

def _on_device_of(t, fn):  # compiled on CUDA; eager on CPU, where it buys nothing
    return _compiled(fn) if t.is_cuda else fn

def register_fp8_ops():  # once, on first use: a second copy of this module (__main__ and imported) reuses them
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
    """x @ w.T in bf16 through float8 operands; x (T, in) bf16, w (out, in) bf16 or fp32; differentiable."""
    if not torch.compiler.is_compiling():  # GPT() registers them too; not traceable
        register_fp8_ops()
    return torch.ops.train_gpt.fp8_mm(x, w, x_scale, w_scale, grad_scale)[0]


# --- the GPT -------------------------------------------------------------------------------------
VAL_HEAD_CHUNK = 32768  # validation rows per head pass: (32768 x 50304) fp32 logits are 6.6 GB

def value_embed_of_layer(args):
    """Per block, its value embedding or None: value_embed_layers, or embedding i feeding blocks i
    and L-n+i (012...012)."""
    if args.value_embed_layers:
        return [None if c == "." else int(c) for c in args.value_embed_layers]
    L, n = args.num_layers, args.num_value_embeds
    return [i if i < n else (i - (L - n) if i >= L - n else None) for i in range(L)]

class GPT(nn.Module):
    def __init__(self, args, hw):
        super().__init__()
        self.args, self.hw = args, hw
        V, D, L = args.vocab_size, args.model_dim, args.num_layers
        longest = max(_numbers(args.train_seq_len_schedule, int) + [args.train_seq_len, args.val_seq_len])
        self.rotary = Rotary(args.head_dim, longest, args.rotary_base, args.attn_scale, args.yarn)
        self.embed = nn.Embedding(V, D)
        self.value_embeds = nn.ModuleList(nn.Embedding(V, D) for _ in range(args.num_value_embeds))
        # (previous, own) token pairs hashed into a table, zero at the start (the record's bigram embedding)
        self.bigram_embed = nn.Embedding(args.bigram_vocab_size, D) if args.bigram_vocab_size else None
        self.value_embed_of_layer = value_embed_of_layer(args)
        self.blocks = nn.ModuleList(Block(args, i, self.rotary, self.value_embed_of_layer[i] is not None,
                                          hw.mlp_backend) for i in range(L))
        self.skip_layers = _layer_list(args.skip_layers)
        if self.skip_layers:  # one skip, x += sigmoid(l) * 2 sigmoid(w x0[:12]) * (the earlier block's output)
            self.skip_gate, self.skip_lambda = nn.Parameter(torch.zeros(ATTN_GATE_DIMS)), nn.Parameter(torch.tensor(-1.5))
        else:  # U-net: each encoder block's output joins its mirror decoder block
            self.skip_weights = nn.Parameter(torch.ones(L // 2))
        if args.smear:  # x[t] += l * sigmoid(w x[t][:12]) * x[t-1], on the embeddings
            self.smear_gate, self.smear_lambda = nn.Parameter(torch.zeros(ATTN_GATE_DIMS)), nn.Parameter(torch.tensor(0.0))
        if args.backout_layer >= 0:
            self.backout_lambda = nn.Parameter(torch.tensor(0.5))
        self.lm_head_w = nn.Parameter(torch.zeros(V, D))  # 2025: zero, the initial loss exactly ln(V)
        with torch.no_grad():
            for embedding in [self.bigram_embed] + (list(self.value_embeds) if args.init == "2026" else []):
                if embedding is not None:
                    embedding.weight.zero_()
            if args.init == "2026":  # the head small and random, the token embedding a copy of it
                self.lm_head_w.normal_(0, 0.005)
                self.embed.weight.copy_(self.lm_head_w)
        if args.bf16_embeds:  # as in the record: half the memory and half the bytes on the wire
            for embedding in [self.embed, self.bigram_embed, *self.value_embeds]:
                if embedding is not None:
                    embedding.bfloat16()
        if args.bf16_weights:  # the 2026 record's: Adam's small steps round in bf16 (a gate's stop moving past ~0.03)
            for name, p in self.named_parameters():
                if name == "lm_head_w" or name.endswith("gate") or name.endswith("gate_w"):
                    p.data = p.data.bfloat16()
                elif name.endswith(("qkvo_w", "fc_w", "proj_w")):  # its bf16 start, the mantissa's low bits zero
                    p.data = p.data.bfloat16().float()
        self.fp8_scales = fp8_head_scales(D, args.fp8_scales)
        self.embed_tied = False  # set per step: embed_tied_at
        # varlen's (longest document, capacity) out of training: set by train() from its validation windows,
        # which alone it then fits; None: T and training's capacity
        self.varlen_eval_bounds = None
        if hw.fp8_head:
            register_fp8_ops()

    def forward(self, tokens, targets, long_window_blocks, short_window_blocks=None, mtp_weights=None):
        """tokens, targets: (T,) int64 -> the fp32 cross-entropy summed over positions in training (as
        the record: its FP8 scale assumes it), averaged in eval; without targets, the logits.
        mtp_weights: (K,) the loss's weights of the next K tokens (training)."""
        return self.head(self.trunk(tokens, long_window_blocks, short_window_blocks), targets, mtp_weights)

    def compile_for_training(self, scope, backend="inductor"):
        """scope "model": one graph, as the record (every gradient is final only when backward is).
        "blocks": each block and the head alone, so gradient communication overlaps backward."""
        # about 12 graph variants of the blocks, or (varlen) a graph per window: more than dynamo's default limit of 8
        if scope == "blocks" or self.hw.attention == "varlen":
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if scope == "model":
            self.compile(dynamic=False, fullgraph=True, backend=backend)
            return
        for block in self.blocks:
            block.compile(dynamic=False, backend=backend)
        self.head = torch.compile(self.head, dynamic=False, backend=backend)

    def trunk(self, tokens, long_window_blocks, short_window_blocks=None):
        masks = attention_masks(tokens, long_window_blocks, self.args, self.hw, short_window_blocks,
                                sorted({block.mask_kind for block in self.blocks if block.attn is not None}), self.training,
                                self.varlen_eval_bounds)
        # the embedding is the head's weights while tied (its gradient joins the head's, as the record's sum)
        x = (F.embedding(tokens, self.lm_head_w) if self.embed_tied else self.embed(tokens)).to(self.hw.compute_dtype)
        if self.args.smear:  # (across documents, as the record)
            gate = self.smear_lambda * torch.sigmoid(x[1:, :ATTN_GATE_DIMS] @ self.smear_gate.to(x.dtype))
            x = torch.cat([x[:1], x[1:] + gate[:, None] * x[:-1]])
        x = x0 = rms_norm(x[None])
        value_embeds = [ve(tokens)[None].to(x.dtype) for ve in self.value_embeds]
        x0_bigram = None if self.bigram_embed is None else \
            self.bigram_embed(bigram_hash(tokens, self.args.bigram_vocab_size))[None].to(x.dtype)
        skips, half, x_backout = [], len(self.blocks) // 2, None
        first_decoder = len(self.blocks) - half
        for i, block in enumerate(self.blocks):
            if self.skip_layers and i == self.skip_layers[1]:
                gate = torch.sigmoid(self.skip_lambda) * 2 * torch.sigmoid(x0[..., :ATTN_GATE_DIMS] @ self.skip_gate.to(x0.dtype))
                x = x + gate[..., None] * skips.pop()
            elif not self.skip_layers and i >= first_decoder:  # U-net: the last encoder output joins the first decoder block
                x = x + self.skip_weights[i - first_decoder] * skips.pop()
            ve_index = self.value_embed_of_layer[i]
            x = block(x, x0, value_embeds[ve_index] if ve_index is not None else None, masks, x0_bigram)
            if (i == self.skip_layers[0]) if self.skip_layers else (i < half):
                skips.append(x)
            if i == self.args.backout_layer:
                x_backout = x
        if x_backout is not None:  # what the early blocks wrote for later context, not for the prediction
            x = x - self.backout_lambda * x_backout
        return x

    def head(self, x, targets=None, mtp_weights=None):
        """Final norm, the (optionally FP8) projection, the soft cap, and the loss if targets given."""
        x = rms_norm(x).flatten(0, 1)
        if targets is not None and not self.training:
            # a chunk of rows at a time: an uncompiled head never holds all the logits
            sums = [F.cross_entropy(self._soft_cap(self._logits(part)), part_targets, reduction="sum")
                    for part, part_targets in zip(x.split(VAL_HEAD_CHUNK), targets.split(VAL_HEAD_CHUNK))]
            return torch.stack(sums).sum() / targets.numel()
        if mtp_weights is not None and targets is not None:  # the cap inside the loss (fused on CUDA)
            cap = (self.args.logit_cap_height or 2 * self.args.logit_softcap, self.args.logit_cap_shift,
                   self.args.logit_softcap / 2)
            loss = CappedMultiTokenLoss.apply if self.hw.ce_backend == "triton" else capped_multi_token_loss_torch
            return loss(self._logits(x), targets, mtp_weights, *cap).sum()
        logits = self._soft_cap(self._logits(x))
        return logits if targets is None else F.cross_entropy(logits, targets, reduction="sum")

    def _logits(self, x):
        if self.hw.fp8_head and self.training:  # validation measures the model in full bf16
            return fp8_matmul(x, self.lm_head_w, *self.fp8_scales)
        return F.linear(x, self.lm_head_w.to(x.dtype))

    def _soft_cap(self, logits):
        height, shift, width = self.args.logit_cap_height, self.args.logit_cap_shift, self.args.logit_softcap / 2
        if height and not self.training:  # the 2026 record caps validation's logits in their own dtype (bf16)
            return (height * torch.sigmoid((logits + shift) / width)).float()
        return (height or 2 * self.args.logit_softcap) * torch.sigmoid((logits.float() + shift) / width)

# --- the multi-token loss: the soft cap and cross-entropy fused (Triton), and its torch twin ---------
# Row r's loss: sum over k of weights[k] x (logsumexp(z_r) - z_r[targets[r + k]]) where r + k is in
# the micro-batch (across documents, as the record), z = height x sigmoid((logits + shift) / width).
# The kernels read each row's logits twice (forward: an online logsumexp; backward: the gradient),
# never writing the capped logits; the gradient comes out in the logits' dtype.

def capped_multi_token_loss_torch(logits, targets, weights, height, shift, width):  # (rows,) fp32
    z = height * torch.sigmoid((logits.float() + shift) / width)
    lse = z.logsumexp(dim=-1)
    losses = torch.zeros_like(lse)
    for k in range(weights.numel()):
        rows = targets.numel() - k
        losses[:rows] += weights[k] * (lse[:rows] - z[:rows].gather(1, targets[k:, None]).squeeze(1))
    return losses

if triton is not None:
    @triton.jit
    def _capped_loss_fwd_kernel(logits_ptr, losses_ptr, lse_ptr, targets_ptr, weights_ptr, row_stride, n_rows, n_cols,
                                n_weights, height, shift, width, BLOCK: tl.constexpr):
        height, shift, width = _as_fp32(height), _as_fp32(shift), _as_fp32(width)
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        running_max, running_sum = -float("inf"), 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            z = tl.where(cols < n_cols, height * tl.sigmoid((x + shift) / width), -float("inf"))
            new_max = tl.maximum(running_max, tl.max(z, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        tl.store(lse_ptr + row, lse)
        loss = 0.0
        for k in range(n_weights):
            if row + k < n_rows:
                x = tl.load(row_ptr + tl.load(targets_ptr + row + k)).to(tl.float32)
                loss += tl.load(weights_ptr + k) * (lse - height * tl.sigmoid((x + shift) / width))
        tl.store(losses_ptr + row, loss)

    @triton.jit
    def _capped_loss_bwd_kernel(grad_ptr, grad_losses_ptr, logits_ptr, lse_ptr, targets_ptr, weights_ptr, row_stride,
                                n_rows, n_cols, n_weights, height, shift, width, BLOCK: tl.constexpr):
        height, shift, width = _as_fp32(height), _as_fp32(shift), _as_fp32(width)
        row = tl.program_id(0).to(tl.int64)
        lse, grad_loss = tl.load(lse_ptr + row), tl.load(grad_losses_ptr + row)
        weight_sum = 0.0  # each z's share of the softmax, over the row's predictions
        for k in range(n_weights):
            if row + k < n_rows:
                weight_sum += tl.load(weights_ptr + k)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            sig = tl.sigmoid((x + shift) / width)
            z = height * sig
            dloss_dz = weight_sum * tl.exp(z - lse)
            for k in range(n_weights):
                if row + k < n_rows:
                    dloss_dz -= tl.where(cols == tl.load(targets_ptr + row + k), tl.load(weights_ptr + k), 0.0)
            grad = grad_loss * dloss_dz * z * (1.0 - sig) / width  # dz/dx = height sig (1 - sig) / width
            tl.store(grad_ptr + row * row_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)

class CappedMultiTokenLoss(torch.autograd.Function):
    """capped_multi_token_loss_torch by the fused kernels: (rows,) fp32 losses."""
    @staticmethod
    def forward(ctx, logits, targets, weights, height, shift, width):
        _require_triton(logits)
        logits, targets, weights = logits.contiguous(), targets.contiguous(), weights.float().contiguous()
        rows, cols = logits.shape
        losses, lse = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(2))
        _capped_loss_fwd_kernel[(rows,)](logits, losses, lse, targets, weights, logits.stride(0), rows, cols,
                                         weights.numel(), height, shift, width, BLOCK=1024, num_warps=8)
        ctx.save_for_backward(logits, targets, weights, lse)
        ctx.cap = (height, shift, width)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        logits, targets, weights, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        _capped_loss_bwd_kernel[(logits.shape[0],)](grad, grad_losses.contiguous(), logits, lse, targets, weights,
                                                    logits.stride(0), *logits.shape, weights.numel(), *ctx.cap,
                                                    BLOCK=1024, num_warps=8)
        return grad, None, None, None, None, None


# -----------------------------------------------------------------------------------------------
# 7. Data
#
# Shards: a 256 x int32 header (magic, version, token count), then uint16 tokens. A micro-batch packs
# documents from successive BOS tokens, each cut at train_max_doc_len, into exactly seq_len+1 tokens
# (PackedBatches; 2025: a window of seq_len+1 tokens from a BOS, TrainBatches). Micro-batches are
# numbered globally and rank r takes r, r+W, ...: every world size sees the record's token stream,
# and a step's micro-batches come from one shard. A thread reads the next shard ahead.

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
# GPT-2 tokens: an id in vocab_size's padding (50257..50303) means a corrupt shard.
GPT2_VOCAB_SIZE = 50257

class DataError(ValueError):
    """A missing or malformed data file; the message is one line naming the file."""

class DataExhausted(RuntimeError):
    pass

def read_shard_header(path):  # the token count, header and size checked
    try:
        with open(path, "rb") as f:
            raw, size = f.read(SHARD_HEADER_BYTES), os.fstat(f.fileno()).st_size
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) < SHARD_HEADER_BYTES:
        raise DataError(f"{path}: too short for a shard header ({len(raw)} bytes, need {SHARD_HEADER_BYTES})")
    magic, version, count = (int(x) for x in np.frombuffer(raw, dtype="<i4")[:3])
    expected = SHARD_HEADER_BYTES + 2 * count
    says = f"header says {count} tokens ({expected} bytes) but the file has {size} bytes"
    problem = (f"not a shard: bad magic {magic} (expected {SHARD_MAGIC})" if magic != SHARD_MAGIC else
               f"unsupported version {version} (expected {SHARD_VERSION})" if version != SHARD_VERSION else
               f"negative token count {count} in header" if count < 0 else f"truncated: {says}" if size < expected
               else f"{size - expected} trailing bytes: {says}" if size > expected else None)
    if problem:
        raise DataError(f"{path}: {problem}")
    return count

def read_shard_tokens(path, vocab_size=GPT2_VOCAB_SIZE, max_tokens=None):
    """The shard's (first max_tokens) tokens as a uint16 array, each checked below vocab_size."""
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
    """A uint16 tensor. Pinned, a window sliced from it (validation, the 2025 loader) copies to the GPU
    asynchronously; the packed loader's torch.cat of a step's chunks is pageable, as in the record."""
    tokens = read_shard_tokens(path, GPT2_VOCAB_SIZE, max_tokens)
    out = torch.empty(tokens.size, dtype=torch.uint16, pin_memory=pin_memory)
    out.copy_(torch.from_numpy(tokens))
    return out

def find_shards(pattern, what, hint="", option=None):  # option: named in the error where the user set it
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

def step_room(windows_per_step, seq_len):  # beyond a step's first position: the record's margin
    return 2 * windows_per_step * seq_len + 1

class ShardQueue:
    """The training shards in name order, the next one read in a thread while this one is used."""
    def __init__(self, files, rank, world_size, pin_memory, first_shard):
        self.files, self.rank, self.world_size, self.pin_memory = list(files), rank, world_size, pin_memory
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._next_file = first_shard
        self._shard = self._load_next()  # synchronous: a bad first shard fails before training
        self._prefetch = self._submit_next()

    def _load_next(self):
        self._next_file += 1
        return LoadedShard(self.files[self._next_file - 1], self.pin_memory)

    def _submit_next(self):
        return self._pool.submit(self._load_next) if self._next_file < len(self.files) else None

    def _advance_shard(self, taken):
        if self._prefetch is None:
            raise DataExhausted(f"training data ran out after {taken} ({len(self.files)} shard(s), last "
                                f"{self.files[-1]}); download more shards with `python data/cached_fineweb10B.py N` "
                                "or lower --num_iterations")
        self._shard = self._prefetch.result()
        self._prefetch = self._submit_next()

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _position(self, shard, **more):  # for checkpoints: the shard by index, name and length
        return dict(shard=self.files.index(shard.path), file=os.path.basename(shard.path),
                    tokens=shard.tokens.numel(), **more)

class TrainBatches(ShardQueue):
    """BOS-aligned training windows, a step's worth from one shard, dealt out to ranks in global order."""
    def __init__(self, files, seq_len, rank, world_size, pin_memory=False, windows_per_step=1, start=None):
        """start: a checkpoint's state() to continue from, over the same files."""
        start = start or dict(shard=0, cursor=0, windows_taken=0)
        super().__init__(files, rank, world_size, pin_memory, start["shard"])
        self.seq_len, self.windows_per_step = seq_len, windows_per_step
        # the next window starts at the first BOS at or after _cursor; _step_start: where this step began
        self._cursor, self.windows_taken, self._step_start = start["cursor"], start["windows_taken"], None

    def _advance_shard(self):
        super()._advance_shard(f"{self.windows_taken} windows of {self.seq_len} tokens")
        self._cursor = 0

    def _next_bos(self, position):  # index into the shard's BOS positions of the first one at or after position
        return int(torch.searchsorted(self._shard.bos, position))

    def _room_for_a_step(self):
        # the record's test, from the shard's start or the BOS the next window starts at
        shard, position = self._shard, self._cursor
        if position > 0:
            i = self._next_bos(position)
            position = int(shard.bos[i]) if i < len(shard.bos) else shard.tokens.numel()
        return position + step_room(self.windows_per_step, self.seq_len) < shard.tokens.numel()

    def _next_window(self):  # the next global window: seq_len + 1 tokens from a BOS, in one shard
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

    def state(self):
        """The stream position for checkpoints (every rank's); after data ran out mid-step, that step's start."""
        shard, cursor, taken = self._shard, self._cursor, self.windows_taken
        if taken % self.windows_per_step and self._step_start is not None:
            shard, cursor, taken = self._step_start
        return self._position(shard, cursor=cursor, windows_taken=taken)

    def next_batch(self, device, seq_len):  # this rank's next (inputs, targets): one window out of every world_size
        assert seq_len == self.seq_len  # (a train_seq_len_schedule needs PackedBatches: harness/config.py)
        mine = None
        for r in range(self.world_size):
            window = self._next_window()
            self.windows_taken += 1
            if r == self.rank:
                mine = window
        mine = mine.to(device, non_blocking=True).to(torch.int64)
        return mine[:-1], mine[1:]

class PackedBatches(ShardQueue):
    """The 2026-01-19 record's batches: documents from successive BOS tokens, each cut at
    max_doc_len, packed into chunks of exactly seq_len + 1 tokens (the last document cut to fit, the
    rest of it skipped). A step's chunks_per_step chunks come from one shard, or the next shard
    starts them afresh, and are dealt out to ranks in global order: every world size trains on the
    token stream the record's 8 GPUs read (its loader at 8 GPUs fills a step in one call)."""
    def __init__(self, files, max_doc_len, rank, world_size, pin_memory=False, chunks_per_step=1, start=None):
        start = start or dict(shard=0, doc=0, chunks_taken=0)
        super().__init__(files, rank, world_size, pin_memory, start["shard"])
        self.max_doc_len, self.chunks_per_step = max_doc_len, chunks_per_step
        self._bos = self._shard.bos.tolist()
        # _doc: the index among the shard's BOS positions of the next document; _step: this step's
        # chunks as (start, end) token ranges, and where the step began
        self._doc, self.chunks_taken, self._step, self._step_start = start["doc"], start["chunks_taken"], [], None

    def _advance_shard(self):
        super()._advance_shard(f"{self.chunks_taken} chunks")
        self._bos, self._doc = self._shard.bos.tolist(), 0

    def _plan_step(self, seq_len):
        while True:
            bos, size, doc, chunks = self._bos, self._shard.tokens.numel(), self._doc, []
            while len(chunks) < self.chunks_per_step and doc < len(bos):
                ranges, length = [], 0
                while length <= seq_len and doc < len(bos):
                    start = bos[doc]
                    end = min(bos[doc + 1] if doc + 1 < len(bos) else size, start + self.max_doc_len,
                              start + seq_len + 1 - length)
                    ranges.append((start, end))
                    length, doc = length + end - start, doc + 1
                if length == seq_len + 1:
                    chunks.append(ranges)
            if len(chunks) == self.chunks_per_step:
                self._doc = doc
                return chunks
            self._advance_shard()  # too few documents left for the step (the record drops them too)

    def state(self):
        """As TrainBatches.state: mid-step, the step's start (its chunks are planned again from there)."""
        shard, doc, taken = self._shard, self._doc, self.chunks_taken
        if taken % self.chunks_per_step and self._step_start is not None:
            shard, doc, taken = self._step_start
        return self._position(shard, doc=doc, chunks_taken=taken)

    def next_batch(self, device, seq_len):  # this rank's next (inputs, targets), seq_len tokens each
        if self.chunks_taken % self.chunks_per_step == 0:
            self._step_start = (self._shard, self._doc, self.chunks_taken)
            self._step = self._plan_step(seq_len)
        mine = self._step[self.chunks_taken % self.chunks_per_step + self.rank]
        self.chunks_taken += self.world_size
        tokens = self._shard.tokens
        mine = torch.cat([tokens[start:end] for start, end in mine])
        assert mine.numel() == seq_len + 1, "a step's chunks are planned for one seq_len"
        mine = mine.to(device, non_blocking=True).to(torch.int64)
        return mine[:-1], mine[1:]

def bigram_hash(tokens, table_size):
    """Each position's row in the bigram table: (36313 x token XOR 27191 x previous token) mod
    (table_size - 1), the last row for the first position (it has no previous token). Documents
    are not told apart (the record: masking cost time and gained nothing). In int32, as the record,
    where position 1's previous token is already that last row's id (its product wraps)."""
    x, mod = tokens.to(torch.int32).clone(), table_size - 1
    x[0] = mod
    x[1:] = torch.bitwise_xor(36313 * x[1:], 27191 * x[:-1]) % mod
    return x

def load_val_tokens(files, count, pin_memory=False):  # the first count+1 tokens of the validation shards
    parts, need = [], count + 1
    for f in files:
        if need == 0:
            break
        parts.append(load_shard(f, max_tokens=need, pin_memory=pin_memory))
        need -= parts[-1].numel()
    if need:
        raise DataError(f"{files[0]}: validation shards hold {count + 1 - need} tokens, fewer than --val_tokens={count} + 1")
    return parts[0] if len(parts) == 1 else torch.cat(parts)

def val_batches(tokens, seq_len, rank, world_size, device):
    """Contiguous validation windows, rank r taking every world_size-th one."""
    for i in range(rank, (tokens.numel() - 1) // seq_len, world_size):
        start = i * seq_len
        window = tokens[start:start + seq_len + 1].to(device, non_blocking=True).to(torch.int64)
        yield window[:-1], window[1:]

def resolve_data_files(args):
    """The shard files, and the log's line on where they come from (defaults: in this repository)."""
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
    options = ("train_files", "val_files")
    config = harness("config")  # says what to do where a pattern matches no shard
    hints = [config.missing_data_hint(args, option, is_default, on_sample) if config else is_default * (
             f" (the default data lies in data/ beside train_gpt.py: keep a fork beside data/, or set --{option})")
             for option, is_default in zip(options, defaults)]
    # A pattern the user gave first: a typo there is likelier than a missing download.
    order = sorted(range(2), key=lambda i: defaults[i])
    found = {i: find_shards(patterns[i], ("training", "validation")[i], hints[i],
                            None if defaults[i] or on_sample else options[i]) for i in order}
    identity = lambda path: (os.stat(path).st_dev, os.stat(path).st_ino)  # noqa: E731 (links, other spellings)
    both = [path for path in found[0] if identity(path) in set(map(identity, found[1]))]
    if both:
        raise DataError(f"{both[0]}: matched by both --train_files and --val_files; validation must not read "
                        "training shards")
    return found[0], found[1], note


# -----------------------------------------------------------------------------------------------
# 8. Training
#
# Set-up, untimed warmup steps on random tokens that compile every graph (the record's: steps 0-2 and
# those around each window change, each with a validation pass; ours adds a batch-size change), a
# reset to the initial state, then the timed steps (the clock stops for validation). The log keeps
# the public speedrun's line formats. A val loss that is not finite or a nat above step 0's stops the
# run at that validation; a non-finite train loss, a stop signal or a failed log write at the next
# check (every check_every steps and before validations, by all ranks together).

# --- the schedules, by step ----------------------------------------------------------------------
# Progress runs over the scheduled steps: num_iterations less the extension_steps that follow them.

def lr_factor_at(step, args):
    """The plateau of the step's part of the schedule, then linear to final_lr_frac over the last
    cooldown_frac, which holds after the scheduled steps."""
    progress = step / (args.num_iterations - args.extension_steps)
    if progress > 1:
        return args.final_lr_frac
    plateaus = _numbers(args.lr_plateaus)
    peak = plateaus[sum(progress > k / len(plateaus) for k in range(1, len(plateaus)))]
    if progress < 1 - args.cooldown_frac or args.cooldown_frac == 0:
        return peak
    w = (1 - progress) / args.cooldown_frac
    return peak * w + (1 - w) * args.final_lr_frac

def muon_momentum_at(step, args):  # up from start to end over the warmup, back down over the cooldown
    start, end = args.muon_momentum_start, args.muon_momentum_end
    if step < args.muon_momentum_warmup_steps:
        frac = step / args.muon_momentum_warmup_steps
        if args.muon_momentum_cooldown_steps:  # the 2026 record's form (an ulp apart from 2025's at some steps)
            return start + frac * (end - start)
        return (1 - frac) * start + frac * end
    cooldown_start = args.num_iterations - args.muon_momentum_cooldown_steps
    if args.muon_momentum_cooldown_steps and step > cooldown_start:
        return end - (step - cooldown_start) / args.muon_momentum_cooldown_steps * (end - start)
    return end

def _staged(step, scheduled, values, final):  # values[k] over the k-th equal part of the scheduled steps, then final
    return final if step >= scheduled else values[int(len(values) * (step / scheduled))]

def mtp_weights_at(step, args):  # the loss's weights of the next 1-3 tokens: [1, .5, .25 -> 0], [1, .5 -> 0], [1] by thirds
    x = step / (args.num_iterations - args.extension_steps)
    if not args.mtp or x >= 2 / 3:
        return [1.0]
    return [1.0, 0.5, 0.25 * (1 - 3 * x)] if x < 1 / 3 else [1.0, 0.5 * (1 - (3 * x - 1))]

def adam_steps_at(step, args):  # Adam steps on every adam_every-th step, its gradients summed since its last
    return step % args.adam_every == args.adam_every - 1

def embed_split_step(args):  # the first Adam step from embed_split_frac of the scheduled steps on
    start = math.ceil(args.embed_split_frac * (args.num_iterations - args.extension_steps))
    return start + (args.adam_every - 1 - start) % args.adam_every

def embed_tied_at(step, args):  # the split step still trains tied; its state is copied after its update
    return args.embed_split_frac > 0 and step <= embed_split_step(args)

def train_seq_len_at(step, args):  # the batch size schedule, per micro-batch
    lengths = _numbers(args.train_seq_len_schedule, int) or [args.train_seq_len]
    return _staged(step, args.num_iterations - args.extension_steps, lengths, args.train_seq_len)

def eta_seconds(elapsed_ms, step, tokens_through):  # time so far per token over the tokens left (the batch grows)
    return elapsed_ms / 1000 * (tokens_through[-1] - tokens_through[step - 1]) / tokens_through[step - 1]

def long_window_blocks_at(step, args):
    """window_schedule's entry for the step's part of the scheduled steps (window_final_blocks after
    them); without one (2025), window_growth_tokens x step/num_iterations in whole blocks, at least one
    (1 to 14), growing through the extension steps too."""
    blocks, final, scheduled = _numbers(args.window_schedule, int), args.window_final_blocks, \
        args.num_iterations - args.extension_steps
    if blocks:
        return _staged(step, scheduled, blocks, final or blocks[-1])
    tokens = args.window_growth_tokens * (step / args.num_iterations)
    return max(1, int(-(-tokens // args.attn_block_size)))  # float floor division is exact: a true ceiling

def short_window_blocks(long_blocks):  # half the long window, at least a block (the record's ws_long // 2)
    return max(long_blocks // 2, 1) if isinstance(long_blocks, int) else torch.clamp(long_blocks // 2, min=1)

def warmup_steps_at_transitions(args):  # steps 0-2 and those around each change of window or batch (new shapes)
    shapes = [(long_window_blocks_at(s, args), train_seq_len_at(s, args)) for s in range(args.num_iterations)]
    changes = [s for s in range(1, args.num_iterations) if shapes[s] != shapes[s - 1]]
    return sorted(({0, 1, 2} | {s + d for s in changes for d in (-1, 0, 1)}) & set(range(args.num_iterations)))

def follow_windows(rotary, step, args):  # YaRN's state at a step: the initial one, then each window change up to it
    rotary.reset()
    for s in range(step + 1):
        rotary.follow(long_window_blocks_at(s, args), args.attn_block_size)

class RunLog:
    """records/<date>_<run_name>/<run_id>.txt, by rank 0, never overwritten; it appears with the
    header, so a run that fails in set-up leaves none. A failed write (a full disk) is kept in
    `error` for the loop's next check; later lines go to the console only. console: False, or the
    console's own version of the line."""

    def __init__(self, args, ranks, echo=True):
        self.echo = echo and ranks.is_master
        self.path = os.path.join(run_folder(args), f"{uuid.uuid4()}.txt") if ranks.is_master else None
        self.error, self.started = None, False

    def __call__(self, text, console=True):
        if self.path is None:
            return
        if not self.started and self.echo:
            say(f"logging to {self.path}")
        if console and self.echo:
            say(text if console is True else console)
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

def duration(seconds):  # 83 -> "1m23s", for the console's eta
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"

def run_summary(args, result, log):
    """The console's last line: the final val loss against the target, the train time, the log."""
    N, target = args.num_iterations, args.target_val_loss
    step, loss = result.val_losses[-1] if result.val_losses else (None, None)
    scored = (f"val_loss {loss:.4f} {'reached' if loss <= target else 'missed'} the target {target}"
              if step == N and not result.failure else f"stopped at step {result.steps_done}/{N}: target {target} "
              f"not reached" + (f" (last val_loss {loss:.4f} at step {step})" if result.val_losses else ""))
    timing = "" if result.crashed else f"; train time {result.train_time_ms / 1000:.1f} s"  # a crash's clock is unread
    return f"{scored}{timing}; log {os.path.abspath(log.path)}"

def hardware_description(hw):  # nvidia-smi's, or the same dated form (compare.py reads the date)
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

def shown_paths(paths):  # relative to the repository where they lie inside it
    return ",".join(os.path.relpath(p, REPO_DIR) if os.path.abspath(p).startswith(REPO_DIR + os.sep) else p
                    for p in paths)

def log_header(log, args, ranks, hw, model, optimizer, data_note, data_files):
    cuda = f"compiled for CUDA {torch.version.cuda}" if torch.version.cuda else "(CPU build)"
    log("\n".join([logged_code(), "=" * 100, f"Running Python {sys.version}", f"Running PyTorch {torch.__version__} {cuda}",
                   f"Running Triton version {triton.__version__ if triton else 'not installed'}",
                   hardware_description(hw)]), console=False)
    shown = dict(zip(("train_files", "val_files"), map(shown_paths, data_files)))  # the shards actually read
    effective = dict(world_size=ranks.world_size, effective_device=hw.device.type,
                     effective_compute_dtype=str(hw.compute_dtype).removeprefix("torch."),
                     effective_attention=hw.attention, effective_fp8_head=hw.fp8_head,
                     effective_ns_backend=hw.ns_backend, effective_ce_backend=hw.ce_backend,
                     effective_mlp_backend=hw.mlp_backend, grad_accum_steps=args.micro_batches // ranks.world_size,
                     parameters=sum(p.numel() for p in model.parameters()),
                     optimizer_state_bytes_per_rank=optimizer.state_bytes())
    if hw.device.type == "cpu":  # the thread count orders the CPU's sums: runs compare only at one count
        effective["effective_threads"] = torch.get_num_threads()
    log("\n".join([f"{f.name}={shown.get(f.name, getattr(args, f.name))}" for f in dataclasses.fields(args)]
                  + [f"{key}={value}" for key, value in effective.items()] + ["=" * 100]
                  + [f"{s.name}: {tuple(s.param.shape)} {s.optimizer} {s.group} lr_mult={s.lr_mult}" for s in optimizer.specs]),
        console=False)
    log(data_note)

@dataclass
class TrainResult:
    train_losses: list = field(default_factory=list)   # per step: the objective per token (with mtp, 1-3 tokens' weighted)
    val_losses: list = field(default_factory=list)     # (step, val_loss)
    resumed_val_losses: list = field(default_factory=list)  # the checkpoint's, kept in the next ones
    steps_done: int = 0
    train_time_ms: float = 0.0
    stopped_early: str | None = None   # the data ran out
    checkpoint_error: str | None = None
    failure: str | None = None   # the line that ended the run: divergence, a signal, a failed log write, a crash
    exit_code: int = 0
    crashed: bool = False        # an exception ended the loop (the other ranks may be gone)
    traceback_logged: bool = False

    def all_val_losses(self):  # the resumed checkpoint's, then this run's; one per step
        here = dict(self.val_losses)
        return [v for v in self.resumed_val_losses if v[0] not in here] + self.val_losses

# Exit codes of main(); an interrupted run exits with 128 + the signal's number.
EXIT_ERROR, EXIT_CONFIG, EXIT_DATA_RAN_OUT, EXIT_DIVERGED = 1, 2, 3, 4
# What stops a run at its next check (harness/launch.py watches them; SIGHUP: a closed terminal).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

class NoStopSignals:  # without the harness no signal is watched
    signum = repeat = None
    phase = ""

def peak_memory_line(hw):
    if hw.device.type == "cuda":
        return (f"peak memory allocated: {torch.cuda.max_memory_allocated(hw.device) // 1024 // 1024} MiB "
                f"reserved: {torch.cuda.max_memory_reserved(hw.device) // 1024 // 1024} MiB")
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (2**20 if sys.platform == "darwin" else 1024)
    return f"peak memory allocated: {peak_rss} MiB reserved: {peak_rss} MiB"

def synchronize(hw):
    if hw.device.type == "cuda":
        torch.cuda.synchronize(hw.device)

def train(args, ranks, hw, log, collectives=None, on_step=None, stop=None):
    """Set up, warm up, run the timed loop; a TrainResult says how it ended. on_step(step, model,
    optimizer) runs after each step (tests); stop: harness/launch.py's StopSignals."""
    stop = stop or NoStopSignals()
    torch.manual_seed(args.seed)
    pin = hw.device.type == "cuda"
    failure = checkpoints = None
    try:
        train_files, val_files, data_note = resolve_data_files(args)
        if trains_on_sample(args):  # its checkpoints name the sample: a resume reads it
            args = dataclasses.replace(args, train_files=SAMPLE_FILES[0], val_files=SAMPLE_FILES[1])
        if args.resume or args.save_checkpoint:  # reads --resume now: its failures are set-up's
            checkpoints = harness("checkpoints", "--resume/--save_checkpoint").Checkpoints(args, ranks, hw, log)
        val_tokens = load_val_tokens(val_files, args.val_tokens, pin)
        # every token read now: a bad shard late in the list would end a run hours in
        without_bos = [path for path in train_files if not (read_shard_tokens(path) == BOS_TOKEN).any()]
        train_files = [path for path in train_files if path not in without_bos]  # no window starts there
        config = harness("config")  # warns where the shards cannot last the run
        warnings = config.data_shortfall(train_files, args, without_bos) + config.unapplied_adam_steps(args) \
            if config else []
        if not train_files:  # (the harness has said more)
            raise DataError(f"{args.train_files}: no training shard holds a BOS token ({BOS_TOKEN}): nothing would train")
        model = GPT(args, hw).to(hw.device)
        if hw.attention == "varlen":  # validation's own set-up (its time is not the run's)
            model.varlen_eval_bounds = validation_document_bounds(val_tokens, args.val_seq_len)
        optimizer = ShardedMuonAdam(param_specs(model, args), args, ranks, hw, collectives)
        if checkpoints is not None:  # now, not after minutes of compiling
            checkpoints.check_fits(model, optimizer, train_files)
    except Exception as e:  # out of memory too: at several ranks, every rank must learn of it
        failure = e
    launch = harness("launch") if ranks.world_size > 1 or failure is not None else None
    if launch is not None:  # the lowest rank that failed says why, once, and every rank ends
        launch.agree_on_set_up(failure, ranks, hw, checkpoints)
    elif failure is not None:
        raise failure
    batches = None  # made inside the clock: setup derived from the data counts as training time
    # one device scalar per window size, made once: a copy each step would make the host wait (varlen: ints,
    # FlashAttention's window is the kernel's argument: a graph per window, as the record's)
    longs = {long_window_blocks_at(s, args) for s in range(args.num_iterations + 1)}
    window_sizes = {blocks: blocks if hw.attention == "varlen" else torch.tensor(blocks, device=hw.device)
                    for blocks in longs | {max(b // 2, 1) for b in longs} | {args.window_validate_final_blocks}}

    # the multi-token loss's weights of each step, made once (a copy each step would make the host wait)
    tokens_through = np.cumsum([train_seq_len_at(s, args) for s in range(args.num_iterations)]).tolist()
    mtp_weights = ([torch.tensor(mtp_weights_at(s, args), device=hw.device) for s in range(args.num_iterations + 1)]
                   if args.mtp else None)

    def enter_step(step, final_validation=False):
        """Sets the step's model state (YaRN at its window, the embedding tied or split) and returns its
        (long, short) window sizes in blocks: short is half the long."""
        long = long_window_blocks_at(step, args)
        short = short_window_blocks(long)
        model.rotary.follow(long, args.attn_block_size)  # (YaRN, where the window changes)
        model.embed_tied = optimizer.embed_tied = embed_tied_at(step, args)  # (the step's model, too)
        if final_validation and args.window_validate_final_blocks:
            long = args.window_validate_final_blocks
        return window_sizes[long], window_sizes[short]
    log_header(log, args, ranks, hw, model, optimizer, data_note, (train_files, val_files))
    for warning in warnings:
        log(warning)
    result, N, step_losses, accum_steps = TrainResult(), args.num_iterations, [], args.micro_batches // ranks.world_size
    checked, checked_step = 0, None  # step_losses[:checked] are known to be finite; the step of the last check

    def check(step, weights=False):
        """Why the run must stop now, as (line, exit code), or None, the same on every rank: one
        host-GPU sync for the losses since the last check (and, before a checkpoint, the weights)."""
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

    ending = check(0)
    if ending:
        result.failure, result.exit_code = ending
        return result

    def train_step(step, next_batch):
        seq_len = train_seq_len_at(step, args)
        optimizer.lr_factor = lr_factor_at(step, args)
        optimizer.adam_step_now = adam_steps_at(step, args)
        optimizer.muon_momentum = muon_momentum_at(step, args)
        step_windows = enter_step(step)
        loss_sum = torch.zeros((), device=hw.device)
        for micro in range(accum_steps):
            inputs, targets = next_batch(seq_len)
            if micro == accum_steps - 1 and args.overlap_comms:
                optimizer.arm_for_final_backward()
            loss = model(inputs, targets, *step_windows, mtp_weights and mtp_weights[step])  # summed over its tokens
            loss.backward()
            loss_sum += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        if args.embed_split_frac and step == embed_split_step(args):
            optimizer.untie_embedding()
        return loss_sum / (accum_steps * seq_len)

    @torch.no_grad()
    def validate(step):
        model.eval()
        step_windows = enter_step(step, final_validation=step == N)
        sum_and_count = torch.zeros(2, device=hw.device)  # ranks may hold one window more than others
        for inputs, targets in val_batches(val_tokens, args.val_seq_len, ranks.rank, ranks.world_size, hw.device):
            sum_and_count[0] += model(inputs, targets, *step_windows)
            sum_and_count[1] += 1
        model.train()
        if ranks.world_size > 1:
            dist.all_reduce(sum_and_count)
        return (sum_and_count[0] / sum_and_count[1]).item()

    def warm_up():  # compile and tune on random BOS-led windows, then back to the initial state
        log("Compiling model and warming up kernels" if args.compile else
            "Compiling Adam's update and warming up kernels" if args.compile_adam else "Warming up kernels")
        initial_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        rng = torch.Generator().manual_seed(args.seed + 1)  # not the model's stream
        def random_batch(seq_len):
            tokens = torch.randint(0, BOS_TOKEN, (seq_len + 1,), generator=rng)
            tokens[::args.train_max_doc_len or seq_len + 1] = BOS_TOKEN  # packed: documents as long as the loader's
            tokens = tokens.to(hw.device)  # inputs and targets view one buffer, as the loader's batches
            return tokens[:-1], tokens[1:]
        def validation_pass(step):
            with torch.no_grad():
                model.eval()
                inputs, targets = next(val_batches(val_tokens, args.val_seq_len, 0, 1, hw.device))
                model(inputs, targets, *enter_step(step))
                model.train()
        steps = [w * args.num_iterations // args.warmup_steps for w in range(args.warmup_steps)]
        if args.warmup_at_transitions:  # the record's: every graph the run will need (its windows, YaRN scales, sizes)
            steps = warmup_steps_at_transitions(args)
            log(f"Sampling steps {steps} for warmup")
        for step in steps:
            if args.warmup_at_transitions:
                validation_pass(step)
            train_step(step, random_batch)
        follow_windows(model.rotary, 0, args)  # step 0's rotary (not YaRN's changes run backwards)
        validation_pass(0)
        model.load_state_dict(initial_params)
        optimizer.reset_state()
        log("Resetting Model")

    training_time_ms, step = 0.0, 0
    try:  # the loader's thread is closed however this ends (a KeyboardInterrupt too)
        try:  # from compiling on, where a fork's bug or the compiler first fails, a failure is one line and logged
            if args.compile:
                model.compile_for_training(args.compile_scope)
                optimizer.compile_orthogonalizer()
            if args.compile_adam:
                optimizer.compile_adam()
            if args.warmup_steps:
                warm_up()
            resumed_loader = None
            if checkpoints is not None and checkpoints.resuming:
                step, training_time_ms, resumed_loader, result.resumed_val_losses = checkpoints.restore(model, optimizer)
            follow_windows(model.rotary, step, args)  # after warmup's window changes; a resumed run's
            gc.collect()  # as the record, before its clock: warmup's garbage is not collected in timed steps
            synchronize(hw)
            t0 = time.perf_counter()
            stop.phase = "loop"  # from here on a signal ends the run at the next check, on every rank
            checked_step = None  # warmup and the restore came after check(0): check again
            while True:
                last_step = step == N or result.stopped_early is not None
                validating = ((last_step or (args.val_every > 0 and step % args.val_every == 0))
                              and not (result.val_losses and result.val_losses[-1][0] == step))  # (data ran out)
                if ((last_step or step % args.check_every == 0) and checked_step != step
                        or (ranks.world_size == 1 and stop.signum)):
                    ending = check(step)  # (a sync)
                    if ending:
                        result.failure, result.exit_code = ending
                        training_time_ms += 1000 * (time.perf_counter() - t0)
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
                    first = result.all_val_losses()[0]  # the same values on every rank
                    # more than a nat above the untrained model's: a healthy run's first steps may wander above it
                    if not math.isfinite(val_loss) or (first[0] == 0 and step > 0 and val_loss > first[1] + 1):
                        above = f", more than a nat above step 0's {first[1]:.4f}" if math.isfinite(val_loss) else ""
                        result.failure = f"diverged at step {step}/{N}: val_loss is {val_loss:.4f}{above}"
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
                        batches = (PackedBatches(train_files, args.train_max_doc_len, ranks.rank, ranks.world_size,
                                                 pin, chunks_per_step=args.micro_batches, start=resumed_loader)
                                   if args.train_max_doc_len else
                                   TrainBatches(train_files, args.train_seq_len, ranks.rank, ranks.world_size, pin,
                                                windows_per_step=args.micro_batches, start=resumed_loader))
                    step_losses.append(train_step(step, functools.partial(batches.next_batch, hw.device)))
                except DataExhausted as e:
                    result.stopped_early = str(e)
                    log(f"stopping early at step {step}/{N}: {e}")
                    continue
                step += 1
                approx_ms = training_time_ms + 1000 * (time.perf_counter() - t0)
                line = f"step:{step}/{N} train_time:{approx_ms:.0f}ms step_avg:{approx_ms / step:.2f}ms"
                log(line, console=f"{line} eta:{duration(eta_seconds(approx_ms, step, tokens_through))}")
                if args.checkpoint_every and step % args.checkpoint_every == 0 and step < N:
                    synchronize(hw)  # the clock stops while the checkpoint is checked and written
                    training_time_ms += 1000 * (time.perf_counter() - t0)
                    ending = check(step, weights=True)  # this step's check: a diverged model must not
                    if ending and ending[1] == EXIT_DIVERGED:  # replace the last good checkpoint
                        result.failure, result.exit_code = ending
                        break
                    result.checkpoint_error = checkpoints.save(step, training_time_ms, model, optimizer, batches,
                                                               result)
                    if ending:  # a signal or a failed log write: written first, so a resume goes on from here
                        result.failure, result.exit_code = ending
                        break
                    t0 = time.perf_counter()
                if on_step is not None:
                    on_step(step, model, optimizer)
        except Exception as e:  # a late failure (bad shard, out of memory, lost rank, bug)
            phase, stop.phase = stop.phase, "end"  # first: no signal may raise from here on
            if harness("launch") is None:
                raise
            harness("launch").late_failure(e, phase, step, result, args, ranks, log, stop, checkpoints)
        stop.phase = "end"
        # where the run can go on from (not after a divergence), before the line that says why it ended
        if result.failure and result.exit_code != EXIT_DIVERGED and checkpoints is not None:
            checkpoints.log_where_to_go_on()
        if result.failure and (result.exit_code != EXIT_ERROR or result.crashed):
            # main() prints a crash's line (on every rank) and a failed write's
            log(result.failure, console=result.exit_code != EXIT_ERROR)
        if args.save_checkpoint and result.failure is None:  # the clock stopped at the final validation
            result.checkpoint_error = checkpoints.save(step, training_time_ms, model, optimizer, batches, result)
        log(peak_memory_line(hw))
        if step_losses and not result.crashed:  # after a crash the device or the other ranks may be gone
            losses = torch.stack(step_losses)
            if ranks.world_size > 1:
                dist.all_reduce(losses, op=dist.ReduceOp.AVG)
            result.train_losses = losses.tolist()
    finally:
        if batches is not None:
            batches.close()
    result.steps_done, result.train_time_ms = step, training_time_ms
    return result


# -----------------------------------------------------------------------------------------------
# 9. Launch
#
# With harness/ beside this file, main() hands over to harness/launch.py: options checked (and
# --help), signals, one line and an exit code for each way a run ends. A copy of this file alone
# trains with --field=value options and reports a failure as Python does.

HARNESS = {}  # the harness modules loaded so far, by name

def harness(name, needed_for=None):
    """harness/<name>.py, loaded on first use; None in a copy of this file alone (needed_for: the
    options that cannot work without it)."""
    if name not in HARNESS:
        here = os.path.dirname(os.path.abspath(__file__))  # (tests move REPO_DIR, the data's root)
        if not os.path.isfile(os.path.join(here, "harness", f"{name}.py")):
            if needed_for:
                raise ConfigError(f"{needed_for}: needs harness/{name}.py beside {os.path.basename(__file__)}")
            return None
        sys.modules.setdefault("train_gpt", sys.modules[__name__])  # the harness's name for this module
        if here not in sys.path:
            sys.path.insert(0, here)
        HARNESS[name] = importlib.import_module(f"harness.{name}")
    return HARNESS[name]

@functools.cache
def source_code():  # this file as main() found it
    with open(__file__, "rb") as f:
        return f.read()

@functools.cache
def logged_code():
    """What a run's log starts with, read as main() starts (an edit saved while it trains is not the
    code that runs): this file, then the harness modules a training run uses."""
    code = source_code().decode("utf-8", "replace")
    for name in ("launch", "config", "checkpoints"):
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", f"{name}.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                code += f"\n\n{'-' * 40}\n# harness/{name}.py\n{'-' * 40}\n\n{f.read()}"
    return code

def plain_config(argv):  # a copy of this file alone: the machine's preset, then --field=value options
    types = {f.name: f.type for f in dataclasses.fields(Hyperparameters)}
    options = dict(arg.removeprefix("--").split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    unknown = [arg for arg in argv if not arg.startswith("--") or "=" not in arg or arg[2:].split("=")[0] not in types]
    needs = [f"--{n}: needs harness/ beside train_gpt.py" for n in ("sample", "resume", "save_checkpoint") if n in options]
    if unknown or needs:
        raise ConfigError(needs[0] if needs else f"{unknown[0]}: expected --field=value with a field of Hyperparameters")
    preset = options.get("preset", "speedrun" if torch.cuda.is_available() else "cpu")
    if preset not in PRESETS:
        raise ConfigError(f"--preset={preset}: expected one of {', '.join(PRESETS)}")
    booleans = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)
    values = {}
    for name, text in options.items():
        try:
            values[name] = booleans[text.lower()] if types[name] is bool else types[name](text)
        except (KeyError, ValueError):
            expected = "true or false" if types[name] is bool else f"a value of type {types[name].__name__}"
            raise ConfigError(f"--{name}={text}: expected {expected}") from None
    return Hyperparameters(**{**PRESETS[preset], "preset": preset, **values})

def main(argv=None, environ=None):
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    logged_code()  # now: the next idea may be written into these files while the run trains
    # as in the record: segments grow instead of fragmenting (read when CUDA initializes)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    launch = harness("launch")
    if launch is not None:
        return launch.main(argv, environ)
    ranks = Ranks.from_env(environ)
    try:
        args = plain_config(argv)
        check_config(args, ranks.world_size, torch.cuda.is_available())
    except (ConfigError, ValueError, TypeError) as e:
        say(f"{os.path.basename(__file__)}: error: {first_line(e)}", sys.stderr)
        return EXIT_CONFIG
    hw = Hardware.detect(args, ranks)
    if hw.device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, usable_cpus() // ranks.local_world_size))
        keep_freed_memory_on_cpu()
    init_process_group(args, ranks, hw)
    result, log = None, RunLog(args, ranks)
    try:
        result = train(args, ranks, hw, log)
    except (ConfigError, DataError) as e:  # the line names the file or option
        say(f"{os.path.basename(__file__)}: error: {e}", sys.stderr)
        return EXIT_ERROR
    finally:
        leave_process_group(clean=result is not None and not result.crashed)
    if result.failure and result.exit_code == EXIT_ERROR:
        say(f"{os.path.basename(__file__)}: error: {result.failure}", sys.stderr)
    if ranks.is_master:
        say(run_summary(args, result, log))
    return result.exit_code or (EXIT_DATA_RAN_OUT if result.stopped_early else 0)

if TRITON_INTERPRETING and triton is not None:  # tests on CPU: Triton 3.6's interpreter needs a fix
    with contextlib.suppress(ImportError):
        importlib.import_module("harness.triton_interpreter")

if __name__ == "__main__":
    sys.exit(main())
