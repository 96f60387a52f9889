"""Probe (not part of the book): one trained WRN, tested with each test-time augmentation.

    python scripts/probes/tta_eval.py RUN_DIR [RUN_DIR ...]

Loads ``RUN_DIR/checkpoint.pt`` of ``python -m tutorial_utils.train`` (its weights and, for
runs with ``--ema``, the moving average too) and classifies the CIFAR-10 test set plainly, with
the mirror image, and with the mirror image plus shifts of 1 and 2 pixels: every comparison is
between the same weights, so none of it is run-to-run noise.
"""

import sys
from pathlib import Path

import torch

from tutorial_utils.checkpoint import load_checkpoint
from tutorial_utils.data import DeviceLoader, load_cifar10
from tutorial_utils.models import WideResNet
from tutorial_utils.train import predict

VIEWS = {"plain": (False, 0), "mirror": (True, 0), "mirror+shift1": (True, 1),
         "mirror+shift2": (True, 2)}

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
rows = []
for run_dir in map(Path, sys.argv[1:]):
    state = load_checkpoint(run_dir / "checkpoint.pt", {})
    cfg = state["config"]
    data = load_cifar10(cfg["data"], Path(cfg["data_dir"]), download=False)
    test = DeviceLoader(data.test_x, data.test_y, 500, device=dev, train=False,
                        channels_last=True)
    weights = {"weights": state["model"]}
    if state.get("ema"):  # AveragedModel's state: "module." + the network's keys, n_averaged
        weights["average"] = {k.removeprefix("module."): v for k, v in state["ema"].items()
                              if k.startswith("module.")}
    for name, sd in weights.items():
        net = WideResNet(cfg["depth"], cfg["width"]).to(dev, memory_format=torch.channels_last)
        net.load_state_dict(sd)
        net.eval()
        for view, (tta, shift) in VIEWS.items():
            correct = 0
            with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
                for x, y in test:
                    correct += int((predict(net, x, tta, shift).argmax(1) == y).sum())
            rows.append((run_dir.name, name, view, correct / len(data.test_y)))
            print(f"{run_dir.name:<24}{name:<10}{view:<16}{100 * rows[-1][3]:6.2f} %", flush=True)
