"""The 2025-08-23 record's options (RECORD_2025) make our model compute that record's forward pass
(SparseAttnGate) and our schedules its schedules. The speedrun preset is now the 2026-01-19
record's (tests/test_record_2026_*.py); the 2025 record's ways remain options, held here.

record_loss below restates the record's model as plain functions on the record's own parameter
layout (one `scalars` vector, `c_fc`/`c_proj`, `attn_gate`), written from its train_gpt.py; each
step names the line it follows. Our GPT, given the same weights, must give the same loss and the
same gradients: a fork that changes the model's math (another activation, another norm, a
window off by one) fails here, not after a GPU run. Where ../shared holds the record script, its
own model code is run too, on CPU, and must give record_loss's value.

The model is the 2025 record's layout at width 128 and 256 (one and two heads of 128, as its
attention requires): 12 blocks, no attention in block 7, value embeddings 012...012, long and short
windows LSSSLSSLSSSL, on 512 tokens in 128-token blocks. Weights are random, not the zero
initialization, so that every path carries signal."""

import ast
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train_gpt
from conftest import effective_block_mask

PEER = Path(__file__).resolve().parents[1].parent / "shared" / "peers" / "modded-nanogpt_9d9dc969_train_gpt.py"
L, T, BLOCK = 12, 512, 128
VOCAB = 50304  # BOS is 50256: the vocabulary cannot shrink
CPU = train_gpt.Hardware(torch.device("cpu"), torch.float32, "sdpa", False, "torch", "gloo")
# The 2025-08-23 record by our options, where the defaults (the 2026 record's) differ: its model, its
# windows from a BOS, its schedules (1695 steps, one lr plateau, windows grown by progress), fp32 weights.
RECORD_2025 = dict(
    num_layers=12, attention_free_layers="7", value_embed_layers="", window_pattern="LSSSLSSLSSSL",
    bigram_vocab_size=0, smear=False, skip_layers="", backout_layer=-1, resid_lambda_init=1.0, init="2025",
    attn_scale=0.12, yarn=False, logit_cap_height=0.0, logit_cap_shift=0.0, mtp=False, value_gates=False,
    key_offset=False, paired_head_layers="", token_windows=False, bf16_weights=False, fp8_scales="bounded",
    train_max_doc_len=0, train_seq_len_schedule="", num_iterations=1695, extension_steps=0, lr_plateaus="1",
    cooldown_frac=0.45, muon_momentum_cooldown_steps=0, window_schedule="", window_final_blocks=0,
    window_validate_final_blocks=0,
)


def record_weights(heads, seed=0):
    """Random weights in the record's layout and its names, at width 128 x heads."""
    dim = 128 * heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()
    w = {"embed.weight": rand(VOCAB, dim, scale=1.0), "lm_head.weight": rand(VOCAB, dim, scale=dim ** -0.5)}
    for i in range(3):
        w[f"value_embeds.{i}.weight"] = rand(VOCAB, dim, scale=1.0)
    for i in range(L):
        if i != 7:
            w[f"blocks.{i}.attn.qkvo_w"] = rand(4, dim, dim, scale=dim ** -0.5)
            w[f"blocks.{i}.attn.attn_gate.weight"] = rand(heads, 12, scale=0.5)
        w[f"blocks.{i}.mlp.c_fc"] = rand(dim, 4 * dim, scale=dim ** -0.5)
        w[f"blocks.{i}.mlp.c_proj"] = rand(dim, 4 * dim, scale=(4 * dim) ** -0.5)
    # skip weights (12, the first 6 used), block lambdas (12 x 2), attention lambdas (12 x 2), padding
    w["scalars"] = (torch.cat([torch.ones(L), torch.tensor([1.0, 0.0]).repeat(L), torch.full((2 * L,), 0.5),
                               torch.ones(4)]) + 0.2 * torch.randn(5 * L + 4, generator=g)).requires_grad_()
    return w


def tokens_and_targets(seed=0):
    """Four documents, two of them starting inside a 128-token block."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 50000, (T + 1,), generator=g)
    seq[[0, 100, 260, 300]] = 50256
    return seq[:-1], seq[1:]


def record_loss(w, tokens, targets, long_blocks, training=True):
    """The record's GPT.forward on weights w (its layout), in float32."""
    H = w["blocks.0.attn.qkvo_w"].size(1) // 128  # heads of 128
    def norm(x):  # norm(x) = F.rms_norm(x, (x.size(-1),))
        return F.rms_norm(x, (x.size(-1),))

    # docs = (input_seq == 50256).cumsum(0); document_causal: q_idx >= kv_idx and the same document;
    # a window of n blocks: the query's block and the n-1 before it (block masks built from n)
    docs = (tokens == 50256).cumsum(0)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]

    def window(n):
        return (q >= k) & (docs[q] == docs[k]) & (q // BLOCK - k // BLOCK < max(n, 1))
    masks = {"L": window(long_blocks), "S": window(long_blocks // 2)}  # build_bm(n), build_bm(n // 2)
    # angular_freq = (1 / 1024) ** linspace(0, 1, dim//4), then dim//4 zeros; y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos
    freq = (1 / 1024) ** torch.linspace(0, 1, 128 // 4)
    theta = torch.outer(torch.arange(T, dtype=torch.float32), torch.cat([freq, torch.zeros(128 // 4)]))
    cos, sin = theta.cos()[None, :, None, :], theta.sin()[None, :, None, :]

    def rotary(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, -x1 * sin + x2 * cos), 3)

    scalars = w["scalars"]
    skip_weights, lambdas, sa_lambdas = scalars[:L // 2], scalars[L:3 * L].view(-1, 2), scalars[3 * L:5 * L].view(-1, 2)
    ve = [F.embedding(tokens, w[f"value_embeds.{i}.weight"])[None] for i in range(3)]
    ve = ve + [None] * (L - 6) + ve  # ve = [ve[0], ve[1], ve[2]] + [None] * (len(self.blocks) - 6) + [ve[0], ve[1], ve[2]]
    x = x0 = norm(F.embedding(tokens, w["embed.weight"])[None])
    skips = []
    for i in range(L):
        if i >= L // 2:  # x = x + skip_weights[i - n] * skip_connections.pop()
            x = x + skip_weights[i - L // 2] * skips.pop()
        x = lambdas[i][0] * x + lambdas[i][1] * x0
        if i != 7:  # Block: attention if layer_idx != 7
            a, qkvo = norm(x), w[f"blocks.{i}.attn.qkvo_w"]
            qh, kh, vh = F.linear(a, qkvo[:3].flatten(end_dim=1)).view(1, T, 3 * H, 128).chunk(3, dim=-2)
            qh, kh = rotary(norm(qh)), rotary(norm(kh))  # QK norm, then rotary
            vh = sa_lambdas[i][0] * vh + (sa_lambdas[i][1] * ve[i].view_as(vh) if ve[i] is not None else 0)
            y = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2),
                                               attn_mask=masks["LSSSLSSLSSSL"[i]], scale=0.12).transpose(1, 2)
            y = y * torch.sigmoid(F.linear(a[..., :12], w[f"blocks.{i}.attn.attn_gate.weight"])).view(1, T, H, 1)
            x = x + F.linear(y.reshape(1, T, 128 * H), qkvo[3])
        h = F.relu(F.linear(norm(x), w[f"blocks.{i}.mlp.c_fc"].T)).square()  # relu(x).square()
        x = x + F.linear(h, w[f"blocks.{i}.mlp.c_proj"])
        if i < L // 2:
            skips.append(x)
    logits = 30 * torch.sigmoid(F.linear(norm(x), w["lm_head.weight"]).float() / 7.5)  # 30 * sigmoid(logits / 7.5)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets, reduction="sum" if training else "mean")


def ours_from(w, heads):
    """Our GPT with the record's weights w: {our parameter name: (record name, how to take it)}."""
    args = train_gpt.Hyperparameters(**RECORD_2025, model_dim=128 * heads, num_heads=heads, head_dim=128,
                                     train_seq_len=T, val_seq_len=T, bf16_embeds=False)
    model = train_gpt.GPT(args, CPU)
    source = {"embed.weight": ("embed.weight", None), "lm_head_w": ("lm_head.weight", None),
              "skip_weights": ("scalars", slice(0, L // 2))}
    for i in range(3):
        source[f"value_embeds.{i}.weight"] = (f"value_embeds.{i}.weight", None)
    for i in range(L):
        source[f"blocks.{i}.resid_lambda"] = ("scalars", L + 2 * i)
        source[f"blocks.{i}.x0_lambda"] = ("scalars", L + 2 * i + 1)
        source[f"blocks.{i}.mlp.fc_w"] = (f"blocks.{i}.mlp.c_fc", None)
        source[f"blocks.{i}.mlp.proj_w"] = (f"blocks.{i}.mlp.c_proj", None)
        if i != 7:
            source[f"blocks.{i}.attn.qkvo_w"] = (f"blocks.{i}.attn.qkvo_w", None)
            source[f"blocks.{i}.attn.gate_w"] = (f"blocks.{i}.attn.attn_gate.weight", None)
            size = 2 if i in (0, 1, 2, 9, 10, 11) else 1  # blocks without a value embedding use lambdas[0] only
            source[f"blocks.{i}.attn.v_lambdas"] = ("scalars", slice(3 * L + 2 * i, 3 * L + 2 * i + size))
    assert set(source) == {name for name, _ in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            record_name, part = source[name]
            p.copy_(w[record_name].detach()[part] if part is not None else w[record_name])
    return model, source


@pytest.mark.parametrize("heads, long_blocks", [(1, 1), (1, 3), (2, 3)])  # long 1: short 0, one block
def test_the_speedrun_model_is_the_records_forward_and_backward(heads, long_blocks):
    w = record_weights(heads)
    tokens, targets = tokens_and_targets()
    model, source = ours_from(w, heads)
    expected = record_loss(w, tokens, targets, long_blocks)
    got = model(tokens, targets, torch.tensor(long_blocks))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    expected.backward()
    got.backward()
    for name, p in model.named_parameters():
        record_name, part = source[name]
        reference = w[record_name].grad[part] if part is not None else w[record_name].grad
        scale = reference.abs().max().item()
        torch.testing.assert_close(p.grad, reference, rtol=0, atol=1e-4 * scale, msg=lambda m: f"{name}: {m}")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, targets, torch.tensor(long_blocks)),
                                   record_loss(w, tokens, targets, long_blocks, training=False), rtol=1e-5, atol=0)


def block_sparse_attention(q, k, v, block_mask, scale):
    """FlexAttention as its fused kernel computes it (conftest.effective_block_mask)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=effective_block_mask(block_mask, q.size(-2)), scale=scale)


def record_model_module():
    """The record's model classes (norm .. GPT), taken from its script and run on CPU: its
    create_blockmasks builds its block indices on "cuda", here on the tokens' device (that one
    edit), its world size, used only to pad the scalars, is 8, and FlexAttention is
    block_sparse_attention."""
    tree = ast.parse(PEER.read_text())
    wanted = {"norm", "CastedLinear", "Rotary", "CausalSelfAttention", "MLP", "Block", "next_multiple_of_n", "GPT"}
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
    assert {n.name for n in nodes} == wanted
    source = "\n\n".join(ast.get_source_segment(PEER.read_text(), n) for n in nodes)
    assert source.count('device="cuda"') == 1
    source = source.replace('device="cuda"', "device=input_seq.device")
    from torch.nn.attention.flex_attention import BlockMask
    namespace = dict(torch=torch, nn=torch.nn, F=F, Tensor=torch.Tensor, BlockMask=BlockMask,
                     flex_attention=block_sparse_attention, os=types.SimpleNamespace(environ={"DISABLE_FP8": "1"}),
                     dist=types.SimpleNamespace(get_world_size=lambda: 8))
    exec(compile(source, str(PEER), "exec"), namespace)
    return namespace


@pytest.mark.skipif(not PEER.exists(), reason="../shared/peers is absent")
@pytest.mark.parametrize("heads, long_blocks", [(1, 1), (1, 2), (1, 3), (1, 4), (2, 3)])
def test_record_loss_is_what_the_records_own_model_code_computes(heads, long_blocks):
    """The record's classes, forward only (its attention is checked in forward; record_loss's
    backward is autograd's, and ours is checked against it above)."""
    record = record_model_module()
    model = record["GPT"](vocab_size=50257, num_layers=L, num_heads=heads, model_dim=128 * heads, max_seq_len=T)
    w = record_weights(heads)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(w[name])
    tokens, targets = tokens_and_targets()
    for training in (True, False):
        model.train(training)
        with torch.no_grad():
            got = model(tokens, targets, torch.tensor(long_blocks, dtype=torch.int32))
            torch.testing.assert_close(got, record_loss(w, tokens, targets, long_blocks, training), rtol=1e-5, atol=0)


@pytest.mark.skipif(not PEER.exists(), reason="../shared/peers is absent")
def test_schedules_are_the_records_at_every_step():
    """The learning-rate factor, Muon's momentum and the long window, at every one of the 1695
    steps (and the window at the final validation), as the record's own functions compute them:
    get_lr and get_window_size_blocks run from its source (its tensor helper replaced by the block
    count it holds), the momentum from its two lines in the training loop."""
    import re
    source = PEER.read_text()
    nodes = [n for n in ast.parse(source).body
             if isinstance(n, ast.FunctionDef) and n.name in ("get_lr", "get_window_size_blocks", "next_multiple_of_n")]
    assert len(nodes) == 3
    args = train_gpt.Hyperparameters(**RECORD_2025)
    namespace = dict(args=types.SimpleNamespace(num_iterations=1695, cooldown_frac=0.45))
    exec(compile("\n\n".join(ast.get_source_segment(source, n) for n in nodes), str(PEER), "exec"), namespace)
    namespace["get_window_size_blocks_helper"] = lambda window_size: window_size // 128
    frac_line = re.search(r"^\s*frac = (min\(step / 300, 1\))", source, re.M).group(1)
    momentum_line = re.search(r'^\s*group\["momentum"\] = (\(1 - frac\) \* 0\.85 \+ frac \* 0\.95)', source, re.M)
    for step in range(args.num_iterations + 1):
        assert train_gpt.long_window_blocks_at(step, args) == namespace["get_window_size_blocks"](step), step
        if step == args.num_iterations:  # the record's get_lr asserts progress < 1: no step is taken there
            break
        assert train_gpt.lr_factor_at(step, args) == namespace["get_lr"](step), step
        frac = eval(frac_line, {"step": step})
        assert train_gpt.muon_momentum_at(step, args) == eval(momentum_line.group(1), {"frac": frac}), step
