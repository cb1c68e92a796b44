"""The demo's Python side: examples/python/train_charmlp.py (the PyTorch
example) and demo/plot.py (the plot amdemo's curves are drawn with)."""
import csv
import importlib.util
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFERENCE = os.path.join(ROOT, "..", "shared", "reference", "automagic3.py")
WORDS = ("apple banana cherry date elder fig grape hazel iris juniper kiwi lemon mango "
         "nectar olive peach quince raisin sloe tomato ugli vanilla walnut yam zucchini")


def _load(relpath, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def words_file(tmp_path):
    p = tmp_path / "words.txt"
    p.write_text("\n".join(WORDS.split() + ["Capital", "it's"]) + "\n")
    return str(p)


def test_example_trains_all_optimizers(words_file, capsys):
    ex = _load("examples/python/train_charmlp.py", "train_charmlp")
    args = ex.parse_args(["--data", words_file, "--steps", "30", "--hidden", "16",
                          "--batch", "32"])
    results = ex.run(args)
    out = capsys.readouterr().out
    names = [r["name"] for r in results]
    assert names[0].startswith("automagic.Automagic3")
    assert names[-1].startswith("torch.optim.AdamW")
    assert "ms/step" in out
    for r in results:
        assert math.isfinite(r["val"]) and r["ms"] > 0
        # 30 steps from a near-uniform start: below log(27) = 3.296
        assert r["train"] < math.log(27)
    if not os.path.exists(REFERENCE):
        assert "reference Automagic3: skipped" in out
        pytest.skip("reference not found at %s: front end vs reference not compared" % REFERENCE)
    ref = results[1]
    assert ref["name"] == "reference Automagic3"
    # float32: the front end follows the reference's trajectory (SPEC 3)
    assert abs(results[0]["val"] - ref["val"]) < 1e-4
    assert abs(results[0]["train"] - ref["train"]) < 1e-4


def test_example_rejects_a_missing_data_file(tmp_path, capsys):
    ex = _load("examples/python/train_charmlp.py", "train_charmlp")
    missing = str(tmp_path / "nope.txt")
    assert ex.main(["--data", missing, "--steps", "1"]) == 2
    assert "cannot use data file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed must be in"),                     # was a traceback
    (["--seed", str(2 ** 64)], "--seed must be in"),             # was an OverflowError
    (["--adamw-lr", "inf"], "--adamw-lr must be positive and finite"),  # trained to nan
])
def test_example_refuses_bad_arguments(argv, message, capsys):
    ex = _load("examples/python/train_charmlp.py", "train_charmlp")
    with pytest.raises(SystemExit) as e:
        ex.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_example_words_follow_the_demo_rule(tmp_path):
    # only the line end is dropped, as amdemo does: a line with spaces around
    # a word is not a word (strip() kept it); CR LF ends a line
    ex = _load("examples/python/train_charmlp.py", "train_charmlp")
    p = tmp_path / "w.txt"
    p.write_bytes(("\n".join(WORDS.split()) + "\n  padded\nwith space\r\ncrlf\r\n").encode())
    words = ex.load_words(str(p))
    assert words == WORDS.split() + ["crlf"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (scripts/demo.sh "
                        "installs it); demo/plot.py not checked")
    plot = _load("demo/plot.py", "demo_plot")
    fields = ["run", "step", "train_loss", "val_loss", "lr_mean", "lr_min", "lr_p10", "lr_p50",
              "lr_p90", "lr_max", "lr_emb", "lr_W1", "lr_b1", "lr_W2", "lr_b2",
              "train_seconds"]
    with open(tmp_path / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for run in ("automagic3", "adamw", "automagic3-sr", "automagic3-rtn"):
            for step in range(0, 101, 10):
                loss = 3.3 - step / 100
                w.writerow([run, step, "" if step == 0 else loss, loss] +
                           [1e-3 * (1 + k) for k in range(11)] + [step / 10])
    assert plot.main(["plot.py", str(tmp_path)]) == 0
    with open(tmp_path / "demo.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert plot.main(["plot.py", str(tmp_path / "missing")]) == 1
    # a CSV without the float32 Automagic3 run (--runs adamw, DEMO.md's lr
    # sweep): its loss panel, not an error
    adamw = tmp_path / "adamw"
    adamw.mkdir()
    with open(tmp_path / "curves.csv") as src, open(adamw / "curves.csv", "w") as dst:
        for i, line in enumerate(src):
            if i == 0 or line.startswith("adamw,"):
                dst.write(line)
    assert plot.main(["plot.py", str(adamw)]) == 0
    assert (adamw / "demo.png").exists()
