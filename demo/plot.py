#!/usr/bin/env python3
"""Draws amdemo's curves.csv as one PNG (run by scripts/demo.sh).

usage: plot.py OUT_DIR      reads OUT_DIR/curves.csv, writes OUT_DIR/demo.png

Panels: validation loss of every run; what bfloat16 storage costs (validation
loss minus the float32 Automagic3 run's) with stochastic rounding and with
round-to-nearest; the spread of Automagic3's per-row learning rates over time;
the mean learning rate of each tensor.
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "automagic3": "Automagic3, float32 (defaults)",
    "adamw": "AdamW, float32",
    "automagic3-sr": "Automagic3, bf16 weights, stochastic rounding",
    "automagic3-rtn": "Automagic3, bf16 weights, round-to-nearest",
}
COLORS = {"automagic3": "C0", "adamw": "C1", "automagic3-sr": "C2", "automagic3-rtn": "C3"}
# bf16 with stochastic rounding lies on top of float32: dashed, so both show.
STYLES = {"automagic3-sr": "--"}


def load(path):
    runs = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            runs.setdefault(row["run"], []).append(row)
    return runs


def col(rows, name):
    return [float(r[name]) if r[name] != "" else float("nan") for r in rows]


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out_dir = argv[1]
    src = os.path.join(out_dir, "curves.csv")
    try:
        runs = load(src)
    except OSError as e:
        print("plot.py: cannot read %s: %s" % (src, e.strerror), file=sys.stderr)
        return 1

    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    (a_loss, a_bf16), (a_lr, a_tensor) = ax

    for name, rows in runs.items():
        a_loss.plot(col(rows, "step"), col(rows, "val_loss"), COLORS.get(name, "k"),
                    linestyle=STYLES.get(name, "-"), label=LABELS.get(name, name))
    a_loss.set_title("validation loss (4096 held-out examples)")
    a_loss.set_xlabel("step")
    a_loss.set_ylabel("cross-entropy (nats)")
    lo = min(min(col(r, "val_loss")) for r in runs.values())
    a_loss.set_ylim(lo - 0.05, lo + 1.0)
    a_loss.grid(alpha=0.3)
    a_loss.legend()

    if "automagic3" not in runs:
        # (--runs without it, e.g. DEMO.md's AdamW lr sweep: the loss panel
        # only; the others compare with or show the float32 Automagic3 run)
        for a in (a_bf16, a_lr, a_tensor):
            a.text(0.5, 0.5, "no float32 Automagic3 run in this CSV (--runs)",
                   ha="center", va="center")
            a.set_axis_off()
        return save(fig, out_dir)

    base = dict(zip(col(runs["automagic3"], "step"), col(runs["automagic3"], "val_loss")))
    for name in ("automagic3-sr", "automagic3-rtn"):
        if name in runs:
            steps = col(runs[name], "step")
            diff = [v - base.get(s, float("nan")) for s, v in zip(steps, col(runs[name], "val_loss"))]
            a_bf16.plot(steps, diff, color=COLORS[name], label=LABELS[name])
    a_bf16.axhline(0.0, color="C0", lw=1, label="float32 (reference)")
    a_bf16.set_title("bfloat16 weights: validation loss minus float32's")
    a_bf16.set_xlabel("step")
    a_bf16.set_ylabel("loss difference (nats)")
    a_bf16.grid(alpha=0.3)
    a_bf16.legend()

    rows = runs["automagic3"]
    steps = col(rows, "step")
    a_lr.fill_between(steps, col(rows, "lr_min"), col(rows, "lr_max"), color="C0", alpha=0.15,
                      label="min to max")
    a_lr.fill_between(steps, col(rows, "lr_p10"), col(rows, "lr_p90"), color="C0", alpha=0.35,
                      label="10th to 90th percentile")
    a_lr.plot(steps, col(rows, "lr_p50"), color="C0", label="median")
    a_lr.set_yscale("log")
    a_lr.set_title("Automagic3 (float32): per-row lrs of emb, W1, W2")
    a_lr.set_xlabel("step")
    a_lr.set_ylabel("learning rate")
    a_lr.grid(alpha=0.3, which="both")
    a_lr.legend(loc="lower left")

    for i, t in enumerate(("emb", "W1", "b1", "W2", "b2")):
        key = "lr_" + t
        if key in rows[0]:
            a_tensor.plot(steps, col(rows, key), color="C%d" % (i + 4), label=t)
    a_tensor.set_yscale("log")
    a_tensor.set_title("Automagic3 (float32): mean lr of each tensor")
    a_tensor.set_xlabel("step")
    a_tensor.set_ylabel("learning rate")
    a_tensor.grid(alpha=0.3, which="both")
    a_tensor.legend()

    return save(fig, out_dir)


def save(fig, out_dir):
    fig.suptitle("amdemo: character-level MLP on the wamerican word list")
    fig.tight_layout()
    dst = os.path.join(out_dir, "demo.png")
    fig.savefig(dst, dpi=90)
    print("wrote %s" % dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
