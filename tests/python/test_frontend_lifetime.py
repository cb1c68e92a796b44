"""Lifetimes: an optimizer, its state and its model are freed when the
script drops them, in fused mode too (its backward hooks hold no strong
reference to the optimizer)."""
import copy
import gc
import weakref

import pytest
import torch

import automagic


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(m, opt, steps, fused):
    for _ in range(steps):
        m(torch.randn(8, 16)).square().mean().backward()
        if not fused:
            opt.step()
            opt.zero_grad()


def _hooks(p):
    return len(p._post_accumulate_grad_hooks or {})


@pytest.mark.parametrize("fused", [True, False])
def test_optimizer_and_model_are_freed(fused):
    # p -> post-accumulate-grad hook -> optimizer -> p was a cycle the
    # garbage collector cannot see (it does not look into tensor hooks):
    # every fused optimizer, its state and its model stayed alive forever.
    m = _model()
    opt = automagic.Automagic3(m.parameters(), fused=fused)
    _train(m, opt, 2, fused)
    w_opt, w_param = weakref.ref(opt), weakref.ref(m[0].weight)
    w_state = weakref.ref(opt.state[m[0].weight]["exp_avg_sq_row"])
    copies = [copy.deepcopy((m, opt)) for _ in range(2)]
    w_copy = weakref.ref(copies[0][1])
    del m, opt, copies
    gc.collect()
    assert w_opt() is None and w_param() is None and w_state() is None and w_copy() is None


def test_recreated_fused_optimizer_trains_alone():
    # Creating the optimizer again (each epoch, say) left the old one's
    # hooks on the parameters: the old optimizer went on updating them and
    # the new one updated only at its first step.
    m = _model()
    for epoch in range(3):
        opt = automagic.Automagic3(m.parameters())
        _train(m, opt, 3, True)
        gc.collect()
        assert all(_hooks(p) == 1 for p in m.parameters()), epoch
        assert all(opt.state[p]["step"] == 3 for p in m.parameters()), epoch
    del opt
    gc.collect()
    assert all(_hooks(p) == 0 for p in m.parameters())


def test_hooks_of_a_live_optimizer_stay():
    # only a dropped optimizer loses its hooks; one the script holds keeps
    # updating, and remove_hooks() still switches it to step mode
    m = _model()
    opt = automagic.Automagic3(m.parameters())
    gc.collect()
    _train(m, opt, 2, True)
    assert all(opt.state[p]["step"] == 2 for p in m.parameters())
    opt.remove_hooks()
    assert all(_hooks(p) == 0 for p in m.parameters())
    _train(m, opt, 1, False)
    assert all(opt.state[p]["step"] == 3 for p in m.parameters())


def test_replaced_group_dict_keeps_fused_updates():
    # the hooks find their group by identity (they hold the optimizer
    # weakly); a script that replaces a group dict (param_groups[0] =
    # dict(...)) must not stop the fused updates of its parameters
    m = _model()
    opt = automagic.Automagic3(m.parameters())
    _train(m, opt, 1, True)
    opt.param_groups[0] = dict(opt.param_groups[0])
    before = [p.detach().clone() for p in m.parameters()]
    _train(m, opt, 1, True)
    assert all(opt.state[p]["step"] == 2 for p in m.parameters())
    assert all(not torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before))
    assert all(p.grad is None for p in m.parameters())
