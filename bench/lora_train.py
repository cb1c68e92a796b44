"""The LoRA training step as a user runs it: backward, then the optimizer,
for Automagic3 in fused mode (its default: each update inside backward, the
moment the gradient is ready), in step mode, and fused AdamW. bench.py's
LoRA step times the optimizer alone, with the gradients already in place,
which fused mode cannot be timed by.

Each step builds a cheap forward (each adapter times a fixed tensor,
summed), evicts the caches (untimed, as a real model's forward would), then
times backward plus the optimizer. "bare" is the same backward with no
optimizer; each optimizer's cost is its time minus bare's. Kinds run
round-robin, two steps of a kind in a row with the second timed; the
minimum of each is kept.

Why two: every kind's backward allocates its own 12 MB of gradients, and
one kind's frees can leave the top of the C heap free, which glibc then
gives back to the system, so the next kind's gradients page-fault back in.
With one step of each in turn, step mode (after fused mode, which frees
each gradient inside backward) took about 1900 page faults a step, 3-4 ms
of its time, that a training loop running one optimizer never sees
(twenty-ninth session: 0 faults from its second step on). The first step
of each pair brings the heap to that kind's steady state."""
import time


def _forward(torch, ps, ws):
    loss = None
    for p, w in zip(ps, ws):
        t = (p * w).sum()
        loss = t if loss is None else loss + t
    return loss


def lora_train_bench(torch, automagic, make_params, evict, shapes, threads, reps):
    """{kind: seconds (min)} for bare, adamw_fused, ours_fused, ours_step on
    float32 adapters of the given shapes (gradients: make_params' gs)."""
    torch.set_num_threads(threads)
    runs = {}
    for kind in ("bare", "adamw_fused", "ours_fused", "ours_step"):
        ps, ws = make_params(torch, shapes, torch.float32)
        opt = None
        if kind == "adamw_fused":
            # weight decay 0, as ours runs and bench.py's AdamW (its default
            # 0.01 ran here until the thirtieth session: a review)
            opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.0, fused=True)
        elif kind == "ours_fused":
            opt = automagic.Automagic3(ps, fused=True)
        elif kind == "ours_step":
            opt = automagic.Automagic3(ps, fused=False)
        runs[kind] = (ps, ws, opt)

    def one(kind):
        ps, ws, opt = runs[kind]
        loss = _forward(torch, ps, ws)
        evict(torch)
        t0 = time.perf_counter()
        loss.backward()
        if opt is not None and kind != "ours_fused":
            opt.step()
        t = time.perf_counter() - t0
        if kind != "ours_fused":  # fused mode drops each gradient itself
            for p in ps:
                p.grad = None
        return t

    times = {k: [] for k in runs}
    for k in runs:
        one(k)  # warm-up: state allocation
    for _ in range(reps):
        for k in runs:
            one(k)  # (untimed: the heap as this kind leaves it, see above)
            times[k].append(one(k))
    for k, (_, _, opt) in runs.items():
        if k.startswith("ours"):
            opt.remove_hooks()
    return {k: min(v) for k, v in times.items()}


def lora_train_lines(result):
    """bench.py's text lines for result["lora_train"]."""
    out = []
    for lo in result.get("lora_train") or []:
        s = lo["sec"]
        bare = s["bare"]
        extra = {k: s[k] - bare for k in ("adamw_fused", "ours_fused", "ours_step")}
        if min(extra.values()) <= 0:  # a noisy minimum (--quick): no ratios
            out.append("LoRA rank %d training step, %d thread(s): backward alone %.2f ms; "
                       "too noisy to subtract (%s)" % (
                           lo["rank"], lo["threads"], bare * 1e3,
                           ", ".join("%s %.2f ms" % (k, v * 1e3) for k, v in s.items())))
            continue
        out.append(
            "LoRA rank %d training step (backward + optimizer, %d tensors, %d parameters, "
            "float32), %d thread(s): backward alone %.2f ms; the optimizer adds: fused AdamW "
            "%.2f ms, ours fused mode (default) %.2f ms, ours step mode %.2f ms; fused AdamW "
            "/ ours = %.2fx fused mode, %.2fx step mode" % (
                lo["rank"], lo["tensors"], lo["params"], lo["threads"], bare * 1e3,
                extra["adamw_fused"] * 1e3, extra["ours_fused"] * 1e3,
                extra["ours_step"] * 1e3, extra["adamw_fused"] / extra["ours_fused"],
                extra["adamw_fused"] / extra["ours_step"]))
    return out
