"""Fused mode with accumulation_steps > 1 and a parameter that has no
backward hook (frozen when the optimizer was built and unfrozen later, as in
gradual unfreezing, or put into a group's list by hand): step() updates it
from its gradient, as step mode does, and these tests hold that through the
ways a window can end or be carried over. Found by a randomized review
(fortieth session): a round trip mid-window dropped its gradient into the
next window, and the loops that end their windows with step() and
zero_grad() never updated it."""
import copy
import warnings

import pytest
import torch

import automagic
from _frontend_models import assert_same_state
from _line_interrupt import LineInterrupt


def _params(unhooked):
    """(a, b, how b is given to the optimizer): b is frozen at construction
    and unfrozen after ("unfrozen"), appended to the group by hand
    ("by_hand"), or an ordinary parameter (None: hooked)."""
    torch.manual_seed(0)
    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(5, requires_grad=unhooked != "unfrozen")
    return a, b


def _optimizer(a, b, unhooked, **kw):
    if unhooked == "by_hand":
        opt = automagic.Automagic3([a], lr=1e-3, **kw)
        opt.param_groups[0]["params"].append(b)
    else:
        opt = automagic.Automagic3([a, b], lr=1e-3, **kw)
    b.requires_grad_(True)
    return opt


def _state(opt, p):
    st = opt.state.get(p, {})
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}


@pytest.mark.parametrize("how,unhooked", [("state_dict", "unfrozen"), ("deepcopy", "unfrozen"),
                                          ("state_dict", "by_hand")])
def test_a_carry_over_mid_window_keeps_an_unhooked_gradient(how, unhooked):
    """A state_dict saved after a window's first pass and loaded into a new
    optimizer (same process, gradients kept), or a deepcopy there, goes on
    as the uninterrupted run: the new optimizer hooks b (it requires grad
    now) and applies its gradient of that pass at the window's end. The
    saved window left b out (no hook had reported it): b was not updated in
    that window and its old gradient was added to the next window's (and
    one put into the group by hand was left out until a step() registered
    it: a review)."""
    def run(carry):
        a, b = _params(unhooked)
        opt = _optimizer(a, b, unhooked, accumulation_steps=2)
        ga, gb = torch.randn(4, 3), torch.randn(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ((a * ga).sum() + (b * gb).sum()).backward()
            if carry == "state_dict":
                sd = opt.state_dict()
                opt.remove_hooks()
                opt = automagic.Automagic3([a, b], lr=1e-3, accumulation_steps=2)
                opt.load_state_dict(sd)
            elif carry == "deepcopy":
                old = opt
                opt, a, b = copy.deepcopy((opt, a, b))
                old.remove_hooks()
            (a * ga).sum().backward()
            opt.step()
            first = (b.detach().clone(), b.grad, _state(opt, b))
            for _ in range(2):
                ((a * ga).sum() + (b * gb).sum()).backward()
            opt.step()
        return first, (a.detach().clone(), b.detach().clone(), _state(opt, a), _state(opt, b))
    (b0, g0, s0), last0 = run(None)
    (b1, g1, s1), last1 = run(how)
    assert g0 is None and g1 is None and s0["step"] == 1
    assert torch.equal(b0, b1)
    assert_same_state(s0, s1)
    assert last0[3]["step"] == 2
    assert torch.equal(last0[0], last1[0]) and torch.equal(last0[1], last1[1])
    assert_same_state(last0[2], last1[2])
    assert_same_state(last0[3], last1[3])


@pytest.mark.parametrize("unhooked", ["unfrozen", "by_hand"])
def test_step_and_zero_grad_after_each_pass_update_an_unhooked_parameter(unhooked):
    """accumulation_steps=2 and a loop that calls step() and zero_grad()
    after every backward pass: each zero_grad() ends the window and applies
    it, as step mode would (docs/PYTORCH.md); b, without a hook, is updated
    there too, bit for bit as in step mode (it never was: step() returned
    before it, mid-window, and zero_grad() dropped its gradient)."""
    def run(fused, k):
        a, b = _params(unhooked)
        opt = _optimizer(a, b, unhooked, fused=fused, **({"accumulation_steps": k} if fused
                                                          else {}))
        g = torch.Generator().manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(4):
                ((a * torch.randn(4, 3, generator=g)).sum()
                 + (b * torch.randn(5, generator=g)).sum()).backward()
                opt.step()
                opt.zero_grad()
        return a.detach().clone(), b.detach().clone(), _state(opt, a), _state(opt, b)
    ref = run(False, 1)
    got = run(True, 2)
    assert ref[3]["step"] == 4
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert_same_state(ref[2], got[2])
    assert_same_state(ref[3], got[3])


class _Loss(torch.nn.Module):
    """The loss as a module's forward: the front end notices a forward pass
    since a mid-window step() by a module forward pre-hook (Lightning's
    order)."""

    def forward(self, a, b, ga, gb):
        return (a * ga).sum() + (b * gb).sum()


@pytest.mark.parametrize("unhooked", ["unfrozen", "by_hand"])
def test_lightning_order_keeps_an_unhooked_gradient(unhooked, monkeypatch):
    """PyTorch Lightning's order with accumulation_steps=2 and epochs of one
    batch (forward through a module, zero_grad(), backward, step() at the
    epoch's end): the window's gradients are kept across that zero_grad()
    and applied at a later step(); b without a hook the same as b with one
    (its gradient was cleared at every epoch: never updated)."""
    from automagic.optim import Automagic3
    kept = []
    real = Automagic3._zero_grad_outside_window
    monkeypatch.setattr(Automagic3, "_zero_grad_outside_window",
                        lambda self, *a: kept.append(1) or real(self, *a))

    def run(how):
        a, b = _params(how)
        opt = _optimizer(a, b, how, accumulation_steps=2)
        g, loss_of = torch.Generator().manual_seed(1), _Loss()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                loss = loss_of(a, b, torch.randn(4, 3, generator=g), torch.randn(5, generator=g))
                opt.zero_grad()
                loss.backward()
                opt.step()
        return a.detach().clone(), b.detach().clone(), _state(opt, a), _state(opt, b)
    hooked = run(None)
    got = run(unhooked)
    assert len(kept) == 2  # (each run's second epoch took Lightning's branch)
    assert hooked[3]["step"] == 2
    assert torch.equal(hooked[0], got[0]) and torch.equal(hooked[1], got[1])
    assert_same_state(hooked[2], got[2])
    assert_same_state(hooked[3], got[3])


def test_zero_grad_interrupted_as_it_updates_an_unhooked_parameter_finishes_on_retry(
        monkeypatch):
    """A KeyboardInterrupt as zero_grad() (ending a window after a
    mid-window step()) starts the parameters without a hook: the retried
    zero_grad() updates them, as a retried step() would (the window was
    already closed, and the retry cleared their gradients unapplied: a
    review)."""
    from automagic.optim import Automagic3

    def run(interrupt):
        a, b = _params("unfrozen")
        opt = _optimizer(a, b, "unfrozen", accumulation_steps=2)
        g = torch.Generator().manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ((a * torch.randn(4, 3, generator=g)).sum()
             + (b * torch.randn(5, generator=g)).sum()).backward()
            opt.step()  # mid-window: the zero_grad() below ends the window
            if interrupt:
                real = Automagic3._update_grads

                def once(self, *args, **kw):
                    monkeypatch.setattr(Automagic3, "_update_grads", real)
                    raise KeyboardInterrupt
                monkeypatch.setattr(Automagic3, "_update_grads", once)
                with pytest.raises(KeyboardInterrupt):
                    opt.zero_grad()
                assert b.grad is not None
            opt.zero_grad()
        return b.detach().clone(), b.grad, _state(opt, b)
    clean, retried = run(False), run(True)
    assert clean[1] is None and retried[1] is None and clean[2]["step"] == 1
    assert torch.equal(clean[0], retried[0])
    assert_same_state(clean[2], retried[2])


def test_zero_grad_interrupted_at_every_line_ends_the_window_on_retry():
    """A KeyboardInterrupt at every line the package runs in a zero_grad()
    that ends a window after a mid-window step(), then the same call again:
    grad mode is on after each (an interrupt at a `with torch.no_grad()`
    line left it off: a review), and every parameter ends as in the
    uninterrupted run: the hooked one (an interrupt in the window's flush
    had closed the window, and the retry cleared the gradients it had not
    applied yet: 127 of 461 lines) and those without a hook (one unfrozen,
    one put in by hand)."""
    def run(k):
        torch.manual_seed(0)
        a = torch.nn.Parameter(torch.randn(5, 7))
        b = torch.nn.Parameter(torch.randn(6), requires_grad=False)
        c = torch.nn.Parameter(torch.randn(4))
        opt = automagic.Automagic3([a, b], accumulation_steps=2)
        b.requires_grad_(True)
        opt.param_groups[0]["params"].append(c)
        g = torch.Generator().manual_seed(1)

        def backward():
            ((a * torch.randn(5, 7, generator=g)).sum() + (b * torch.randn(6, generator=g)).sum()
             + (c * torch.randn(4, generator=g)).sum()).backward()
        interrupt = LineInterrupt(k)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backward()
            opt.step()  # mid-window: the zero_grad() below ends the window
            interrupt.run(opt.zero_grad)
            grad_mode = torch.is_grad_enabled()
            torch.set_grad_enabled(True)
            opt.zero_grad()  # (the retry; the whole call when k == 0)
            backward()
            backward()
            opt.step()
            opt.zero_grad()
        out = [a.detach().clone(), b.detach().clone(), c.detach().clone()]
        for p in (a, b, c):
            out += [v if isinstance(v, torch.Tensor) else torch.tensor(v)
                    for _, v in sorted(opt.state[p].items())]
        return out, interrupt.fired, grad_mode
    ref, _, _ = run(0)
    k, bad, off = 1, [], []
    while True:
        got, fired, grad_mode = run(k)
        if not fired:
            break
        if not grad_mode:
            off.append(k)
        if not all(torch.equal(x, y) for x, y in zip(ref, got)):
            bad.append(k)
        k += 1
    assert k > 100 and not bad and not off, (k, bad, off)


def _setup_raise(**kw):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    u = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
    opt = automagic.Automagic3([w, u], accumulation_steps=2, **kw)
    u.requires_grad_(True)  # unfrozen after construction: no hook
    return w, u, opt


def test_a_refused_window_end_in_zero_grad_is_raised_once_and_updates_nothing_later():
    """nonfinite="raise" and a non-finite gradient in a window that zero_grad()
    ends after a mid-window step(): raised once; the next zero_grad() clears,
    and a later zero_grad() that discards a window updates nothing (the
    unhooked update stayed pending: it was raised again, and then applied
    with the discarded pass's gradient; a review)."""
    w, u, opt = _setup_raise(nonfinite="raise")
    x = torch.full((4, 3), float("inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ((w * x).sum() + (u * x).sum()).backward()
        opt.step()
        with pytest.raises(automagic.NonFiniteGradientError):
            opt.zero_grad()
        opt.zero_grad()
        assert w.grad is None and u.grad is None
        w, u, opt = _setup_raise(nonfinite="raise")
        x = torch.randn(4, 3)
        x[0, 0] = float("inf")
        ((w * x).sum() + u.sum()).backward()
        opt.step()
        with pytest.raises(automagic.NonFiniteGradientError):
            opt.zero_grad()
        u0 = u.detach().clone()
        (w.sum() + u.sum()).backward()
        opt.zero_grad()  # mid-window, no step() since: discards
    assert torch.equal(u.detach(), u0)
    assert opt.state.get(u, {}).get("step", 0) == 0 and u.grad is None


def test_an_interrupted_window_end_not_retried_leaves_nothing_pending(monkeypatch):
    """A KeyboardInterrupt in zero_grad()'s window end, and the loop goes on
    with a backward pass instead of a retry: a later zero_grad() that
    discards the window updates nothing (the unhooked update stayed pending
    and was applied there, with the discarded pass's gradient; a review)."""
    from automagic.optim import Automagic3
    w, u, opt = _setup_raise()
    g = torch.Generator().manual_seed(1)

    def loss():
        return ((w * torch.randn(4, 3, generator=g)).sum()
                + (u * torch.randn(4, 3, generator=g)).sum())
    real = Automagic3._update_param

    def once(self, *args, **kw):
        monkeypatch.setattr(Automagic3, "_update_param", real)
        raise KeyboardInterrupt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss().backward()
        opt.step()  # mid-window
        monkeypatch.setattr(Automagic3, "_update_param", once)
        with pytest.raises(KeyboardInterrupt):
            opt.zero_grad()
        loss().backward()  # no retry
        w0, u0 = w.detach().clone(), u.detach().clone()
        opt.zero_grad()  # mid-window, no step() since: discards
    assert torch.equal(w.detach(), w0) and torch.equal(u.detach(), u0)
    assert w.grad is None and u.grad is None
