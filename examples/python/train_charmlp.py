#!/usr/bin/env python3
"""The demo's model in PyTorch: a character-level MLP language model on a word
list, trained from the same initial weights on the same batches with

  automagic.Automagic3   libautomagic's PyTorch front end (defaults, fused)
  reference Automagic3   the original class, ../shared/reference/automagic3.py
                         (skipped with a message when that file is absent)
  torch.optim.AdamW      at a fixed lr (default 3e-3)

printing the loss and the time per step of each, then a summary.

usage: python examples/python/train_charmlp.py [--steps N] [--data FILE] ...
       (install the front end first: pip install .)
"""
import argparse
import importlib.util
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

import automagic

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.normpath(os.path.join(HERE, "..", "..", "..", "shared", "reference",
                                          "automagic3.py"))
VOCAB = 27  # '.' (word boundary) and a..z, as in the C demo
MAX_DATA_BYTES = 64 << 20
# the C demo's ranges (demo/main.c)
LIMITS = {"steps": 100000000, "batch": 65536, "context": 16, "embed": 1024, "hidden": 16384,
          "threads": 1024}


def load_words(path):
    """The lines made only of a..z (the C demo's rule: only the line end is
    dropped, CR LF too; a line with a space is not a word)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        # (at most 64 MiB, as the C demo: /dev/zero filled the memory)
        text = f.read(MAX_DATA_BYTES + 1)
    if len(text) > MAX_DATA_BYTES:
        raise ValueError("larger than 64 MiB")
    words = [w[:-1] if w.endswith("\r") else w for w in text.split("\n")]
    words = [w for w in words if w and len(w) <= 64 and all("a" <= c <= "z" for c in w)]
    if len(words) < 10:
        raise ValueError("%s has %d usable words (lines of a-z only); need at least 10"
                         % (path, len(words)))
    return words


def examples(words, ctx):
    """X (n, ctx) previous tokens, Y (n) next token; '.' pads and ends."""
    xs, ys = [], []
    for w in words:
        window = [0] * ctx
        for ch in w + ".":
            t = 0 if ch == "." else ord(ch) - ord("a") + 1
            xs.append(window)
            ys.append(t)
            window = window[1:] + [t]
    return torch.tensor(xs, dtype=torch.long), torch.tensor(ys, dtype=torch.long)


class CharMLP(torch.nn.Module):
    """emb (V, E) -> W1 (H, K*E) + tanh -> W2 (V, H): the C demo's model."""

    def __init__(self, ctx, embed, hidden):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, embed)
        self.fc1 = torch.nn.Linear(ctx * embed, hidden)
        self.fc2 = torch.nn.Linear(hidden, VOCAB)
        with torch.no_grad():  # the C demo's init
            torch.nn.init.normal_(self.fc1.weight, std=(5 / 3) / math.sqrt(ctx * embed))
            torch.nn.init.normal_(self.fc2.weight, std=0.1 / math.sqrt(hidden))
            self.fc1.bias.zero_()
            self.fc2.bias.zero_()

    def forward(self, x):  # x (B, K) -> logits (B, V)
        return self.fc2(torch.tanh(self.fc1(self.emb(x).flatten(1))))


def load_reference():
    if not os.path.exists(REFERENCE):
        return None
    spec = importlib.util.spec_from_file_location("automagic3_reference", REFERENCE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Automagic3


def train(name, make_opt, init_state, args, Xtr, Ytr, Xva, Yva):
    model = CharMLP(args.context, args.embed, args.hidden)
    model.load_state_dict(init_state)
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(args.seed)  # same batches for every optimizer
    every = max(1, args.steps // 10)
    tail, t_train, t_win, n_win, loss_win = [], 0.0, 0.0, 0, 0.0
    print("\n%s" % name)
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, Xtr.shape[0], (args.batch,), generator=gen)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(Xtr[idx]), Ytr[idx])
        loss.backward()  # Automagic3 (both) update each parameter inside backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        t_train += dt
        t_win += dt
        n_win += 1
        loss_win += loss.item()
        if step > args.steps - max(1, args.steps // 10):
            tail.append(loss.item())
        if step % every == 0 or step == args.steps:
            print("  step %6d  loss %.4f  %.2f ms/step" % (step, loss_win / n_win,
                                                           1e3 * t_win / n_win))
            t_win, n_win, loss_win = 0.0, 0, 0.0
    with torch.no_grad():
        val = F.cross_entropy(model(Xva), Yva).item()
    return dict(name=name, train=sum(tail) / len(tail), val=val, ms=1e3 * t_train / args.steps)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\nusage:")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="steps per optimizer (default 1000)")
    p.add_argument("--data", default="/usr/share/dict/words",
                   help="word list, one word per line (default: Debian wamerican's)")
    p.add_argument("--batch", type=int, default=128, help="minibatch size (default 128)")
    p.add_argument("--context", type=int, default=4,
                   help="previous characters seen (default 4)")
    p.add_argument("--embed", type=int, default=16, help="embedding size (default 16)")
    p.add_argument("--hidden", type=int, default=192, help="hidden units (default 192)")
    p.add_argument("--adamw-lr", type=float, default=3e-3,
                   help="AdamW's learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the split, init, batches and rounding (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    for k, top in LIMITS.items():
        if not 1 <= getattr(args, k) <= top:
            p.error("--%s must be in [1, %d], as the C demo's" % (k, top))
    if not 0 < args.adamw_lr < math.inf:
        p.error("--adamw-lr must be positive and finite")
    if not 0 <= args.seed < 2 ** 64:
        p.error("--seed must be in [0, 2**64)")
    return args


def run(args):
    """Trains with every optimizer; returns their results (dicts), or None
    when the data file is unusable (message on stderr)."""
    try:
        words = load_words(args.data)
    except (OSError, ValueError) as e:
        print("train_charmlp.py: cannot use data file %r: %s" % (args.data, e), file=sys.stderr)
        return None

    torch.set_num_threads(args.threads)
    random.Random(args.seed).shuffle(words)
    n_val = max(1, len(words) // 10)
    Xtr, Ytr = examples(words[:-n_val], args.context)
    Xva, Yva = examples(words[-n_val:], args.context)
    torch.manual_seed(args.seed)
    init_state = CharMLP(args.context, args.embed, args.hidden).state_dict()
    print("data: %s: %d words, %d train / %d validation examples; %d steps of batch %d"
          % (args.data, len(words), len(Ytr), len(Yva), args.steps, args.batch))

    runs = [("automagic.Automagic3 (libautomagic)",
             lambda ps: automagic.Automagic3(ps, seed=args.seed))]
    reference = load_reference()
    if reference is None:
        print("reference Automagic3: skipped (%s not found)" % REFERENCE)
    else:
        runs.append(("reference Automagic3", lambda ps: reference(ps)))
    runs.append(("torch.optim.AdamW lr=%g" % args.adamw_lr,
                 lambda ps: torch.optim.AdamW(ps, lr=args.adamw_lr)))

    results = [train(name, make, init_state, args, Xtr, Ytr, Xva, Yva) for name, make in runs]
    ref_ms = results[-1]["ms"]
    print("\n| %-36s | %-10s | %-8s | %-16s |" % ("optimizer", "train loss", "val loss",
                                                 "ms/step"))
    print("|%s|%s|%s|%s|" % ("-" * 38, "-" * 12, "-" * 10, "-" * 18))
    for r in results:
        print("| %-36s | %10.4f | %8.4f | %7.2f (x%.2f) |" % (r["name"], r["train"], r["val"],
                                                            r["ms"], r["ms"] / ref_ms))
    print("train loss: mean over the last 10% of steps; ms/step: forward + backward + "
          "update, (xN) relative to AdamW in this run")
    return results


def main(argv=None):
    return 0 if run(parse_args(argv)) is not None else 2


if __name__ == "__main__":
    sys.exit(main())
