"""Under torchrun (gloo, 4 processes): the tensor-parallel checks with one collective dropped.

Each mutation removes one collective the split model needs, runs the mode it breaks through
``tp_check.compare``, and puts the code back. Rank 0 writes one JSON line per mutation to the
path given as the only argument; the test asserts that every one of them is caught.
"""

import sys
from pathlib import Path
from unittest import mock

from torch.distributed.tensor.parallel import style

from tutorial_utils.jsonl import write_jsonl
from tutorial_utils.parallel import tensor
from tutorial_utils.parallel.distributed import distributed
from tutorial_utils.workers import tp_check


def _no_backward_sum(ctx, grad):
    return grad, None  # f's backward without its all-reduce


def _no_forward_sum(ctx, x, group):
    return x.clone()  # g's forward without its all-reduce


def _partial_output(output_layouts, use_local_output, mod, outputs, device_mesh):
    return outputs.to_local()  # the row-parallel layer's partial sums, never added up


def _no_gradient_sync(model, mesh, **options):
    model = tensor.two_dimensional(model, mesh, **options)
    model.set_requires_gradient_sync(False)  # no reduce-scatter over dp
    return model


MUTATIONS = {
    "f: no all-reduce in backward": (
        "by-hand", mock.patch.object(tensor._CopyToRanks, "backward",
                                     staticmethod(_no_backward_sum))),
    "g: no all-reduce in forward": (
        "by-hand", mock.patch.object(tensor._SumOverRanks, "forward",
                                     staticmethod(_no_forward_sum))),
    "RowwiseParallel: output not reduced": (
        "parallelize_module", mock.patch.object(style.RowwiseParallel, "_prepare_output_fn",
                                                staticmethod(_partial_output))),
    "FSDP2: gradients not reduce-scattered": (
        "2-D", mock.patch.object(tp_check, "two_dimensional", _no_gradient_sync)),
}

with distributed("cpu") as ctx:
    rows = []
    for name, (mode, patch) in MUTATIONS.items():
        cfg = tp_check.TPCheckConfig(modes=(mode,), device="cpu")
        with patch:
            (row,) = tp_check.compare(cfg, ctx)
        rows.append(row | {"mutation": name})
    if ctx.is_main:
        write_jsonl(Path(sys.argv[1]), rows)
