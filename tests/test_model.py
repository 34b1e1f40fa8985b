"""The GPT: shapes, the initial loss, which parameters train, the block layouts (the speedrun's, the
2026-01-19 record's, and the 2025-08-23 record's, still options), the FP8 head against a
full-precision reference."""

import math
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import train_gpt
from harness import config as cfg
from conftest import ROOT, TINY

# The speedrun's blocks (the 2026-01-19 record's 11), at TINY's width
SPEEDRUN_LAYOUT = {name: getattr(train_gpt.Hyperparameters, name) for name in (
    "num_layers", "window_pattern", "attention_free_layers", "num_value_embeds", "value_embed_layers",
    "paired_head_layers", "skip_layers", "backout_layer")}
# The 2025-08-23 record's model and optimizer table: U-net skips, v_lambdas, a zero head, 2025's rotary
# and cap, no bigram table, smear, backout, value gates, key offset or paired heads; its 12 blocks
RECORD_2025 = dict(init="2025", embed_split_frac=0.0, yarn=False, value_gates=False, key_offset=False, paired_head_layers="", skip_layers="",
                   backout_layer=-1, bigram_vocab_size=0, smear=False, token_windows=False, logit_cap_height=0.0,
                   logit_cap_shift=0.0, mtp=False, value_embed_layers="", resid_lambda_init=1.0, attn_scale=0.12,
                   bf16_weights=False, adam_table="2025", window_schedule="", window_final_blocks=0,
                   window_validate_final_blocks=0)
LAYOUT_2025 = dict(num_layers=12, window_pattern="LSSSLSSLSSSL", attention_free_layers="7", num_value_embeds=3)


def tiny_model(**overrides):
    args = train_gpt.Hyperparameters(**dict(TINY, **overrides))
    cfg.check_config(args, 1, False)
    hw = train_gpt.Hardware.detect(args)
    torch.manual_seed(0)
    return train_gpt.GPT(args, hw), args


def random_tokens(n, seed=0, docs=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, train_gpt.BOS_TOKEN, (n + 1,), generator=g)
    tokens[torch.randint(0, n, (docs,), generator=g)] = train_gpt.BOS_TOKEN
    tokens[0] = train_gpt.BOS_TOKEN
    return tokens[:-1], tokens[1:]


def test_logits_and_loss_shapes():
    model, args = tiny_model()
    inputs, targets = random_tokens(args.train_seq_len)
    window = torch.tensor(2)
    logits = model(inputs, None, window)
    assert logits.shape == (args.train_seq_len, args.vocab_size) and logits.dtype == torch.float32
    # the soft cap bounds logits to (0, height): 23 (the 2026 record's), 2 x logit_softcap in 2025
    assert logits.min() >= 0 and logits.max() <= args.logit_cap_height
    loss = model(inputs, targets, window)
    assert loss.shape == () and loss.dtype == torch.float32


@pytest.mark.parametrize("init", ["2025", "2026"])
def test_initial_loss_is_log_vocab_summed_in_training_and_averaged_in_eval(init):
    model, args = tiny_model(init=init, **({"embed_split_frac": 0.0} if init == "2025" else {}))
    inputs, targets = random_tokens(args.train_seq_len)
    summed = model(inputs, targets, torch.tensor(4))
    model.eval()
    mean = model(inputs, targets, torch.tensor(4)).item()
    assert summed.item() == pytest.approx(args.train_seq_len * mean, rel=1e-6)
    # 2025: a zero head, every logit equals the cap, the prediction is uniform. 2026: the head
    # N(0, 0.005) (and the embedding its copy): near uniform, not exactly
    if init == "2025":
        assert mean == pytest.approx(math.log(args.vocab_size), abs=1e-5)
    else:
        assert 1e-4 < abs(mean - math.log(args.vocab_size)) < 1e-2


def test_validation_loss_in_chunks_equals_the_unchunked_mean(monkeypatch):
    model, args = tiny_model()
    with torch.no_grad():
        model.lm_head_w.normal_(0, 0.05)
    model.eval()
    inputs, targets = random_tokens(args.train_seq_len, docs=4)
    whole = F.cross_entropy(model(inputs, None, torch.tensor(4)), targets)
    monkeypatch.setattr(train_gpt, "VAL_HEAD_CHUNK", 48)  # 128 rows: chunks of 48, 48 and 32
    with torch.no_grad():
        chunked = model(inputs, targets, torch.tensor(4))
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)


def test_gradients_reach_every_parameter():
    model, args = tiny_model()
    # Zero-initialized projections and head block all gradients below them at step 0, so perturb
    # every parameter first; then every one of them must receive a finite, nonzero gradient.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    inputs, targets = random_tokens(args.train_seq_len, docs=4)
    model(inputs, targets, torch.tensor(4)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"


def test_architecture_layout_2025():
    model, args = tiny_model(**RECORD_2025, **LAYOUT_2025)
    assert model.value_embed_of_layer == [0, 1, 2, None, None, None, None, None, None, 0, 1, 2]
    assert [b.attn is None for b in model.blocks] == [i == 7 for i in range(12)]
    assert model.skip_weights.shape == (6,)
    for i, b in enumerate(model.blocks):
        if b.attn is not None:
            assert b.attn.qkvo_w.shape == (4, args.model_dim, args.model_dim)
            assert torch.count_nonzero(b.attn.qkvo_w[3]) == 0  # output projection starts at zero
            # (l0, l1) where a value embedding is added, l0 alone elsewhere; both start at 0.5
            has_ve = model.value_embed_of_layer[i] is not None
            assert b.attn.v_lambdas.tolist() == ([0.5, 0.5] if has_ve else [0.5])
        assert b.mlp.fc_w.shape == b.mlp.proj_w.shape == (args.model_dim, 4 * args.model_dim)
        assert torch.count_nonzero(b.mlp.proj_w) == 0
    assert torch.count_nonzero(model.lm_head_w) == 0


def test_architecture_layout():
    """The speedrun's 11 blocks (the record's, P's parameter shapes in tests/test_record_preset.py):
    value embeddings 1, 2 into the first two blocks and 0, 1, 2 into the last three, block 6 without
    attention, one gated skip 3 -> 6, paired heads in 0, 2, 5, 9, the key offset in the long-window
    blocks; each block starts as the identity (zero output projections), the head small and random
    with the embedding its copy, the value and bigram embeddings zero."""
    model, args = tiny_model(**SPEEDRUN_LAYOUT)
    L = args.num_layers
    assert model.value_embed_of_layer == [1, 2, None, None, None, None, None, None, 0, 1, 2]
    assert [b.attn is None for b in model.blocks] == [i == 6 for i in range(L)]
    assert not hasattr(model, "skip_weights") and model.skip_layers == [3, 6] and model.skip_lambda.item() == -1.5
    assert [b.attn.paired for b in model.blocks if b.attn] == [i in (0, 2, 5, 9) for i in range(L) if i != 6]
    assert [b.attn.key_offset for b in model.blocks if b.attn] == [i in (3, 10) for i in range(L) if i != 6]
    for i, b in enumerate(model.blocks):
        if b.attn is not None:
            assert b.attn.qkvo_w.shape == (4, args.model_dim, args.model_dim)
            assert torch.count_nonzero(b.attn.qkvo_w[3]) == 0
            assert b.attn.sa_lambdas.tolist() == [0.5, 1.0] and not hasattr(b.attn, "v_lambdas")
            assert (b.attn.ve_gate_w is not None) == (model.value_embed_of_layer[i] is not None)
        assert b.mlp.fc_w.shape == b.mlp.proj_w.shape == (args.model_dim, 4 * args.model_dim)
        assert torch.count_nonzero(b.mlp.proj_w) == 0
    assert 0.004 < model.lm_head_w.float().std().item() < 0.006
    assert torch.equal(model.embed.weight, model.lm_head_w.to(model.embed.weight.dtype))
    for embedding in (*model.value_embeds, model.bigram_embed):
        assert torch.count_nonzero(embedding.weight) == 0


@pytest.mark.parametrize("table", ["2025", "2026"])
def test_param_specs_cover_each_parameter_once(table):
    model, args = tiny_model(**(RECORD_2025 if table == "2025" else {}))
    specs = train_gpt.param_specs(model, args)
    assert sorted(id(s.param) for s in specs) == sorted(id(p) for p in model.parameters())
    by_name = {s.name: s for s in specs}
    assert by_name["blocks.0.attn.qkvo_w"].optimizer == "muon"
    assert by_name["blocks.0.mlp.fc_w"].optimizer == "muon"
    assert by_name["lm_head_w"].group == "head"
    if table == "2025":
        assert by_name["embed.weight"].optimizer == "adam" and by_name["embed.weight"].lr_mult == args.embed_lr_mult
        assert by_name["blocks.0.attn.gate_w"].optimizer == "muon"
        assert by_name["blocks.0.attn.v_lambdas"].group == "scalar"
        assert by_name["skip_weights"].group == "scalar"
        return
    # the 2026 record's: Adam's betas and multipliers by kind (ADAM_2026), the gates on Adam too
    for name, kind in [("embed.weight", "embed"), ("lm_head_w", "head"), ("value_embeds.0.weight", "value_embed"),
                       ("bigram_embed.weight", "value_embed"), ("blocks.0.attn.gate_w", "gate"),
                       ("blocks.0.attn.ve_gate_w", "gate"), ("blocks.0.x0_lambda", "x0_lambda"),
                       ("blocks.0.attn.sa_lambdas", "scalar"), ("skip_gate", "skip_gate"), ("smear_gate", "smear_gate")]:
        spec = by_name[name]
        assert (spec.optimizer, spec.group, *spec.betas, spec.lr_mult, spec.wd_mult) == ("adam", kind,
                                                                                      *train_gpt.ADAM_2026[kind]), name
    assert by_name["blocks.0.mlp.proj_w"].lr_mult == args.mlp_proj_lr_mult == 2.0


def test_rotary_rotates_half_the_dimensions():
    rotary = train_gpt.Rotary(head_dim=16, max_seq_len=8)
    x = torch.randn(1, 8, 2, 16)
    y = rotary(x)
    # norms are preserved (a rotation), position 0 is untouched, and the zero-frequency quarter
    # of each half is never rotated
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])
    torch.testing.assert_close(y[..., 4:8], x[..., 4:8])
    torch.testing.assert_close(y[..., 12:16], x[..., 12:16])
    assert not torch.allclose(y[:, 1:, :, :4], x[:, 1:, :, :4])


ROTARY_TABLE_ERROR = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
import train_gpt
from harness import config as cfg
rotary = train_gpt.Rotary(head_dim=64, max_seq_len=1024)  # the first cos and sin of this process
quarter = 16
freqs = (1 / 1024.0) ** torch.linspace(0, 1, quarter, dtype=torch.float32)
theta = torch.outer(torch.arange(1024, dtype=torch.float32), torch.cat([freqs, freqs.new_zeros(quarter)]))
theta = theta.numpy().astype(np.float64)  # the reference in numpy, one thread: not torch's racy first call
print(max(np.abs(rotary.cos.numpy() - np.cos(theta)).max(), np.abs(rotary.sin.numpy() - np.sin(theta)).max()))
"""


@pytest.mark.slow
def test_rotary_tables_are_exact_in_every_process():
    """The 2025 rotary's fp32 tables (--yarn false; YaRN's are bf16, coarser than the race's error)
    at the cpu preset's sizes in fresh processes, each making its first vectorized cos and sin
    there: without the one-element call before them, 1 to 4 processes in 10 (2-core Xeon,
    torch 2.13.0+cpu) had cos errors of 1.5e-4 in the second thread's half of the table: a race,
    so the old code failed this test often (3 of 4 tries), not always."""
    for _ in range(6):
        out = subprocess.run([sys.executable, "-c", ROTARY_TABLE_ERROR, str(ROOT)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert float(out.stdout) < 1e-6  # fp32 rounding of the table is 6e-8 at most


def test_window_schedule_is_the_records_rule():
    """The 2025 record's grown windows (--window_schedule ""): window_size =
    next_multiple_of_n(1728 * x, n=128), x = step / 1695, i.e. the smallest multiple of 128 that is
    >= 1728x, and at least 128. (The 2026 record's: tests/test_record_2026_schedules.py.)"""
    args = train_gpt.Hyperparameters(window_schedule="", num_iterations=1695, extension_steps=0)
    blocks = [train_gpt.long_window_blocks_at(s, args) for s in range(args.num_iterations + 1)]
    assert blocks[0] == 1 and blocks[-1] == 14
    for step, b in enumerate(blocks):
        v = 1728 * (step / 1695)
        assert b * 128 >= v and (b == 1 or (b - 1) * 128 < v), step
    assert blocks[1130] == 9  # 1728 * 1130/1695 = 1152 = 9 * 128 exactly: no tenth block


def test_fp8_matmul_matches_full_precision():
    torch.manual_seed(0)
    dim = 32
    x = train_gpt.rms_norm(torch.randn(64, dim)).bfloat16().requires_grad_()  # the head's input is normed
    w = (torch.randn(48, dim) * 0.1).requires_grad_()
    out = train_gpt.fp8_matmul(x, w, *train_gpt.fp8_head_scales(dim))
    assert out.dtype == torch.bfloat16
    grad = torch.rand(64, 48) * 2 - 1  # a soft-capped logit's gradient lies in [-1, 1]
    out.backward(grad.bfloat16())
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    xf, wf = x.detach().float(), w.detach()
    ref = xf @ wf.T
    # e4m3 keeps 3 mantissa bits (relative error up to 1/16 per operand); errors average out
    # over the 32-long dot products, so a few percent of the output scale is the honest bound
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max()
    assert (x.grad.float() - grad @ wf).abs().max() < 0.1 * (grad @ wf).abs().max()
    assert (w.grad - grad.T @ xf).abs().max() < 0.1 * (grad.T @ xf).abs().max()


def test_fp8_ops_fake_matches_real():
    """torch.compile plans memory from the fake functions: an output whose real strides differ
    from the fake's fails at run time inside compiled code (it did on an H100: the weight
    gradient came out transposed). Checks shapes, dtypes and strides of both ops on CPU."""
    train_gpt.register_fp8_ops()
    torch.manual_seed(0)
    scales = train_gpt.fp8_head_scales(32)
    x = train_gpt.rms_norm(torch.randn(64, 32)).bfloat16()
    w = torch.randn(48, 32) * 0.1
    _, x8, w8 = torch.ops.train_gpt.fp8_mm(x, w, *scales)
    grad = (torch.rand(64, 48) * 2 - 1).bfloat16()
    for op, inputs in ((torch.ops.train_gpt.fp8_mm.default, (x, w, *scales)),
                       (torch.ops.train_gpt.fp8_mm_backward.default, (grad, x8, w8, *scales))):
        result = torch.library.opcheck(op, inputs, test_utils=("test_faketensor",))
        assert result == {"test_faketensor": "SUCCESS"}, (op, result)
    grad_x, grad_w = torch.ops.train_gpt.fp8_mm_backward(grad, x8, w8, *scales)
    assert grad_x.is_contiguous() and grad_w.is_contiguous()


def test_fp8_static_scales_cannot_overflow():
    """The scales bound each operand by e4m3's (e5m2's) range: |x_i| <= sqrt(dim) after RMSNorm,
    a one-hot input reaches it; weights up to 0.875; gradients of a summed, soft-capped
    cross-entropy up to 1."""
    x_scale, w_scale, grad_scale = train_gpt.fp8_head_scales(768)
    assert 768 ** 0.5 / x_scale == pytest.approx(448)
    assert 0.875 / w_scale == 448 and 1 / grad_scale == pytest.approx(448)
    worst = train_gpt.rms_norm(torch.nn.functional.one_hot(torch.tensor([3]), 768).float()).bfloat16().requires_grad_()
    w = torch.full((4, 768), 0.875, requires_grad=True)
    assert (worst / x_scale).abs().max() <= 448 and (w / w_scale).abs().max() <= 448
    # CPU's cast to e4m3 saturates at 448 rather than overflowing, so finite outputs alone prove nothing:
    # the product itself (24.28 in full precision; with a scale 4x too small, 6.06) and the gradients
    out = train_gpt.fp8_matmul(worst, w, x_scale, w_scale, grad_scale)
    torch.testing.assert_close(out.float(), worst.float().detach() @ w.detach().T, rtol=1 / 32, atol=0)
    out.backward(torch.ones_like(out))  # the largest gradient the summed, capped loss gives
    torch.testing.assert_close(worst.grad.float(), torch.ones(1, 4) @ w.detach(), rtol=1 / 8, atol=0)
    torch.testing.assert_close(w.grad.float(), torch.ones(4, 1) @ worst.float().detach(), rtol=1 / 8, atol=0)


def test_fp8_head_is_close_to_full_precision_and_only_used_in_training():
    model, args = tiny_model(train_seq_len=64)  # few tokens: torch._scaled_mm on a CPU can be a scalar loop
    with torch.no_grad():
        model.lm_head_w.normal_(0, 0.05)
    inputs, targets = random_tokens(args.train_seq_len)
    window = torch.tensor(4)
    full_hw = train_gpt.Hardware(torch.device("cpu"), torch.float32, "sdpa", False, "torch", "gloo")
    fp8_hw = train_gpt.Hardware(torch.device("cpu"), torch.float32, "sdpa", True, "torch", "gloo")
    model.hw = full_hw
    full = model(inputs, None, window)
    model.hw = fp8_hw
    fp8 = model(inputs, None, window)
    # the FP8 path is really taken, and stays within FP8 rounding of the full-precision logits
    assert not torch.equal(fp8, full)
    centered = full - full.mean()
    assert (fp8 - full).abs().max() < 0.05 * centered.abs().max()
    summed = model(inputs, targets, window).item()  # training: summed over positions
    # the training loss is the FP8 logits' cross-entropy summed; each row's differs from full precision's
    # by at most twice the largest logit error (logsumexp and the target's logit move by at most that)
    assert summed / len(targets) == pytest.approx(F.cross_entropy(fp8, targets).item(), rel=1e-6)
    assert abs(summed / len(targets) - F.cross_entropy(full, targets).item()) <= 2 * (fp8 - full).abs().max()
    model.eval()  # validation measures the model without FP8
    assert torch.equal(model(inputs, None, window), full)


@pytest.mark.slow
def test_compiled_blocks_stay_compiled_for_training_and_validation():
    """The speedrun layout has ~12 block variants (attention or not, value embedding or not, long
    or short window, paired heads or not, training or validation); dynamo must not fall back to eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    model, args = tiny_model(**SPEEDRUN_LAYOUT, val_seq_len=256)
    torch._dynamo.reset()
    counters.clear()
    try:
        model.compile_for_training("blocks", backend="eager")  # dynamo's capture without inductor's code generation
        inputs, targets = random_tokens(args.train_seq_len)
        model(inputs, targets, torch.tensor(2)).backward()
        model.eval()
        with torch.no_grad():
            inputs, targets = random_tokens(args.val_seq_len)
            model(inputs, targets, torch.tensor(2))
        fallbacks = [reason for reason in counters["unimplemented"] if "recompile" in reason.lower()]
        assert not fallbacks, fallbacks
        assert counters["stats"]["unique_graphs"] > 8  # more variants than dynamo's default limit
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bf16 sdpa fp8", "fp32 flex"])  # between them: both dtypes, both kernels
def test_whole_model_compiles_to_one_graph_for_training_and_one_for_validation(layout):
    """--compile_scope model, the record's: fullgraph=True, so a graph break anywhere in the forward
    is an error; the window size is a tensor, so a later window makes no new graph. The captured
    step's loss and gradients are eager's (aot_eager: capture, not inductor's numerics), on CPU's
    path and in CUDA's dtype with its FP8 head;
    FlexAttention (CUDA's attention) has no backward on CPU, so its graphs are captured without
    gradients."""
    import dataclasses
    import torch._dynamo
    from torch._dynamo.utils import counters
    dtype, attention, *fp8 = layout.split()
    # the speedrun's 11 blocks in fp32; CUDA's dtype and FP8 head on TINY's 4 blocks and 32 tokens (the head
    # is what differs; torch._scaled_mm on a CPU can be a scalar loop)
    model, args = (tiny_model(val_seq_len=256, train_seq_len=32) if fp8 else
                   tiny_model(**SPEEDRUN_LAYOUT, val_seq_len=256))
    model.hw = dataclasses.replace(model.hw, compute_dtype=getattr(torch, {"bf16": "bfloat16"}.get(dtype, "float32")),
                                   attention=attention, fp8_head=bool(fp8))
    if fp8:
        train_gpt.register_fp8_ops()  # as GPT() does when the hardware runs the FP8 head
        with torch.no_grad():
            model.lm_head_w.normal_(0, 0.05)  # a zero head would give FP8 nothing to round
    grad = attention == "sdpa"
    inputs, targets = random_tokens(args.train_seq_len)
    with torch.set_grad_enabled(grad):
        eager = model(inputs, targets, torch.tensor(2))
        if grad:
            eager.backward()
            eager_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    counters.clear()
    try:
        model.compile_for_training("model", backend="aot_eager" if grad else "eager")
        with torch.set_grad_enabled(grad):
            losses = [model(inputs, targets, torch.tensor(window)) for window in (3, 2)]
            if grad:
                losses[-1].backward()
        model.eval()
        with torch.no_grad():
            model(*random_tokens(args.val_seq_len), torch.tensor(2))
        graphs = counters["stats"]["unique_graphs"]  # (a graph break would have raised: fullgraph)
    finally:
        torch._dynamo.reset()
    assert graphs == 2
    assert losses[-1].item() == pytest.approx(eager.item(), rel=1e-6)
    if grad:
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, eager_grads[name], msg=name)

needs_cxx = pytest.mark.skipif(not shutil.which("g++"), reason="inductor's CPU code needs a C++ compiler")


def assert_inductor_matches_eager(model, tokens, targets, windows, scope="model", then=None):
    """Inductor's own code (C++ on a CPU, where a GPU's is Triton), not dynamo's capture alone: the
    model, tied as the first two thirds train, with the multi-token loss, compiles as one graph
    (scope blocks: one a block, and the head's) whose training and validation losses are eager's
    within 1e-6 and whose gradients are eager's up to fp32 rounding: each at most twice eager's
    distance from a run of the model in fp64 (its loss still fp32, as the loss twin computes it;
    where sums cancel, the embeddings' and some scalars' gradients move by 1e-3 relative in either
    form). then(model): run while compiled."""
    import copy
    import dataclasses
    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo.utils import counters
    with torch.no_grad():  # no zero-initialized weight (W_o, c_proj, gates): every path carries a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    model.embed_tied = True
    weights = torch.tensor([1.0, 0.5, 0.25])

    def loss_and_grads(net, dtype=torch.float32):
        net.zero_grad(set_to_none=True)
        loss = net(tokens, targets, *windows, weights.to(dtype))
        loss.backward()
        return loss.detach().double(), {name: p.grad.double() for name, p in net.named_parameters() if p.grad is not None}
    reference = copy.deepcopy(model).double()
    reference.hw = dataclasses.replace(model.hw, compute_dtype=torch.float64)
    _, ref_grads = loss_and_grads(reference, torch.float64)
    eager_loss, eager_grads = loss_and_grads(model)

    def validation_loss():  # validation's graph: eval, no gradients, the head in chunks
        model.eval()
        with torch.no_grad():
            loss = model(tokens, targets, *windows)
        model.train()
        return loss.item()
    eager_validation = validation_loss()
    torch._dynamo.reset()
    counters.clear()
    try:  # scalar C++ (simdlen 1): torch 2.11's vectorized C++ for a masked blend does not compile (a bug
        # of that release's CPU code generation; a GPU's code is Triton)
        with torch._inductor.config.patch({"cpp.simdlen": 1}):
            model.compile_for_training(scope, backend="inductor")
            loss, grads = loss_and_grads(model)
            graphs = counters["stats"]["unique_graphs"]
            validation = validation_loss()
            validation_graphs = counters["stats"]["unique_graphs"] - graphs
            then and then(model)
    finally:
        torch._dynamo.reset()
    assert graphs == (1 if scope == "model" else len(model.blocks) + 1)
    assert validation == pytest.approx(eager_validation, rel=1e-6) and validation_graphs == graphs
    assert loss.item() == pytest.approx(eager_loss.item(), rel=1e-6)
    assert grads.keys() == eager_grads.keys() == ref_grads.keys() and "lm_head_w" in grads and "embed.weight" not in grads
    distance = lambda g, name: ((g - ref_grads[name]).norm() / ref_grads[name].norm()).item()  # noqa: E731
    for name, g in grads.items():
        assert distance(g, name) <= 2 * distance(eager_grads[name], name) + 1e-5, name


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_inductor_compiles_the_model_to_what_eager_computes(scope):
    """The record's layout at TINY's size, the CPU's attention (SDPA), at each --compile_scope;
    varlen's: tests/test_attention_varlen.py."""
    model, args = tiny_model()
    assert_inductor_matches_eager(model, *random_tokens(args.train_seq_len), (torch.tensor(2), torch.tensor(1)), scope)


def checked_detect(args, ranks=None):
    """Hardware.detect as harness/launch.py calls it: after the harness's checks of this machine."""
    ranks = ranks or train_gpt.Ranks()
    cfg.check_machine(args, ranks)
    return train_gpt.Hardware.detect(args, ranks)



def test_fp8_head_shapes_are_checked_where_the_fp8_head_runs(monkeypatch):
    """torch._scaled_mm takes multiples of 16 only: GPT-2's own 50257 tokens failed at the first
    step, after compiling; now refused before anything starts, on GPUs that run the FP8 head only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for fields, name in [(dict(vocab_size=50257), "--vocab_size=50257"),
                         (dict(num_heads=5, head_dim=104, model_dim=520), "--model_dim=520")]:
        with pytest.raises(train_gpt.ConfigError) as err:
            checked_detect(train_gpt.Hyperparameters(**fields))
        assert str(err.value) == (f"{name}: the FP8 head needs a multiple of 16 on this GPU (a new run: "
                                  "--fp8_head false; any run, a resumed one too: --device cpu)")
        assert checked_detect(train_gpt.Hyperparameters(**fields, fp8_head=False)).fp8_head is False
        assert checked_detect(train_gpt.Hyperparameters(**fields, sample="run.pt")).device.type == "cuda"
    assert checked_detect(train_gpt.Hyperparameters(vocab_size=50320)).fp8_head is True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100: no FP8 head
    assert checked_detect(train_gpt.Hyperparameters(vocab_size=50257)).fp8_head is False


def test_training_on_cuda_with_dynamo_disabled_is_refused(monkeypatch):
    """Under TORCHDYNAMO_DISABLE=1 torch.compile does nothing, and FlexAttention runs unfused: every
    score at once, and its mask's block lists (the window) ignored. Refused before anything starts;
    sampling (dense attention) and CPU training are unaffected."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with pytest.raises(train_gpt.ConfigError) as err:
        checked_detect(train_gpt.Hyperparameters())
    assert str(err.value) == ("TORCHDYNAMO_DISABLE=1 in the environment: on CUDA FlexAttention runs only compiled "
                              "(unset it: --compile false keeps the rest eager; or --device cpu)")
    assert checked_detect(train_gpt.Hyperparameters(sample="run.pt")).device.type == "cuda"
    assert checked_detect(train_gpt.Hyperparameters(device="cpu")).device.type == "cpu"
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    assert checked_detect(train_gpt.Hyperparameters()).attention == "flex"


@pytest.mark.parametrize("cuda, capability, fp8", [(False, None, False), (True, (8, 0), False), (True, (9, 0), True)])
def test_hardware_branches(monkeypatch, cuda, capability, fp8):
    """FP8 only on GPUs that support it (compute capability 8.9+), Triton orthogonalization and
    FlexAttention on CUDA, the dense-mask path and the PyTorch twin on CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if cuda else 0)
    args = train_gpt.Hyperparameters(fp8_head=True)
    hw = train_gpt.Hardware.detect(args)
    assert hw.fp8_head is fp8
    assert (hw.device.type, hw.attention, hw.dist_backend) == (("cuda", "flex", "nccl") if cuda else ("cpu", "sdpa", "gloo"))
    assert hw.compute_dtype == (torch.bfloat16 if cuda else torch.float32)
    assert hw.ns_backend == ("triton" if cuda and train_gpt.triton is not None else "torch")
    assert hw.ce_backend == hw.mlp_backend == ("triton" if cuda and train_gpt.triton is not None else "torch")  # auto
    assert train_gpt.Hardware.detect(train_gpt.Hyperparameters(fp8_head=False)).fp8_head is False
    assert train_gpt.Hardware.detect(train_gpt.Hyperparameters(ns_backend="torch")).ns_backend == "torch"


# The compile tests of the FP8 head run 32 tokens: CPU torch._scaled_mm is a scalar loop on some
# machines, and the head has 50304 rows whatever the model's width.
FP8_TOKENS = 32


@pytest.mark.slow
def test_fp8_head_traces_under_compile():
    """The custom op's fake (meta) functions and autograd registration, as torch.compile sees them:
    the compiled head gives the eager head's logits and gradients."""
    import torch._dynamo
    model, args = tiny_model(train_seq_len=FP8_TOKENS)
    with torch.no_grad():
        model.lm_head_w.normal_(0, 0.05)
    model.hw = train_gpt.Hardware(torch.device("cpu"), torch.bfloat16, "sdpa", True, "torch", "gloo")
    train_gpt.register_fp8_ops()  # as GPT() does when the hardware runs the FP8 head
    x = torch.randn(1, args.train_seq_len, args.model_dim, dtype=torch.bfloat16)
    _, targets = random_tokens(args.train_seq_len)
    eager = model.head(x, targets)
    eager.backward()
    eager_grad = model.lm_head_w.grad.clone()
    model.lm_head_w.grad = None
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model.head, backend="aot_eager", dynamic=False, fullgraph=True)(x, targets)
        compiled.backward()
    finally:
        torch._dynamo.reset()
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-6)
    torch.testing.assert_close(model.lm_head_w.grad, eager_grad)


@pytest.mark.slow
def test_fp8_op_bodies_are_captured_once(monkeypatch):
    """On CUDA each FP8 op body is compiled on its own. AOT autograd runs a compiled graph's first
    call under a dispatch mode (its custom-op aliasing check) that changes the dispatch keys the
    body's guards see, and the forward body was captured again at the compiled head's second call
    (bench/gpu_proof.py on an H100 at 918c1b4: new_graphs_round2 = 2, with three casts compiled;
    reproduced on CPU, where the two bodies of now give 3, 4, 4 graphs without the fix). CPU
    runs the bodies eager, so they are compiled here as on CUDA (graph capture only)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    monkeypatch.setattr(train_gpt, "_on_device_of", lambda t, fn: train_gpt._compiled(fn, "eager"))
    model, args = tiny_model(train_seq_len=FP8_TOKENS)
    with torch.no_grad():
        model.lm_head_w.normal_(0, 0.05)
    model.hw = train_gpt.Hardware(torch.device("cpu"), torch.bfloat16, "sdpa", True, "torch", "gloo")
    train_gpt.register_fp8_ops()
    x = torch.randn(1, args.train_seq_len, args.model_dim, dtype=torch.bfloat16)
    _, targets = random_tokens(args.train_seq_len)
    eager = model.head(x, targets)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    try:
        head = torch.compile(model.head, backend="aot_eager", dynamic=False)
        for _ in range(3):
            loss = head(x, targets)
            loss.backward()
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
    assert graphs == [3, 3, 3], graphs  # the head, the forward body, the backward body
    assert loss.item() == pytest.approx(eager.item(), rel=1e-6)


@pytest.mark.parametrize("table", ["2025", "2026"])
def test_gradient_communication_starts_with_the_head(table):
    """Units launch in the order backward finishes their gradients: the head first (untied), then the
    blocks from the last to the first, the embeddings last (2026: with the bigram table, and the
    scalars that share betas with block 0's, in one unit)."""
    model, args = tiny_model(**(RECORD_2025 if table == "2025" else {}))
    specs = train_gpt.param_specs(model, args)
    optimizer = train_gpt.ShardedMuonAdam(specs, args, train_gpt.Ranks(0, 0, 2, 2), model.hw)
    names = {id(s.param): s.name for s in specs}
    launched = [[names[id(p)] for p in unit.params] for unit in optimizer.units]

    def first_use(name):  # the block whose forward first reads the parameter
        if name.startswith("blocks."):
            return int(name.split(".")[1])
        return {"lm_head_w": args.num_layers, "backout_lambda": args.num_layers, "skip_weights": args.num_layers // 2,
                "skip_gate": 3, "skip_lambda": 3}.get(name, -1)  # (TINY's skip 0 -> 3)
    positions = [min(first_use(n) for n in unit) for unit in launched]
    assert launched[0] == ["lm_head_w"]
    assert positions == sorted(positions, reverse=True)
    embeddings = ["embed.weight", "value_embeds.0.weight"] + ["bigram_embed.weight"] * (table == "2026")
    if table == "2025":
        assert sorted(sum(launched[-2:], [])) == embeddings
    else:
        last = [unit for unit, position in zip(launched, positions) if position == -1]
        assert last == launched[-len(last):] and set(embeddings) < set(sum(last, []))
        assert all(len(unit) == 1 for unit in last if set(unit) & set(embeddings))
    # tied, the head's gradient is final with the lookup's, as backward ends: the head moves from the
    # front to the back, the others keep their order
    optimizer.embed_tied = True
    optimizer.arm_for_final_backward()
    tied = [[names[id(p)] for p in unit.params] for unit in optimizer.units]
    assert tied == launched[1:] + [["lm_head_w"]]


def test_fp8_weight_gradient_in_the_records_orientation_is_ours_transposed_in_memory():
    """bench/fp8_head.py times the record's (x^T g)^T beside ours, g^T x: the same values, other strides."""
    sys.path.insert(0, str(ROOT))
    from bench.fp8_head import weight_gradient, weight_gradient_as_the_record  # noqa: E402
    torch.manual_seed(0)
    x_scale, w_scale, grad_scale = train_gpt.fp8_head_scales(32)
    x = train_gpt.rms_norm(torch.randn(64, 32)).bfloat16()
    _, x8, w8 = train_gpt._fp8_mm_forward(x, torch.randn(48, 32) * 0.1, x_scale, w_scale)
    grad = (torch.rand(64, 48) * 2 - 1).bfloat16()
    g8 = grad.div(grad_scale).to(torch.float8_e5m2)
    [ours], [record] = weight_gradient(g8, x8, x_scale, grad_scale), weight_gradient_as_the_record(g8, x8, x_scale,
                                                                                                   grad_scale)
    assert torch.equal(ours, train_gpt._fp8_mm_backward(grad, x8, w8, x_scale, w_scale, grad_scale)[1])  # the trainer's
    torch.testing.assert_close(record, ours, rtol=1e-6, atol=1e-6)  # one GEMM's sums in another order
    assert ours.is_contiguous() and record.mT.is_contiguous()
