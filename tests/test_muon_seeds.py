"""The Muon options of the seeds in ../shared/seeds, each checked against the seed's own formula,
written out here from its text (the seeds are read, not imported):
  001 nanochat's MuonAdamW: NorMuon variance reduction and cautious weight decay;
  003 Optimisers.jl's Muon: 1-D arrays, embeddings and heads go to the fallback optimizer, and a
      learning-rate change keeps the ratio of the fallback's lr to Muon's;
  004 Moonlight's Muon: update scaled by 0.2*sqrt(max(rows, cols)), used with the AdamW lr.
The formulas are restated in the docstrings, so these tests run where ../shared is absent. The
seeds' Muon is plain Muon: MUON_2025 (the 2025-08-23 record's options) is the base each seed's
options are set on; the speedrun's (the 2026 record's) NorMuon is tests/test_record_2026_optim.py's."""

import pytest
import torch

import train_gpt
from conftest import perturbed_tiny_model


# The 2025-08-23 record's Muon: Newton-Schulz, max(1, rows/cols)^0.5, no NorMuon or decay; its Adam table
# leaves the attention gates to Muon; fp32 weights.
MUON_2025 = dict(adam_table="2025", ns_method="newton_schulz", muon_update_scale="2025", normuon=False,
                 weight_decay=0.0, muon_decay="lr", cautious_wd=False, mlp_proj_lr_mult=1.0, muon_lr=0.05,
                 bf16_weights=False)


def tiny_setup(**overrides):
    args, hw, model = perturbed_tiny_model(**overrides)
    return args, hw, model, train_gpt.param_specs(model, args)


def one_step(args, hw, specs, grads, lr_factor=1.0, momentum=0.9):
    optimizer = train_gpt.ShardedMuonAdam(specs, args, train_gpt.Ranks(), hw)
    for s in specs:
        s.param.grad = grads[s.name].clone()
    optimizer.muon_momentum = momentum
    optimizer.lr_factor = lr_factor
    optimizer.step()


# --- seed 004: Moonlight's update scale ------------------------------------------------------

def seed004_moonlight_step(p, g, lr, wd, momentum, ns):
    """Seed 004 (Moonlight's Muon), first step from a zero momentum buffer:
        buf = momentum*buf + g;  g = g + momentum*buf  (Nesterov)
        u = zeropower_via_newtonschulz5(g)
        adjusted_lr = lr * 0.2 * sqrt(max(A, B))     (A, B = the parameter's shape)
        p *= 1 - lr*wd;  p -= adjusted_lr * u
    with one lr shared by its Muon and AdamW parameters."""
    buf = g.clone()
    u = ns(g + momentum * buf)
    rows, cols = p.shape[-2:]
    return p * (1 - lr * wd) - lr * 0.2 * max(rows, cols) ** 0.5 * u


def test_moonlight_update_scale_is_seed_004s():
    args, hw, model, specs = tiny_setup(**dict(MUON_2025, muon_update_scale="moonlight", adam_lr=0.01, muon_lr=0.5,
                                               weight_decay=0.1))
    muon = [s for s in specs if s.optimizer == "muon"]
    assert {tuple(s.param.shape[-2:]) for s in muon} >= {(32, 32), (32, 128), (2, 12)}  # square, wide, gate
    before = {s.name: s.param.detach().clone() for s in specs}
    grads = {s.name: torch.randn_like(s.param) for s in specs}
    one_step(args, hw, specs, grads, momentum=0.9)
    # Newton-Schulz normalizes by the Frobenius norm first, so its output does not depend on the
    # momentum's overall scale (the seed sums gradients, we average them).
    ns = lambda g: train_gpt.orthogonalize(g, "newton_schulz", "torch")  # noqa: E731
    for s in muon:
        expected = seed004_moonlight_step(before[s.name], grads[s.name], lr=0.01, wd=0.1, momentum=0.9, ns=ns)
        torch.testing.assert_close(s.param.detach(), expected, atol=1e-5, rtol=1e-5, msg=s.name)
        assert not torch.allclose(s.param.detach(), before[s.name])


def test_update_scale_factors():
    """The factor per matrix under each rule: 2025 is the 2025 speedrun's max(1, rows/cols)^0.5, aspect
    the 2026 record's (long side / short side)^0.5."""
    for rule, shape, factor in [("2025", (768, 3072), 1.0), ("2025", (3072, 768), 2.0),
                                ("moonlight", (768, 3072), 0.2 * 3072 ** 0.5),
                                ("moonlight", (3072, 768), 0.2 * 3072 ** 0.5),
                                ("moonlight", (4, 768, 768), 0.2 * 768 ** 0.5),
                                ("aspect", (768, 3072), 2.0), ("aspect", (3072, 768), 2.0), ("aspect", (768, 768), 1.0)]:
        spec = train_gpt.ParamSpec("w", torch.nn.Parameter(torch.zeros(shape)), "muon", "matrix", 1.0)
        slot = train_gpt.MatrixSlot(spec, 0 if len(shape) == 3 else None, shape[-2] > shape[-1], rule)
        assert slot.lr_scale == pytest.approx(factor), (rule, shape)


# --- seed 003: what goes to the fallback optimizer, and the lr ratio ---------------------------

@pytest.mark.parametrize("adam_table", ["2025", "2026"])
def test_fallback_rule_is_seed_003s(adam_table):
    """Seed 003: 'Muon is used for the internal layer >2D weights, and AdamW is used for the 1D
    weights, embeddings, and heads' (the 2026 record's table gives Adam the attention gates too);
    adjust!(state, eta) sets Muon's lr to eta and the fallback's to eta * (fallback lr / Muon lr),
    'preserving their ratio'. Here the schedule's lr factor multiplies both optimizers' learning
    rates, so every step keeps the ratio (the weight decays, which scale with lr^2, off)."""
    args, hw, model, specs = tiny_setup(adam_table=adam_table, bf16_embeds=False, bf16_weights=False,  # fp32 throughout:
                                        weight_decay=0.0, adam_weight_decay=0.0)  # deltas compare exactly
    by_param = {id(s.param): s for s in specs}
    embeddings = {id(p) for e in (model.embed, model.value_embeds, model.bigram_embed) for p in e.parameters()}
    for name, p in model.named_parameters():
        s = by_param[id(p)]
        fallback = p.ndim < 2 or id(p) in embeddings or p is model.lm_head_w or (
            adam_table == "2026" and name.endswith("gate_w"))
        assert s.optimizer == ("adam" if fallback else "muon"), name
    assert any(name.endswith("gate_w") for name, p in model.named_parameters() if p.ndim == 2)
    assert any(s.optimizer == "muon" for s in specs) and any(p.ndim < 2 for p in model.parameters())

    start = {s.name: s.param.detach().clone() for s in specs}
    grads = {s.name: torch.randn_like(s.param) for s in specs}
    deltas = {}
    for eta in (1.0, train_gpt.lr_factor_at(args.num_iterations, args)):
        with torch.no_grad():
            for s in specs:
                s.param.copy_(start[s.name])
        one_step(args, hw, specs, grads, lr_factor=eta)
        deltas[eta] = {s.name: s.param.detach() - start[s.name] for s in specs}
    full, eta = 1.0, min(deltas)
    assert eta < 0.5
    for s in specs:  # Adam's first step and Muon's step are both linear in the lr
        torch.testing.assert_close(deltas[eta][s.name], eta * deltas[full][s.name], atol=1e-6, rtol=1e-4,
                                   msg=s.name)


# --- seed 001: NorMuon and cautious weight decay ---------------------------------------------

def seed001_normuon(g, buffer, beta2):
    """Seed 001 (nanochat's muon_step_fused), for one matrix g (rows, cols) and its buffer:
        red_dim = -1 if rows >= cols else -2
        v_mean = mean(g^2 over red_dim);  buffer.lerp_(v_mean, 1 - beta2)
        step_size = rsqrt(clamp_min(buffer, 1e-10))
        g = g * step_size * ||g||_F / ||g * step_size||_F
    i.e. one statistic per row for tall and square matrices, per column for wide ones."""
    red_dim = -1 if g.shape[0] >= g.shape[1] else -2
    buffer.lerp_(g.square().mean(dim=red_dim, keepdim=True), 1 - beta2)
    step_size = buffer.clamp_min(1e-10).rsqrt()
    return g * step_size * g.norm() / (g * step_size).norm().clamp_min(1e-10)


def seed001_update(p, g, lr, wd, beta2, buffer):
    """Seed 001's cautious weight decay and update, with lr = group lr * max(1, rows/cols)^0.5:
        mask = (g * p) >= 0;  p -= lr*g + lr*wd*p*mask"""
    g = seed001_normuon(g, buffer, beta2)
    lr = lr * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
    return p - (lr * g + lr * wd * p * ((g * p) >= 0))


def ours_normuon(g, second_moment, beta2):
    """normuon_normalize as the trainer calls it: on the wide orientation (tall matrices transposed),
    a statistic per row of square matrices, per column of the others."""
    tall = g.shape[0] > g.shape[1]
    wide = g.mT if tall else g
    out = train_gpt.normuon_normalize(wide[None].clone(), second_moment, beta2, -1 if g.shape[0] == g.shape[1] else -2)[0]
    return out.mT if tall else out


@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (16, 16)])
def test_normuon_against_seed_001(shape):
    """Three steps on the same inputs, columns and rows of unequal scale: wide, tall and square
    matrices agree with the seed (the 2026 record computes the same)."""
    torch.manual_seed(0)
    rows, cols = shape
    ours_buffer = torch.zeros(1, rows, 1) if rows == cols else torch.zeros(1, 1, max(rows, cols))
    seed_buffer = torch.zeros(rows, 1) if rows >= cols else torch.zeros(1, cols)
    for _ in range(3):
        g = torch.randn(shape) * torch.rand(rows, 1) * torch.rand(1, cols) * 3
        torch.testing.assert_close(ours_normuon(g, ours_buffer, 0.95), seed001_normuon(g, seed_buffer, 0.95),
                                   atol=1e-6, rtol=1e-5)


def test_normuon_and_cautious_decay_step_against_seed_001():
    """One optimizer step with NorMuon and cautious weight decay on the tiny model: each matrix
    (the MLP's, the gate, the square attention ones; lr factor 1) lands where seed 001's formula
    puts it. The seed multiplies the weight decay by max(1, rows/cols)^0.5 too; we do not, which
    would matter only for tall matrices, and this model has none."""
    args, hw, model, specs = tiny_setup(**dict(MUON_2025, normuon=True, normuon_beta2=0.9, weight_decay=0.5,
                                               cautious_wd=True, muon_lr=0.03))
    muon = [s for s in specs if s.optimizer == "muon"]
    assert all(s.param.shape[-2] <= s.param.shape[-1] for s in muon)
    before = {s.name: s.param.detach().clone() for s in specs}
    grads = {s.name: torch.randn_like(s.param) for s in specs}
    one_step(args, hw, specs, grads, momentum=0.9)
    checked = {"wide": 0, "square": 0}
    for s in muon:
        stack = s.param.detach() if s.param.ndim == 3 else s.param.detach()[None]
        for i, p in enumerate(before[s.name] if s.param.ndim == 3 else before[s.name][None]):
            g = grads[s.name][i] if s.param.ndim == 3 else grads[s.name]
            nesterov = g.lerp(0.1 * g, 0.9)  # seed 001's lerp momentum from a zero buffer
            u = train_gpt.orthogonalize(nesterov, args.ns_method, "torch")
            rows, cols = p.shape
            expected = seed001_update(p, u, 0.03, 0.5, 0.9, torch.zeros(1, cols) if rows < cols else torch.zeros(rows, 1))
            checked["wide" if rows < cols else "square"] += 1
            torch.testing.assert_close(stack[i], expected, atol=1e-5, rtol=1e-5, msg=f"{s.name}[{i}]")
    assert checked["wide"] and checked["square"]


# --- --ns_coeffs: the orthogonalizer's table from the command line ---------------------------

def test_ns_coeffs_flag_is_the_table_the_optimizer_runs(monkeypatch):
    """A step with --ns_coeffs T equals a step whose method's own table is T (the module
    attribute swapped), and differs from the default table's step."""
    table = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5), (1.875, -1.25, 0.375)]
    text = ";".join(",".join(repr(v) for v in step) for step in table)

    def params_after_step(**overrides):
        args, hw, model, specs = tiny_setup(ns_method="aol", **overrides)
        torch.manual_seed(1)
        grads = {s.name: torch.randn_like(s.param) for s in specs}
        one_step(args, hw, specs, grads)
        return {s.name: s.param.detach().clone() for s in specs if s.optimizer == "muon"}

    flagged = params_after_step(ns_coeffs=text)
    default = params_after_step()
    monkeypatch.setattr(train_gpt, "AOL_COEFFS", table)
    swapped = params_after_step()
    for name in flagged:
        torch.testing.assert_close(flagged[name], swapped[name], rtol=0, atol=0)
    assert any(not torch.allclose(flagged[n], default[n]) for n in flagged)
