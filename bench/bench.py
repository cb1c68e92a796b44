#!/usr/bin/env python3
"""The automagic CPU benchmark: one command, a table, JSON and a PNG plot.

    python bench/bench.py                 # full run (about 10-20 minutes)
    python bench/bench.py --quick         # smaller shapes, one rep, smoke test

What it measures, all in the same run (the machine may be shared, so every
comparison is a ratio of numbers measured next to each other):
  1. C kernels (bench/bench_kernels.c): am_update per shape x dtype x threads,
     ns/element, effective GB/s under the traffic model of
     docs/PERFORMANCE.md, and the fraction of a STREAM-style triad measured
     with the same thread count before the case and before each timed update
     (the best of each).
  2. The same parameters in PyTorch (same thread count): ours through the
     front end (automagic.Automagic3, step mode), the reference Automagic3
     (../shared/reference, skipped with a message when absent) and
     torch.optim.AdamW foreach and fused: time per step and speedups.
  3. GPT-2 small's parameter list (124M, float32): full step time for ours,
     the reference and AdamW (foreach, fused); our kernels alone on the same
     list, called from the same process in the same round-robin, and the sum
     of their times from the C program (front-end overhead); optimizer state
     bytes/parameter.
Results: bench/results/bench.{json,md,png} (--out DIR).
"""
import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_train import lora_train_bench, lora_train_lines  # noqa: E402 (bench/lora_train.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (768, 3072), (256, 256, 3, 3),
          (4096,), (16777216,)]
QUICK_SHAPES = [(1024, 1024), (256, 64, 3, 3), (4096,), (1048576,)]
DTYPES = ["float32", "bfloat16", "float16"]
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def gpt2_small_shapes():
    """(name, shape) of GPT-2 small (HF layout, Conv1D weights (in, out),
    lm_head tied to wte): 124,439,808 parameters."""
    d, ff, n_layer, vocab, ctx = 768, 3072, 12, 50257, 1024
    out = [("wte", (vocab, d)), ("wpe", (ctx, d))]
    for i in range(n_layer):
        h = "h.%d." % i
        out += [(h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
                (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
                (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
                (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
                (h + "mlp.c_fc.weight", (d, ff)), (h + "mlp.c_fc.bias", (ff,)),
                (h + "mlp.c_proj.weight", (ff, d)), (h + "mlp.c_proj.bias", (d,))]
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return out


def lora_shapes(rank=16):
    """LoRA adapters (PEFT layout: A (rank, in), B (out, rank)) on the q, k,
    v and o projections of a 24-layer, 1024-wide transformer: 192 tensors,
    3.1M parameters at rank 16; B's rows are rank elements long."""
    d, n_layer = 1024, 24
    return [s for _ in range(n_layer * 4) for s in ((rank, d), (d, rank))]


def cpu_model():
    """The CPU's name, vendor, family and model as /proc/cpuinfo gives them
    (kernel tuning differs by vendor: docs/PERFORMANCE.md); "" elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            info = {}
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                info[k.strip()] = v.strip()
    except OSError:
        return ""
    return "%s (%s, family %s, model %s)" % (info.get("model name", "?"), info.get("vendor_id", "?"),
                                              info.get("cpu family", "?"), info.get("model", "?"))


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def case_name(shape, dtype):
    return "x".join(str(s) for s in shape) + ":" + SHORT[dtype]


# ------------------------------------------------------------------ setup

def ensure_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("== installing matplotlib (for the plot)", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", "matplotlib"])


def build_bench(build_dir):
    print("== building bench_kernels (Release) in %s" % build_dir, flush=True)
    subprocess.check_call(["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                           "-DAM_BUILD_TESTS=OFF", "-DAM_BUILD_EXAMPLES=OFF"],
                          stdout=subprocess.DEVNULL)
    subprocess.check_call(["cmake", "--build", build_dir, "--target", "bench_kernels",
                           "automagic", "-j2"], stdout=subprocess.DEVNULL)
    return os.path.join(build_dir, "bench", "bench_kernels")


def run_kernels(exe, cases, threads, min_time, min_reps, scalar=False):
    cmd = [exe, "--threads", str(threads), "--min-time", str(min_time),
           "--min-reps", str(min_reps)] + (["--scalar"] if scalar else []) + cases
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def load_reference():
    path = os.path.join(ROOT, "..", "shared", "reference")
    if not os.path.exists(os.path.join(path, "automagic3.py")):
        print("!! reference Automagic3 not found at %s: reference columns skipped" % path)
        return None
    sys.path.insert(0, os.path.abspath(path))
    from automagic3 import Automagic3 as Ref  # noqa: E402
    return Ref


# ---------------------------------------------------------- torch timing

def make_params(torch, shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps, gs = [], []
    for shape in shapes:
        ps.append(torch.nn.Parameter((torch.randn(shape, generator=g) * 0.05).to(dtype)))
        gs.append((torch.randn(shape, generator=g) * 1e-3).to(dtype))
    return ps, gs


class Runner:
    """One optimizer over params; step() applies one update with grads gs."""

    def __init__(self, torch, kind, ps, gs, Ref):
        self.torch, self.kind, self.ps, self.gs = torch, kind, ps, gs
        if kind in ("ours", "ours_own_pool"):
            import automagic
            self.opt = automagic.Automagic3(ps, fused=False)
        elif kind == "ours_kernels":
            self._init_kernels_only(ps, gs)
        elif kind == "reference":
            with contextlib.redirect_stdout(io.StringIO()):  # it prints a count
                self.opt = Ref(ps)
            self.group = self.opt.param_groups[0]
        elif kind == "adamw_foreach":
            # weight decay 0, as ours and the reference run (AdamW's default
            # 0.01 costs foreach AdamW a pass of its own)
            self.opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.0, foreach=True)
        elif kind == "adamw_fused":
            self.opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.0, fused=True)
        else:
            raise ValueError(kind)

    def _init_kernels_only(self, ps, gs):
        """Our kernels alone, from this process: through ctypes on the front
        end's own C views of each tensor, with nothing of the front end's
        Python around them (one step through the front end first creates the
        state and the views): one am_update_batch call on several threads, as
        the front end's step() makes, else am_update on each in turn."""
        import ctypes
        import automagic
        from automagic import _lib
        self.opt = automagic.Automagic3(ps, fused=False)
        for p, g in zip(ps, gs):
            p.grad = g
        self.opt.step()
        plans = [self.opt._plans[self.opt._param_index[p]] for p in ps]
        ws, ws_bytes = self.opt._workspace(max(pl.workspace_bytes for pl in plans))
        self.calls = []
        for p, g, pl in zip(ps, gs, plans):
            pl.pt.data, pl.gt.data = p.data_ptr(), g.data_ptr()
            self.calls.append((pl.pt_ref, pl.gt_ref, pl.st_ref, ctypes.byref(pl.hp), pl.key,
                               ws, ws_bytes, pl.rep_ref))
        # on several threads the front end's step() makes one am_update_batch
        # call (whole tensors on separate threads): the same call here
        from automagic._views import _fill_batch_item
        self.items = (_lib.BatchItem * len(plans))()
        for it, pl in zip(self.items, plans):
            _fill_batch_item(it, pl, pl.hp)
        self.batch_ws = {}
        self.lib = _lib.lib

    def step(self):
        if self.kind == "ours_kernels":
            threads = self.torch.get_num_threads()
            self.lib.am_set_num_threads(threads)
            # one am_update_batch call for several tensors at any thread
            # count, as the front end's step() makes (a loop of ctypes calls
            # at one thread took 15-22% longer and hid that much of the
            # front end's overhead)
            if len(self.calls) > 1:
                if threads not in self.batch_ws:
                    import ctypes
                    nb = ctypes.c_size_t(0)
                    if self.lib.am_update_batch_workspace(self.items, len(self.calls), threads,
                                                          ctypes.byref(nb)) != 0:
                        raise RuntimeError("ours_kernels: am_update_batch_workspace failed")
                    self.batch_ws[threads] = self.torch.empty(nb.value, dtype=self.torch.uint8)
                ws = self.batch_ws[threads]
                if self.lib.am_update_batch(self.items, len(self.calls), ws.data_ptr(),
                                            ws.numel()) != 0:
                    raise RuntimeError("ours_kernels: am_update_batch failed")
                return
            for c in self.calls:
                if self.lib.am_update(*c) != 0:
                    raise RuntimeError("ours_kernels: am_update failed")
            return
        for p, g in zip(self.ps, self.gs):
            p.grad = g
        if self.kind == "ours_own_pool":
            # the library's own threads instead of torch's OpenMP team
            # (python/automagic/_threads.py), for comparison
            from automagic import _threads
            on = _threads.set_enabled(False)
            try:
                self.opt.step()
            finally:
                _threads.set_enabled(on)
        elif self.kind == "reference":
            for p in self.ps:
                self.opt._update_param(p, self.group)
        else:
            self.opt.step()

    def state_bytes(self):
        total = 0
        for st in self.opt.state.values():
            for v in st.values():
                if hasattr(v, "element_size"):
                    total += v.numel() * v.element_size()
        return total

    def workspace_bytes(self):
        """Scratch the optimizer keeps between steps beside its state (ours:
        the update workspace of each thread that updated; none for AdamW and
        the reference)."""
        tls = getattr(getattr(self, "opt", None), "_tls", None)
        ws = getattr(tls, "ws", None) if tls is not None else None
        # ours_kernels' own am_update_batch buffers count too (they were left out)
        extra = sum(t.numel() for t in getattr(self, "batch_ws", {}).values())
        return (ws[1] if ws else 0) + extra


_EVICT = None


def evict(torch):
    """Writes 256 MB (untimed) so every step starts with cold caches, as
    bench_kernels does (see there)."""
    global _EVICT
    if _EVICT is None:
        _EVICT = torch.empty(64 << 20, dtype=torch.float32)
    _EVICT.fill_(1.0)


def time_runners(runners, reps, min_time):
    """Round-robin timing: rep r of every runner runs before rep r+1 of any,
    so a burst of load from other processes hits all of them alike. Returns
    {kind: (min seconds, median seconds)}."""
    times = {k: [] for k in runners}
    for r in runners.values():
        r.step()  # warm-up: state allocation, first-step paths
    t_start = time.perf_counter()
    while True:
        for k, r in runners.items():
            evict(r.torch)
            t0 = time.perf_counter()
            r.step()
            times[k].append(time.perf_counter() - t0)
        if len(times[next(iter(times))]) >= reps and time.perf_counter() - t_start > min_time:
            break
    return {k: (min(v), sorted(v)[len(v) // 2]) for k, v in times.items()}


def torch_case(torch, shape, dtype, threads, Ref, reps, min_time):
    torch.set_num_threads(threads)
    tdt = getattr(torch, dtype)
    runners, errors = {}, {}
    kinds = ["ours", "reference", "adamw_foreach", "adamw_fused"]
    for kind in kinds:
        if kind == "reference" and Ref is None:
            continue
        ps, gs = make_params(torch, [shape], tdt)
        try:
            runners[kind] = Runner(torch, kind, ps, gs, Ref)
            runners[kind].step()
        except Exception as e:  # e.g. a dtype an optimizer does not support
            errors[kind] = "%s: %s" % (type(e).__name__, e)
            runners.pop(kind, None)
    res = time_runners(runners, reps, min_time)
    out = {k: {"sec_min": v[0], "sec_median": v[1]} for k, v in res.items()}
    for k, e in errors.items():
        out[k] = {"error": e}
    return out


# ------------------------------------------------------------------ main

def _int_list(text):
    """argparse type: comma-separated positive integers (checked before any
    measuring: a bad value raised a traceback after minutes of it)."""
    try:
        vals = [int(t) for t in text.split(",")]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError("%r: comma-separated positive integers expected"
                                         % text)
    return vals


def _dtype_list(text):
    vals = text.split(",")
    bad = [v for v in vals if v not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError("%s: not among %s" % (",".join(bad), ",".join(DTYPES)))
    return vals


def _check_out(ap, out):
    """The output folder must take bench.json, bench.md and bench.png: found
    out only when writing them, the whole run was lost."""
    try:
        os.makedirs(out, exist_ok=True)
        for name in ("bench.json", "bench.md", "bench.png"):
            path = os.path.join(out, name)
            if os.path.isdir(path):
                raise OSError("%s is a directory" % path)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as e:
        ap.error("--out %s cannot take the results: %s" % (out, e))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small shapes, 1 rep, no GPT-2 step (which needs about 9 GB): "
                         "a smoke test")
    ap.add_argument("--threads", default=[1, 2], type=_int_list,
                    help="thread counts, comma-separated (default 1,2)")
    ap.add_argument("--dtypes", default=list(DTYPES), type=_dtype_list,
                    help="dtypes, comma-separated (default %s)" % ",".join(DTYPES))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"),
                    help="folder for bench.json, bench.md and bench.png (default: "
                         "bench/results, the committed results, overwritten)")
    # not build/bench: a CMake tree configured in build/ puts its bench
    # subdirectory there, and two trees in one folder confuse each other
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "bench-release"),
                    help="where the Release build of the library and bench_kernels goes "
                         "(default build/bench-release)")
    ap.add_argument("--no-gpt2", action="store_true", help="skip the GPT-2 small step")
    ap.add_argument("--gpt2", action="store_true",
                    help="with --quick: run the GPT-2 small step all the same")
    ap.add_argument("--no-lora", action="store_true", help="skip the LoRA step")
    ap.add_argument("--lora-ranks", default=[16], type=_int_list,
                    help="LoRA ranks to time, comma-separated (default 16; e.g. 4,8,16,32,64)")
    ap.add_argument("--threshold", action="store_true",
                    help="also measure small updates with and without threads "
                         "(the threading threshold)")
    args = ap.parse_args()
    _check_out(ap, args.out)

    ensure_matplotlib()
    exe = build_bench(args.build_dir)
    import torch
    # The front end from this tree, on the library just built (the same code
    # as bench_kernels), whatever is installed.
    os.environ["AUTOMAGIC_LIBRARY"] = os.path.join(args.build_dir, "libautomagic.so")
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import automagic
    print("== front end %s on %s (kernels: %s)" % (
        automagic.__file__, os.environ["AUTOMAGIC_LIBRARY"],
        automagic._lib.lib.am_kernel_name().decode()), flush=True)
    Ref = load_reference()

    threads, dtypes = args.threads, args.dtypes
    shapes = QUICK_SHAPES if args.quick else SHAPES
    min_time, reps = (0.0, 1) if args.quick else (0.5, 3)
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "cpu_model": cpu_model(),
                          "torch": torch.__version__, "python": platform.python_version(),
                          "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                          "commit": source_commit()},
              "kernels": [], "torch": [], "gpt2": None, "lora": [], "lora_train": [],
              "threshold": []}

    cases = [case_name(s, d) for s in shapes for d in dtypes]
    for t in threads:
        print("== C kernels, %d thread(s)" % t, flush=True)
        # at least 2 s and 5 updates per case (each with a triad before it):
        # cheap next to the PyTorch cases, and the best of each is steadier
        result["kernels"] += run_kernels(exe, cases, t, 2.0 if min_time else 0.0,
                                         max(reps, 5) if min_time else 1)
    print("== scalar reference kernels, 1 thread (SIMD speedup)", flush=True)
    result["kernels"] += run_kernels(exe, [case_name(shapes[0], d) for d in dtypes], 1,
                                     0.0, 1, scalar=True)

    for t in threads:
        for s in shapes:
            for d in dtypes:
                print("== torch: %s %s, %d thread(s)" % (s, d, t), flush=True)
                r = torch_case(torch, s, d, t, Ref, reps, min_time)
                result["torch"].append({"shape": list(s), "dtype": d, "threads": t, **r})

    if not args.no_gpt2 and (args.gpt2 or not args.quick):
        result["gpt2"] = gpt2_bench(torch, exe, threads[-1], Ref, 1 if args.quick else 7)
    if not args.no_lora:
        for rank in args.lora_ranks:
            for t in threads:
                result["lora"].append(lora_bench(torch, t, Ref, 2 if args.quick else 15, rank))
        for t in threads:
            result["lora_train"].append(lora_train_case(torch, automagic, t,
                                                        2 if args.quick else 20))
    if args.threshold:
        result["threshold"] = threshold_bench(exe)

    path = os.path.join(args.out, "bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print_tables(result)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(markdown(result))
    png = os.path.join(args.out, "bench.png")
    plot(result, png)
    print("\nwrote %s, %s and %s" % (path, os.path.join(args.out, "bench.md"), png))


def gpt2_bench(torch, exe, threads, Ref, reps):
    shapes = [s for _, s in gpt2_small_shapes()]
    n = sum(numel(s) for s in shapes)
    print("== GPT-2 small: %d tensors, %d parameters, float32, %d thread(s)"
          % (len(shapes), n, threads), flush=True)
    torch.set_num_threads(threads)
    out = {"params": n, "tensors": len(shapes), "threads": threads, "dtype": "float32",
           "step": {}, "state_bytes_per_param": {}, "workspace_bytes_per_param": {}}
    # All optimizers side by side (about 8 GB), timed round-robin as in
    # torch_case: timed one after the other, bursts of load from other
    # processes made single runs differ by 30% here.
    runners = {}
    for kind in ["ours", "ours_kernels", "ours_own_pool", "reference", "adamw_foreach",
                 "adamw_fused"]:
        if kind == "reference" and Ref is None:
            continue
        if kind == "ours_kernels":
            # our kernels alone on the very tensors of "ours" (its own
            # optimizer and state): the step against them then differs by
            # the front end only. On separate copies, where each set of 124M
            # parameters landed in memory moved the C call itself by 1-2 ms
            # of ~44 (thirty-first session: the call inside "ours" took
            # 0.6-1.6 ms longer than the same call on the copy allocated
            # after it, and not longer when the copy was allocated first).
            ps, gs = runners["ours"].ps, runners["ours"].gs
        else:
            ps, gs = make_params(torch, shapes, torch.float32)
        runners[kind] = Runner(torch, kind, ps, gs, Ref)
    res = time_runners(runners, reps, 0.0)
    for kind, r in runners.items():
        out["step"][kind] = {"sec_min": res[kind][0], "sec_median": res[kind][1]}
        out["state_bytes_per_param"][kind] = r.state_bytes() / n
        out["workspace_bytes_per_param"][kind] = r.workspace_bytes() / n
    del runners
    # The front end's overhead: the step against our kernels alone, called
    # from the same process in the same round-robin (ours_kernels); and, as
    # before, against the sum of our kernels' times over the same list from
    # the C program (one am_update per tensor, each from cold caches,
    # minutes away from the step: noisier).
    out["kernels_in_process_sec"] = res["ours_kernels"][0]
    uniq = {}
    for s in shapes:
        uniq[s] = uniq.get(s, 0) + 1
    recs = run_kernels(exe, [case_name(s, "float32") for s in uniq], threads, 0.0, reps)
    ksum = 0.0
    for rec in recs:
        ksum += rec["sec_min"] * uniq[tuple(rec["shape"])]
    out["kernel_sum_sec"] = ksum
    # The front end's fixed cost per tensor, measured where the kernels cost
    # nothing: the same number of 2x2 parameters through the same step().
    ps, gs = make_params(torch, [(2, 2)] * len(shapes), torch.float32)
    r = Runner(torch, "ours", ps, gs, Ref)
    tiny = time_runners({"ours": r}, 20, 0.5)["ours"][0]
    out["frontend_overhead_sec"] = tiny
    out["frontend_overhead_us_per_tensor"] = tiny / len(shapes) * 1e6
    return out


def lora_bench(torch, threads, Ref, reps, rank=16):
    """A whole LoRA step (lora_shapes(rank), float32): ours, our kernels
    alone, the reference and fused AdamW, round-robin from cold caches."""
    shapes = lora_shapes(rank)
    n = sum(numel(s) for s in shapes)
    print("== LoRA rank %d: %d tensors, %d parameters, float32, %d thread(s)"
          % (rank, len(shapes), n, threads), flush=True)
    torch.set_num_threads(threads)
    runners = {}
    for kind in ("ours", "ours_kernels", "reference", "adamw_fused"):
        if kind == "reference" and Ref is None:
            continue
        ps, gs = make_params(torch, shapes, torch.float32)
        runners[kind] = Runner(torch, kind, ps, gs, Ref)
    res = time_runners(runners, reps, 0.0)
    return {"rank": rank, "params": n, "tensors": len(shapes), "threads": threads,
            "dtype": "float32",
            "step": {k: {"sec_min": v[0], "sec_median": v[1]} for k, v in res.items()}}


def lora_train_case(torch, automagic, threads, reps, rank=16):
    """lora_train.py's training step (backward + optimizer) at rank."""
    shapes = lora_shapes(rank)
    print("== LoRA rank %d training step (backward + optimizer), %d thread(s)"
          % (rank, threads), flush=True)
    sec = lora_train_bench(torch, automagic, make_params, evict, shapes, threads, reps)
    return {"rank": rank, "tensors": len(shapes), "params": sum(numel(s) for s in shapes),
            "threads": threads, "sec": sec}


def lora_lines(result):
    """The LoRA steps as text lines (print_tables and markdown)."""
    out = []
    for lo in result.get("lora") or []:
        st = lo["step"]
        ours = st["ours"]["sec_min"]
        out.append("LoRA rank %d (%d tensors, %d parameters, %s), %d thread(s): %s; fused "
                   "AdamW / ours = %.2fx" % (
                       lo.get("rank", 16), lo["tensors"], lo["params"], lo["dtype"], lo["threads"],
                       ", ".join("%s %.2f ms" % (k, v["sec_min"] * 1e3) for k, v in st.items()),
                       st["adamw_fused"]["sec_min"] / ours))
    return out


def threshold_bench(exe):
    """Small float32 updates at 2 threads with the pool always used vs never:
    the work size where threads start to pay (AM_PAR_MIN_BYTES)."""
    cases = [case_name((r, 1024), "float32") for r in (4, 16, 64, 256, 1024)]
    rows = []
    for label, env in (("pool", "0"), ("serial", "1e18")):
        e = dict(os.environ, AUTOMAGIC_PAR_MIN_BYTES=env)
        cmd = [exe, "--threads", "2", "--min-time", "0.3", "--min-reps", "20"] + cases
        res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=e).stdout
        for line in res.splitlines():
            rec = json.loads(line)
            rec["mode"] = label
            rows.append(rec)
    return rows


# -------------------------------------------------------------- reports

def kernel_rows(result):
    """The kernel cases with ns/element, GB/s under the traffic model and
    frac: that GB/s over the best triad of the whole run at the same thread
    count (each case's own triad swung 1.5x within a run at 2 threads, and a
    case that drew a low one read a high fraction; it is still shown)."""
    best = {}
    for k in result["kernels"]:
        best[k["threads"]] = max(best.get(k["threads"], 0.0), k["triad_gbs"])
    rows = []
    for k in result["kernels"]:
        n = k["numel"]
        gbs = n * k["model_bytes_per_elem"] / k["sec_min"] / 1e9
        # process CPU time only at one thread: Linux adds a worker thread's
        # time to the process clock late (at its next tick or sleep), so a
        # two-thread update shorter than a tick read as one thread's (768x3072
        # at 2 threads: 0.53 ms wall and 0.53 ms CPU, where 1 thread took 0.76)
        cpu = k["cpu_sec_min"] / n * 1e9 if k["threads"] == 1 else None
        rows.append(dict(k, ns_per_elem=k["sec_min"] / n * 1e9,
                         cpu_ns_per_elem=cpu, gbs=gbs,
                         triad_best=best[k["threads"]], frac=gbs / best[k["threads"]]))
    return rows


def cpu_cell(k):
    """A kernel row's CPU ns/element as printed: "-" where it is not known
    (more than one thread; see kernel_rows)."""
    return "-" if k["cpu_ns_per_elem"] is None else "%.3f" % k["cpu_ns_per_elem"]


def torch_lookup(result, shape, dtype, threads):
    for r in result["torch"]:
        if r["shape"] == list(shape) and r["dtype"] == dtype and r["threads"] == threads:
            return r
    return None


def ratio(r, a, b):
    if not r or "sec_min" not in r.get(a, {}) or "sec_min" not in r.get(b, {}):
        return float("nan")
    return r[a]["sec_min"] / r[b]["sec_min"]


def print_tables(result):
    print("\nC kernels (am_update; min over reps; frac = effective GB/s under the traffic "
          "model / the run's best STREAM triad GB/s at the same threads, both in the bytes "
          "memory moves: the triad's 16 per element include its write-allocate read)")
    hdr = "%-22s %-8s %3s %-6s %9s %9s %8s %8s %8s %6s" % (
        "shape", "dtype", "thr", "kern", "ns/elem", "cpu ns/el", "GB/s", "triad", "run's",
        "frac")
    print(hdr)
    print("-" * len(hdr))
    for k in kernel_rows(result):
        print("%-22s %-8s %3d %-6s %9.3f %9s %8.2f %8.2f %8.2f %5.0f%%" % (
            "x".join(map(str, k["shape"])), k["dtype"], k["threads"], k["kernels"],
            k["ns_per_elem"], cpu_cell(k), k["gbs"], k["triad_gbs"],
            k["triad_best"], 100 * k["frac"]))
    print("\nPyTorch, same parameters, same threads (ms per step, min over reps; "
          "speedup = their time / ours through the front end)")
    hdr = "%-22s %-8s %3s %9s %9s %9s %9s %8s %8s %8s" % (
        "shape", "dtype", "thr", "ours", "ref", "adamw_fe", "adamw_fu", "x ref", "x fe",
        "x fused")
    print(hdr)
    print("-" * len(hdr))
    for r in result["torch"]:
        def ms(kind):
            v = r.get(kind, {})
            return "%9.2f" % (v["sec_min"] * 1e3) if "sec_min" in v else "%9s" % "n/a"
        print("%-22s %-8s %3d %s %s %s %s %8.1f %8.2f %8.2f" % (
            "x".join(map(str, r["shape"])), r["dtype"], r["threads"], ms("ours"),
            ms("reference"), ms("adamw_foreach"), ms("adamw_fused"),
            ratio(r, "reference", "ours"), ratio(r, "adamw_foreach", "ours"),
            ratio(r, "adamw_fused", "ours")))
        for kind in ("ours", "reference", "adamw_foreach", "adamw_fused"):
            if "error" in r.get(kind, {}):
                print("    %s: %s" % (kind, r[kind]["error"]))
    g = result.get("gpt2")
    if g:
        print("\nGPT-2 small (%d tensors, %d parameters, %s, %d thread(s))" % (
            g["tensors"], g["params"], g["dtype"], g["threads"]))
        ours = g["step"]["ours"]["sec_min"]
        wsb = g.get("workspace_bytes_per_param", {})
        for kind, v in g["step"].items():
            print("  %-14s %8.1f ms/step  (%.2fx ours)  state %.3f bytes/param, kept "
                  "workspace %.3f" % (kind, v["sec_min"] * 1e3, v["sec_min"] / ours,
                                      g["state_bytes_per_param"][kind], wsb.get(kind, 0.0)))
        if "kernels_in_process_sec" in g:
            kin = g["kernels_in_process_sec"]
            print("  our kernels alone, called in the same round-robin: %.1f ms; full step / "
                  "that - 1 = %.1f%%" % (kin * 1e3, 100 * (ours / kin - 1)))
        print("  sum of our kernels' times (C program, per tensor): %.1f ms; full step / sum "
              "- 1 = %.1f%% (noisier: measured minutes apart)" % (
                  g["kernel_sum_sec"] * 1e3, 100 * (ours / g["kernel_sum_sec"] - 1)))
        print("  front end fixed cost: %.1f us per tensor, %.2f ms per step = %.2f%% of the "
              "kernel sum" % (g["frontend_overhead_us_per_tensor"],
                              g["frontend_overhead_sec"] * 1e3,
                              100 * g["frontend_overhead_sec"] / g["kernel_sum_sec"]))
    if result.get("lora") or result.get("lora_train"):
        print()
        for line in lora_lines(result) + lora_train_lines(result):
            print(line)
    if result.get("threshold"):
        print("\nThreading threshold (2 threads, pool forced on vs off, us per update)")
        by = {}
        for rec in result["threshold"]:
            by.setdefault(rec["case"], {})[rec["mode"]] = rec["sec_min"] * 1e6
        for case, v in by.items():
            print("  %-14s pool %9.1f  serial %9.1f" % (case, v.get("pool", 0), v.get("serial", 0)))


def source_commit():
    """The checkout's commit (with "+changes" when the tracked files differ
    from it), so that a stored result names what it measured; None outside
    a git checkout."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, check=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=here,
                               stderr=subprocess.DEVNULL).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+changes" if dirty else "")


def markdown(result):
    """The tables of print_tables as Markdown (for docs/PERFORMANCE.md)."""
    m = result["machine"]
    out = ["Measured %s UTC on %s, %d CPUs%s, torch %s%s.\n" % (
        m["date_utc"], m["platform"], m["cpus"],
        " (%s)" % m["cpu_model"] if m.get("cpu_model") else "", m["torch"],
        ", commit %s" % m["commit"] if m.get("commit") else "")]
    out.append("| shape | dtype | thr | kernels | ns/elem | CPU ns/elem | GB/s (model) | "
               "triad GB/s (case) | triad GB/s (run's best) | of bound |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for k in kernel_rows(result):
        out.append("| %s | %s | %d | %s | %.3f | %s | %.2f | %.2f | %.2f | %.0f%% |" % (
            "x".join(map(str, k["shape"])), k["dtype"], k["threads"], k["kernels"],
            k["ns_per_elem"], cpu_cell(k), k["gbs"], k["triad_gbs"],
            k["triad_best"], 100 * k["frac"]))
    out.append("")
    out.append("| shape | dtype | thr | ours ms | reference ms | AdamW foreach ms | "
               "AdamW fused ms | x ref | x foreach | x fused |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["torch"]:
        def ms(kind):
            v = r.get(kind, {})
            return "%.2f" % (v["sec_min"] * 1e3) if "sec_min" in v else "n/a"
        out.append("| %s | %s | %d | %s | %s | %s | %s | %.1f | %.2f | %.2f |" % (
            "x".join(map(str, r["shape"])), r["dtype"], r["threads"], ms("ours"),
            ms("reference"), ms("adamw_foreach"), ms("adamw_fused"),
            ratio(r, "reference", "ours"), ratio(r, "adamw_foreach", "ours"),
            ratio(r, "adamw_fused", "ours")))
    g = result.get("gpt2")
    if g:
        out.append("")
        out.append("GPT-2 small, %d tensors, %d parameters, %s, %d thread(s):\n" % (
            g["tensors"], g["params"], g["dtype"], g["threads"]))
        out.append("| optimizer | ms/step | vs ours | state bytes/param | kept workspace "
                   "bytes/param |")
        out.append("|---|---|---|---|---|")
        ours = g["step"]["ours"]["sec_min"]
        wsb = g.get("workspace_bytes_per_param", {})
        for kind, v in g["step"].items():
            out.append("| %s | %.1f | %.2fx | %.3f | %.3f |" % (
                kind, v["sec_min"] * 1e3, v["sec_min"] / ours,
                g["state_bytes_per_param"][kind], wsb.get(kind, 0.0)))
        out.append("")
        if "kernels_in_process_sec" in g:
            kin = g["kernels_in_process_sec"]
            out.append("Our kernels alone (ours_kernels: the front end's C calls, "
                       "am_update_batch on several threads, from the same process, in the "
                       "same round-robin): %.1f ms; the full step is %+.1f%% "
                       "of that." % (kin * 1e3, 100 * (ours / kin - 1)))
            out.append("")
        out.append("Sum of our kernels' times over the same tensors (C): %.1f ms; the front "
                   "end's fixed cost: %.1f us per tensor = %.2f%% of that sum." % (
                       g["kernel_sum_sec"] * 1e3, g["frontend_overhead_us_per_tensor"],
                       100 * g["frontend_overhead_sec"] / g["kernel_sum_sec"]))
    for line in lora_lines(result) + lora_train_lines(result):
        out.append("")
        out.append(line)
    return "\n".join(out) + "\n"


def plot(result, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [k for k in kernel_rows(result) if k["kernels"] != "scalar"]
    threads = sorted({k["threads"] for k in rows})
    dtypes = [d for d in DTYPES if any(k["dtype"] == d for k in rows)]
    shapes = []
    for k in rows:
        s = "x".join(map(str, k["shape"]))
        if s not in shapes:
            shapes.append(s)
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    width = 0.8 / (len(threads) * len(dtypes))
    ax = axes[0]
    i = 0
    for t in threads:
        for d in dtypes:
            ys = []
            for s in shapes:
                m = [k for k in rows if "x".join(map(str, k["shape"])) == s
                     and k["dtype"] == d and k["threads"] == t]
                ys.append(100 * m[0]["frac"] if m else 0)
            ax.bar([x + i * width for x in range(len(shapes))], ys, width,
                   label="%s, %d thr" % (d, t))
            i += 1
    ax.axhline(80, color="k", ls="--", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))])
    ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% of STREAM triad bandwidth (traffic model)")
    ax.set_title("am_update: fraction of the bandwidth bound")
    ax.legend(fontsize=7)
    ax = axes[1]
    i = 0
    tr = [r for r in result["torch"] if r["threads"] == threads[-1]]
    labels = ["x".join(map(str, r["shape"])) + "\n" + SHORT[r["dtype"]] for r in tr]
    for kind, lab in (("reference", "vs reference"), ("adamw_foreach", "vs AdamW foreach"),
                      ("adamw_fused", "vs AdamW fused")):
        ys = [ratio(r, kind, "ours") for r in tr]
        ax.bar([x + i * 0.27 for x in range(len(tr))], ys, 0.27, label=lab)
        i += 1
    ax.set_yscale("log")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks([x + 0.27 for x in range(len(tr))])
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("speedup of ours (their time / ours), log")
    ax.set_title("PyTorch, same params, %d thread(s)" % threads[-1])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
