"""The port to the record of 2026-01-19: its optimizers against restatements of the record's code
(../shared/peers/modded-nanogpt_93f0e6b9/train_gpt.py, lines named beside each), on CPU."""

import dataclasses

import pytest
import torch

import train_gpt
from test_record_2026_model import RECORD_MODEL

# P 1575-1590 (TrainingManager.param_table) with the defaults it leaves out (lr_mul, wd_mul 1.0, P 327-328):
# label: (betas, lr_mul, wd_mul)
RECORD_ADAM = {"scalars": ((0.9, 0.99), 5.0, 0.0), "ve": ((0.75, 0.95), 75.0, 5.0),
               "bigram_embed": ((0.75, 0.95), 75.0, 5.0), "smear_gate": ((0.9, 0.99), 0.01, 0.0),
               "skip_gate": ((0.9, 0.99), 0.05, 0.0), "attn_gate_bank": ((0.9, 0.99), 1.0, 1.0),
               "ve_gate_bank": ((0.9, 0.99), 1.0, 1.0), "x0_lambdas": ((0.65, 0.95), 5.0, 0.0),
               "lm_head": ((0.5, 0.95), 1.0, 150.0), "embed": ((0.5, 0.95), 1.0, 150.0)}
ADAM_LR, ADAM_EPS, ADAM_WD = 0.008, 1e-10, 0.005  # adam_defaults, P 1601-1605


def record_label(name):  # the record parameter (its label) that holds our parameter's values
    if name.startswith("value_embeds."):
        return "ve"
    if name.endswith(".attn.gate_w"):
        return "attn_gate_bank"
    if name.endswith(".ve_gate_w"):
        return "ve_gate_bank"
    if name.endswith(".x0_lambda"):
        return "x0_lambdas"
    return {"lm_head_w": "lm_head", "embed.weight": "embed", "bigram_embed.weight": "bigram_embed",
            "smear_gate": "smear_gate", "skip_gate": "skip_gate"}.get(name, "scalars")


def record_adam_step(p, g, state, betas, lr, wd_mul):
    """NorMuonAndAdam._adam_update and _adam_update_step (P 655-691): lr = 0.008 x lr_mul x get_lr."""
    beta1, beta2 = betas
    state["step"] += 1
    t = state["step"]
    bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** t
    step_size, eff_wd = lr * (bias2 ** 0.5 / bias1), lr * lr * ADAM_WD * wd_mul
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    update = exp_avg.div(exp_avg_sq.sqrt().add_(ADAM_EPS)).mul_(step_size)
    mask = (update * p) > 0
    update.addcmul_(p, mask, value=eff_wd)
    p.add_(update, alpha=-1.0)


def model_and_specs(**overrides):
    args = train_gpt.Hyperparameters(**dict(RECORD_MODEL, micro_batches=1, **overrides))
    assert (args.adam_table, args.adam_lr, args.adam_eps, args.adam_weight_decay) == ("2026", ADAM_LR, ADAM_EPS, ADAM_WD)
    train_gpt.harness("config").check_config(args, 1, False)
    hw = train_gpt.Hardware.detect(args)
    torch.manual_seed(0)
    model = train_gpt.GPT(args, hw)
    return args, hw, model, train_gpt.param_specs(model, args)


def test_every_adam_parameter_has_the_records_betas_lr_and_decay():
    _, _, model, specs = model_and_specs()
    adam = {s.name: s for s in specs if s.optimizer == "adam"}
    muon = {s.name for s in specs if s.optimizer == "muon"}
    # the record's NorMuon trains the attention and MLP banks only; every gate is Adam's
    assert muon == {n for n, _ in model.named_parameters() if n.endswith(("qkvo_w", "fc_w", "proj_w"))}
    assert set(adam) | muon == {n for n, _ in model.named_parameters()}
    for name, spec in adam.items():
        betas, lr_mul, wd_mul = RECORD_ADAM[record_label(name)]
        assert (spec.betas, spec.lr_mult, spec.wd_mult) == (betas, lr_mul, wd_mul), name
    assert {record_label(n) for n in adam} == set(RECORD_ADAM)


@pytest.mark.parametrize("bf16_embeds", [False, True, "weights"], ids=["fp32", "bf16 embeddings", "bf16 weights"])
def test_adam_steps_are_the_records(bf16_embeds):
    """Three steps at lr factors 1, 1.52 and 0.5 with random gradients: every Adam parameter as the
    record's update leaves it (per-kind betas, lr and decay multipliers, fp32 moments, the cautious
    decay lr^2 x 0.005 x wd_mul where the update and the parameter agree in sign). Each step starts
    the record's update from our parameters; the moments are the record's throughout. The update's
    last bit may differ (its step size is rounded in another order), so the result may differ by the
    rounding of the parameter's dtype: a few units in the last place of the larger of before/after
    (bf16: one unit, 2^-7 of it at most; fp32: 2^-20, 16 units)."""
    args, hw, model, specs = model_and_specs(bf16_embeds=bool(bf16_embeds), bf16_weights=bf16_embeds == "weights")
    if bf16_embeds == "weights":  # the record's: every gate and the head bf16, its banks start bf16 (P 1802-1808)
        assert all(torch.equal(p, p.bfloat16().float()) for n, p in model.named_parameters()
                   if n.endswith(("qkvo_w", "fc_w", "proj_w")))
        assert {n for n, p in model.named_parameters() if p.dtype == torch.bfloat16} == {
            n for n, _ in model.named_parameters() if n.startswith(("embed.", "value_embeds.", "bigram_embed.")) or
            n in ("lm_head_w", "smear_gate", "skip_gate") or n.endswith("gate_w")}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # every sign present: the decay mask matters
    optimizer = train_gpt.ShardedMuonAdam(specs, args, train_gpt.Ranks(), hw)
    adam = [s for s in specs if s.optimizer == "adam"]
    state = {s.name: dict(step=0, exp_avg=torch.zeros_like(s.param, dtype=torch.float32),
                          exp_avg_sq=torch.zeros_like(s.param, dtype=torch.float32)) for s in adam}
    gen = torch.Generator().manual_seed(2)
    for factor in (1.0, 1.52, 0.5):
        before = {s.name: s.param.detach().clone() for s in adam}
        grads = {s.name: torch.randn(s.param.shape, generator=gen).to(s.param.dtype) for s in specs}
        for s in specs:
            s.param.grad = grads[s.name].clone()
        optimizer.lr_factor = factor
        optimizer.step()
        optimizer.zero_grad()
        for s in adam:
            betas, lr_mul, wd_mul = RECORD_ADAM[record_label(s.name)]
            reference = before[s.name].clone()
            record_adam_step(reference, grads[s.name], state[s.name], betas, ADAM_LR * factor * lr_mul, wd_mul)
            last_place = 2 ** -7 if s.param.dtype == torch.bfloat16 else 2 ** -20
            bound = last_place * torch.maximum(before[s.name].abs(), reference.abs()).float()
            assert ((s.param.detach().float() - reference.float()).abs() <= bound).all(), (s.name, factor)
            if s.param.dtype == torch.bfloat16 and lr_mul < 0.1:  # the smear and skip gates' steps (8e-5, 4e-4)
                assert s.name.endswith(("smear_gate", "skip_gate"))  # round away in bf16 at |w| ~ 0.1, as the record's
            else:
                assert not torch.equal(reference, before[s.name]), s.name
    assert all(m.dtype == torch.float32 for m in optimizer.state_tensors())  # fp32 moments, bf16 embeddings too


MUON_2026 = dict(normuon=True, normuon_beta2=0.95, cautious_wd=True, weight_decay=1.2, muon_lr=0.023,  # the defaults
                 muon_update_scale="aspect", mlp_proj_lr_mult=2.0, muon_decay="lr2", ns_method="polar_express")


def record_variance_reduction(v, second, beta2=0.95):
    """NorMuonAndAdam._apply_normuon_variance_reduction (P 762-775) in the record's orientation, eager:
    statistics in fp32 from v (bf16 in the record: Polar Express's output, P 157, 195), the scale
    rounded to v's dtype and v scaled in it (P 775)."""
    red_dim = -1 if v.size(-2) >= v.size(-1) else -2
    v_mean = v.float().square().mean(dim=red_dim, keepdim=True)
    size = v.size(red_dim)
    v_norm = v_mean.sum(dim=(-2, -1), keepdim=True).mul_(size).sqrt_()
    second.lerp_(v_mean, 1 - beta2)
    step_size = second.clamp_min(1e-10).rsqrt()
    v_norm_new = ((v_mean * size) * step_size.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt_()
    return v * (step_size * (v_norm / v_norm_new.clamp_min_(1e-10))).type_as(v)


def record_cautious_update(p, v, lr, lr_mul, wd=1.2):
    """_cautious_wd_and_update_inplace (P 744-760) on the fp32 master (the record's bf16 weights with
    a 16-bit mantissa): the update upcast, decay 1.2 x lr x the matrix's lr where update and
    parameter agree in sign (or either is 0)."""
    grad, eff_lr, eff_wd = v.float(), lr_mul * lr, wd * lr
    mask = (grad * p) >= 0
    return p - (p * mask * eff_wd * eff_lr) - (grad * eff_lr)


def record_normuon_step(p, g, state, lr, lr_mul, momentum, beta2=0.95, wd=1.2):
    """NorMuonAndAdam._normuon_update (P 694-741) for one matrix in the record's orientation, fp32
    throughout (the record's Polar Express output is bf16: see the bf16 test below), with its variance
    reduction and cautious decay; Polar Express as ours (tests/test_ns.py holds it to the record's)."""
    g = g.float()
    state["buf"].lerp_(g, 1 - momentum)
    g = g.lerp_(state["buf"], momentum)
    v = record_variance_reduction(train_gpt.orthogonalize(g, "polar_express", "torch"), state["second"], beta2)
    return record_cautious_update(p, v, lr, lr_mul, wd)


def test_normuon_steps_are_the_records():
    """Two steps (momentum 0.85 then 0.9, lr factors 1 and 1.52): every attention and MLP matrix
    as the record's NorMuon leaves it, in the record's orientation (its MLP matrices are ours
    transposed: (hidden, dim)): momentum, Polar Express, per-row statistics (per column of our
    (dim, hidden) MLP storage), lr 0.023 x (2 for the MLP's shape) x (2 for c_proj), cautious decay
    1.2 x lr x the matrix's lr."""
    args, hw, model, specs = model_and_specs()
    assert {k: getattr(args, k) for k in MUON_2026} == MUON_2026 and hw.ns_backend == "torch"
    optimizer = train_gpt.ShardedMuonAdam(specs, args, train_gpt.Ranks(), hw)
    muon = [s for s in specs if s.optimizer == "muon"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def record_view(name, t):  # (matrices, rows, cols) in the record's orientation
        return t.mT if name.endswith(("fc_w", "proj_w")) else t
    reference = {s.name: record_view(s.name, s.param.detach().clone()) for s in muon}
    reference = {n: t if t.ndim == 3 else t[None] for n, t in reference.items()}
    states = {n: [dict(buf=torch.zeros(t.shape), second=torch.zeros(t.shape[0], 1)) for t in ts]  # rows >= cols
              for n, ts in reference.items()}
    gen = torch.Generator().manual_seed(3)
    for factor, momentum in ((1.0, 0.85), (1.52, 0.9)):
        grads = {s.name: torch.randn(s.param.shape, generator=gen) for s in specs}
        for s in specs:
            s.param.grad = grads[s.name].clone()
        optimizer.lr_factor, optimizer.muon_momentum = factor, momentum
        optimizer.step()
        optimizer.zero_grad()
        for s in muon:
            g = record_view(s.name, grads[s.name])
            g = g if g.ndim == 3 else g[None]
            lr_mul = (2.0 if s.name.endswith(("fc_w", "proj_w")) else 1.0) * (2.0 if s.name.endswith("proj_w") else 1.0)
            reference[s.name] = torch.stack([record_normuon_step(p, gi, st, 0.023 * factor, lr_mul, momentum)
                                             for p, gi, st in zip(reference[s.name], g, states[s.name])])
    for s in muon:
        ours = record_view(s.name, s.param.detach())
        torch.testing.assert_close(ours if ours.ndim == 3 else ours[None], reference[s.name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=s.name: f"{n}: {m}")
    assert {s.name.split(".")[-1] for s in muon} == {"qkvo_w", "fc_w", "proj_w"}


def test_normuon_bf16_update_is_the_records(monkeypatch):
    """--bf16_weights with the GPU's bf16 orthogonalizer (the torch twin runs bf16 on CPU too), two
    steps: the update each Muon stack hands to its parameters is bit for bit the record's v_chunk
    (fp32 momentum, Polar Express bf16 in and out, statistics in fp32, the scale rounded to bf16
    and applied in bf16: P 700-719, 762-775), and the fp32 master moves as the record's update of
    its bf16 weight + mantissa (P 744-760) to 16 units in the last place (fp32 arithmetic in
    another order; measured: 2 at most). The update kept fp32 (the path before) is not bf16, and its
    unrounded scale moves the parameters up to 1e-4 from the record's (allowed here: 4e-7)."""
    args, hw, model, specs = model_and_specs(bf16_weights=True)  # (RECORD_MODEL's fp32 otherwise)
    hw = dataclasses.replace(hw, compute_dtype=torch.bfloat16)
    optimizer = train_gpt.ShardedMuonAdam(specs, args, train_gpt.Ranks(), hw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    applied = []
    muon_apply = train_gpt.muon_apply
    def spy(params, update, *rest):
        new = muon_apply(params, update, *rest)
        applied.append((params.clone(), update.clone(), new.clone()))
        return new
    monkeypatch.setattr(train_gpt, "muon_apply", spy)
    groups = optimizer.muon_groups
    is_mlp = [group["owned"][0].spec.name.endswith(("fc_w", "proj_w")) for group in groups]
    assert sorted(is_mlp) == [False, True]  # one stack of square attention matrices, one of the MLP's (64, 256)
    record = lambda t, mlp: t.mT if mlp else t  # noqa: E731  the record's (hidden, dim) MLP matrices: ours transposed
    shapes = [record(g["momentum"], mlp).shape for g, mlp in zip(groups, is_mlp)]  # rows >= cols: a statistic per row
    states = [dict(buf=torch.zeros(shape), second=torch.zeros(*shape[:-1], 1)) for shape in shapes]
    gen = torch.Generator().manual_seed(4)
    for factor, momentum in ((1.0, 0.85), (1.52, 0.9)):
        grads = {s.name: torch.randn(s.param.shape, generator=gen).to(s.param.dtype) for s in specs}
        for s in specs:
            s.param.grad = grads[s.name].clone()
        optimizer.lr_factor, optimizer.muon_momentum = factor, momentum
        applied.clear()
        optimizer.step()
        optimizer.zero_grad()
        assert len(applied) == len(groups)
        for group, mlp, state, (before, update, after) in zip(groups, is_mlp, states, applied):
            g = record(torch.stack([slot.view(grads[slot.spec.name]) for slot in group["owned"]]), mlp)
            state["buf"].lerp_(g, 1 - momentum)
            g = g.lerp_(state["buf"], momentum)
            # Polar Express: ours (tests/test_ns.py), on the wide view the record's takes too (P 158-159)
            v = record(train_gpt.orthogonalize(record(g, mlp).bfloat16(), "polar_express", "torch"), mlp)
            v = record_variance_reduction(v, state["second"])
            assert v.dtype == update.dtype == torch.bfloat16
            assert torch.equal(record(update, mlp).view(torch.int16), v.view(torch.int16))
            names = [slot.spec.name for slot in group["owned"]]
            lr_mul = [(2.0 if mlp else 1.0) * (2.0 if n.endswith("proj_w") else 1.0) for n in names]
            reference = torch.stack([record_cautious_update(p, vi, 0.023 * factor, m)
                                     for p, vi, m in zip(record(before, mlp), v, lr_mul)])
            bound = 2 ** -20 * torch.maximum(before.abs(), after.abs())
            assert ((record(after, mlp) - reference).abs() <= record(bound, mlp)).all()
            assert not torch.equal(after, before)
    assert {s.name.split(".")[-1] for s in specs if s.optimizer == "muon"} == {"qkvo_w", "fc_w", "proj_w"}


def test_adam_every_other_step_and_the_tied_embedding_are_the_records():
    """Eight steps of the record's Adam flow (NorMuonAndAdam.step and TrainingManager.step_optimizers,
    P 560-650, 493-530, 1683-1699), restated: Adam steps on odd steps only, on the gradients summed
    over two steps (the even step's are not cleared); while tied, the head's gradient takes the
    embedding's, the head steps and the embedding becomes its copy; at the split step (odd, here
    5), after its tied update, the embedding takes the head's Adam state, and then both train apart.
    Ours: the loop's flags per step; tied, the model's embedding lookup reads the head's weights, so
    autograd hands the head the sum (the next test) and the embedding has no gradient."""
    args, hw, model, specs = model_and_specs(embed_split_frac=0.5, num_iterations=10, extension_steps=0,
                                             muon_momentum_cooldown_steps=0)  # (10 steps: no room for 50)
    assert args.adam_every == 2
    assert train_gpt.embed_split_step(args) == 5 and [train_gpt.adam_steps_at(s, args) for s in range(4)] == \
        [False, True, False, True]
    optimizer = train_gpt.ShardedMuonAdam(specs, args, train_gpt.Ranks(), hw)
    adam = {s.name: s for s in specs if s.optimizer == "adam"}
    with torch.no_grad():
        for s in adam.values():
            s.param.add_(0.1 * torch.randn_like(s.param))
    reference = {n: s.param.detach().clone() for n, s in adam.items()}
    state = {n: dict(step=0, exp_avg=torch.zeros_like(s.param), exp_avg_sq=torch.zeros_like(s.param))
             for n, s in adam.items()}
    pending = {n: torch.zeros_like(s.param) for n, s in adam.items()}  # the record's .grad between Adam steps
    split = False
    gen = torch.Generator().manual_seed(4)
    for step in range(8):
        factor = train_gpt.lr_factor_at(step, args)
        grads = {s.name: torch.randn(s.param.shape, generator=gen) for s in specs}
        tied = train_gpt.embed_tied_at(step, args)
        for s in specs:  # ours: tied, the head's gradient is the sum, the embedding has none
            if s.name == "embed.weight" and tied:
                s.param.grad = None
            else:
                g = grads[s.name] + (grads["embed.weight"] if s.name == "lm_head_w" and tied else 0)
                s.param.grad = g.clone() if s.param.grad is None else s.param.grad + g
        optimizer.lr_factor, optimizer.adam_step_now, optimizer.embed_tied = factor, step % 2 == 1, tied
        optimizer.step()
        optimizer.zero_grad()
        if step == train_gpt.embed_split_step(args):
            optimizer.untie_embedding()
        # the record
        for n in pending:
            pending[n] += grads[n]
        if step % 2 == 1:
            if not split:
                pending["lm_head_w"] += pending["embed.weight"]
            for n in adam:
                if n == "embed.weight" and not split:
                    continue
                betas, lr_mul, wd_mul = RECORD_ADAM[record_label(n)]
                record_adam_step(reference[n], pending[n], state[n], betas, ADAM_LR * factor * lr_mul, wd_mul)
            if not split:
                reference["embed.weight"].copy_(reference["lm_head_w"])
            for n in pending:
                pending[n].zero_()
            if step == 5:  # copy_lm_state_to_embed
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    state["embed.weight"][key] = (state["lm_head_w"][key] if key == "step" else
                                                  state["lm_head_w"][key].clone())
                split = True
        for n, s in adam.items():
            if n == "embed.weight" and tied:
                continue  # ours is not read while tied (the head's weights are); the record's is the head's copy
            # (tied, the head's gradient sums in another order: (g_head + g_embed) per step, the record's
            # per parameter over the two steps; Adam lifts that last bit where a sum nearly cancels)
            torch.testing.assert_close(s.param.detach(), reference[n], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n, step=step: f"{n} after step {step}: {m}")
    assert optimizer.adam_steps == 4 and split
    assert not torch.equal(adam["embed.weight"].param, adam["lm_head_w"].param)  # apart since step 5


def test_a_tied_embedding_hands_the_head_both_gradients():
    """Tied, the embedding lookup reads the head's weights: the head's gradient is its own plus the
    embedding's (the record adds embed.grad.T to the head's), the embedding gets none."""
    args, hw, model, _ = model_and_specs()
    with torch.no_grad():
        model.embed.weight.copy_(model.lm_head_w)
    gen = torch.Generator().manual_seed(5)
    chunk = torch.randint(0, 50257, (129,), generator=gen)
    chunk[0] = train_gpt.BOS_TOKEN
    grads = {}
    for tied in (False, True):
        model.zero_grad()
        model.embed_tied = tied
        model(chunk[:-1], chunk[1:], torch.tensor(2), torch.tensor(1)).backward()
        grads[tied] = (model.lm_head_w.grad.clone(), None if model.embed.weight.grad is None else model.embed.weight.grad.clone())
    assert grads[True][1] is None
    torch.testing.assert_close(grads[True][0], grads[False][0] + grads[False][1], rtol=1e-5, atol=1e-7)
