"""float32 trajectories of automagic.Automagic3 against the reference class.

Both optimizers get the same starting parameter and the same sequence of
gradients (fed through ``p.backward(g)``, so fused mode runs from the
post-accumulate-grad hook exactly as in training); ours runs fused or in step
mode (``fused=False`` + ``opt.step()``). After every step:

- parameters: |ours - ref| <= 1e-5 * |ref| + 1e-5 * max|ref| for every
  element, i.e. 1e-5 relative, with the second term standing in for elements
  that pass near zero (their relative error is meaningless);
- second-moment state (row/col or sq): the same bound;
- per-row lrs: bit-identical to SPEC 3.4 evaluated from the reference's
  agreements, and |ours - ref| <= 1e-6 * |ref| for every row, plus one
  float32 ulp for each step at which the reference's own torch.exp was not
  correctly rounded (see LrRecurrence: counted, not guessed);
- polarity: our packed bits equal the reference's bool tensor exactly
  (and padding bits are zero); step counts are equal.

Gradients are chosen per scenario so that each regime is really exercised,
and the regime is asserted on the reference (not assumed):
- the update-RMS clip binding on every step, on no step, and on some steps
  (the ratio rms(u)/clip_threshold the reference computes is recorded);
- the per-row lr reaching max_lr (constant signs: agreement 1), min_lr
  (alternating signs: agreement 0), and both in one tensor.
"""
import math

import pytest
import torch

import automagic

STEPS = 100

# Every shape class: 0-D, 1-D, 2-D, 3-D, 4-D (conv-like, 3x3 and 1x1 kernels),
# dimensions of size 1 in every position, odd sizes, one 5-D.
SHAPES = {
    "0d": (),
    "1d_single": (1,),
    "1d_odd": (7,),
    "2d_1x1": (1, 1),
    "2d_odd": (7, 13),
    "2d_one_row": (1, 9),
    "2d_one_col": (9, 1),
    "3d": (3, 4, 5),
    "3d_unit_mid": (2, 1, 3),
    "4d_conv3x3": (4, 3, 3, 3),
    "4d_conv1x1": (6, 5, 1, 1),
    "4d_unit_out": (1, 3, 2, 5),
    "5d": (2, 3, 1, 2, 3),
}

RAILS = dict(lr=1e-4, min_lr=1e-6, max_lr=1e-2)  # ~46 full bumps from lr to a rail

# name -> (gradient kind, hyperparameters, clip regime expected on the reference)
SCENARIOS = {
    "clip_binds": ("random_sign", dict(lr=1e-4), "always"),
    "clip_free": ("gauss", dict(lr=1e-4, clip_threshold=1e4), "never"),
    "clip_sometimes": ("gauss", dict(lr=1e-4, beta2=0.9, clip_threshold=2.0), "some"),
    "rail_max": ("constant", RAILS, None),
    "rail_min": ("alternating", RAILS, None),
    "rail_both": ("split", RAILS, None),
}


def lr_rows(shape):
    if len(shape) >= 2:
        return shape[0]
    return math.prod(shape)


def row_view(t, shape):
    """t with its elements grouped by lr-row: [lr_rows, elements per row]."""
    return t.reshape(lr_rows(shape), -1)


def gradients(shape, kind, steps, seed):
    """float32 gradients of one scenario (a list, so that both runs see the same)."""
    gen = torch.Generator().manual_seed(seed)
    rows = lr_rows(shape)
    # Per-row scales spread over two decades so that the factored second moment
    # is not close to uniform.
    row_scale = torch.exp(torch.empty(rows).uniform_(-2.3, 2.3, generator=gen))
    row_scale = row_scale.reshape((rows,) + (1,) * (max(len(shape), 1) - 1))
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    # alternate[r] is True for lr-rows whose sign flips every step ("split").
    alternate = (torch.arange(rows) % 2 == 1).reshape(row_scale.shape)
    out = []
    for t in range(steps):
        magnitude = 1e-3 * (torch.rand(shape, generator=gen) + 0.1)
        if kind == "gauss":
            g = 1e-3 * torch.randn(shape, generator=gen)
        elif kind == "random_sign":
            # |g| within 20% of constant: without bias correction rms(u) stays
            # above 1/sqrt(1 - beta2**t) * 0.8/1.2 > 2 for t <= 100 (clip binds)
            g = 1e-3 * torch.empty(shape).uniform_(0.8, 1.2, generator=gen) * torch.where(
                torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        elif kind == "constant":
            g = sign * magnitude
        elif kind == "alternating":
            g = sign * magnitude * (-1.0) ** t
        elif kind == "split":
            flip = torch.where(alternate, (-1.0) ** t, 1.0)
            g = (sign * magnitude * flip.reshape(row_scale.shape)).reshape(shape)
        else:
            raise AssertionError(kind)
        out.append((g * row_scale.reshape(row_scale.shape)).reshape(shape).contiguous())
    return out


def unpack_polarity(packed, shape):
    """Our packed polarity (header: one byte-aligned bit run per lr-row) as bools."""
    n = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    per_row = n // rows
    row_bytes = (per_row + 7) // 8
    assert packed.numel() == rows * row_bytes
    bits = (packed.reshape(rows, row_bytes, 1).to(torch.int32)
            >> torch.arange(8, dtype=torch.int32)) & 1
    bits = bits.reshape(rows, row_bytes * 8)
    assert not bits[:, per_row:].any(), "padding bits of the polarity must be zero"
    return bits[:, :per_row].reshape(shape).bool()


def scaled_error(ours, ref):
    """max over elements of |ours - ref| / (|ref| + max|ref|); <= 1e-5 is the bound."""
    ours, ref = ours.detach().double(), ref.detach().double()
    if ref.numel() == 0:
        return 0.0
    scale = ref.abs() + ref.abs().max()
    diff = (ours - ref).abs()
    if scale.max() == 0:
        return float(diff.max())
    return float((diff / scale.clamp_min(1e-300)).max())


def lr_error(ours, ref):
    return float(((ours.double() - ref.double()).abs() / ref.double().abs()).max())


class LrRecurrence:
    """SPEC 3.4 evaluated by the test from the reference's own agreements.

    The reference computes lr * exp((2a - 1) * lr_bump_rate) in float32 with
    torch.exp, which is not correctly rounded: for some arguments it is 1 ulp
    off (e.g. a = 13/30). libautomagic rounds exp once from double (so that
    CPU and GPU agree), and the lr is a running product, so such 1-ulp steps
    accumulate: over 100 steps of a 30-element row they add up to ~1e-6.

    This class therefore keeps two things per lr-row:
    - ``lr``: the recurrence with float32 arithmetic exactly as the reference
      and exp correctly rounded; ours must equal it bit for bit;
    - ``exp_off``: how many steps the reference's torch.exp differed from the
      correctly rounded value; the reference's lr may then differ from ours by
      up to that many float32 ulps (2**-23 relative each) beyond 1e-6.
    """

    def __init__(self, shape, hparams):
        rows = lr_rows(shape)
        self.shape = shape
        self.lr = torch.full((rows,), float(hparams.get("lr", 1e-6)), dtype=torch.float32)
        self.exp_off = torch.zeros(rows)
        self.bump = float(hparams.get("lr_bump_rate", 0.1))
        self.lo = float(hparams.get("min_lr", 1e-8))
        self.hi = float(hparams.get("max_lr", 1e-2))
        self.step = 0

    def advance(self, prev_polarity, polarity):
        eq = (prev_polarity == polarity).reshape(self.lr.shape[0], -1)
        # the reference: eqb.sum(dtype=float32) / m, then (2a - 1) * bump, all float32
        a = eq.sum(dim=1, dtype=torch.float32).div_(eq.shape[1])
        x = a.mul_(2.0).sub_(1.0).mul_(self.bump)
        if self.step > 0:
            exact = torch.tensor([math.exp(v) for v in x.double().tolist()],
                                 dtype=torch.float64).float()
            self.exp_off += (torch.exp(x) != exact).float()
            self.lr = (self.lr * exact).clamp_(min=self.lo, max=self.hi)
        self.step += 1


def assert_matches(ours_p, ref_p, ours_opt, ref_opt, spec_lr, where, measured):
    so, sr = ours_opt.state[ours_p], ref_opt.state[ref_p]
    shape = tuple(ref_p.shape)
    assert so["step"] == sr["step"], where
    err = scaled_error(ours_p, ref_p)
    assert err <= 1e-5, "%s: parameter differs from the reference by %.3g (scaled)" % (where, err)
    measured.record("float32 param, max scaled elementwise error", err, where)
    keys = ("exp_avg_sq_row", "exp_avg_sq_col") if len(shape) >= 2 else ("exp_avg_sq",)
    for key in keys:
        assert so[key].dtype == torch.float32
        e = scaled_error(so[key], sr[key])
        assert e <= 1e-5, "%s: %s differs by %.3g (scaled)" % (where, key, e)
        measured.record("float32 state %s, max scaled error" % key, e, where)
    ours_lr, ref_lr = so["lr"].reshape(-1), sr["lr"].reshape(-1)
    assert torch.equal(ours_lr, spec_lr.lr), \
        "%s: per-row lr differs from SPEC 3.4 (float32, exp correctly rounded)" % where
    rel = (ours_lr.double() - ref_lr.double()).abs() / ref_lr.double().abs()
    bound = 1e-6 + spec_lr.exp_off.double() * 2.0 ** -23
    assert torch.all(rel <= bound), "%s: per-row lr differs from the reference by %.3g " \
        "relative (bound %.3g)" % (where, rel.max(), bound.max())
    measured.record("float32 per-row lr, max relative error", rel.max(), where)
    if spec_lr.exp_off.max() == 0:
        measured.record("float32 per-row lr, max rel. error where the reference's "
                        "torch.exp was exact", rel.max(), where)
    pol = unpack_polarity(so["polarity"], shape)
    assert torch.equal(pol, sr["last_polarity"]), "%s: polarity differs" % where


def run_pair(make_reference, shape, kind, hparams, weight_decay, mode, measured, where,
             seed=0):
    torch.manual_seed(1000 + seed)
    p0 = torch.randn(shape)
    ref_p = p0.clone().requires_grad_()
    our_p = p0.clone().requires_grad_()
    ref = make_reference([ref_p], weight_decay=weight_decay, **hparams)
    ours = automagic.Automagic3([our_p], weight_decay=weight_decay,
                                fused=(mode == "fused"), **hparams)
    clip = hparams.get("clip_threshold", 1.0)
    ratios = []
    reference_rms = ref._rms

    def recording_rms(t):
        r = reference_rms(t)
        ratios.append(float(r) / clip)
        return r
    ref._rms = recording_rms  # instance attribute shadows the staticmethod

    spec_lr = LrRecurrence(shape, hparams)
    prev_polarity = torch.zeros(shape, dtype=torch.bool)
    for t, g in enumerate(gradients(shape, kind, STEPS, seed)):
        ref_p.backward(g.clone())
        before = our_p.detach().clone()
        our_p.backward(g.clone())
        if mode == "step":
            assert our_p.grad is not None and torch.equal(our_p.detach(), before), \
                "step mode must leave the update to step()"
            ours.step()
        assert our_p.grad is None and ref_p.grad is None
        polarity = ref.state[ref_p]["last_polarity"]
        spec_lr.advance(prev_polarity, polarity)
        prev_polarity = polarity.clone()
        assert_matches(our_p, ref_p, ours, ref, spec_lr, "%s step %d" % (where, t + 1),
                       measured)
    assert len(ratios) == STEPS
    rel = float((our_p.detach() - ref_p.detach()).norm() / ref_p.detach().norm())
    measured.record("float32 param, relative norm error after %d steps" % STEPS, rel, where)
    return ref_p, our_p, ref, ours, ratios


def _trajectory_cases():
    """Every shape x scenario, once fused without weight decay and once in step
    mode with it; the other two mode/decay pairings on one shape per rank
    class (0-D, 2-D, 4-D), to keep the file fast on a loaded 2-core machine."""
    cases = []
    for shape_name in SHAPES:
        for scenario in SCENARIOS:
            pairings = [(0.0, "fused"), (0.1, "step")]
            if shape_name in ("0d", "2d_odd", "4d_conv3x3"):
                pairings += [(0.1, "fused"), (0.0, "step")]
            for wd, mode in pairings:
                cases.append(pytest.param(shape_name, scenario, wd, mode,
                                          id="%s-%s-wd%g-%s" % (shape_name, scenario, wd, mode)))
    return cases


@pytest.mark.parametrize("shape_name,scenario,weight_decay,mode", _trajectory_cases())
def test_float32_trajectory_matches_reference(make_reference, measured, shape_name,
                                              scenario, weight_decay, mode):
    shape = SHAPES[shape_name]
    kind, hparams, clip_regime = SCENARIOS[scenario]
    where = "%s %s wd=%g %s" % (shape_name, scenario, weight_decay, mode)
    ref_p, our_p, ref, ours, ratios = run_pair(
        make_reference, shape, kind, hparams, weight_decay, mode, measured, where)

    # The regime this scenario is meant to exercise really happened.
    if clip_regime == "always":
        assert min(ratios) > 1.0, "clip was meant to bind on every step: %s" % min(ratios)
    elif clip_regime == "never":
        assert max(ratios) < 1.0, "clip was meant never to bind: %s" % max(ratios)
    elif clip_regime == "some":
        assert min(ratios) < 1.0 < max(ratios), \
            "clip was meant to bind on some steps only: %s..%s" % (min(ratios), max(ratios))

    lr_ref = row_view(ref.state[ref_p]["lr"], (lr_rows(shape),)).flatten()
    top = torch.tensor(hparams.get("max_lr", 1e-2), dtype=torch.float32)
    bottom = torch.tensor(hparams.get("min_lr", 1e-8), dtype=torch.float32)
    if kind == "constant":
        assert torch.all(lr_ref == top), "every row should sit on max_lr"
    elif kind == "alternating":
        assert torch.all(lr_ref == bottom), "every row should sit on min_lr"
    elif kind == "split":
        assert torch.all(lr_ref[0::2] == top) and torch.all(lr_ref[1::2] == bottom)
    else:
        # random signs: agreement near 1/2, the lrs wander but stay off the rails
        assert torch.all((lr_ref > bottom) & (lr_ref < top))


def test_get_learning_rates_match_reference(make_reference, measured):
    """Two groups, one parameter that never gets a gradient, before and after steps."""
    torch.manual_seed(5)
    shapes = [[(5, 3), (7,), ()], [(4, 3, 3, 3), (2, 6)]]
    ref_groups, our_groups = [], []
    for i, group_shapes in enumerate(shapes):
        p0s = [torch.randn(s) for s in group_shapes]
        ref_groups.append([p.clone().requires_grad_() for p in p0s])
        our_groups.append([p.clone().requires_grad_() for p in p0s])
    hp = dict(lr=1e-4, min_lr=1e-6, max_lr=1e-2)
    ref = make_reference([{"params": ref_groups[0]},
                          {"params": ref_groups[1], "lr": 3e-5}], **hp)
    ours = automagic.Automagic3([{"params": our_groups[0]},
                                 {"params": our_groups[1], "lr": 3e-5}], **hp)
    assert ours.get_learning_rates() == ref.get_learning_rates() == [1e-4, 3e-5]
    assert ours.get_avg_learning_rate() == ref.get_avg_learning_rate()

    kinds = ["split", "gauss", "constant", "alternating", "random_sign"]
    pairs = [(r, o) for rg, og in zip(ref_groups, our_groups) for r, o in zip(rg, og)]
    params = [(r, o, k) for (r, o), k in zip(pairs, kinds)]
    # the last parameter of group 1 never gets a gradient: it has no state and
    # does not count in its group's mean (as in the reference)
    stepped = params[:-1]
    grads = [gradients(tuple(r.shape), k, 60, seed=i) for i, (r, o, k) in enumerate(stepped)]
    for t in range(60):
        for (r, o, k), gs in zip(stepped, grads):
            r.backward(gs[t].clone())
            o.backward(gs[t].clone())
        lr_ref, lr_ours = ref.get_learning_rates(), ours.get_learning_rates()
        for a, b in zip(lr_ours, lr_ref):
            assert abs(a - b) <= 1e-6 * abs(b)
            measured.record("get_learning_rates, max relative error", abs(a - b) / b,
                            "step %d" % (t + 1))
        avg_o, avg_r = ours.get_avg_learning_rate(), ref.get_avg_learning_rate()
        assert abs(avg_o - avg_r) <= 1e-6 * abs(avg_r)
    assert params[-1][1] not in ours.state or len(ours.state[params[-1][1]]) == 0
    # the groups really moved away from their initial lr
    assert all(abs(a - b) > 1e-2 * b for a, b in zip(ref.get_learning_rates(), [1e-4, 3e-5]))


@pytest.mark.parametrize("lr", [2e-3, 1.0])
def test_high_lr_is_forced_with_a_warning_not_a_print(make_reference, capsys, lr):
    p = torch.zeros(3, requires_grad=True)
    with pytest.warns(UserWarning, match="forcing to 1e-6"):
        ours = automagic.Automagic3([p], lr=lr)
    assert capsys.readouterr().out == "", "the front end must not print"
    ref = make_reference([torch.zeros(3, requires_grad=True)], lr=lr)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-6
    assert ours.defaults["lr"] == ref.defaults["lr"] == 1e-6
    p.backward(torch.ones(3))
    assert torch.all(ours.state[p]["lr"] == torch.tensor(1e-6, dtype=torch.float32))


def test_lr_at_the_threshold_is_kept(make_reference, recwarn):
    """1e-3 itself is not 'above 1e-3': neither implementation forces it."""
    ours = automagic.Automagic3([torch.zeros(2, requires_grad=True)], lr=1e-3)
    ref = make_reference([torch.zeros(2, requires_grad=True)], lr=1e-3)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-3
    assert not [w for w in recwarn if "forcing" in str(w.message)]


def test_float32_lr_at_the_threshold_is_kept_as_the_reference_keeps_it(make_reference,
                                                                        recwarn):
    """The reference compares lr > 1e-3 in lr's own type: a float32 tensor
    of 1e-3 (1.0000000475e-3 as a Python float) is not above it there."""
    for lr in (torch.tensor(1e-3), torch.tensor([1e-3])):
        ours = automagic.Automagic3([torch.zeros(2, requires_grad=True)], lr=lr)
        ref = make_reference([torch.zeros(2, requires_grad=True)], lr=lr)
        assert float(ours.param_groups[0]["lr"]) == float(ref.param_groups[0]["lr"]) \
            == float(torch.tensor(1e-3))
    assert not [w for w in recwarn if "forcing" in str(w.message)]
    lr = torch.tensor(1.001e-3)
    with pytest.warns(UserWarning, match=r"start lr 0\.00100100\d* is very high"):
        ours = automagic.Automagic3([torch.zeros(2, requires_grad=True)], lr=lr)
    assert ours.param_groups[0]["lr"] == 1e-6


@pytest.mark.parametrize("fused", [False, True])
def test_named_parameters_duplicates_and_group_lr_as_the_reference(make_reference, fused):
    """Three things a script written for the reference does: pass
    model.named_parameters() (torch keeps the names as "param_names"), list
    a parameter twice in a group (torch warns; the reference updates it
    once per step), and give a group its own start lr above 1e-3 (the
    reference forces only the constructor's lr). The same trajectory as the
    reference, float32, 3 steps."""
    def build():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))

    def groups(m):
        named = list(m[0].named_parameters())
        return [{"params": named + [named[0]]},  # a duplicate, by name too
                {"params": list(m[1].named_parameters()), "lr": 5e-3}]

    ours_m, ref_m = build(), build()
    with pytest.warns(UserWarning, match="more than once"):
        ours = automagic.Automagic3(groups(ours_m), lr=1e-4, fused=fused)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own duplicate warning
        ref = make_reference(groups(ref_m), lr=1e-4)
    assert ours.param_groups[0]["param_names"] == ["weight", "bias"]
    assert ours.param_groups[1]["lr"] == ref.param_groups[1]["lr"] == 5e-3
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(4))
    for step in range(3):
        for m, o in ((ours_m, ours), (ref_m, ref)):
            m(x).square().sum().backward()
            if o is ours and not fused:
                o.step()
            o.zero_grad()
        for (name, a), b in zip(ours_m.named_parameters(), ref_m.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
            assert int(ours.state[a]["step"]) == int(ref.state[b]["step"]) == step + 1
            assert torch.equal(ours.state[a]["lr"], ref.state[b]["lr"]), name
    assert ours.state_dict()["param_groups"][1]["param_names"] == ["weight", "bias"]
    with pytest.raises(ValueError, match="all be named"):
        automagic.Automagic3([("w", torch.nn.Parameter(torch.zeros(2))),
                              torch.nn.Parameter(torch.zeros(2))])


@pytest.mark.parametrize("fused", [False, True])
def test_tensor_lr_as_a_number(make_reference, fused):
    """lr given as a one-element tensor (torch's optimizers and the
    reference take it; it was refused): the same trajectory as the number,
    the reference's too; the other hyperparameters must stay numbers."""
    def run(lr, impl):
        torch.manual_seed(7)
        lin = torch.nn.Linear(5, 3)
        o = (automagic.Automagic3(lin.parameters(), lr=lr, fused=fused) if impl == "ours"
             else make_reference(lin.parameters(), lr=lr))
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(8))
        for _ in range(3):
            lin(x).square().sum().backward()
            if impl == "ours" and not fused:
                o.step()
            o.zero_grad()
        return [p.detach().clone() for p in lin.parameters()]
    a, b = run(torch.tensor(1e-4), "ours"), run(1e-4, "ours")
    r = run(torch.tensor(1e-4), "reference")
    for x, y, z in zip(a, b, r):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match="weight_decay must be a number"):
        automagic.Automagic3(torch.nn.Linear(2, 2).parameters(), weight_decay=torch.tensor(0.1))
