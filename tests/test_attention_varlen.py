"""--attn_backend varlen: the documents as torch's varlen_attn (FlashAttention-2) takes them, the
2026-01-19 record's flash_attn_varlen_func call (P 960-965, 1014-1022). The kernel is CUDA-only; on
CPU a twin written from FlashAttention's rule (below) stands in for it, so that what the trainer
hands the kernel is checked here: the padded document starts, the length bound, the token window,
the paired heads' doubling, through attend, the model and the training loop. The kernel itself
against the twin: bench/gpu_proof.py's correct phase, in bf16 on a GPU (the suite hides GPUs)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import train_gpt
from harness import config as cfg
from conftest import TINY
from test_model import assert_inductor_matches_eager, needs_cxx

BOS = train_gpt.BOS_TOKEN


def flash_allowed(cu_seqlens, window, total):
    """flash_attn_varlen_func(cu_seqlens_q=cu_seqlens_k=cu, causal=True, window_size=(W, 0)): query i
    attends key j when both lie in one segment [cu[b], cu[b+1]) and i - W <= j <= i. Also each
    position's offset in its segment (-1: in none)."""
    pos = torch.arange(total)
    cu = cu_seqlens.long()
    segment = torch.searchsorted(cu, pos, right=True) - 1  # the last b with cu[b] <= p (empty segments skipped)
    covered = (segment < len(cu) - 1) & (pos < cu[-1])
    segment = torch.where(covered, segment, -1)
    offset = torch.where(covered, pos - cu[segment.clamp(min=0)], -1)
    same = (segment[:, None] == segment[None, :]) & covered[:, None]
    return same & (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= window), offset


def varlen_attn_twin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """varlen_attn's computation on CPU, from its documented rule: (T, H, D) in and out, int32 starts,
    the window an int; rows past max_q in their segment, or in no segment, are NaN (the kernel's
    grid never reaches them: what a wrong bound would cost)."""
    assert query.dim() == 3 and cu_seq_q.dtype == torch.int32 and cu_seq_q is cu_seq_k and max_q == max_k
    assert isinstance(max_q, int) and isinstance(window_size[0], int) and window_size[1] == 0
    allowed, offset = flash_allowed(cu_seq_q, window_size[0], query.shape[0])
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)[0].transpose(0, 1)
    reached = (offset >= 0) & (offset < max_q)
    return torch.where(reached[:, None, None], out, float("nan"))


@pytest.fixture
def twin(monkeypatch):
    """The twin in varlen_attn's place; the calls' windows, and in .bounds their (max_seqlen, cu_seqlens entries)."""
    import torch.nn.attention.varlen as varlen
    class Calls(list):
        bounds = []
    calls = Calls()
    def call(*a, **k):
        calls.append(k["window_size"])
        calls.bounds.append((a[5], a[3].numel()))
        return varlen_attn_twin(*a, **k)
    monkeypatch.setattr(varlen, "varlen_attn", call)
    return calls


def tokens_with(T, bos, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, BOS, (T,), generator=g)
    tokens[list(bos)] = BOS
    return tokens


T = 96
LAYOUTS = {  # BOS positions
    "BOS at 0": [0, 17, 40, 41, 80],
    "no BOS at 0": [5, 33, 34, 90],
    "no BOS": [],
    "one document": [0],
    "many tiny documents": sorted(set(range(0, T, 2)) | set(range(1, T, 7))),
    "a BOS at the end": [0, 1, 2, 50, T - 1],
}


@pytest.mark.parametrize("documents, piece, expected", [
    (127, 128, (128, 127)), (128, 128, (128, 255)), (126, 129, (256, 127)), (1, 1024, (1024, 127))])
def test_validation_bounds_at_their_rounding_edges(documents, piece, expected):
    """A window of `documents` documents, the longest `piece` tokens: 127 documents fit 128 cu_seqlens
    entries, 128 need the next 128; a 129-token piece needs a bound of 256; one document the whole window, T."""
    T_ = 1024
    tokens = torch.zeros(T_ + 1, dtype=torch.long)  # one window: documents - 1 short ones, then the piece
    short = [(T_ - piece) // max(documents - 1, 1)] * (documents - 1)
    short[:1] = [T_ - piece - sum(short[1:])] if short else []
    tokens[torch.tensor([0] + short).cumsum(0)[:documents]] = BOS if documents > 1 else 0
    longest, capacity = train_gpt.validation_document_bounds(tokens, T_)
    starts = train_gpt.document_starts(tokens[:T_], T_, capacity=T_)
    assert int((starts[1:] > starts[:-1]).sum()) == documents and int((starts[1:] - starts[:-1]).max()) == piece
    assert (longest, capacity) == expected


@pytest.mark.parametrize("paired", [False, True], ids=["plain", "paired"])
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_starts_allow_what_the_dense_mask_allows(layout, window, paired):
    tokens = tokens_with(T, LAYOUTS[layout])
    capacity = T  # room for one document a token
    mask = train_gpt.varlen_mask(tokens, window, 8, T, paired=paired, capacity=capacity)
    total = (1 + paired) * T
    assert mask.starts.dtype == torch.int32 and mask.starts.shape == (capacity + 1,)
    assert mask.window == 8 * window and mask.longest == total
    allowed, offset = flash_allowed(mask.starts, mask.window, total)
    assert (offset >= 0).all()  # every position in a segment
    dense = train_gpt.dense_attention_mask(tokens, window, 8, token_window=True, paired=paired)
    assert torch.equal(allowed, dense)
    documents = len(LAYOUTS[layout]) + (0 not in LAYOUTS[layout])
    assert torch.equal(mask.starts[documents:], torch.full((capacity + 1 - documents,), total, dtype=torch.int32))


def test_the_capacity_depends_on_the_length_only_and_is_the_records():
    for T_ in (128, 1024, 4096):
        shapes = {train_gpt.varlen_mask(tokens_with(T_, bos), 2, 128, T_).starts.shape
                  for bos in ([0], [3, 9, 60], list(range(0, T_, 64)))}
        assert shapes == {(train_gpt.varlen_capacity(T_) + 1,)}
    # the record's cu_seqlens entries, next_multiple_of_n(T // 300, n=128), at 16Ki, 32Ki, 48Ki and validation's 256Ki
    assert [train_gpt.varlen_capacity(T_) + 1 for T_ in (16384, 32768, 49152, 262144)] == [128, 128, 256, 896]
    assert train_gpt.varlen_capacity(100) + 1 == 128  # (the record's rule gives none below 300 tokens)


@pytest.mark.parametrize("seed", range(4))
def test_validation_bounds_hold_every_window_and_are_tight(seed):
    """validation_document_bounds over the windows val_batches cuts: the longest document (or piece of one)
    and the most documents of any window, rounded up to 128 (cu_seqlens entries); every window's starts
    pass document_starts' check with them and equal those without a bound."""
    g = torch.Generator().manual_seed(seed)
    T_, windows = 1024, 5
    tokens = torch.randint(0, BOS, (windows * T_ + 1 + seed,), generator=g)
    if seed % 2:  # one window of many short documents: more than 127
        tokens[2 * T_:3 * T_:5] = BOS
    lengths = torch.randint(1, 700, (40,), generator=g).cumsum(0)
    tokens[lengths[lengths < tokens.numel()]] = BOS
    longest, capacity = train_gpt.validation_document_bounds(tokens.to(torch.uint16), T_)
    exact_longest = exact_most = 0
    for i in range((tokens.numel() - 1) // T_):
        window = tokens[i * T_:(i + 1) * T_]
        unbounded = train_gpt.document_starts(window, T_, capacity=T_)
        documents = int((unbounded[1:] > unbounded[:-1]).sum())
        exact_longest = max(exact_longest, int((unbounded[1:] - unbounded[:-1]).max()))
        exact_most = max(exact_most, documents)
        bounded = train_gpt.document_starts(window, longest, capacity)  # raises where a bound is too tight
        assert torch.equal(bounded, unbounded[:capacity + 1])
    assert longest == min(T_, -(-exact_longest // 128) * 128) and (capacity + 1) % 128 == 0
    assert exact_most <= capacity < exact_most + 128 and (capacity > 127) == bool(seed % 2)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_micro_batch_past_the_capacity_or_the_length_bound_stops_the_run(compiled):
    build = torch.compile(train_gpt.varlen_mask, backend="aot_eager", fullgraph=True) if compiled else train_gpt.varlen_mask
    five = tokens_with(T, [0, 10, 30, 50, 70])  # five documents, the longest 26 tokens
    assert build(five, 1, 8, 26, capacity=5).starts.tolist() == [0, 10, 30, 50, 70, T]
    with pytest.raises(RuntimeError, match="more documents in a micro-batch than its capacity"):
        build(five, 1, 8, 26, capacity=4)  # FlashAttention would leave the fifth document's rows unwritten
    with pytest.raises(RuntimeError, match="or one too long"):
        build(five, 1, 8, 25, capacity=5)  # ... the last token of each 26-token document


def test_attention_masks_give_each_kind_its_window_and_bound():
    args = train_gpt.Hyperparameters(preset="cpu", attn_block_size=8, token_windows=True, train_max_doc_len=40)
    hw = train_gpt.Hardware(torch.device("cpu"), torch.float32, "varlen", False, "torch", "gloo")
    tokens = tokens_with(T, [0, 30, 60])
    kinds = ("L", "S", "pL", "pS")
    training = train_gpt.attention_masks(tokens, 5, args, hw, kinds=kinds, training=True)
    assert {k: (m.window, m.longest) for k, m in training.items()} == \
        {"L": (40, 40), "S": (16, 40), "pL": (40, 80), "pS": (16, 80)}  # short: 5 // 2 blocks
    assert torch.equal(training["pL"].starts, 2 * training["L"].starts)
    evaluation = train_gpt.attention_masks(tokens, 5, args, hw, short_blocks=1, kinds=kinds)
    assert {k: (m.window, m.longest) for k, m in evaluation.items()} == \
        {"L": (40, T), "S": (8, T), "pL": (40, 2 * T), "pS": (8, 2 * T)}  # validation: documents whole
    bounded = train_gpt.attention_masks(tokens, 5, args, hw, kinds=kinds, eval_bounds=(40, 7))  # the run's validation
    assert {k: (m.longest, m.starts.numel()) for k, m in bounded.items()} == \
        {"L": (40, 8), "S": (40, 8), "pL": (80, 8), "pS": (80, 8)}
    assert train_gpt.attention_masks(tokens, 5, args, hw, training=True, eval_bounds=(40, 7))["L"].starts.numel() == \
        train_gpt.varlen_capacity(T) + 1  # training keeps its own
    unpacked = train_gpt.attention_masks(tokens, 1, dataclasses.replace(args, train_max_doc_len=0), hw, training=True)
    assert unpacked["S"].window == 8 and unpacked["L"].longest == T


def test_attention_masks_find_the_document_starts_once_for_every_kind(monkeypatch):
    args = train_gpt.Hyperparameters(preset="cpu", attn_block_size=8, token_windows=True, train_max_doc_len=40)
    hw = train_gpt.Hardware(torch.device("cpu"), torch.float32, "varlen", False, "torch", "gloo")
    tokens = tokens_with(T, [0, 30, 60])
    calls = []
    starts_of = train_gpt.document_starts
    monkeypatch.setattr(train_gpt, "document_starts", lambda *a, **k: calls.append(a) or starts_of(*a, **k))
    masks = train_gpt.attention_masks(tokens, 5, args, hw, kinds=("L", "S", "pL", "pS"), training=True)
    assert len(calls) == 1  # a searchsorted and an assert per forward, not one per kind
    for kind, mask in masks.items():  # each kind as varlen_mask alone builds it
        alone = starts_of(tokens, 40)
        expected = train_gpt.varlen_mask(tokens, 5 if kind[-1] == "L" else 2, 8, 40, paired=kind[0] == "p")
        assert torch.equal(mask.starts, expected.starts) and mask[1:] == expected[1:], kind
        assert torch.equal(alone * (1 + (kind[0] == "p")), mask.starts)


@pytest.mark.parametrize("paired", [False, True], ids=["plain", "paired"])
def test_attend_with_a_varlen_mask_is_the_dense_twin(twin, paired):
    tokens = tokens_with(T, [4, 20, 21, 64])
    g = torch.Generator().manual_seed(1)
    n = (1 + paired) * T
    q, k, v = (torch.randn(1, n, 2, 8, generator=g) for _ in range(3))
    mask = train_gpt.varlen_mask(tokens, 3, 8, T, paired=paired)
    out = train_gpt.attend(q, k, v, mask, scale=0.12)
    dense = train_gpt.dense_attention_mask(tokens, 3, 8, token_window=True, paired=paired)
    torch.testing.assert_close(out, train_gpt.attend(q, k, v, dense, scale=0.12), rtol=1e-6, atol=1e-6)
    assert out.shape == q.shape and twin == [(24, 0)]


def test_the_records_model_gives_the_same_loss_and_gradients_with_varlen(twin):
    from test_record_2026_model import RECORD_MODEL
    args = train_gpt.Hyperparameters(**dict(RECORD_MODEL, train_max_doc_len=40, attn_backend="varlen"))
    cfg.check_config(args, 1, False)
    sdpa = train_gpt.Hardware.detect(args)
    assert sdpa.attention == "sdpa"  # on CPU the dense twin serves whatever the option
    torch.manual_seed(0)
    model = train_gpt.GPT(args, sdpa)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    chunk = tokens_with(129, [0, 30, 31, 70, 100])  # packed: documents of at most 40 tokens
    tokens, targets = chunk[:-1], chunk[1:]
    mtp = torch.tensor([1.0, 0.5])

    def loss_and_grads(attention, windows):
        model.hw = dataclasses.replace(sdpa, attention=attention)
        model.train()
        loss = model(tokens, targets, *windows, mtp)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        model.eval()
        with torch.no_grad():
            return loss, grads, model(tokens, targets, *windows)

    ref = loss_and_grads("sdpa", (torch.tensor(5), torch.tensor(2)))
    ours = loss_and_grads("varlen", (5, 2))
    assert twin and set(twin) == {(40, 0), (16, 0)}
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-6, atol=0)
    for (name, _), a, b in zip(model.named_parameters(), ours[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_the_whole_model_compiles_to_one_graph_per_window_with_varlen(twin):
    """--compile_scope model (fullgraph=True: a graph break is an error) with the varlen masks made
    inside the graph (searchsorted, the asynchronous assert); the window an int, so each window is a
    graph of its own (as the record's); the loss and gradients are eager's (aot_eager: capture)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    args = train_gpt.Hyperparameters(**dict(TINY, token_windows=True, yarn=True, value_gates=True,
                                            paired_head_layers="0", attn_backend="varlen", train_max_doc_len=64))
    model = train_gpt.GPT(args, dataclasses.replace(train_gpt.Hardware.detect(args), attention="varlen"))
    chunk = tokens_with(args.train_seq_len + 1, [0, 40, 90])
    eager = model(chunk[:-1], chunk[1:], 3)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    torch._dynamo.reset()
    counters.clear()
    try:
        model.compile_for_training("model", backend="aot_eager")
        losses = [model(chunk[:-1], chunk[1:], window) for window in (3, 2)]
        grads = torch.autograd.grad(losses[0], list(model.parameters()))
        model.eval()
        with torch.no_grad():
            model(chunk[:-1], chunk[1:], 2)
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs == 3  # training at windows 3 and 2, validation at 2
    assert losses[0].item() == pytest.approx(eager.item(), rel=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), grads, eager_grads):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.slow
@needs_cxx
def test_inductor_compiles_the_varlen_model_to_what_eager_computes_and_keeps_its_bound(twin):
    """Inductor's code for the masks made in the graph (searchsorted, padding) and the twin in the
    kernel's place: as eager (test_model.py's bound), and the asynchronous assert survives it, so a
    document past the bound still stops a compiled run."""
    args = train_gpt.Hyperparameters(**dict(TINY, attn_backend="varlen", train_max_doc_len=64))
    torch.manual_seed(0)
    model = train_gpt.GPT(args, dataclasses.replace(train_gpt.Hardware.detect(args), attention="varlen"))
    chunk = tokens_with(args.train_seq_len + 1, [0, 40, 90])
    overlong = tokens_with(args.train_seq_len + 1, [0, 100])

    def refuses_a_document_past_the_bound(compiled):
        with pytest.raises(RuntimeError, match="or one too long"):
            compiled(overlong[:-1], overlong[1:], 3, 1, torch.tensor([1.0, 0.5, 0.25]))
    assert_inductor_matches_eager(model, chunk[:-1], chunk[1:], (3, 1), then=refuses_a_document_past_the_bound)
    assert set(twin) == {(3 * args.attn_block_size, 0), (args.attn_block_size, 0)}


def test_the_training_loop_feeds_varlen_int_windows_and_packed_warmup_batches(twin, make_shards):
    """A packed record-like run (paired heads, windows staged, YaRN) with the varlen twin: the same
    losses as the dense path. The loop's windows must be ints there, and warmup's random batches
    hold documents no longer than the loader's (else the twin's unreached rows make them NaN)."""
    train_glob, val_glob, (_, val_stream) = make_shards(max_len=200)
    config = dict(TINY, train_files=train_glob, val_files=val_glob, num_iterations=2, val_every=0, warmup_steps=1,
                  val_tokens=1024, val_seq_len=512, token_windows=True, train_max_doc_len=48, window_schedule="1,2",
                  yarn=True, value_gates=True, paired_head_layers="0", attn_backend="varlen")
    args = train_gpt.Hyperparameters(**config)
    cfg.check_config(args, 1, False)
    sdpa = train_gpt.Hardware.detect(args)
    losses, calls = [], []
    for attention in ("sdpa", "varlen"):
        result = train_gpt.train(args, train_gpt.Ranks(), dataclasses.replace(sdpa, attention=attention),
                                 lambda *a, **k: None)
        losses.append((result.train_losses, result.val_losses))
        calls.append(len(twin))
    assert calls[0] == 0 and calls[1] > 0
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses[1][0])
    (ref_train, ref_val), (train, val) = losses
    assert train == pytest.approx(ref_train, rel=1e-5) and [s for s, _ in val] == [s for s, _ in ref_val]
    assert [v for _, v in val] == pytest.approx([v for _, v in ref_val], rel=1e-5)  # (approx takes no pairs)
    # validation's bounds come from its documents (at most 200 tokens here): under its 512, which the twin
    # would have made NaN rows of had a document been longer; training's from the loader's cut (48)
    bounds = train_gpt.validation_document_bounds(torch.from_numpy(val_stream[:1025].astype("int64")), 512)
    assert bounds == (256, 127)
    assert set(twin.bounds) == {(48, 128), (96, 128), (256, 128), (512, 128)}  # plain and paired, training and validation


@pytest.mark.parametrize("flags, message", [
    (dict(attn_backend="flash"), "--attn_backend='flash': expected one of flex, varlen"),
    (dict(attn_backend="varlen", token_windows=False), "--attn_backend=varlen: needs --token_windows true "
                                                        "(FlashAttention's window reaches W tokens back, not whole blocks)"),
])
def test_bad_attention_backends_are_one_line_errors(flags, message):
    with pytest.raises(train_gpt.ConfigError) as err:
        cfg.check_config(train_gpt.Hyperparameters(**flags), 1, True)
    assert str(err.value) == message


def test_varlen_on_cuda_needs_a_torch_with_its_window(monkeypatch):
    args = train_gpt.Hyperparameters(attn_backend="varlen", token_windows=True, attn_block_size=64)
    cfg.check_config(args, 1, True)  # any block size: FlexAttention's tile does not apply
    cfg.check_config(args, 1, False)
    monkeypatch.setattr(cfg, "varlen_attn_available", lambda: False)
    cfg.check_config(args, 1, False)  # CPU: the dense twin serves
    with pytest.raises(train_gpt.ConfigError, match=r"^--attn_backend=varlen: torch .* has no torch.nn.attention"):
        cfg.check_config(args, 1, True)


def test_the_hardware_runs_varlen_on_cuda_only(monkeypatch):
    args = train_gpt.Hyperparameters(attn_backend="varlen", token_windows=True)
    assert train_gpt.Hardware.detect(args).attention == "sdpa"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert train_gpt.Hardware.detect(args).attention == "varlen"
    assert train_gpt.Hardware.detect(train_gpt.Hyperparameters()).attention == "flex"  # the default
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # FlexAttention's objection (unfused), not varlen's
    with pytest.raises(train_gpt.ConfigError, match="^TORCHDYNAMO_DISABLE=1 in the environment: on CUDA FlexAttention"):
        cfg.check_machine(train_gpt.Hyperparameters(), train_gpt.Ranks())
    cfg.check_machine(args, train_gpt.Ranks())  # varlen: no objection
