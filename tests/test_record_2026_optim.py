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
    args = train_gpt.Hyperparameters(**dict(RECORD_MODEL, adam_table="2026", adam_weight_decay=ADAM_WD, micro_batches=1,
                                            **overrides))
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


@pytest.mark.parametrize("bf16_embeds", [False, True], ids=["fp32", "bf16 embeddings"])
def test_adam_steps_are_the_records(bf16_embeds):
    """Three steps at lr factors 1, 1.52 and 0.5 with random gradients: every Adam parameter as the
    record's update leaves it (per-kind betas, lr and decay multipliers, fp32 moments, the cautious
    decay lr^2 x 0.005 x wd_mul where the update and the parameter agree in sign). Each step starts
    the record's update from our parameters; the moments are the record's throughout. The update's
    last bit may differ (its step size is rounded in another order), so the result may differ by the
    rounding of the parameter's dtype: a few units in the last place of the larger of before/after
    (bf16: one unit, 2^-7 of it at most; fp32: 2^-20, 16 units)."""
    args, hw, model, specs = model_and_specs(bf16_embeds=bf16_embeds)
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
            assert not torch.equal(reference, before[s.name]), s.name
    assert all(m.dtype == torch.float32 for m in optimizer.state_tensors())  # fp32 moments, bf16 embeddings too
