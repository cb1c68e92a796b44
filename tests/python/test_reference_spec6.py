"""The two SPEC 6 measurements: reproduced on the reference, shown fixed here.

6.1 float16 parameters with gradients around 1e-4: the reference keeps its
    second moment in float16, where (1 - beta2) * g^2 ~ 1e-11 underflows, so
    exp_avg_sq_row (and col, and the 1-D exp_avg_sq) is exactly 0.0 after
    every step. Ours keeps float32 state: nonzero and equal to the state of a
    float32 run of the reference on the same gradients.
6.2 one NaN or Inf in a gradient: the reference turns every element of the
    parameter into NaN, and it stays NaN. Ours leaves parameter and state
    exactly as they were, counts the skip (opt.nonfinite_skips), warns once
    (RuntimeWarning through `warnings`), and from then on continues exactly as
    a run that never saw the bad gradient.
"""
import warnings

import pytest
import torch

import automagic

from test_reference_trajectories import scaled_error


def _state_snapshot(opt, p):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in opt.state[p].items()}


def _assert_state_equal(opt, p, snapshot, where):
    state = opt.state[p]
    assert set(state) == set(snapshot), where
    for k, v in snapshot.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(state[k], v), "%s: state %s changed" % (where, k)
        else:
            assert state[k] == v, "%s: state %s changed" % (where, k)


@pytest.mark.parametrize("shape", [(8, 12), (12,), (2, 5, 6)], ids=["2d", "1d", "3d"])
def test_fp16_second_moment_underflow(make_reference, measured, shape):
    steps = 20
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(shape, generator=gen).half()
    grads = [(1e-4 * torch.randn(shape, generator=gen)).half() for _ in range(steps)]
    assert all(g.abs().max() < 1e-3 and g.abs().max() > 1e-5 for g in grads)
    keys = ("exp_avg_sq_row", "exp_avg_sq_col") if len(shape) >= 2 else ("exp_avg_sq",)

    ref_p = p0.clone().requires_grad_()
    ref = make_reference([ref_p])
    f32_p = p0.float().requires_grad_()
    ref32 = make_reference([f32_p])
    our_p = p0.clone().requires_grad_()
    ours = automagic.Automagic3([our_p])
    for t, g in enumerate(grads):
        ref_p.backward(g.clone())
        f32_p.backward(g.float())
        our_p.backward(g.clone())
        for key in keys:
            # SPEC 6.1 reproduced: the reference's fp16 state is exactly zero
            assert ref.state[ref_p][key].dtype == torch.float16
            assert torch.all(ref.state[ref_p][key] == 0), \
                "step %d: the reference's %s did not underflow" % (t + 1, key)
            # fixed: ours is float32, nonzero, and what float32 state holds
            mine = ours.state[our_p][key]
            assert mine.dtype == torch.float32
            assert torch.all(mine > 0), "step %d: our %s has zeros" % (t + 1, key)
            err = scaled_error(mine, ref32.state[f32_p][key])
            assert err <= 1e-5, "step %d: our %s differs from float32 state by %.3g" \
                % (t + 1, key, err)
            measured.record("fp16 grads ~1e-4: our state vs float32 reference, scaled err",
                            err, "%s %s step %d" % (shape, key, t + 1))
    assert ours.state[our_p]["step"] == steps


def _bad_gradient(shape, kind, gen):
    g = 1e-3 * torch.randn(shape, generator=gen)
    flat = g.view(-1)
    flat[int(torch.randint(flat.numel(), (1,), generator=gen))] = {
        "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[kind]
    return g


def _our_warnings(records):
    return [w for w in records if issubclass(w.category, RuntimeWarning)
            and "Automagic3" in str(w.message)]


@pytest.mark.parametrize("mode", ["fused", "step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("shape", [(5, 7), (9,), (3, 4, 5)], ids=["2d", "1d", "3d"])
def test_nonfinite_gradient(make_reference, shape, kind, dtype, mode):
    steps, bad_steps = 30, (10, 20)
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(shape, generator=gen).to(dtype)
    good = [(1e-3 * torch.randn(shape, generator=gen)).to(dtype) for _ in range(steps)]
    bad = {t: _bad_gradient(shape, kind, gen).to(dtype) for t in bad_steps}

    # SPEC 6.2 reproduced: every element NaN after the bad step, for good
    ref_p = p0.clone().requires_grad_()
    ref = make_reference([ref_p])
    for t in range(steps):
        ref_p.backward(bad.get(t, good[t]).clone())
        if t < bad_steps[0]:
            assert torch.isfinite(ref_p).all()
        else:
            assert torch.isnan(ref_p).all(), "step %d: the reference was not poisoned" % t

    # fixed: the bad gradients are skipped, everything else proceeds as usual
    def train(p, opt, with_bad):
        for t in range(steps):
            if t in bad and not with_bad:
                continue
            g = bad[t] if t in bad else good[t]
            before, snap = p.detach().clone(), _state_snapshot(opt, p)
            with warnings.catch_warnings(record=True) as records:
                warnings.simplefilter("always")
                p.backward(g.clone())
                if mode == "step":
                    opt.step()
            assert p.grad is None
            ours_warned = _our_warnings(records)
            if t in bad and with_bad:
                assert torch.equal(p.detach(), before), "step %d: parameter changed" % t
                _assert_state_equal(opt, p, snap, "step %d" % t)
                assert opt.nonfinite_skips == bad_steps.index(t) + 1
                # warned once: on the first bad gradient, not on the second
                assert len(ours_warned) == (1 if t == bad_steps[0] else 0), ours_warned
                if ours_warned:
                    msg = str(ours_warned[0].message)
                    assert "non-finite gradient" in msg and "nonfinite_skips" in msg, msg
            else:
                assert not ours_warned, ours_warned
                assert torch.isfinite(p).all()

    our_p = p0.clone().requires_grad_()
    ours = automagic.Automagic3([our_p], fused=(mode == "fused"))
    train(our_p, ours, with_bad=True)
    assert ours.nonfinite_skips == len(bad_steps)

    clean_p = p0.clone().requires_grad_()
    clean = automagic.Automagic3([clean_p], fused=(mode == "fused"))
    train(clean_p, clean, with_bad=False)
    assert clean.nonfinite_skips == 0
    # same seed, same parameter id, same step numbers: identical bits
    assert torch.equal(our_p.detach(), clean_p.detach())
    _assert_state_equal(ours, our_p, _state_snapshot(clean, clean_p), "final state")
    assert ours.state[our_p]["step"] == steps - len(bad_steps)

    if dtype == torch.float32:
        # and that is what the reference computes when it never sees them
        ref_clean_p = p0.clone().requires_grad_()
        ref_clean = make_reference([ref_clean_p])
        for t in range(steps):
            if t not in bad:
                ref_clean_p.backward(good[t].clone())
        assert scaled_error(our_p, ref_clean_p) <= 1e-5
