"""A small MLP trained for 200 steps: fused mode and step mode end identical.

Both modes compute every gradient from the same parameters (fused mode updates
a parameter only after autograd has used it), and the update of a parameter
depends only on its own gradient, state, the seed, its index and its step, so
the two runs must end with identical bits (torch.equal), in float32 and in
bfloat16 (stochastic rounding keyed by seed, parameter index and step).
In float32 the fused run is also compared with the reference class.
"""
import pytest
import torch

import automagic

from test_reference_trajectories import scaled_error, unpack_polarity

STEPS = 200


def make_problem(dtype):
    gen = torch.Generator().manual_seed(21)
    torch.manual_seed(21)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3)).to(dtype)
    x = torch.randn(64, 6, generator=gen)
    teacher = torch.randn(6, 3, generator=gen)
    y = torch.sin(x @ teacher)
    return model, x.to(dtype), y.to(dtype)


def clone_model(model):
    clone = type(model)(*[type(m)(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear)
                          else type(m)() for m in model])
    clone.load_state_dict(model.state_dict())
    return clone.to(next(model.parameters()).dtype)


def train(model, x, y, opt, fused):
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        if fused:
            assert all(p.grad is None for p in model.parameters()), "fused: grads consumed"
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mlp_fused_and_step_mode_identical(dtype):
    model, x, y = make_problem(dtype)
    fused_model, step_model = clone_model(model), clone_model(model)
    hp = dict(lr=1e-3, min_lr=1e-5, max_lr=1e-2, weight_decay=0.01, seed=5)
    fused_opt = automagic.Automagic3(fused_model.parameters(), fused=True, **hp)
    step_opt = automagic.Automagic3(step_model.parameters(), fused=False, **hp)
    fused_losses = train(fused_model, x, y, fused_opt, fused=True)
    step_losses = train(step_model, x, y, step_opt, fused=False)

    assert fused_losses[-1] < 0.5 * fused_losses[0], "the MLP should learn"
    assert fused_losses == step_losses
    for (name, a), b in zip(fused_model.named_parameters(), step_model.parameters()):
        assert a.dtype == dtype
        assert torch.equal(a, b), "%s differs between fused and step mode" % name
        sa, sb = fused_opt.state[a], step_opt.state[b]
        assert sa["step"] == sb["step"] == STEPS
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(sa[key], sb[key]), "%s: state %s differs" % (name, key)


def test_mlp_float32_follows_reference(make_reference, measured):
    """Closed-loop training amplifies ulp-level differences: the gradient depends
    on the parameters, and once some element's update is so close to zero that
    its sign differs between two runs, that lr-row's lr differs by exp(2*bump/m)
    and the runs separate. That is a property of the algorithm, not of either
    implementation: the reference against itself with one weight moved by one
    ulp separates the same way (measured: its first differing sign at step 145;
    ours vs the reference: step 70, parameters 4.7e-6 apart (scaled) before).
    So: while every sign decision agrees the parameters stay within the float32
    bound (1e-5 scaled, as in the trajectory tests), and after 200 steps the
    loss is within 1% of the reference's (measured: 0.4%).
    """
    model, x, y = make_problem(torch.float32)
    ours_model, ref_model = clone_model(model), clone_model(model)
    hp = dict(lr=1e-3, min_lr=1e-5, max_lr=1e-2, weight_decay=0.01)
    ours = automagic.Automagic3(ours_model.parameters(), **hp)
    ref = make_reference(list(ref_model.parameters()), **hp)
    pairs = list(zip(ours_model.parameters(), ref_model.parameters()))
    same_decisions, first_split = True, None
    for t in range(STEPS):
        for mdl in (ours_model, ref_model):
            torch.nn.functional.mse_loss(mdl(x), y).backward()
        if same_decisions:
            same_decisions = all(
                torch.equal(unpack_polarity(ours.state[a]["polarity"], tuple(a.shape)),
                            ref.state[b]["last_polarity"]) for a, b in pairs)
            if not same_decisions:
                first_split = t + 1
                continue
            err = max(scaled_error(a, b) for a, b in pairs)
            measured.record("MLP float32: param scaled error while decisions agree", err,
                            "step %d" % (t + 1))
            assert err <= 1e-5, "step %d: %.3g (scaled) with identical decisions" % (t + 1, err)
    measured.record("MLP float32: first step with a differing sign decision",
                    first_split or 0, "of %d" % STEPS)
    with torch.no_grad():
        lo = float(torch.nn.functional.mse_loss(ours_model(x), y))
        lr_ = float(torch.nn.functional.mse_loss(ref_model(x), y))
        l0 = float(torch.nn.functional.mse_loss(model(x), y))
    measured.record("MLP float32: final loss relative difference", abs(lo - lr_) / lr_,
                    "after %d steps" % STEPS)
    assert lr_ < 0.2 * l0
    assert abs(lo - lr_) <= 0.01 * lr_, (lo, lr_)
