"""The Python bad-input matrix: every case is a clear exception that leaves
parameters and state as they were, or is handled correctly (and checked)."""
import copy
import warnings

import pytest
import torch

import automagic
from _frontend_models import batches, loss_of, make, snapshot, assert_unchanged
from _torch_compat import HAS_GRAD_DTYPE, needs_grad_dtype


def _param(*shape, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype).to(device))


# ------------------------------------------------------ refused at construction
@pytest.mark.parametrize("make_param, error, match", [
    (lambda: _param(3, 4, device="meta"), ValueError, "device 'meta'"),
    (lambda: _param(3, 4, dtype=torch.float64), TypeError, "float64"),
    (lambda: _param(3, dtype=torch.complex128), TypeError, r"complex128; supported: float32, "
     r"bfloat16, float16 \(a parameter that does not require grad may have any dtype\)$"),
    # (not "float64 would be rounded", which an int64 tensor was told)
    (lambda: _param(3, 4, dtype=torch.complex64), TypeError, "complex64"),
    (lambda: _param(*([1] * 9)), ValueError, "9 dims"),
    (lambda: torch.nn.Parameter(torch.eye(3).to_sparse()), ValueError, "layout"),
    # two elements at one address: no update can write it (copy_ refuses)
    (lambda: torch.nn.Parameter(torch.randn(1, 4).expand(3, 4)), ValueError, "share memory"),
    (lambda: 3.0, TypeError, "parameter 1 is a float, not a torch.Tensor$"),
    # a module: named, with what to pass (it was "(shape ()) is a Linear")
    (lambda: torch.nn.Linear(3, 3), TypeError, "Linear, not a torch.Tensor: pass "
     "model.parameters"),
])
def test_unsupported_parameters_are_refused(make_param, error, match):
    good = _param(2, 2)
    with pytest.raises(error, match=match):
        automagic.Automagic3([good, make_param()])
    # refused by add_param_group: the optimizer is left as it was
    opt = automagic.Automagic3([good])
    with pytest.raises(error, match=match):
        opt.add_param_group({"params": [make_param()]})
    assert len(opt.param_groups) == 1 and len(opt._hook_handles) == 1


@pytest.mark.parametrize("fused", [True, False])
def test_frozen_parameters_of_other_dtypes_are_left_alone(fused):
    # model.parameters() of a model with a frozen quantized or float64 part:
    # the reference accepts them and leaves them alone; they were refused at
    # construction (a review, thirty-seventh session). Unfrozen with a
    # gradient, such a parameter is refused at the update, nothing changed.
    torch.manual_seed(0)
    w = _param(4, 4)
    q = torch.nn.Parameter(torch.zeros(3, dtype=torch.int8), requires_grad=False)
    d = torch.nn.Parameter(torch.randn(3, dtype=torch.float64), requires_grad=False)
    opt = automagic.Automagic3([w, q, d], fused=fused)
    for _ in range(2):
        (w ** 2).sum().backward()
        if not fused:
            opt.step()
    assert opt.state[w]["step"] == 2 and not opt.state.get(q) and not opt.state.get(d)
    before = d.detach().clone()
    d.requires_grad_(True)
    (d ** 2).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fused: "has a gradient but no backward hook")
        with pytest.raises(automagic.AutomagicError, match="float64 is not supported"):
            opt.step()
    assert torch.equal(d, before) and d.grad is not None and not opt.state.get(d)


@pytest.mark.parametrize("kw, error, match", [
    (dict(beta2=1.0), ValueError, "beta2"),
    (dict(beta2=float("nan")), ValueError, "beta2"),
    (dict(min_lr=1e-3, max_lr=1e-4), ValueError, "min_lr"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(clip_threshold=0.0), ValueError, "clip_threshold"),
    (dict(weight_decay=float("inf")), ValueError, "weight_decay"),
    (dict(lr_bump_rate=True), TypeError, "lr_bump_rate"),
    (dict(weight_decay=torch.tensor(0.1)), TypeError, "weight_decay"),
    (dict(lr="1e-6"), TypeError, "lr"),
    (dict(lr=-1e-6), ValueError, "lr"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(fused=1), TypeError, "fused"),
    (dict(accumulation_steps=0), ValueError, "accumulation_steps"),
    (dict(nonfinite="ignore"), ValueError, "nonfinite"),
    (dict(lr_schedule="linear"), ValueError, "lr_schedule"),
])
def test_invalid_hyperparameters(kw, error, match):
    with pytest.raises(error, match=match):
        automagic.Automagic3([_param(2, 2)], **kw)
    if kw.keys() & {"beta2", "min_lr", "max_lr", "eps", "clip_threshold", "weight_decay",
                    "lr_bump_rate", "lr"}:
        opt = automagic.Automagic3([_param(2, 2)])
        with pytest.raises(error, match=match):
            opt.add_param_group(dict(params=[_param(3)], **kw))
        assert len(opt.param_groups) == 1


def test_params_as_set_or_twice():
    with pytest.raises(TypeError, match="not a set"):
        automagic.Automagic3([{"params": {_param(2)}}])
    p = _param(2)
    with pytest.raises(ValueError, match="more than one"):
        automagic.Automagic3([{"params": [p]}, {"params": [p]}])


# ----------------------------------------------------- refused at update time
@pytest.mark.parametrize("fused", [False, True])
def test_sparse_gradient(fused):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    lin = torch.nn.Linear(4, 2)
    opt = automagic.Automagic3(list(emb.parameters()) + list(lin.parameters()), fused=fused)
    w = emb.weight.detach().clone()
    with pytest.raises(automagic.AutomagicError, match="sparse gradients"):
        lin(emb(torch.tensor([1, 2, 3]))).sum().backward()
        opt.step()
    assert torch.equal(emb.weight, w) and emb.weight not in opt.state


def test_changed_after_construction_is_refused_unchanged():
    m = make()
    opt = automagic.Automagic3(m.parameters(), fused=False)
    loss_of(m, batches(1)[0]).backward()
    opt.step()
    cases = []
    # an invalid hyperparameter set on the group after construction
    cases.append((lambda: opt.param_groups[0].__setitem__("beta2", 2.0), "beta2"))
    # ... or one that is not a plain number (step() validates a group again
    # whenever its values or their types change)
    cases.append((lambda: opt.param_groups[0].__setitem__("eps", torch.tensor(1e-30)), "eps"))
    cases.append((lambda: opt.param_groups[0].__setitem__("weight_decay", True),
                  "weight_decay"))
    # a gradient in a dtype the library does not take (allowed by grad_dtype)
    def f64_grad():
        m.fc.bias.grad = None
        m.fc.bias.grad_dtype = torch.float64
        m.fc.bias.grad = torch.ones(m.fc.bias.shape, dtype=torch.float64)
    if HAS_GRAD_DTYPE:  # (older torch refuses such a gradient itself)
        cases.append((f64_grad, "float64"))
    # parameter data swapped to float64 / to another device behind our back
    cases.append((lambda: setattr(m.ln.weight, "data", m.ln.weight.data.double()), "float64"))
    for i, (break_it, word) in enumerate(cases):
        loss_of(m, batches(1, seed=i + 1)[0]).backward()
        hp = dict(opt.param_groups[0])
        break_it()
        snap = snapshot(m, opt)
        with pytest.raises(automagic.AutomagicError) as err:
            opt.step()
        assert word in str(err.value), err.value
        # every gradient is checked before any update: nothing moved
        assert_unchanged(m, opt, snap)
        opt.param_groups[0].clear()
        opt.param_groups[0].update(hp)
        m.fc.bias.grad_dtype = None
        m.ln.weight.data = m.ln.weight.data.float()
        opt.zero_grad()


@pytest.mark.parametrize("value", ["0.9", torch.tensor(0.9), True])
def test_fused_hook_refuses_a_hyperparameter_that_is_not_a_number(value):
    # As step() does (above): a hook took float() of a string or a tensor
    # set on the group after construction and went on with it.
    p = _param(3, 4)
    opt = automagic.Automagic3([p], fused=True)
    (p * 2.0).sum().backward()
    before = (p.detach().clone(), opt.state[p]["lr"].clone(), int(opt.state[p]["step"]))
    opt.param_groups[0]["beta2"] = value
    with pytest.raises(automagic.AutomagicError, match="beta2 must be a number"):
        (p * 2.0).sum().backward()
    assert torch.equal(p.detach(), before[0]) and torch.equal(opt.state[p]["lr"], before[1])
    assert int(opt.state[p]["step"]) == before[2]
    opt.param_groups[0]["beta2"] = 0.9  # a number: accepted
    p.grad = None
    (p * 2.0).sum().backward()
    assert int(opt.state[p]["step"]) == before[2] + 1


def test_lr_schedule_scale_negative_lr_is_refused():
    p = _param(3, 4)
    opt = automagic.Automagic3([p], fused=False, lr_schedule="scale")
    p.grad = torch.ones(3, 4)
    opt.step()
    snap = (p.detach().clone(), {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                 for k, v in opt.state[p].items()})
    opt.param_groups[0]["lr"] = -1.0
    p.grad = torch.ones(3, 4)
    with pytest.raises(automagic.AutomagicError, match="lr_schedule='scale'"):
        opt.step()
    assert torch.equal(p, snap[0])
    assert all(torch.equal(opt.state[p][k], v) if isinstance(v, torch.Tensor)
               else opt.state[p][k] == v for k, v in snap[1].items())


# ------------------------------------------------------- handled correctly
def test_noncontiguous_parameter_and_gradient():
    base = _param(5, 7, seed=3)
    p_t = torch.nn.Parameter(base.detach().t().contiguous().t())   # (5,7), strides (1,5)
    p_c = torch.nn.Parameter(base.detach().clone())
    assert not p_t.is_contiguous()
    o_t = automagic.Automagic3([p_t], fused=False, lr=1e-3)
    o_c = automagic.Automagic3([p_c], fused=False, lr=1e-3)
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        grad = torch.randn(5, 7, generator=g)
        p_t.grad = grad.t().contiguous().t()       # non-contiguous gradient
        p_c.grad = grad.clone()
        o_t.step()
        o_c.step()
    assert torch.equal(p_t, p_c) and p_t.stride() == (1, 5)
    assert o_t.state[p_t].keys() == o_c.state[p_c].keys()
    for k, v in o_c.state[p_c].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(o_t.state[p_t][k], v), k
        else:
            assert o_t.state[p_t][k] == v, k


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misaligned_parameter_and_gradient(fused, dtype):
    # Tensors whose address is not a multiple of their element size
    # (torch.frombuffer at an odd offset): the C update refuses such
    # memory, so they go through a contiguous copy, as strided ones do
    # (step() raised AutomagicError until the twenty-sixth session).
    es = torch.tensor([], dtype=dtype).element_size()
    buf = bytearray(es * 36 + 1)
    p_m = torch.nn.Parameter(torch.frombuffer(buf, dtype=dtype, offset=1, count=35).view(5, 7))
    assert p_m.data_ptr() % es != 0
    p_m.data.copy_(_param(5, 7, seed=5).to(dtype))
    p_a = torch.nn.Parameter(p_m.detach().clone())
    o_m = automagic.Automagic3([p_m], fused=fused, lr=1e-3)
    o_a = automagic.Automagic3([p_a], fused=fused, lr=1e-3)
    g = torch.Generator().manual_seed(6)
    gbuf = bytearray(es * 36 + 1)
    for _ in range(4):
        x = torch.randn(3, 5, generator=g).to(dtype)
        if fused:
            (x @ p_m).float().square().sum().backward()
            (x @ p_a).float().square().sum().backward()
        else:
            grad = torch.randn(5, 7, generator=g).to(dtype)
            gm = torch.frombuffer(gbuf, dtype=dtype, offset=1, count=35).view(5, 7)
            gm.copy_(grad)
            p_m.grad, p_a.grad = gm, grad.clone()
            o_m.step()
            o_a.step()
    assert torch.equal(p_m, p_a) and p_m.data_ptr() % es != 0
    assert torch.equal(o_m.state[p_m]["lr"], o_a.state[p_a]["lr"])


def test_channels_last_conv_fused_equals_contiguous():
    data = batches(3, seed=41)
    m1 = make()
    m2 = copy.deepcopy(m1)
    m2.conv.to(memory_format=torch.channels_last)
    assert not m2.conv.weight.is_contiguous()
    o1 = automagic.Automagic3(m1.parameters())
    o2 = automagic.Automagic3(m2.parameters())
    for b in data:
        loss_of(m1, b).backward()
        loss_of(m2, b).backward()
    assert m2.conv.weight.is_contiguous(memory_format=torch.channels_last)
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        # conv's gradient may be summed in another order in channels_last
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-8, msg=n)
        assert o2.state[q]["step"] == 3


@needs_grad_dtype
@pytest.mark.parametrize("pdtype, gdtype", [(torch.bfloat16, torch.float32),
                                            (torch.float32, torch.float16),
                                            (torch.float16, torch.bfloat16)])
def test_gradient_dtype_differs_from_parameter(pdtype, gdtype):
    # torch allows it through Tensor.grad_dtype; the library converts any of
    # its three dtypes to float32, so the result equals the same values given
    # in the parameter's dtype.
    p1, p2 = _param(4, 6, dtype=pdtype, seed=5), _param(4, 6, dtype=pdtype, seed=5)
    p1.grad_dtype = gdtype
    o1 = automagic.Automagic3([p1], fused=False, seed=2)
    o2 = automagic.Automagic3([p2], fused=False, seed=2)
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        grad = torch.randn(4, 6, generator=g).to(gdtype).to(pdtype).to(gdtype)
        p1.grad = grad
        p2.grad = grad.to(pdtype)
        o1.step()
        o2.step()
    assert torch.equal(p1, p2)


def test_mixed_parameter_dtypes_in_one_group():
    p = [_param(3, 4, dtype=d, seed=i)
         for i, d in enumerate((torch.float32, torch.bfloat16, torch.float16))]
    opt = automagic.Automagic3(p, fused=False, lr=1e-3)
    before = [q.detach().clone() for q in p]
    for q in p:
        q.grad = torch.ones_like(q)
    opt.step()
    for q, b in zip(p, before):
        assert q.dtype == b.dtype and not torch.equal(q, b)
        assert opt.state[q]["lr"].dtype == torch.float32


def test_empty_and_scalar_parameters():
    empty, scalar = _param(3, 0), _param()
    opt = automagic.Automagic3([empty, scalar], fused=False, lr=1e-3)
    empty.grad, scalar.grad = torch.zeros(3, 0), torch.tensor(2.0)
    s0 = scalar.detach().clone()
    opt.step()
    assert empty.shape == (3, 0) and scalar.item() != s0.item()
    assert opt.state[scalar]["step"] == 1


@pytest.mark.parametrize("fused", [False, True])
def test_params_without_requires_grad_are_left_alone(fused):
    m = make()
    for p in m.conv.parameters():
        p.requires_grad_(False)
    opt = automagic.Automagic3(m.parameters(), fused=fused)
    frozen = [p.detach().clone() for p in m.conv.parameters()]
    for b in batches(2):
        loss_of(m, b).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(m.conv.parameters(), frozen))
    assert all(p not in opt.state for p in m.conv.parameters())
    assert opt.state[m.fc.weight]["step"] == 2


# ------------------------------------------- state that no longer fits the parameter
def _one_step(p, opt):
    (p.float() ** 2).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("change", ["reshape", "grow", "state_dtype", "state_shape"])
def test_state_that_does_not_fit_the_parameter_is_refused(fused, change):
    # p.data given another shape, or a state tensor replaced, after the first
    # update: the C library was handed buffers smaller than it writes (heap
    # corruption: aborts, segfaults, or a silent skip). Now a clear error,
    # nothing changed.
    p = _param(10, 8)
    opt = automagic.Automagic3([p], fused=fused)
    _one_step(p, opt)
    st = opt.state[p]
    if change == "reshape":
        p.data = torch.randn(12, 9)
    elif change == "grow":
        p.data = torch.randn(4096, 64)
    elif change == "state_dtype":
        st["exp_avg_sq_row"] = st["exp_avg_sq_row"].bfloat16()
    else:
        st["lr"] = torch.full((20,), 1e-6)
    before = p.detach().clone()
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
    with pytest.raises(automagic.AutomagicError, match="state of a parameter"):
        (p.float() ** 2).sum().backward()
        opt.step()
    assert torch.equal(p.detach(), before)
    for k, v in saved.items():
        now = opt.state[p][k]
        assert (torch.equal(now, v) and now.dtype == v.dtype) if isinstance(v, torch.Tensor) \
            else now == v, k


@pytest.mark.parametrize("fused", [True, False])
def test_parameter_replaced_by_an_expanded_tensor_is_refused(fused):
    # the update of a non-contiguous parameter goes to a copy that is copied
    # back; for an expanded one that copy_ failed after the state was
    # committed (step and moments advanced, parameter not)
    p = _param(3, 4)
    opt = automagic.Automagic3([p], fused=fused)
    _one_step(p, opt)
    p.data = torch.randn(1, 4).expand(3, 4)
    snap = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
    with pytest.raises(automagic.AutomagicError, match="share memory"):
        (p.float() ** 2).sum().backward()
        opt.step()
    assert opt.state[p]["step"] == snap["step"] == 1
    assert torch.equal(opt.state[p]["exp_avg_sq_row"], snap["exp_avg_sq_row"])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("lr", ["1e-4", None, [1e-4]])
def test_group_lr_that_is_not_a_number_is_named(fused, lr):
    p = _param(3, 4)
    opt = automagic.Automagic3([p], fused=fused)
    opt.param_groups[0]["lr"] = lr
    with pytest.raises(automagic.AutomagicError, match=r"group\['lr'\] must be a number"):
        (p ** 2).sum().backward()
        opt.step()
    assert opt.state.get(p, {}) == {}


@pytest.mark.parametrize("fused", [True, False])
def test_state_replaced_where_the_old_one_was_is_refused(fused):
    # the plan knows state tensors by address: a smaller replacement
    # allocated where the freed one was passed unchecked and was written past
    # its end (glibc aborted). The plan now holds the tensors it points at,
    # so the old memory cannot be reused before the check.
    p = _param(1000, 4)
    opt = automagic.Automagic3([p], fused=fused)
    _one_step(p, opt)
    st = opt.state[p]
    del st["lr"]
    st["lr"] = torch.full((900,), 1e-6)
    before = p.detach().clone()
    with pytest.raises(automagic.AutomagicError, match="state of a parameter"):
        (p.float() ** 2).sum().backward()
        opt.step()
    assert torch.equal(p.detach(), before)


def _two(fused=False, **kw):
    """A module of two small linear maps, one step taken."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    opt = automagic.Automagic3(m.parameters(), fused=fused, **kw)
    m(torch.randn(6, 5)).square().mean().backward()
    if not fused:
        opt.step()
    return m, opt


@pytest.mark.parametrize("key, value", [("nonfinite_skips", None),
                                        ("skipped_by_param", {"a": 1}),
                                        ("micro_step", "x"), ("deferred", [None]),
                                        ("deferred", [99]), ("nonfinite_skips", -1),
                                        # truncated, read per character or an
                                        # OverflowError/RuntimeError before
                                        ("nonfinite_skips", 1.7),
                                        ("nonfinite_skips", float("inf")),
                                        ("skipped_by_param", {0: float("inf")}),
                                        ("micro_step", True), ("deferred", "0"),
                                        ("deferred", [1.9]),
                                        ("passes", torch.tensor([1, 2])),
                                        ("window_fired", [torch.tensor(True)]),
                                        # (a negative count of passes: mutation
                                        # test, thirty-eighth session)
                                        ("passes", -1)])
def test_load_bad_bookkeeping_changes_nothing(key, value):
    # these were converted after the groups and the state had been replaced
    from automagic._checkpoint import CheckpointError
    m, opt = _two()
    sd = copy.deepcopy(opt.state_dict())
    m(torch.randn(6, 5)).square().mean().backward()
    opt.step()
    snap = snapshot(m, opt)
    sd["automagic"][key] = value
    with pytest.raises(CheckpointError, match="'automagic' entry"):
        opt.load_state_dict(sd)
    assert_unchanged(m, opt, snap)


@pytest.mark.parametrize("step", [float("inf"), torch.tensor(float("inf")), torch.tensor(True),
                                  2.5, "3", torch.tensor([1, 2])])
def test_load_bad_step_changes_nothing(step):
    # inf raised OverflowError, a bool tensor loaded as step 1
    _load_refused(lambda sd: sd["state"][0].update(step=step), "step must be an integer")


def _load_refused(mutate, match):
    """A dict of _two()'s, changed by mutate, is refused with match and
    changes nothing."""
    from automagic._checkpoint import CheckpointError
    m, opt = _two()
    sd = copy.deepcopy(opt.state_dict())
    mutate(sd)
    snap = snapshot(m, opt)
    with pytest.raises(CheckpointError, match=match):
        opt.load_state_dict(sd)
    assert_unchanged(m, opt, snap)


def test_load_accepts_json_keys_and_numpy_counts():
    # what the stricter parsing must still take: a JSON round trip's string
    # keys, numpy scalars and 0-d arrays (a review of this session's changes)
    import numpy as np
    m, opt = _two()
    sd = copy.deepcopy(opt.state_dict())
    sd["automagic"]["skipped_by_param"] = {"1": 2}
    sd["automagic"]["nonfinite_skips"] = np.int64(2)
    sd["automagic"]["micro_step"] = np.array(0)
    sd["state"][0]["step"] = np.float32(1.0)
    opt.load_state_dict(sd)
    assert opt.nonfinite_skips == 2 and opt._skipped == {1: 2}
    assert opt.state[m[0].weight]["step"] == 1


def test_load_refuses_a_huge_integer_scheduler_lr():
    # math.isfinite(10**400) raised OverflowError
    _load_refused(lambda sd: sd["param_groups"][0].update(initial_lr=1e-6, lr=10 ** 400),
                  "must be a finite number")


def test_load_seed_of_several_values_warns():
    # a tensor of two seeds raised RuntimeError ("Boolean value of Tensor ...")
    m, opt = _two()
    sd = copy.deepcopy(opt.state_dict())
    sd["automagic"]["seed"] = torch.tensor([1, 2])
    with pytest.warns(UserWarning, match="saved with seed"):
        opt.load_state_dict(sd)


def test_loaded_state_that_requires_grad_is_a_leaf():
    # a state tensor with requires_grad=True was copied with its autograd
    # history: deepcopy(opt) and deepcopy(opt.state_dict()) then failed
    m, opt = _two()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["lr"] = sd["state"][0]["lr"].clone().requires_grad_(True)
    sd["state"][0]["exp_avg_sq_row"] = sd["state"][0]["exp_avg_sq_row"].clone().requires_grad_()
    opt.load_state_dict(sd)
    st = opt.state[m[0].weight]
    assert not st["lr"].requires_grad and st["lr"].grad_fn is None
    assert not st["exp_avg_sq_row"].requires_grad
    copy.deepcopy(opt)
    copy.deepcopy(opt.state_dict())


def test_load_refuses_a_nan_scheduler_lr():
    # restored with its initial_lr, a NaN lr made every later new row fail
    from automagic._checkpoint import CheckpointError
    m, opt = _two()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["initial_lr"] = 1e-6
    sd["param_groups"][0]["lr"] = float("nan")
    snap = snapshot(m, opt)
    with pytest.raises(CheckpointError, match="saved lr nan"):
        opt.load_state_dict(sd)
    assert_unchanged(m, opt, snap)


def test_refused_start_lr_leaves_no_half_state():
    # the state got {'step': 0} before the start lr was refused, and every
    # later step() failed on the missing 'lr'
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = automagic.Automagic3([p], fused=False)
    opt.param_groups[0]["lr"] = -1.0
    p.grad = torch.randn(3, 4)
    with pytest.warns(UserWarning), pytest.raises(automagic.AutomagicError, match="lr"):
        opt.step()
    assert not opt.state.get(p)
    opt.param_groups[0]["lr"] = 1e-6
    opt.step()
    assert opt.state[p]["step"] == 1


@pytest.mark.parametrize("copied", [False, True])
def test_refused_start_lr_leaves_no_empty_state_entry(copied):
    # a start lr refused at the first update of a batch left an empty {} for
    # the first parameter in opt.state and state_dict() (with a parameter
    # updated through a copy in the batch too since 36bbd5c: its precheck
    # came before the preparation there)
    ps = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(4, 6)),
          torch.nn.Parameter(torch.randn(3, 3))]
    opt = automagic.Automagic3(ps, fused=False, lr_schedule="ignore")
    opt.param_groups[0]["lr"] = -1.0
    ps[0].grad = torch.randn(5, 7)
    ps[1].grad = torch.randn(6, 4).t() if copied else torch.randn(4, 6)
    ps[2].grad = torch.randn(3, 3)
    with pytest.warns(UserWarning), pytest.raises(automagic.AutomagicError, match="lr"):
        opt.step()
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
    assert all(p.grad is not None for p in ps)
    opt.param_groups[0]["lr"] = 1e-6
    opt.step()
    assert [opt.state[p]["step"] for p in ps] == [1, 1, 1]


@pytest.mark.parametrize("kw", [dict(lr_schedule="scale"), dict(nonfinite="raise"),
                                dict(batch_updates=None)])
def test_refused_second_parameter_changes_nothing(kw):
    # the second parameter's state no longer fits p.data: under "scale" the
    # first one's lrs were left scaled (once more per retry); one at a time
    # (nonfinite="raise", batch_updates=False) the first was updated before
    # the second was refused, though the message said nothing was
    batch_off = kw.pop("batch_updates", 1) is None
    m, opt = _two(**kw)
    if batch_off:
        opt.batch_updates = False
    if "lr_schedule" in kw:
        opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.5
    w = m[1].weight
    w.data = torch.randn(5, 4)  # its state is for (3, 4)
    m[1].bias.data = torch.randn(5)
    m(torch.randn(6, 5))  # (forward no longer matches: set the gradients by hand)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    snap = snapshot(m, opt)
    for _ in range(2):
        with pytest.raises(automagic.AutomagicError, match="Nothing was updated"):
            opt.step()
        assert_unchanged(m, opt, snap)


def test_fused_queue_updates_the_others_when_one_is_refused():
    # a queued parameter refused in the batch's preparation stopped the
    # others of its batch; now they are updated, then the error is raised
    m, opt = _two(fused=True)
    m(torch.randn(6, 5)).square().mean().backward()  # a step the callback closed
    m[1].weight.data = torch.randn(5, 4)
    before = [p.detach().clone() for p in m.parameters()]
    x = torch.randn(6, 5)
    h = torch.tanh(m[0](x))
    loss = (h.sum(1, keepdim=True) * m[1].weight.sum() + m[1].bias.sum()).mean()
    with pytest.raises(automagic.AutomagicError, match="Nothing was updated"):
        loss.backward()
    ps = list(m.parameters())
    assert m[1].weight.grad is not None and torch.equal(m[1].weight.detach(), before[2])
    for i in (0, 1, 3):
        assert not torch.equal(ps[i].detach(), before[i]), i
        assert ps[i].grad is None, i


def test_own_state_dict_loads_after_a_parameter_left_its_group():
    # indices are never renumbered: a skip counted for index 2 while only
    # two parameters are listed is valid (the first bound refused it)
    ps = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    opt = automagic.Automagic3(ps, fused=False)
    for p in ps[1:]:
        p.grad = torch.randn(4, 4)
    ps[2].grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning):
        opt.step()
    opt.zero_grad()
    del opt.param_groups[0]["params"][0]
    opt.load_state_dict(opt.state_dict())
    assert opt._skipped == {2: 1}


def test_one_at_a_time_refused_start_lr_changes_nothing():
    # a parameter without state refused at its start lr (a NaN group lr)
    # after another had been updated, one at a time
    a = torch.nn.Parameter(torch.randn(3, 4))
    opt = automagic.Automagic3([a], fused=False, nonfinite="raise")
    a.grad = torch.randn(3, 4)
    opt.step()
    b = torch.nn.Parameter(torch.randn(5))
    opt.add_param_group({"params": [b], "lr": 1e-6})
    opt.param_groups[1]["lr"] = float("nan")
    a.grad, b.grad = torch.randn(3, 4), torch.randn(5)
    a0 = a.detach().clone()
    with pytest.warns(UserWarning), pytest.raises(automagic.AutomagicError, match="start"):
        opt.step()
    assert torch.equal(a.detach(), a0) and opt.state[a]["step"] == 1 and a.grad is not None


def test_numpy_and_fraction_hyperparameters_are_numbers():
    # numpy float32 values are not floats (np.float64 is): the reference and
    # torch.optim take them, from a constructor or a numpy-based schedule
    import fractions

    import numpy as np
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(8, 5)), torch.nn.Parameter(torch.randn(5))]
    ref = [p.detach().clone().requires_grad_() for p in ps]
    opt = automagic.Automagic3(ps, lr=np.float32(1e-4), weight_decay=np.float32(0.01),
                               beta2=fractions.Fraction(999, 1000), fused=False)
    # stored as floats: the state_dict loads under weights_only=True (a
    # group value a script sets later stays what it sets, as in torch.optim)
    import io
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)
    twin = automagic.Automagic3(ref, lr=float(np.float32(1e-4)),
                                weight_decay=float(np.float32(0.01)), beta2=0.999, fused=False)
    for o, qs in ((opt, ps), (twin, ref)):
        for step in range(3):
            for q in qs:
                q.grad = torch.full_like(q, 1e-3 * (step + 1))
            o.param_groups[0]["lr"] = np.float32(1e-4) if o is opt else float(np.float32(1e-4))
            o.step()
    for a, b in zip(ps, ref):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="weight_decay"):
        automagic.Automagic3(ps, weight_decay=np.bool_(True))
    with pytest.raises(TypeError, match="lr"):
        automagic.Automagic3(ps, lr=True)


def test_a_float32_tensor_lr_equal_to_the_start_lr_does_not_warn():
    # OneCycleLR on a one-element tensor lr writes its start value into the
    # tensor (float32) and into initial_lr (float64): "group['lr'] changed
    # from 4e-05 to 4e-05" was warned at the first step
    import warnings
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = automagic.Automagic3([p], lr=torch.tensor(1e-4), fused=False)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=10,
                                        cycle_momentum=False)
    assert float(opt.param_groups[0]["lr"]) != opt.param_groups[0]["initial_lr"]
    p.grad = torch.ones_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # (OneCycleLR's min_lr/max_lr over the clamps: warned about apart)
        warnings.filterwarnings("ignore", message=r"Automagic3: group\['min_lr'\]")
        opt.step()
    opt.param_groups[0]["lr"].fill_(2e-5)  # a real change still warns
    p.grad = torch.ones_like(p)
    with pytest.warns(UserWarning, match="changed from"):
        opt.step()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name,bad", [("weight_decay", "0.0"), ("clip_threshold", "1.0"),
                                      ("clip_threshold", True)])
def test_a_string_or_bool_equal_in_value_is_refused_in_both_modes(fused, name, bad):
    """Fused mode's hooks took a string or a bool whose float() equals the
    value before (step mode refused it); found by a randomized review."""
    w = torch.nn.Parameter(torch.ones(3, 4))
    opt = automagic.Automagic3([w], lr=1e-3, fused=fused)
    (w * 2).sum().backward()
    if not fused:
        opt.step()
    before = w.detach().clone()
    opt.param_groups[0][name] = bad
    with pytest.raises(automagic.AutomagicError, match="%s must be a number" % name):
        (w * 2).sum().backward()
        opt.step()
    assert torch.equal(w.detach(), before)


@pytest.mark.parametrize("fused", [False, True])
def test_scale_schedule_names_a_bad_max_lr(fused):
    w = torch.nn.Parameter(torch.ones(3, 4))
    opt = automagic.Automagic3([w], lr=1e-4, fused=fused, lr_schedule="scale")
    opt.param_groups[0]["max_lr"] = "x0.01"
    with pytest.raises(automagic.AutomagicError, match="max_lr must be a number"):
        (w * 2).sum().backward()
        opt.step()


@pytest.mark.parametrize("fused", [False, True])
def test_a_refused_first_update_makes_no_state(fused):
    """A NaN hyperparameter (fused mode: found in the C update, after the
    state was made) or a later parameter's bad state tensor (step mode's
    batch) left a state made at the group's lr of that moment, where the
    rows then started for good; found by a randomized review."""
    a = torch.nn.Parameter(torch.ones(5))
    b = torch.nn.Parameter(torch.ones(3, 4))
    opt = automagic.Automagic3([a, b], lr=1e-4, fused=fused)
    if fused:
        opt.param_groups[0]["weight_decay"] = float("nan")
        with pytest.raises(automagic.AutomagicError, match="weight_decay"):
            (a.sum() + b.sum()).backward()
    else:
        b.grad = torch.ones(3, 4)
        opt.step()  # b has state now, a none
        opt.state[b]["exp_avg_sq_col"] = torch.zeros(7)
        a.grad, b.grad = torch.ones(5), torch.ones(3, 4)
        with pytest.raises(automagic.AutomagicError, match="exp_avg_sq_col"):
            opt.step()
    assert not opt.state.get(a)
    if fused:  # (whichever hook ran first)
        assert not opt.state.get(b)


@pytest.mark.parametrize("fused", [True, False])
def test_lazy_module_parameters_are_refused_clearly(fused):
    # an nn.LazyLinear's parameters before its first forward: torch's own
    # error about their shape pointed at load_state_dict (found by a review,
    # twenty-fifth session)
    m = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="uninitialized.*forward pass"):
        automagic.Automagic3(m.parameters(), fused=fused)
    m(torch.randn(1, 3))
    opt = automagic.Automagic3(m.parameters(), fused=fused)
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert all(opt.state[p]["step"] == 1 for p in m.parameters())


@pytest.mark.parametrize("one_at_a_time", ["batch_updates", "nonfinite"])
def test_bad_hyperparameter_of_a_later_group_leaves_the_earlier_unchanged(one_at_a_time):
    # step() validates every group before anything is updated, also a group
    # of plain numbers it validated at an earlier step (its values are
    # cached): checked only on the first sight, one update at a time updated
    # the first group's parameters before the second's beta2 was refused
    # (a mutation test, thirty-eighth session)
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))
    opt = automagic.Automagic3([{"params": [a]}, {"params": [b]}], fused=False,
                               nonfinite="raise" if one_at_a_time == "nonfinite" else "skip")
    opt.batch_updates = one_at_a_time != "batch_updates"
    a.grad, b.grad = torch.randn(3, 4), torch.randn(5)
    opt.step()
    opt.param_groups[1]["beta2"] = 2.0
    a.grad, b.grad = torch.randn(3, 4), torch.randn(5)
    a0, lr0 = a.detach().clone(), opt.state[a]["lr"].clone()
    with pytest.raises(automagic.AutomagicError, match="beta2"):
        opt.step()
    assert torch.equal(a.detach(), a0) and torch.equal(opt.state[a]["lr"], lr0)
    assert opt.state[a]["step"] == 1 and a.grad is not None


def test_batch_fallback_under_scale_restores_the_scaled_lrs_first():
    # a batch refused whole (a gradient over its own state: shared memory)
    # runs one at a time; under lr_schedule="scale" the lrs the refused
    # batch had scaled must go back first: each update scales them again
    # (mutation test, thirty-eighth session)
    torch.manual_seed(0)
    p1, p2 = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    twin = torch.nn.Parameter(p1.detach().clone())
    opt = automagic.Automagic3([p1, p2], fused=False, lr_schedule="scale")
    ref = automagic.Automagic3([twin], fused=False, lr_schedule="scale")
    g = torch.randn(8)
    p1.grad, twin.grad, p2.grad = g.clone(), g.clone(), torch.randn(8)
    opt.step()
    ref.step()
    for o in (opt, ref):
        o.param_groups[0]["lr"] = o.param_groups[0]["lr"] * 0.5
    lr2 = opt.state[p2]["lr"].clone()
    g = torch.randn(8)
    p1.grad, twin.grad = g.clone(), g.clone()
    p2.grad = opt.state[p2]["exp_avg_sq"]  # over p2's own state: the batch is refused
    with pytest.raises(automagic.AutomagicError, match="share memory"):
        opt.step()
    ref.step()
    assert torch.equal(p1.detach(), twin.detach())
    assert torch.equal(opt.state[p1]["lr"], ref.state[twin]["lr"])
    assert torch.equal(opt.state[p2]["lr"], lr2)  # the refused one's lrs as they were


def test_gradient_of_another_shape_is_refused():
    # p.data given another shape (the same number of elements) after its
    # gradient was set: the gradient's shape no longer matches, and the
    # update read it as if it had p's shape (mutation test, thirty-eighth
    # session)
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = automagic.Automagic3([p], fused=False)
    p.grad = torch.ones(3, 4)
    p.data = torch.randn(4, 3)
    p0 = p.detach().clone()
    with pytest.raises(automagic.AutomagicError, match="gradient shape"):
        opt.step()
    assert torch.equal(p.detach(), p0) and not opt.state.get(p) and p.grad is not None


def test_state_tensor_replaced_by_a_strided_view_is_refused():
    # a state tensor of the right shape and dtype that is not contiguous
    # (a view with a stride): the C update writes it as contiguous memory,
    # other elements than the tensor's (mutation test, thirty-eighth session)
    p = torch.nn.Parameter(torch.randn(4, 6))
    opt = automagic.Automagic3([p], fused=False)
    p.grad = torch.randn(4, 6)
    opt.step()
    st = opt.state[p]
    st["lr"] = torch.full((8,), 1e-6)[::2]  # shape (4,), stride 2
    lr0, p0 = st["lr"].clone(), p.detach().clone()
    p.grad = torch.randn(4, 6)
    with pytest.raises(automagic.AutomagicError, match="not contiguous"):
        opt.step()
    assert torch.equal(p.detach(), p0) and torch.equal(st["lr"], lr0) and st["step"] == 1


def test_several_refused_in_the_batch_fallback_raise_the_first_error():
    # a batch refused whole runs one at a time; where several are refused
    # the first one's error is raised after the others ran, as one batch
    # does (the last one's was; mutation test, thirty-eighth session)
    torch.manual_seed(0)
    p1, p2, p3 = (torch.nn.Parameter(torch.randn(n)) for n in (8, 5, 6))
    opt = automagic.Automagic3([p1, p2, p3], fused=False)
    for p in (p1, p2, p3):
        p.grad = torch.randn_like(p)
    opt.step()
    p1.grad, p3.grad = opt.state[p1]["exp_avg_sq"], opt.state[p3]["exp_avg_sq"]
    p2.grad = torch.randn(5)
    with pytest.raises(automagic.AutomagicError, match=r"shape \(8,\)"):
        opt.step()
    assert opt.state[p2]["step"] == 2 and p2.grad is None  # the other one ran
