"""Lifetimes: an optimizer, its state and its model are freed when the
script drops them, in fused mode too (its backward hooks hold no strong
reference to the optimizer)."""
import copy
import gc
import warnings
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
    # the new one updated only at its first step. (No warning of another
    # optimizer's hooks: the old one is dropped before the new one trains.)
    m = _model()
    for epoch in range(3):
        opt = automagic.Automagic3(m.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
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


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("how", ["replaced", "replaced_lr_only", "appended"])
def test_group_dict_put_in_by_hand_gets_what_add_param_group_gives(fused, how):
    # a group dict put into param_groups by hand has no base_lr (the start
    # lr add_param_group records): step() and the hooks failed with a bare
    # KeyError: 'base_lr' (found by a review, thirtieth session). It gets the
    # constructor's values of what it lacks and its lr as its start lr.
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    extra = torch.nn.Parameter(torch.randn(3))
    opt = automagic.Automagic3(m.parameters(), lr=1e-4, fused=fused, min_lr=1e-6)
    if how == "replaced":
        opt.param_groups[0] = {"params": list(m.parameters()), **opt.defaults}
    elif how == "replaced_lr_only":
        opt.param_groups[0] = {"params": list(m.parameters()), "lr": 2e-4}
    else:
        opt.param_groups.append({"params": [extra], "lr": 3e-4})
    for _ in range(2):
        (m(torch.randn(3, 4)).sum() + extra.sum()).backward()
        opt.step()
        opt.zero_grad()
    g = opt.param_groups[-1]
    assert g["base_lr"] == {"replaced": 1e-4, "replaced_lr_only": 2e-4, "appended": 3e-4}[how]
    assert g["min_lr"] == 1e-6  # the constructor's value of what it lacked
    assert all(opt.state[p]["step"] == 2 for p in m.parameters())
    if how == "appended":
        assert opt.state[extra]["step"] == 2
        assert torch.allclose(opt.state[extra]["lr"], torch.full((3,), 3e-4), rtol=0.5)


def test_group_dict_put_in_by_hand_with_a_bad_lr_is_refused_by_name():
    m = torch.nn.Linear(4, 2)
    opt = automagic.Automagic3(m.parameters(), fused=False)
    opt.param_groups[0] = {"params": list(m.parameters()), "lr": "fast"}
    m(torch.randn(3, 4)).sum().backward()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(automagic.AutomagicError, match="group\\['lr'\\] as its start lr"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before))


def test_group_dict_put_in_by_hand_takes_a_schedulers_initial_lr_and_refuses_lr_zero():
    # a review of the first fix: torch.distributed.checkpoint's
    # initialisation step (every lr 0 for one step()) or a warm-up from 0
    # filled base_lr = 0: rows started at 0 and lr_schedule="scale" divided
    # by 0 at every later step. A scheduler's initial_lr is the start lr;
    # without one an lr of 0 is refused as add_param_group refuses it.
    m = torch.nn.Linear(4, 2)
    opt = automagic.Automagic3(m.parameters(), lr=1e-3, lr_schedule="scale", fused=False)
    opt.param_groups[0] = {"params": list(m.parameters()), "lr": 1e-3}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, e / 2))  # from 0
    assert opt.param_groups[0]["lr"] == 0.0
    for _ in range(3):
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["base_lr"] == 1e-3
    assert all(bool((opt.state[p]["lr"] > 0).all()) for p in m.parameters())
    v = torch.nn.Parameter(torch.ones(3))
    opt.param_groups.append({"params": [v], "lr": 0.0})
    v.grad = torch.ones(3)
    before = [p.detach().clone() for p in m.parameters()]
    m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(automagic.AutomagicError, match="start lr.*> 0"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before))
    assert torch.equal(v.detach(), torch.ones(3))


def test_group_dict_put_in_by_hand_before_load_copy_and_save():
    # load_state_dict before the group's first step kept the saved
    # schedule's lr as a factor of a start lr not yet recorded (every rate
    # doubled); deepcopy before its first step failed with KeyError:
    # 'min_lr'; state_dict() saved it without its start lr
    m = torch.nn.Linear(4, 2)
    a = automagic.Automagic3(m.parameters(), lr=1e-4, lr_schedule="scale", fused=False)
    a.param_groups[0]["lr"] = 0.5e-4  # a ReduceLROnPlateau-style halving
    sd = copy.deepcopy(a.state_dict())
    b = automagic.Automagic3(m.parameters(), lr=1e-4, lr_schedule="scale", fused=False)
    b.param_groups[0] = {"params": list(m.parameters()), "lr": 1e-4}
    c = copy.deepcopy(b)  # (before any step)
    assert "base_lr" not in c.param_groups[0] or c.param_groups[0]["base_lr"] == 1e-4
    b.load_state_dict(sd)
    g = b.param_groups[0]
    assert g["base_lr"] == 1e-4 and g["lr"] == 0.5e-4
    d = automagic.Automagic3(m.parameters(), lr=1e-4, fused=False)
    d.param_groups[0] = {"params": list(m.parameters()), "lr": 3e-4}
    assert d.state_dict()["param_groups"][0]["base_lr"] == 3e-4


@pytest.mark.parametrize("bad", [{"beta2": 1.5}, {"params": "dtype"}])
def test_refused_constructor_leaves_no_hooks(bad):
    # torch's Optimizer.__init__ adds the groups one at a time and each
    # registered its hooks at once: a group refused after another left the
    # first group's hooks behind, and the half-built optimizer (alive while
    # a traceback holds it, as interactive shells keep sys.last_traceback)
    # updated those parameters and consumed their gradients.
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(600, 600))  # updated in its own hook
    s = torch.nn.Parameter(torch.randn(8))         # queued (small)
    second = torch.nn.Parameter(torch.randn(4, dtype=torch.float64)
                                if bad.get("params") == "dtype" else torch.randn(4))
    group = {"params": [second]}
    group.update({k: v for k, v in bad.items() if k != "params"})
    kept = None
    try:
        automagic.Automagic3([{"params": [w, s]}, group])
    except (TypeError, ValueError) as e:
        kept = e  # its traceback holds the half-built optimizer
    assert kept is not None and kept.__traceback__ is not None
    gc.collect()
    assert _hooks(w) == 0 and _hooks(s) == 0
    before = (w.detach().clone(), s.detach().clone())
    (w.sum() + s.sum()).backward()
    assert w.grad is not None and s.grad is not None  # nobody consumed them
    assert torch.equal(w.detach(), before[0]) and torch.equal(s.detach(), before[1])
    # the optimizer built next updates them alone
    w.grad = s.grad = None
    opt = automagic.Automagic3([w, s])
    (w.sum() + s.sum()).backward()
    assert opt.state[w]["step"] == 1 and opt.state[s]["step"] == 1


@pytest.mark.parametrize("small", [True, False])
def test_hook_uses_the_group_that_lists_its_parameter(small):
    # A hook found its group by id() alone: a group dict created after the
    # original was freed can reuse its id (replacing the dicts one after
    # another did, in CPython), and a parameter moved to another group by
    # hand kept the first group's dict; either way the update used the
    # wrong group's hyperparameters (here a weight decay of 1000).
    torch.manual_seed(0)
    shape = (4, 3) if small else (600, 600)  # queued, or updated in its hook
    a = torch.nn.Parameter(torch.randn(shape))
    b = torch.nn.Parameter(torch.randn(5))
    opt = automagic.Automagic3([dict(params=[a], weight_decay=1000.0), dict(params=[b])])
    g0, g1 = opt.param_groups

    def move(src, dst):  # by identity (list.remove compares tensors with ==)
        src["params"].pop(next(i for i, q in enumerate(src["params"]) if q is a))
        dst["params"].append(a)

    move(g0, g1)  # a moves to the group without decay
    a0 = a.detach().clone()
    (a.sum() * 0 + b.sum()).backward()  # a's gradient is zero: only decay moves it
    assert opt.state[a]["step"] == 1
    assert torch.equal(a.detach(), a0)
    # and back: the hook follows the parameter again
    move(g1, g0)
    (a.sum() * 0 + b.sum()).backward()
    assert opt.state[a]["step"] == 2
    assert not torch.equal(a.detach(), a0)


@pytest.fixture
def swap_on_conversion():
    # torch.utils.swap_tensors for Module.to()/half(): the Parameter object
    # stays, its tensor is swapped (and its post-accumulate-grad hooks stop
    # firing, though the Python dict still lists them)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def test_swapped_parameters_found_by_step(swap_on_conversion):
    # after the swap, fused mode stopped updating silently: the hooks no
    # longer fired and step() skipped the parameters it had hooked
    m = torch.nn.Linear(4, 3)
    opt = automagic.Automagic3(m.parameters(), lr=1e-3)
    m(torch.randn(2, 4)).sum().backward()
    assert all(opt.state[p]["step"] == 1 for p in m.parameters())
    w = m.weight
    m.to(torch.bfloat16)
    assert m.weight is w and w.dtype == torch.bfloat16
    m(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    assert w.grad is not None  # no hook fired
    before = w.detach().clone()
    with pytest.warns(UserWarning, match="swapped"):
        opt.step()
    assert all(opt.state[p]["step"] == 2 for p in m.parameters())
    assert w.grad is None and not torch.equal(w.detach(), before)
    # hooked again: the next backward updates in fused mode, no step() call
    m(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    assert all(opt.state[p]["step"] == 3 for p in m.parameters())
    assert all(p.grad is None for p in m.parameters())


def test_swapped_parameters_found_by_zero_grad(swap_on_conversion):
    # load_state_dict(assign=True) swaps too under that flag; a fused-mode
    # loop that calls zero_grad() but not step() is warned, and trains on
    m = torch.nn.Linear(4, 3)
    opt = automagic.Automagic3(m.parameters(), lr=1e-3)
    m(torch.randn(2, 4)).sum().backward()
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    w = m.weight
    m.load_state_dict(sd, assign=True)
    assert m.weight is w
    m(torch.randn(2, 4)).sum().backward()
    assert m.weight.grad is not None
    with pytest.warns(UserWarning, match="zero_grad\\(\\) drops"):
        opt.zero_grad()
    assert all(opt.state[p]["step"] == 1 for p in m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    assert all(opt.state[p]["step"] == 2 for p in m.parameters())
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("fused", [True, False])
def test_second_optimizer_on_hooked_parameters_warns(fused):
    """A fused optimizer still alive keeps updating its parameters in its
    hooks and dropping their gradients: a second optimizer created for the
    same model (the first kept alive by an lr scheduler, say) never updates
    them. That was silent (found by a review, thirty-second session); it
    warns now, and not once the first one's hooks are gone."""
    m = _model()
    first = automagic.Automagic3(m.parameters(), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(first, lambda s: 1.0)  # holds it
    second = automagic.Automagic3(m.parameters(), fused=fused)
    with pytest.warns(UserWarning, match="hook of another Automagic3 optimizer"):
        _train(m, second, 2, fused)  # (said at its first hook or step())
    assert all(len(second.state.get(p, {})) == 0 for p in m.parameters())
    assert all(first.state[p]["step"] == 2 for p in m.parameters())
    # the hooks removed, or their optimizer collected: no warning
    first.remove_hooks()
    second.remove_hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = automagic.Automagic3(m.parameters(), fused=True)
        del third, sched, first
        gc.collect()
        automagic.Automagic3(m.parameters(), fused=fused).remove_hooks()


@pytest.mark.parametrize("fused_batch_bytes", [4 << 20, 0])
def test_parameter_moved_with_add_param_group_as_in_step_mode(fused_batch_bytes):
    # torch's way to give one parameter its own hyperparameters: remove it
    # from its group, then add_param_group. It was given a second index and
    # a second hook: its small update was queued twice, and the second found
    # p.grad gone, raising inside backward at every later pass (thirty-
    # fourth session's review). Now it keeps its index (its noise key) and
    # its hook: fused mode equals step mode, with the new group's decay.
    results = {}
    for mode in ("step", "fused", "unmoved"):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2)).to(torch.bfloat16)
        fused = mode != "step"
        opt = automagic.Automagic3(m.parameters(), lr=1e-3, fused=fused)
        opt.fused_batch_bytes = fused_batch_bytes
        torch.manual_seed(1)
        for i in range(6):
            if i == 3 and mode != "unmoved":
                w = m[0].weight
                g0 = opt.param_groups[0]["params"]
                g0.pop(next(k for k, q in enumerate(g0) if q is w))
                opt.add_param_group({"params": [w], "weight_decay": 0.5})
                assert _hooks(w) == (1 if fused else 0)
            m(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert [opt.state[p]["step"] for p in m.parameters()] == [6] * 4
        results[mode] = [p.detach().clone() for p in m.parameters()]
    for a, b in zip(results["fused"], results["step"]):
        assert torch.equal(a, b)
    assert not torch.equal(results["fused"][0], results["unmoved"][0])  # the decay applies


def test_parameter_listed_twice_by_hand_is_updated_once():
    # A parameter appended to a second group by hand without leaving the
    # first (or twice to one list): step mode put it into its update list
    # twice and raised an AttributeError after updating every parameter.
    # Now updated once, with its first group, as its hook does in fused
    # mode, and warned.
    results = []
    for twice in (False, True):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4)
        with torch.no_grad():
            m.weight.copy_(torch.arange(16.0).reshape(4, 4) / 16)
        opt = automagic.Automagic3(m.parameters(), lr=1e-3, fused=False)
        if twice:
            opt.param_groups.append(dict(opt.param_groups[0], params=[m.weight],
                                         weight_decay=0.1))
            opt.param_groups[0]["params"].append(m.bias)
        for i in range(3):
            torch.manual_seed(2)
            m(torch.randn(2, 4)).sum().backward()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                opt.step()
            assert any("listed more than once" in str(x.message) for x in w) == (twice and i == 0)
            opt.zero_grad()
        assert [opt.state[p]["step"] for p in m.parameters()] == [3, 3]
        results.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_setting_fused_false_is_remove_hooks():
    # opt.fused = False was ignored: the hooks went on updating in backward
    # and step() did nothing (so clip_grad_norm_ saw no gradient).
    m = _model()
    opt = automagic.Automagic3(m.parameters(), lr=1e-3)
    opt.fused = True  # (no change)
    opt.fused = False
    assert all(_hooks(p) == 0 for p in m.parameters())
    m(torch.randn(8, 16)).square().mean().backward()
    assert all(p.grad is not None for p in m.parameters())
    assert torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0) > 0
    opt.step()
    assert all(opt.state[p]["step"] == 1 for p in m.parameters())
    with pytest.raises(ValueError, match="chosen at construction"):
        opt.fused = True
    with pytest.raises(TypeError, match="fused must be True or False"):
        opt.fused = 0
    assert opt.fused is False
    opt2 = copy.deepcopy(opt)  # (pickled under its old key)
    assert opt2.fused is False


def test_parameter_listed_twice_by_hand_warns_in_fused_mode_too():
    # Fused mode updates it once, with the group its hook was registered
    # with; step() said nothing there (the duplicate was filtered with the
    # hooked parameters before the check).
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = automagic.Automagic3([dict(params=[m.bias]), dict(params=[m.weight], weight_decay=0.5)])
    opt.param_groups[0]["params"].append(m.weight)
    w0 = m.weight.detach().clone()
    m(torch.randn(2, 4)).sum().backward()
    assert opt.state[m.weight]["step"] == 1
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.step()
    assert any("listed more than once" in str(x.message) and "fused mode with those of the "
               "group its backward hook" in str(x.message) for x in w)
    assert opt.state[m.weight]["step"] == 1
    assert not torch.equal(m.weight.detach(), w0)
