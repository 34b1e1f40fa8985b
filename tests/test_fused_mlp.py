"""The fused MLP (--mlp_backend): the Triton kernel that writes relu(x fc)^2 with its GEMM, in the
interpreter (fp32: the interpreter's bf16 is wrong for every kernel here, so bf16 is checked on a
GPU by bench/gpu_proof.py), against the torch twin and against the 2026-01-19 record's math; the
twin's bf16 roundings are the record's; the option's resolution and its one-line errors."""

import pytest
import torch

import train_gpt
from conftest import TINY
from harness import config as cfg


def record_mlp(x, c_fc, c_proj, grad):
    """The record's FusedLinearReLUSquareFunction (K 376-391) with its kernel's epilogues (K 290-324),
    c_fc and c_proj stored (hidden, dim): the product rounded to x's dtype before the epilogue.
    -> (output, dx, dc_fc, dc_proj)."""
    def product(a, b):  # the kernel's a @ b^T with an fp32 (here fp64) accumulator, cast to a's dtype (K 290, 302)
        return (a.double() @ b.double().T).to(a.dtype)
    pre = product(x, c_fc)
    post = torch.clamp_min(pre, 0) * torch.clamp_min(pre, 0)        # K 310-311, in pre's dtype
    out = post @ c_proj                                             # K 380
    dpre = 2 * product(grad, c_proj) * torch.where(pre > 0, pre, 0)  # K 303-305 (aux = pre)
    return out, dpre @ c_fc, dpre.T @ x, post.T @ grad               # K 387-390


def with_grads(fn, x, fc, proj, grad):
    x, fc, proj = (t.detach().clone().requires_grad_() for t in (x, fc, proj))
    out = fn(x, fc, proj)
    out.backward(grad)
    return out.detach(), x.grad, fc.grad, proj.grad


def mlp_inputs(shape, dim, hidden, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, dim, generator=gen)
    fc = torch.randn(dim, hidden, generator=gen) * dim ** -0.5
    proj = torch.randn(dim, hidden, generator=gen) * hidden ** -0.5
    grad = torch.randn(*shape, dim, generator=gen)
    return [t.to(dtype) for t in (x, fc, proj, grad)]


# rows not a multiple of the interpreter's 32-row tile; hidden = 4 dim; a (batch, T, dim) input
SHAPES = [((45,), 32, 128), ((70,), 64, 256), ((2, 19), 32, 128), ((1,), 16, 64)]


@pytest.mark.parametrize("shape, dim, hidden", SHAPES)
def test_kernel_path_equals_the_twin_and_the_record(shape, dim, hidden):
    x, fc, proj, grad = mlp_inputs(shape, dim, hidden)
    fused = with_grads(train_gpt.FusedReLUSquareMLP.apply, x, fc, proj, grad)
    twin = with_grads(train_gpt.relu_square_mlp_torch, x, fc, proj, grad)
    rows, grad_rows = x.reshape(-1, dim).double(), grad.reshape(-1, dim).double()
    out, dx, dc_fc, dc_proj = record_mlp(rows, fc.double().T, proj.double().T, grad_rows)
    record = (out.view(*shape, dim), dx.view(*shape, dim), dc_fc.T, dc_proj.T)  # ours stores both (dim, hidden)
    for name, a, b, r in zip(("output", "dx", "dfc_w", "dproj_w"), fused, twin, record):
        assert a.shape == b.shape == r.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n} vs twin: {m}")
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n} vs record: {m}")
    assert fused[2].abs().max() > 0 and fused[1].abs().max() > 0  # relu kept some units: the gradients are real


def test_the_kernel_reads_any_strides_and_writes_both_epilogues():
    """relu_square_matmul_triton on transposed and column-sliced operands: (pre, post), then dpre."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(33, 2 * 40, generator=gen)[:, ::2]           # (33, 40), column stride 2
    b = torch.randn(72, 40, generator=gen).T                      # (40, 72), transposed
    g = torch.randn(40, 33, generator=gen).T                      # (33, 40), transposed
    c = torch.randn(72, 40, generator=gen).T
    pre, post = train_gpt.relu_square_matmul_triton(a, b)
    expected = a.double() @ b.double()
    torch.testing.assert_close(pre.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(post, pre.clamp_min(0).square())
    dpre = train_gpt.relu_square_matmul_triton(g, c, pre)
    torch.testing.assert_close(dpre.double(), 2 * (g.double() @ c.double()) * expected.clamp_min(0),
                               rtol=1e-5, atol=1e-5)
    assert ((dpre == 0) == (pre <= 0)).float().mean() > 0.99  # relu's zeros where pre <= 0
    ones = torch.ones(1, 40).expand(33, 40)                       # stride 0: the gradient of a sum
    torch.testing.assert_close(train_gpt.relu_square_matmul_triton(ones, c, pre).double(),
                               2 * (ones.double() @ c.double()) * expected.clamp_min(0), rtol=1e-5, atol=1e-5)


def test_the_twin_rounds_as_the_record_in_bf16():
    """Where activations are bf16 the twin is the record's kernel: pre rounded to bf16, relu^2 in
    bf16, dpre = 2 round(g proj) relu(pre). Inputs whose first GEMMs are exact in fp32 make the
    comparison bitwise; relu^2 of the unrounded fp32 product would differ (checked)."""
    gen = torch.Generator().manual_seed(2)
    rows, dim, hidden = 45, 32, 128
    x = torch.randint(-3, 4, (rows, dim), generator=gen).bfloat16()
    fc, proj = (torch.randint(-64, 65, (dim, hidden), generator=gen).div(64).bfloat16() for _ in range(2))
    grad = torch.randint(-3, 4, (rows, dim), generator=gen).bfloat16()
    twin = with_grads(train_gpt.relu_square_mlp_torch, x, fc, proj, grad)
    out, dx, dc_fc, dc_proj = record_mlp(x, fc.T, proj.T, grad)
    for name, a, b in zip(("output", "dx", "dfc_w", "dproj_w"), twin, (out, dx, dc_fc.T, dc_proj.T)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    exact = x.float() @ fc.float()
    assert not torch.equal(exact.clamp_min(0).square().bfloat16(), (exact.bfloat16().clamp_min(0)).square())


def mlp_pair(dim=32, hidden=128):
    torch.manual_seed(3)
    mlps = {backend: train_gpt.MLP(dim, hidden, backend=backend) for backend in ("torch", "triton")}
    with torch.no_grad():
        mlps["torch"].proj_w.normal_(0, hidden ** -0.5)  # a zero projection would leave fc_w no gradient
        mlps["triton"].load_state_dict(mlps["torch"].state_dict())
    return mlps


def test_the_mlp_module_is_the_same_by_either_backend():
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(4))
    results = {}
    for backend, mlp in mlp_pair().items():
        inputs = x.clone().requires_grad_()
        out = mlp(inputs)
        out.square().sum().backward()
        results[backend] = (out.detach(), inputs.grad, mlp.fc_w.grad, mlp.proj_w.grad)
    for a, b in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_fused_mlp_compiles_in_one_graph():
    """fullgraph=True through the custom ops (dynamo cannot trace the Triton interpreter, nor needs
    to): aot_eager captures forward and backward, and gives eager's values."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    mlp = mlp_pair()["triton"]
    x = torch.randn(45, 32, generator=torch.Generator().manual_seed(5))

    def step(fn):
        inputs = x.clone().requires_grad_()
        out = fn(inputs)
        out.square().sum().backward()
        grads = [out.detach(), inputs.grad, mlp.fc_w.grad.clone(), mlp.proj_w.grad.clone()]
        mlp.zero_grad(set_to_none=True)
        return grads
    eager = step(mlp)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = step(torch.compile(mlp, dynamic=False, fullgraph=True, backend="aot_eager"))
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)


def test_the_model_runs_the_fused_mlp_where_asked(monkeypatch):
    """--mlp_backend reaches every block's MLP (the kernel runs twice per block, forward and
    backward); a step's loss and gradients are the twin's."""
    launches = []
    kernel = train_gpt.relu_square_matmul_triton
    monkeypatch.setattr(train_gpt, "relu_square_matmul_triton", lambda *a: launches.append(len(a)) or kernel(*a))
    # TINY's model at 2 blocks (the Triton interpreter is slow)
    tiny = dict(TINY, num_layers=2, window_pattern="SL", attention_free_layers="", value_embed_layers="0.",
                skip_layers="0,1", backout_layer=0, attn_block_size=16, train_seq_len=48, val_seq_len=48, val_tokens=96)
    results = {}
    for backend in ("torch", "triton"):
        args = train_gpt.Hyperparameters(**tiny, mlp_backend=backend)
        cfg.check_config(args, 1, False)
        hw = train_gpt.Hardware.detect(args)
        assert hw.mlp_backend == backend
        torch.manual_seed(0)
        model = train_gpt.GPT(args, hw)
        with torch.no_grad():
            for block in model.blocks:
                block.mlp.proj_w.normal_(0, 0.1)
        assert all(block.mlp.backend == backend for block in model.blocks)
        chunk = torch.randint(0, 50257, (49,), generator=torch.Generator().manual_seed(7))
        chunk[0] = train_gpt.BOS_TOKEN
        loss = model(chunk[:-1], chunk[1:], torch.tensor(2))
        loss.backward()
        assert launches == ([2, 2, 3, 3] if backend == "triton" else [])  # (x, fc) per block, then (g, proj, pre)
        results[backend] = [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(results["torch"]) == len(results["triton"]) > 4
    for a, b in zip(results["torch"], results["triton"]):
        # fp32 sums in another order: an entry near 3e-4 differed by 2e-6 on another CPU
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_auto_is_torch_without_cuda():
    assert train_gpt.Hardware.detect(train_gpt.Hyperparameters(preset="cpu")).mlp_backend == "torch"
    assert train_gpt.Hyperparameters.mlp_backend == "auto"


@pytest.mark.parametrize("argv, interpreting, needle", [
    (["--mlp_backend", "cuda"], True, "--mlp_backend='cuda': expected one of auto, torch, triton"),
    (["--mlp_backend", "triton"], False, "--mlp_backend=triton: needs a CUDA device (or TRITON_INTERPRET=1 for tests)"),
])
def test_bad_mlp_backend_is_one_line(monkeypatch, argv, interpreting, needle):
    monkeypatch.setattr(train_gpt, "TRITON_INTERPRETING", interpreting)
    with pytest.raises(train_gpt.ConfigError) as err:
        cfg.parse_config(argv, {}, 1, False)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert cfg.parse_config(["--mlp_backend", "torch"], {}, 1, False).mlp_backend == "torch"
