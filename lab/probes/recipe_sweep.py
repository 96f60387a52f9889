"""Probe (not part of the book): chapter 5's fast 10-epoch recipe on N GPUs, one change at a time.

    python scripts/probes/recipe_sweep.py OUT_DIR [BUDGET_S [VARIANT ...]]

Every variant is the recipe (chapter 5's fast recipe before ``--crop-pad 2`` joined it) plus
its flags — the ``fast`` ones start from chapter 5's recipe itself — run with
``tutorial_utils.experiment.train``; each run's metrics go to
``OUT_DIR/<variant>/metrics.jsonl``. No variant starts after ``BUDGET_S`` seconds (default
480). Without VARIANT names, all run. One seed per variant: differences under ~0.3 points are
noise.
"""

import os
import sys
import time
from pathlib import Path

from tutorial_utils.devices import gpu_count
from tutorial_utils.experiment import train

RECIPE = ["--depth", "28", "--width", "10", "--epochs", "10", "--batch", "128", "--scaling",
          "weak", "--label-smoothing", "0.1", "--tta", "--step-graph", "--compile", "default",
          "--data", os.environ.get("TUTORIAL_CIFAR10", "auto"), "--checkpoint-every", "0",
          "--seed", "0", "--device", "cuda"]
FAST = ["--crop-pad", "2"]  # chapter 5's recipe itself
VARIANTS = {
    "recipe": [],
    "crop-pad-2": ["--crop-pad", "2"],
    "no-norm-decay": ["--no-norm-weight-decay"],
    "lr-0.2": ["--lr", "0.2"],
    "ls-0.2": ["--label-smoothing", "0.2"],
    "pad2+no-norm-decay+ls0.2": ["--crop-pad", "2", "--no-norm-weight-decay",
                                 "--label-smoothing", "0.2"],
    "lr-0.05": ["--lr", "0.05"],
    "crop-pad-0": ["--crop-pad", "0"],
    "pad2+lr-0.05": ["--crop-pad", "2", "--lr", "0.05"],
    "fast": FAST,
    "fast+ghost-32": [*FAST, "--ghost-batch", "32"],
    "fast@seed1": [*FAST, "--seed", "1"],
    "fast+ghost-32@seed1": [*FAST, "--ghost-batch", "32", "--seed", "1"],
    "fast+tune-kernels": [*FAST, "--tune-kernels"],
    "fast+batch-96": [*FAST, "--batch", "96"],  # 96 per GPU: a third more steps, lr scaled
    "fast+wd-1e-3": [*FAST, "--weight-decay", "1e-3"],
    "fast+wd-2.5e-4": [*FAST, "--weight-decay", "2.5e-4"],
    "fast+warmup-0.3": [*FAST, "--warmup-epochs", "0.3"],
    "fast+batch-96+wd-1e-3": [*FAST, "--batch", "96", "--weight-decay", "1e-3"],
}

out_dir = Path(sys.argv[1])
budget_s = float(sys.argv[2]) if len(sys.argv) > 2 else 480
chosen = sys.argv[3:] or list(VARIANTS)
n = gpu_count()
t0 = time.perf_counter()
rows = []
for name in chosen:
    flags = VARIANTS[name]
    if time.perf_counter() - t0 > budget_s:
        print(f"{name}: not started, {budget_s:.0f} s budget spent", flush=True)
        continue
    started = time.perf_counter()
    try:
        r = train(n, [*RECIPE, *flags], out_dir / name, label=name, timeout_s=300)
    except Exception as err:  # one failed variant must not lose the others
        print(f"{name}: failed: {str(err)[-400:]}", flush=True)
        continue
    acc = " ".join(f"{100 * e['test_acc']:.1f}" for e in r.epochs)
    print(f"{name}: {r.train_s:.1f} s, {100 * r.final_acc:.2f} %, warm-up "
          f"{r.start['compile_warmup_s']:.1f} s, wall {time.perf_counter() - started:.0f} s; "
          f"per epoch: {acc}", flush=True)
    rows.append((name, r))

print(f"\n{'variant':<28}{'train s':>8}{'later s':>8}{'test %':>8}{'train %':>8}")
for name, r in rows:
    print(f"{name:<28}{r.train_s:>8.1f}{r.steady_epoch_s:>8.2f}{100 * r.final_acc:>8.2f}"
          f"{100 * r.epochs[-1]['train_acc']:>8.2f}")
