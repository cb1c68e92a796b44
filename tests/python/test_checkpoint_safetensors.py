"""A C optimizer checkpoint is a safetensors file: Python's safetensors package
opens it, and the tensors and metadata it reads are the optimizer's state.

The C optimizer object is driven through ctypes on the library shipped in the
automagic package (declarations below mirror include/automagic.h).
"""
import ctypes

import numpy as np
import pytest

safetensors = pytest.importorskip(
    "safetensors", reason="the safetensors package is not installed "
    "(scripts/setup_env.sh installs it)")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from automagic import _lib  # noqa: E402

lib = _lib.lib
_P = ctypes.POINTER
lib.am_hparams_default.restype = _lib.HParams
lib.am_optimizer_create.argtypes = [_P(_lib.HParams), ctypes.c_uint64,
                                    _P(ctypes.c_void_p)]
lib.am_optimizer_destroy.argtypes = [ctypes.c_void_p]
lib.am_optimizer_add_param.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int32, _P(ctypes.c_int64),
                                       _P(ctypes.c_int32)]
lib.am_optimizer_update_param.argtypes = [ctypes.c_void_p, ctypes.c_int32,
                                          ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
lib.am_optimizer_get_state.argtypes = [ctypes.c_void_p, ctypes.c_int32,
                                       _P(_lib.State), _P(_lib.Shape)]
lib.am_optimizer_save.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
lib.am_optimizer_load.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

SHAPES = [(), (13,), (3, 10), (2, 3, 5), (0, 4), (2, 1, 3, 3)]


def _state_sizes(shape):
    s = _lib.Shape()
    s.ndim = len(shape)
    for i, d in enumerate(shape):
        s.dims[i] = d
    z = _lib.StateSizes()
    assert lib.am_state_get_sizes(ctypes.byref(s), ctypes.byref(z)) == 0
    return z


def _array(ptr, count, ctype, dtype, shape):
    if count == 0:
        return np.zeros(shape, dtype)
    buf = ctypes.cast(ptr, _P(ctype * count)).contents
    return np.frombuffer(buf, dtype=dtype).reshape(shape).copy()


@pytest.fixture
def trained():
    """A C optimizer over SHAPES (float32), trained 4 steps with one skip."""
    hp = lib.am_hparams_default()
    hp.lr = 1e-3
    hp.weight_decay = 0.01
    opt = ctypes.c_void_p()
    assert lib.am_optimizer_create(ctypes.byref(hp), 1234, ctypes.byref(opt)) == 0
    rng = np.random.default_rng(0)
    params = []
    for shape in SHAPES:
        w = rng.standard_normal(shape).astype(np.float32)
        params.append(w)
        dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        pid = ctypes.c_int32()
        assert lib.am_optimizer_add_param(opt, w.ctypes.data, _lib.DTYPE_FLOAT32,
                                          len(shape), dims, ctypes.byref(pid)) == 0
    for step in range(4):
        for i, shape in enumerate(SHAPES):
            g = rng.standard_normal(shape).astype(np.float32)
            if step == 2 and i == 1:
                g[0] = np.inf
            st = lib.am_optimizer_update_param(opt, i, g.ctypes.data,
                                               _lib.DTYPE_FLOAT32, None)
            assert st in (0, 1)
    yield opt, params
    lib.am_optimizer_destroy(opt)


def test_safetensors_reads_c_checkpoint(trained, tmp_path):
    opt, _ = trained
    path = tmp_path / "opt.safetensors"
    assert lib.am_optimizer_save(opt, str(path).encode()) == 0
    tensors = load_file(str(path))
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    assert meta["format"] == "automagic.optimizer"
    assert meta["format_version"] == "1"
    assert meta["num_params"] == str(len(SHAPES))
    assert meta["seed"] == "1234"
    assert float(meta["hp.lr"]) == 1e-3
    assert float(meta["hp.weight_decay"]) == 0.01
    assert meta["checksum"].startswith("crc32:")
    for i, shape in enumerate(SHAPES):
        assert meta["param.%d.dtype" % i] == "float32"
        assert meta["param.%d.shape" % i] == "[" + ",".join(map(str, shape)) + "]"
        st, sh = _lib.State(), _lib.Shape()
        assert lib.am_optimizer_get_state(opt, i, ctypes.byref(st), ctypes.byref(sh)) == 0
        z = _state_sizes(shape)
        lr_shape = (shape[0],) if len(shape) >= 2 else shape
        np.testing.assert_array_equal(
            tensors["param.%d.lr" % i],
            _array(st.lr, z.lr_count, ctypes.c_float, np.float32, lr_shape))
        assert tensors["param.%d.polarity" % i].dtype == np.uint8
        np.testing.assert_array_equal(
            tensors["param.%d.polarity" % i],
            _array(st.polarity, z.polarity_bytes, ctypes.c_uint8, np.uint8,
                   (z.polarity_bytes,)))
        if len(shape) >= 2:
            np.testing.assert_array_equal(
                tensors["param.%d.row" % i],
                _array(st.row, z.row_count, ctypes.c_float, np.float32, shape[:-1]))
            np.testing.assert_array_equal(
                tensors["param.%d.col" % i],
                _array(st.col, z.col_count, ctypes.c_float, np.float32,
                       shape[:-2] + shape[-1:]))
            assert "param.%d.sq" % i not in tensors
        else:
            np.testing.assert_array_equal(
                tensors["param.%d.sq" % i],
                _array(st.sq, z.sq_count, ctypes.c_float, np.float32, shape))
        assert tensors["param.%d.step" % i].dtype == np.int64
        assert tensors["param.%d.step" % i].shape == ()
        assert int(tensors["param.%d.step" % i]) == st.step
        assert int(tensors["param.%d.skipped" % i]) == (1 if i == 1 else 0)
    assert int(tensors["param.1.step"]) == 3  # one of four updates skipped
    assert float(np.abs(tensors["param.2.row"]).sum()) > 0  # really trained


def test_torch_framework_reads_it(trained, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as torch_load

    opt, _ = trained
    path = tmp_path / "opt.safetensors"
    assert lib.am_optimizer_save(opt, str(path).encode()) == 0
    t = torch_load(str(path))
    assert t["param.3.col"].dtype == torch.float32
    assert tuple(t["param.3.col"].shape) == (2, 5)
    assert t["param.0.step"].dtype == torch.int64
    np.testing.assert_array_equal(t["param.2.lr"].numpy(), load_file(str(path))["param.2.lr"])


def test_file_rewritten_by_safetensors_is_rejected_unless_identical(trained, tmp_path):
    """The checksum covers every tensor and metadata value: a file whose data
    was changed by another tool is refused, and the optimizer is untouched."""
    from safetensors.numpy import save_file

    opt, _ = trained
    path = tmp_path / "opt.safetensors"
    assert lib.am_optimizer_save(opt, str(path).encode()) == 0
    tensors = load_file(str(path))
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    # Same contents, rewritten by safetensors (its own layout): still valid,
    # because the checksum is over the canonical contents, not the layout.
    same = tmp_path / "same.safetensors"
    save_file(tensors, str(same), metadata=meta)
    assert lib.am_optimizer_load(opt, str(same).encode()) == 0
    # One lr changed: rejected as corrupt (AM_ERR_FORMAT = -10).
    tensors["param.2.lr"][0] *= 2
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    _lib.clear_message()
    assert lib.am_optimizer_load(opt, str(bad).encode()) == -10
    assert "checksum" in _lib.last_message()
