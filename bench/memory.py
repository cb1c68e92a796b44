"""Peak memory of a training step: automagic's fused mode against its step
mode, the reference class and torch's AdamW (Linux: reads /proc).

    python3 bench/memory.py [--dim 2048] [--layers 16] [--dtype f32|bf16] [--steps 3]

Each optimizer runs in a fresh process (one configuration per process, so
one's freed memory cannot hide another's peak) on a stack of nn.Linear
layers with a batch of 4. Before each step the process's high-water mark
(VmHWM) is reset through /proc/self/clear_refs; after the step the peak
above the resident memory just before it is read: what backward and the
optimizer add at their highest (activations of a batch of 4 are small).
glibc is told to give freed tensors back to the system at once
(MALLOC_MMAP_THRESHOLD_=65536; otherwise freed memory stays resident and
every later peak hides under it). The last step's figures are printed, in
MB and in layers' gradients (one layer's weight and bias).
"""
import argparse
import gc
import json
import os
import subprocess
import sys

MB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "..", "..", "shared", "reference")
CONFIGS = [
    ("automagic, fused (default)", "fused"),
    ("automagic, fused, accumulation_steps=2", "fused_acc2"),
    ("automagic, step mode", "step"),
    ("reference Automagic3", "reference"),
    ("torch AdamW (foreach=False), zero_grad()", "adamw"),
    ("torch AdamW (fused=True), zero_grad()", "adamw_fused"),
]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _make_optimizer(mode: str, params):
    import torch
    if mode.startswith("adamw"):
        return torch.optim.AdamW(params, lr=1e-4, fused=mode == "adamw_fused" or None,
                                 foreach=False if mode == "adamw" else None)
    if mode == "reference":
        import contextlib
        import io
        sys.path.insert(0, REFERENCE)
        from automagic3 import Automagic3 as Reference
        with contextlib.redirect_stdout(io.StringIO()):  # (it prints a count)
            return Reference(params, lr=1e-4)
    import automagic
    if mode == "step":
        return automagic.Automagic3(params, lr=1e-4, fused=False)
    return automagic.Automagic3(params, lr=1e-4,
                                accumulation_steps=2 if mode == "fused_acc2" else 1)


def run_one(mode: str, dim: int, layers: int, dtype: str, steps: int) -> dict:
    """One configuration in this process: the last step's peak."""
    import torch
    torch.manual_seed(0)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, dtype=dt) for _ in range(layers)])
    params = list(model.parameters())
    opt = _make_optimizer(mode, params)
    x = torch.randn(4, dim, dtype=dt)
    passes = 2 if mode == "fused_acc2" else 1
    out = {}
    for _ in range(steps):
        gc.collect()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        for _ in range(passes):
            model(x).float().square().mean().backward()
        opt.step()
        if mode.startswith("adamw"):
            opt.zero_grad(set_to_none=True)
        out = dict(peak=_status("VmHWM") - before,
                   grads_left=sum(p.grad is not None for p in params))
    layer = (dim * dim + dim) * params[0].element_size()
    state = sum(t.numel() * t.element_size() for st in opt.state.values()
                for t in st.values() if isinstance(t, torch.Tensor))
    out.update(layer_grad=layer, state=state, params=sum(p.numel() for p in params))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (the child process)
    a = ap.parse_args()
    if a.dim < 1 or a.layers < 1 or a.steps < 1:
        ap.error("--dim, --layers and --steps must be at least 1")
    if a.one:
        print(json.dumps(run_one(a.one, a.dim, a.layers, a.dtype, a.steps)))
        return 0
    if not os.path.exists("/proc/self/clear_refs"):
        print("memory.py: needs Linux's /proc/self/clear_refs", file=sys.stderr)
        return 2
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    print("%d x Linear(%d, %d), %s, batch 4; peak above the resident memory before the "
          "step, last of %d steps" % (a.layers, a.dim, a.dim, a.dtype, a.steps))
    print("| optimizer | peak MB | in layers' gradients | gradients left | state bytes/param |")
    print("|---|---|---|---|---|")
    for name, mode in CONFIGS:
        if mode == "reference" and not os.path.isdir(REFERENCE):
            print("| %s | (skipped: %s not found) | | | |" % (name, REFERENCE))
            continue
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", mode,
                            "--dim", str(a.dim), "--layers", str(a.layers), "--dtype", a.dtype,
                            "--steps", str(a.steps)], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print("| %s | failed: %s | | | |" % (name, r.stderr.strip().splitlines()[-1:]))
            continue
        d = json.loads(r.stdout.strip().splitlines()[-1])
        print("| %s | %.0f | %.1f | %d | %.3f |" % (name, d["peak"] / MB,
                                                    d["peak"] / d["layer_grad"], d["grads_left"],
                                                    d["state"] / d["params"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
