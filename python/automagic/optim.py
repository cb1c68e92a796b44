"""automagic.Automagic3: the PyTorch front end of libautomagic.

A drop-in for the reference ``Automagic3`` class (same constructor names and
defaults, same state keys where the meaning is the same). Each update runs in
C on the tensors' memory; state lives in ``opt.state[p]`` as torch tensors.
"""
import ctypes
import threading
import warnings
from typing import List

import torch

from . import _lib

_DTYPES = {torch.float32: _lib.DTYPE_FLOAT32, torch.bfloat16: _lib.DTYPE_BFLOAT16,
           torch.float16: _lib.DTYPE_FLOAT16}

# hp.lr is validated by C but not used by an update (the per-row lrs live in
# the state), so every call passes this valid constant.
_PLACEHOLDER_LR = 1e-6


class AutomagicError(RuntimeError):
    """Raised when libautomagic refuses an update (the message says why)."""


def _shape(t: torch.Tensor) -> _lib.Shape:
    s = _lib.Shape()
    s.ndim = t.dim()
    for i, d in enumerate(t.shape):
        s.dims[i] = d
    return s


def _hparams(group: dict) -> _lib.HParams:
    hp = _lib.HParams()
    for name in _lib.HPARAM_NAMES:
        setattr(hp, name, float(group[name]))
    hp.lr = _PLACEHOLDER_LR
    return hp


def _validate_group(group: dict) -> None:
    for name in _lib.HPARAM_NAMES:
        v = group[name]
        if isinstance(v, torch.Tensor) or not isinstance(v, (int, float)):
            raise TypeError("Automagic3: %s must be a number, got %r" % (name, v))
    hp = _hparams(group)
    hp.lr = float(group["lr"])
    _lib.clear_message()
    status = _lib.lib.am_hparams_validate(ctypes.byref(hp))
    if status != _lib.OK:
        raise ValueError("Automagic3: " + (_lib.last_message() or _lib.status_string(status)))


class Automagic3(torch.optim.Optimizer):
    """Automagic3 with the update computed by libautomagic.

    Arguments as in the reference, plus:
      seed:  keys the stochastic rounding of bfloat16/float16 parameters
             (with the parameter's index and step: reproducible whatever the
             thread count).
      fused: True (default) updates each parameter inside backward the moment
             its gradient is accumulated, like the reference, and ``step()``
             does nothing; False leaves gradients to ``step()``.
    """

    def __init__(self, params, lr: float = 1e-6, min_lr: float = 1e-8,
                 max_lr: float = 1e-2, lr_bump_rate: float = 0.1,
                 beta2: float = 0.999, eps: float = 1e-30,
                 clip_threshold: float = 1.0, weight_decay: float = 0.0, *,
                 seed: int = 0, fused: bool = True):
        if not isinstance(lr, (int, float)) or isinstance(lr, bool):
            raise TypeError("Automagic3: lr must be a number, got %r" % (lr,))
        if lr > 1e-3:
            warnings.warn("Automagic3: start lr %g is very high; forcing to 1e-6 "
                          "(as the reference does)" % lr, stacklevel=2)
            lr = 1e-6
        if not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
            raise ValueError("Automagic3: seed must be an int in [0, 2**64), got %r" % (seed,))
        self.seed = seed
        self.fused = bool(fused)
        self.nonfinite_skips = 0
        self._hook_handles = []
        self._param_ids = {}
        self._warned_nonfinite = False
        self._tls = threading.local()
        defaults = dict(lr=lr, min_lr=min_lr, max_lr=max_lr, lr_bump_rate=lr_bump_rate,
                        beta2=beta2, eps=eps, clip_threshold=clip_threshold,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)

    # ----------------------------------------------------------- groups
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate_group(group)
        for p in group["params"]:
            self._param_ids[p] = len(self._param_ids)
            if self.fused and p.requires_grad:
                self._hook_handles.append(
                    p.register_post_accumulate_grad_hook(self._make_hook(group)))

    def _make_hook(self, group):
        def _hook(p: torch.Tensor) -> None:
            self._update_param(p, group)
        return _hook

    # ------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        sizes = _lib.StateSizes()
        shape = _shape(p)
        status = _lib.lib.am_state_get_sizes(ctypes.byref(shape), ctypes.byref(sizes))
        if status != _lib.OK:
            raise ValueError("Automagic3: parameter of shape %s: %s"
                             % (tuple(p.shape), _lib.last_message()))
        f32 = dict(dtype=torch.float32, device=p.device)
        state = self.state[p]
        state["step"] = 0
        lr_shape = (p.shape[0],) if p.dim() >= 2 else p.shape
        state["lr"] = torch.full(lr_shape, float(group["lr"]), **f32)
        state["polarity"] = torch.zeros(sizes.polarity_bytes, dtype=torch.uint8,
                                        device=p.device)
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = torch.zeros(p.shape[:-1], **f32)
            state["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], **f32)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, **f32)
        return state

    def _workspace(self, nbytes: int) -> torch.Tensor:
        ws = getattr(self._tls, "ws", None)
        if ws is None or ws.numel() < nbytes:
            ws = torch.empty(max(nbytes, 4096), dtype=torch.uint8)
            self._tls.ws = ws
        return ws

    # ----------------------------------------------------------- update
    def _check(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        if p.device.type != "cpu":
            raise AutomagicError(
                "Automagic3: parameter on device '%s' is not supported yet; "
                "libautomagic's PyTorch front end takes CPU tensors" % p.device)
        if grad.is_sparse:
            raise AutomagicError("Automagic3 does not support sparse gradients.")
        if p.dtype not in _DTYPES:
            raise AutomagicError("Automagic3: parameter dtype %s is not supported "
                                 "(float32, bfloat16, float16)" % p.dtype)
        if grad.dtype not in _DTYPES:
            raise AutomagicError("Automagic3: gradient dtype %s is not supported "
                                 "(float32, bfloat16, float16)" % grad.dtype)
        if grad.shape != p.shape:
            raise AutomagicError("Automagic3: gradient shape %s differs from the "
                                 "parameter's %s" % (tuple(grad.shape), tuple(p.shape)))
        if p.dim() > _lib.AM_MAX_DIMS:
            raise AutomagicError("Automagic3: %d-D parameters are not supported "
                                 "(at most %d dims)" % (p.dim(), _lib.AM_MAX_DIMS))

    @torch.no_grad()
    def _update_param(self, p: torch.Tensor, group: dict) -> None:
        if p.grad is None:
            return
        grad = p.grad
        self._check(p, grad)
        state = self.state[p]
        if len(state) == 0:
            state = self._init_state(p, group)
        grad = grad.contiguous()
        target = p if p.is_contiguous() else p.contiguous()

        pt = _lib.Tensor(target.data_ptr(), _DTYPES[p.dtype], _shape(p))
        gt = _lib.Tensor(grad.data_ptr(), _DTYPES[grad.dtype], _shape(p))
        st = _lib.State()
        st.lr = state["lr"].data_ptr()
        st.polarity = state["polarity"].data_ptr()
        if p.dim() >= 2:
            st.row = state["exp_avg_sq_row"].data_ptr()
            st.col = state["exp_avg_sq_col"].data_ptr()
        else:
            st.sq = state["exp_avg_sq"].data_ptr()
        st.step = int(state["step"])
        sizes = _lib.StateSizes()
        _lib.lib.am_state_get_sizes(ctypes.byref(pt.shape), ctypes.byref(sizes))
        ws = self._workspace(sizes.workspace_bytes)
        hp = _hparams(group)
        key = _lib.RngKey(self.seed, self._param_ids[p] & 0xFFFFFFFF)
        rep = _lib.Report()
        _lib.lib.am_set_num_threads(torch.get_num_threads())
        _lib.clear_message()
        status = _lib.lib.am_update(ctypes.byref(pt), ctypes.byref(gt), ctypes.byref(st),
                                    ctypes.byref(hp), key, ws.data_ptr(), ws.numel(),
                                    ctypes.byref(rep))
        if status < 0:
            raise AutomagicError("Automagic3: update of a parameter of shape %s failed: %s"
                                 % (tuple(p.shape), _lib.last_message()
                                    or _lib.status_string(status)))
        if status == _lib.OK:
            state["step"] = st.step
            if target is not p:
                p.copy_(target)
        else:
            self.nonfinite_skips += 1
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                warnings.warn("Automagic3: %s for a parameter of shape %s; its update "
                              "was skipped and it is unchanged (counted in "
                              "nonfinite_skips; warned once)"
                              % (_lib.status_string(status), tuple(p.shape)),
                              RuntimeWarning, stacklevel=2)
        p.grad = None

    # ------------------------------------------------------ optimizer API
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.fused:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update_param(p, group)
        return loss

    def get_learning_rates(self) -> List[float]:
        out = []
        for group in self.param_groups:
            lrs = [float(self.state[p]["lr"].mean()) for p in group["params"]
                   if p in self.state and "lr" in self.state[p]]
            out.append(sum(lrs) / len(lrs) if lrs else float(group["lr"]))
        return out

    def get_avg_learning_rate(self) -> float:
        lrs = self.get_learning_rates()
        return sum(lrs) / len(lrs) if lrs else float(self.defaults["lr"])

    def remove_hooks(self) -> None:
        """Removes the backward hooks (fused mode stops updating)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
