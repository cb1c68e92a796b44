"""The front end follows torch.get_num_threads() and the bits do not depend
on it; AUTOMAGIC_FORCE_SCALAR / AUTOMAGIC_DEBUG behave as documented."""
import os
import subprocess
import sys

import torch

import automagic
from automagic import _lib


def _train(threads, dtype):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(3)
    # (1, 1031, 1023): one long lr-row (split across threads); 1-D of 70001:
    # several flat tiles; (64, 33, 3, 3): narrow matrices.
    shapes = [(1, 1031, 1023), (70001,), (64, 33, 3, 3)]
    ps = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in shapes]
    opt = automagic.Automagic3(ps, lr=1e-3, weight_decay=0.1, fused=False, seed=5)
    for _ in range(3):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
        opt.step()
        assert _lib.lib.am_get_num_threads() == threads
    return [p.detach().clone() for p in ps], opt


def test_bits_do_not_depend_on_threads():
    old = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            a, oa = _train(1, dtype)
            for t in (2, 3):
                b, ob = _train(t, dtype)
                for x, y in zip(a, b):
                    assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                                       y.view(torch.uint8) if y.dtype != torch.float32 else y)
                for pa, pb in zip(oa.param_groups[0]["params"], ob.param_groups[0]["params"]):
                    for k, v in oa.state[pa].items():
                        if isinstance(v, torch.Tensor):
                            assert torch.equal(v, ob.state[pb][k]), k
    finally:
        torch.set_num_threads(old)


def test_force_scalar_and_debug_log():
    code = ("import torch, automagic\n"
            "p = torch.nn.Parameter(torch.ones(3, 3))\n"
            "o = automagic.Automagic3([p], fused=False)\n"
            "p.grad = torch.ones(3, 3)\n"
            "o.step()\n"
            "print(automagic._lib.kernel_name())\n")
    env = dict(os.environ, AUTOMAGIC_FORCE_SCALAR="1", AUTOMAGIC_DEBUG="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True)
    assert r.stdout.strip() == "scalar"
    assert "using scalar kernels" in r.stderr and "AUTOMAGIC_FORCE_SCALAR=1" in r.stderr


_RUNNER_SCRIPT = """
import hashlib, torch, automagic
from automagic import _threads
torch.set_num_threads(2)
g = torch.Generator().manual_seed(4)
ps = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in [(700, 1023), (300001,)]]
o = automagic.Automagic3(ps, lr=1e-3, fused=False, seed=9)
for _ in range(2):
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    o.step()
h = hashlib.sha256()
for p in ps:
    h.update(p.detach().numpy().tobytes())
    for k, v in sorted(o.state[p].items()):
        if isinstance(v, torch.Tensor):
            h.update(v.numpy().tobytes())
print(h.hexdigest(), _threads.runtime)
"""


def test_torch_openmp_runner_same_bits():
    """By default the library's parallel jobs run on torch's OpenMP team
    (python/automagic/_threads.py); AUTOMAGIC_TORCH_THREADS=0 keeps the
    library's own pool. Both give the same bits; the debug log says which."""
    def run(**env):
        r = subprocess.run([sys.executable, "-c", _RUNNER_SCRIPT],
                           env=dict(os.environ, AUTOMAGIC_DEBUG="1", **env),
                           capture_output=True, text=True, check=True)
        digest, runtime = r.stdout.split()
        return digest, runtime, r.stderr

    d_own, rt_own, err_own = run(AUTOMAGIC_TORCH_THREADS="0")
    d_omp, rt_omp, err_omp = run()
    assert rt_own == "None"
    assert "own threads: AUTOMAGIC_TORCH_THREADS=0" in err_own
    assert d_omp == d_own
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        import pytest
        pytest.skip("this torch build does not run on OpenMP: the runner is not used")
    assert "libgomp" in rt_omp or "libiomp" in rt_omp or "libomp" in rt_omp
    assert "parallel work on torch's OpenMP runtime" in err_omp


def test_openmp_runtime_choice(monkeypatch):
    """Which OpenMP runtime the front end would use: torch's own when several
    are loaded, none when it cannot tell, none when switched off."""
    from automagic import _threads
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        import pytest
        pytest.skip("this torch build does not run on OpenMP")
    mine = _threads._mapped_openmp_runtimes()
    assert mine, "torch runs on OpenMP but no OpenMP runtime is mapped"
    torch_lib = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "lib")
    own = [p for p in mine if os.path.abspath(p).startswith(torch_lib)]
    other = "/usr/lib/x86_64-linux-gnu/libgomp.so.1"
    if own:
        monkeypatch.setattr(_threads, "_mapped_openmp_runtimes", lambda: [other] + own[:1])
        chosen, _ = _threads._choose()
        assert chosen is not None and chosen[0] == own[0]
    monkeypatch.setattr(_threads, "_mapped_openmp_runtimes", lambda: [other, other + ".x"])
    chosen, reason = _threads._choose()
    assert chosen is None and "several OpenMP runtimes" in reason
    monkeypatch.setattr(_threads, "_mapped_openmp_runtimes", lambda: [])
    chosen, reason = _threads._choose()
    assert chosen is None and "no OpenMP runtime" in reason
    monkeypatch.setenv("AUTOMAGIC_TORCH_THREADS", "0")
    assert _threads._choose() == (None, "AUTOMAGIC_TORCH_THREADS=0")
