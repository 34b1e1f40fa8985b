"""The GPT: shapes, the initial loss, which parameters train, the value-embedding pattern, the
FP8 head against a full-precision reference."""

import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt
from conftest import TINY


def tiny_model(**overrides):
    args = train_gpt.Hyperparameters(**dict(TINY, **overrides))
    train_gpt.check_config(args, 1, False)
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
    logits = model.logits(inputs, window)
    assert logits.shape == (args.train_seq_len, args.vocab_size) and logits.dtype == torch.float32
    # the soft cap bounds logits to (0, 2*cap)
    assert logits.min() >= 0 and logits.max() <= 2 * args.logit_softcap
    loss = model(inputs, targets, window)
    assert loss.shape == () and loss.dtype == torch.float32


def test_initial_loss_is_log_vocab():
    model, args = tiny_model()
    inputs, targets = random_tokens(args.train_seq_len)
    loss = model(inputs, targets, torch.tensor(4))
    # zero-initialized head: every logit equals the cap, the prediction is uniform
    assert loss.item() == pytest.approx(math.log(args.vocab_size), abs=1e-5)


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


def test_architecture_layout():
    model, args = tiny_model(num_layers=12, window_pattern="LSSSLSSLSSSL", attention_free_layers="7",
                             num_value_embeds=3)
    assert model.value_embed_of_layer == [0, 1, 2, None, None, None, None, None, None, 0, 1, 2]
    assert [b.attn is None for b in model.blocks] == [i == 7 for i in range(12)]
    assert model.skip_weights.shape == (6,)
    for i, b in enumerate(model.blocks):
        if b.attn is not None:
            assert b.attn.qkvo_w.shape == (4, args.model_dim, args.model_dim)
            assert torch.count_nonzero(b.attn.qkvo_w[3]) == 0  # output projection starts at zero
            assert (b.attn.value_mix is not None) == (model.value_embed_of_layer[i] is not None)
        assert torch.count_nonzero(b.mlp.proj_w) == 0
    assert torch.count_nonzero(model.lm_head_w) == 0


def test_param_specs_cover_each_parameter_once():
    model, args = tiny_model()
    specs = train_gpt.param_specs(model, args)
    assert sorted(id(s.param) for s in specs) == sorted(id(p) for p in model.parameters())
    by_name = {s.name: s for s in specs}
    assert by_name["embed.weight"].optimizer == "adam" and by_name["embed.weight"].lr_mult == args.embed_lr_mult
    assert by_name["lm_head_w"].group == "head"
    assert by_name["blocks.0.attn.qkvo_w"].optimizer == "muon"
    assert by_name["blocks.0.mlp.fc_w"].optimizer == "muon"
    assert by_name["blocks.0.attn.gate_w"].group == "scalar"
    assert by_name["skip_weights"].group == "scalar"


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


def test_window_schedule_grows_linearly():
    args = train_gpt.Hyperparameters()
    blocks = [train_gpt.long_window_blocks_at(s, args) for s in (0, 875, 1750)]
    assert blocks == [1, 8, 14]  # 128 -> 1792 tokens in 128-token blocks


def test_fp8_matmul_matches_full_precision():
    torch.manual_seed(0)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True) * 0.1
    w.retain_grad()
    out = train_gpt.FP8Matmul.apply(x, w)
    grad = torch.randn_like(out)
    out.backward(grad)
    gx, gw = x.grad.clone(), w.grad.clone()
    ref = x.detach() @ w.detach().T
    # e4m3 keeps 3 mantissa bits (relative error up to 1/16 per operand); errors average out
    # over the 32-long dot products, so a few percent of the output scale is the honest bound
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert (gx - grad @ w.detach()).abs().max() < 0.1 * (grad @ w.detach()).abs().max()
    assert (gw - grad.T @ x.detach()).abs().max() < 0.1 * (grad.T @ x.detach()).abs().max()


def test_fp8_head_is_close_to_full_precision_and_only_used_in_training():
    model, args = tiny_model()
    with torch.no_grad():
        model.lm_head_w.normal_(0, 0.05)
    inputs, targets = random_tokens(args.train_seq_len)
    window = torch.tensor(4)
    full_hw = train_gpt.Hardware(torch.device("cpu"), torch.float32, "sdpa", False, "torch", "gloo")
    fp8_hw = train_gpt.Hardware(torch.device("cpu"), torch.float32, "sdpa", True, "torch", "gloo")
    model.hw = full_hw
    full = model.logits(inputs, window)
    model.hw = fp8_hw
    fp8 = model.logits(inputs, window)
    # the FP8 path is really taken, and stays within FP8 rounding of the full-precision logits
    assert not torch.equal(fp8, full)
    centered = full - full.mean()
    assert (fp8 - full).abs().max() < 0.05 * centered.abs().max()
    assert model(inputs, targets, window).item() == pytest.approx(F.cross_entropy(full, targets).item(), abs=2e-3)
    model.eval()  # validation measures the model without FP8
    assert torch.equal(model.logits(inputs, window), full)


def test_compiled_blocks_stay_compiled_for_training_and_validation():
    """The speedrun layout has ~12 block variants (attention or not, value embedding or not, long
    or short window, block 0, training or validation); dynamo must not fall back to eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    model, args = tiny_model(num_layers=12, window_pattern="LSSSLSSLSSSL", attention_free_layers="7",
                             num_value_embeds=3, val_seq_len=256)
    torch._dynamo.reset()
    counters.clear()
    try:
        model.compile_regions(backend="eager")  # dynamo's graph capture without inductor's code generation
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


@pytest.mark.parametrize("cuda, capability, fp8", [(False, None, False), (True, (8, 0), False), (True, (9, 0), True)])
def test_hardware_branches(monkeypatch, cuda, capability, fp8):
    """FP8 only on GPUs that support it (compute capability 8.9+), Triton orthogonalization and
    FlexAttention on CUDA, the dense-mask path and the PyTorch twin on CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    args = train_gpt.Hyperparameters(fp8_head=True)
    hw = train_gpt.Hardware.detect(args)
    assert hw.fp8_head is fp8
    assert (hw.device.type, hw.attention, hw.dist_backend) == (("cuda", "flex", "nccl") if cuda else ("cpu", "sdpa", "gloo"))
    assert hw.compute_dtype == (torch.bfloat16 if cuda else torch.float32)
    assert hw.ns_backend == ("triton" if cuda and train_gpt.triton is not None else "torch")
    assert train_gpt.Hardware.detect(train_gpt.Hyperparameters(fp8_head=False)).fp8_head is False
    assert train_gpt.Hardware.detect(train_gpt.Hyperparameters(ns_backend="torch")).ns_backend == "torch"
