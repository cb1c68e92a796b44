"""The front end caches the C views of each parameter (_views._Plan) between
updates. These tests change what the cached views point at or were built
from, between two steps, and check that the next update sees the change:
each compares against a copy of the optimizer made after the change (deepcopy
rebuilds every cache), stepped with the same gradient.

Every test runs twice: with the one parameter p, and with a second one
beside it, which sends step() through _apply_batch and its cached item
array (kept between steps while the same plans come in the same order)."""
import copy
import sys

import pytest
import torch

import automagic
from _torch_compat import needs_grad_dtype


@pytest.fixture(autouse=True, params=[False, True], ids=["alone", "batched"])
def _with_second(request, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_SECOND", request.param)


_SECOND = False


def _setup(shape=(6, 10), dtype=torch.float32):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*shape).to(dtype))
    params = [p] + ([torch.nn.Parameter(torch.randn(3, 5).to(dtype))] if _SECOND else [])
    opt = automagic.Automagic3(params, fused=False, lr=1e-3)
    g1, g2 = torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)
    _step(p, opt, g1)
    return p, opt, g2


def _step(p, opt, g):
    p.grad = g.clone()
    for e in opt.param_groups[0]["params"][1:]:
        e.grad = torch.full_like(e, 0.01)
    opt.step()


def _assert_same_state(a, b):
    for k, v in a.items():
        w = b[k]
        assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, k


def _twin(p, opt):
    """A copy of (p, opt) with its own parameter and fresh caches."""
    opt2 = copy.deepcopy(opt)
    return opt2.param_groups[0]["params"][0], opt2


def test_hyperparameter_change_reaches_the_update():
    p, opt, g2 = _setup()
    opt.param_groups[0]["weight_decay"] = 0.5
    opt.param_groups[0]["lr_bump_rate"] = 0.3
    q, opt2 = _twin(p, opt)
    _step(p, opt, g2)
    _step(q, opt2, g2)
    assert torch.equal(p.detach(), q.detach())


def test_weight_decay_change_changes_the_result():
    """The check above could not fail if the change had no effect."""
    p, opt, g2 = _setup()
    q, opt2 = _twin(p, opt)
    opt.param_groups[0]["weight_decay"] = 0.5  # after the copy: only opt has it
    _step(p, opt, g2)
    _step(q, opt2, g2)
    assert not torch.equal(p.detach(), q.detach())


def test_parameter_storage_replaced():
    p, opt, g2 = _setup()
    q, opt2 = _twin(p, opt)
    old = p.data
    p.data = p.data.clone()  # new storage, same values
    _step(p, opt, g2)
    _step(q, opt2, g2)
    assert torch.equal(p.detach(), q.detach())
    assert not torch.equal(old, p.detach())  # the update went to the new storage


def test_load_state_dict_replaces_the_state():
    p, opt, g2 = _setup()
    q, opt2 = _twin(p, opt)
    _step(q, opt2, torch.randn(6, 10))  # opt2 moves on: a different state
    sd = copy.deepcopy(opt2.state_dict())
    with torch.no_grad():
        p.copy_(q)
    opt.load_state_dict(sd)
    _step(p, opt, g2)
    _step(q, opt2, g2)
    assert torch.equal(p.detach(), q.detach())
    _assert_same_state(opt.state[p], opt2.state[q])


@needs_grad_dtype
def test_gradient_dtype_change():
    """The gradient's dtype is not part of the cache: a bfloat16 gradient
    after float32 ones (torch >= 2.10 needs grad_dtype=None to allow it)
    gives the update of the float32 gradient with the same values."""
    p, opt, g2 = _setup()
    q, opt2 = _twin(p, opt)
    for t in (p, q):
        t.grad_dtype = None
    gb = g2.to(torch.bfloat16)
    _step(p, opt, gb)
    _step(q, opt2, gb.float())  # the same values: the same update, exactly
    assert torch.equal(p.detach(), q.detach())


def test_state_storage_moved_in_place():
    """share_memory_() moves a tensor's storage without changing the object:
    the cached pointers must follow (a use-after-free otherwise)."""
    p, opt, g2 = _setup()
    q, opt2 = _twin(p, opt)
    for v in opt.state[p].values():
        if isinstance(v, torch.Tensor):
            v.share_memory_()
    _step(p, opt, g2)
    _step(q, opt2, g2)
    assert torch.equal(p.detach(), q.detach())
    _assert_same_state(opt.state[p], opt2.state[q])


def test_state_tensor_data_replaced():
    p, opt, g2 = _setup()
    q, opt2 = _twin(p, opt)
    st = opt.state[p]
    st["lr"].data = st["lr"].data.clone()
    _step(p, opt, g2)
    _step(q, opt2, g2)
    assert torch.equal(opt.state[p]["lr"], opt2.state[q]["lr"])
    assert torch.equal(p.detach(), q.detach())


def test_seed_change_reaches_the_update():
    """bfloat16: the seed keys the rounding noise. opt's cached plan was built
    with the old seed; opt2 (a copy) builds its plan after the change; opt3
    keeps the old seed, to show that the seed changes the result."""
    p, opt, g2 = _setup(shape=(64, 64), dtype=torch.bfloat16)
    q, opt2 = _twin(p, opt)
    r, opt3 = _twin(p, opt)
    opt.seed = opt2.seed = 12345
    for t, o in ((p, opt), (q, opt2), (r, opt3)):
        _step(t, o, g2)
    assert torch.equal(p.detach(), q.detach())
    assert not torch.equal(p.detach(), r.detach())


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("which", ["param", "state"])
def test_storage_shrunk_under_a_tensor_is_refused(fused, which):
    """A storage resized under its tensor (untyped_storage().resize_): torch
    checks nothing until the tensor is read, and the update wrote the whole
    parameter into the smaller storage (heap corruption)."""
    p = torch.nn.Parameter(torch.randn(64, 256))
    opt = automagic.Automagic3([p], fused=fused)
    (p * p).sum().backward()
    if not fused:
        opt.step()
    st = opt.state[p]
    shrunk = "exp_avg_sq_col" if which == "state" else None
    before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()
              if k != shrunk}
    target = p if which == "param" else st[shrunk]
    target.untyped_storage().resize_(64)
    with pytest.raises(automagic.AutomagicError, match="storage holds 64"):
        if fused:
            (p.detach() * 0 + p).sum().backward()
        else:
            p.grad = torch.ones(64, 256)
            opt.step()
    for k, v in before.items():
        assert (torch.equal(st[k], v) if torch.is_tensor(v) else st[k] == v), k
