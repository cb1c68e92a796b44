#!/usr/bin/env python3
"""GPU benchmark of automagic.Automagic3 against the reference class, both on
CUDA tensors, in the same run: time per optimizer step (CUDA events), and the
speed-up ratio reference / automagic. Usage:

    python scripts/bench_cuda.py OUT_DIR [--quick]

Writes OUT_DIR/bench_python.json and, when matplotlib is importable,
OUT_DIR/bench_python.png. Needs a CUDA build of torch and a GPU; exits 77
(with the reason) otherwise.
"""
import argparse
import importlib.util
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(REPO, "..", "shared", "reference", "automagic3.py")


def load_reference():
    spec = importlib.util.spec_from_file_location("automagic3_reference", REFERENCE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Automagic3


def time_steps(step, iters):
    """Mean milliseconds of step() over iters calls, measured on the GPU."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        step()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / iters


def bench_case(name, shapes, dtype, iters, Ref):
    import automagic

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, device="cuda").to(dtype)) for s in shapes]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    grads = [torch.randn(s, device="cuda").mul_(0.01).to(dtype) for s in shapes]
    opt = automagic.Automagic3(ours, lr=1e-4, fused=False)
    ref = Ref(refs, lr=1e-4)
    group = ref.param_groups[0]

    def step_ours():
        for p, g in zip(ours, grads):
            p.grad = g
        opt.step()

    def step_ref():
        for p, g in zip(refs, grads):
            p.grad = g
            ref._update_param(p, group)

    ms_ours = time_steps(step_ours, iters)
    ms_ref = time_steps(step_ref, max(2, iters // 2))
    numel = sum(p.numel() for p in ours)
    row = dict(case=name, dtype=str(dtype).replace("torch.", ""), params=len(shapes),
               numel=numel, ms_automagic=ms_ours, ms_reference=ms_ref,
               speedup=ms_ref / ms_ours)
    print("%-28s %-9s %8.3f ms automagic %8.3f ms reference  x%.1f"
          % (name, row["dtype"], ms_ours, ms_ref, row["speedup"]), flush=True)
    del ours, refs, grads, opt, ref
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    if not torch.cuda.is_available():
        print("bench_cuda.py: torch %s has no usable CUDA device; not run" % torch.__version__)
        return 77
    from automagic import _cuda
    if not _cuda.available():
        print("bench_cuda.py: libautomagic_cuda unavailable: %s" % _cuda.unavailable_reason())
        return 77
    if not os.path.exists(REFERENCE):
        print("bench_cuda.py: reference class not found at %s; not run" % REFERENCE)
        return 77
    Ref = load_reference()
    it = 5 if args.quick else 20
    cases = [
        ("matrix 4096x4096", [(4096, 4096)], torch.bfloat16),
        ("matrix 4096x4096", [(4096, 4096)], torch.float32),
        ("embedding 50000x4096", [(50000, 4096)], torch.bfloat16),
        ("flat 16M", [(1 << 24,)], torch.bfloat16),
        ("row 1x100M", [(1, 100_000_000)], torch.bfloat16),
        ("200 small (64x64 + 64)", [(64, 64), (64,)] * 100, torch.bfloat16),
    ]
    rows = [bench_case(n, s, d, it, Ref) for n, s, d in cases]
    info = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, rows=rows)
    with open(os.path.join(args.out_dir, "bench_python.json"), "w") as f:
        json.dump(info, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_cuda.py: matplotlib not installed; no figure (numbers in bench_python.json)")
        return 0
    labels = ["%s\n%s" % (r["case"], r["dtype"]) for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(range(len(rows)), [r["speedup"] for r in rows])
    ax.axhline(5.0, color="red", linestyle="--", label="target 5x (bfloat16)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("reference time / automagic time")
    ax.set_title("Automagic3 step on %s" % info["device"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "bench_python.png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
