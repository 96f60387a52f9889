"""Probe helper: step_timing with the network compiled in fewer, larger pieces.

    PIECES=groups torchrun --standalone --nproc_per_node=2 scripts/probes/pieces_step.py ARGS

The same as ``python -m lab.step_timing ARGS``, except that for
``--grad-sync buckets/copy-engine`` the Wide-ResNet is compiled in the pieces PIECES names
instead of child by child (``compile_children``: 15 pieces for WRN-28-10):

- ``children``: the package's way, for the A/B;
- ``groups``: three pieces, the stem with the first group of blocks, the second group, the
  third group with the head (pieces start where a block halves the resolution);
- ``groups4``: the same with the third group, which holds 3/4 of the parameters, cut in two.

The layers are shared, not copied: the step's parameters, hooks and optimizer are the same.
"""

import os

from torch import nn

from tutorial_utils.models.wrn import BasicBlock
from tutorial_utils.parallel import step_timing


def in_pieces(net: nn.Sequential, mode: str) -> nn.Module:
    layers = list(net)
    starts = [0] + [i for i, m in enumerate(layers)
                    if isinstance(m, BasicBlock) and m.conv1.stride == (2, 2)]
    if os.environ["PIECES"] == "groups4":
        blocks_end = max(i for i, m in enumerate(layers) if isinstance(m, BasicBlock)) + 1
        starts.append((starts[-1] + blocks_end) // 2)
    ends = [*starts[1:], len(layers)]
    pieces = [nn.Sequential(*layers[a:b]) for a, b in zip(starts, ends, strict=True)]
    for piece in pieces:
        piece.compile(mode=mode, dynamic=False)
    print(f"pieces start at layers {starts} of {len(layers)}", flush=True)
    return nn.Sequential(*pieces)


if __name__ == "__main__":
    if os.environ.get("PIECES", "children") != "children":
        step_timing.compile_children = in_pieces
    step_timing.main()
