"""Under torchrun (gloo, N processes): each strategy's first step against one process's.

Every rank also trains one process's reference itself, in fp32 on the same data. Rank 0 writes
one JSON line per strategy to the path given as the first argument (the second: a folder for
the checkpoints, the same for every rank), each with:

- the GPT (AdamW): ``loss`` and ``norm`` (the global gradient norm the clipping found), relative
  differences; ``grads``, the largest difference of a clipped gradient over the largest such
  gradient. Compared before the optimizer's step: AdamW's first update is about the sign of
  each gradient, which a rounding difference flips where a gradient is near zero;
- the Wide-ResNet (SGD): ``loss``, relative; ``weights``, the largest difference of a weight
  after one step (``update``: the largest change of a weight in that step); ``stats``, of
  rank 0's BatchNorm statistics, against one process whose BatchNorm normalises the same
  groups (``--ghost-bn``: each rank normalises its own images);
  ``restored``: the largest difference between the weights and BatchNorm statistics saved by
  the sharded strategies (``Trainer.save``, asynchronous) and those a new trainer restored.
"""

import dataclasses
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tutorial_utils.data import synthetic_cifar10
from tutorial_utils.gpt_trainer import GPTTrainer
from tutorial_utils.jsonl import write_jsonl
from tutorial_utils.loaders import normalize
from tutorial_utils.parallel.distributed import DistContext, all_reduce_sum, distributed
from tutorial_utils.parallel.strategy import clip_gradients
from tutorial_utils.text import synthetic_corpus
from tutorial_utils.trainer import TrainConfig, Trainer

ONE = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
BATCH = 16  # global: sequences (the GPT) or images (the WRN)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a, b):
    return abs(float(a) - float(b)) / abs(float(b))


def gpt_step(cfg, ctx, text):
    """Loss (the mean over every rank), gradient norm and clipped gradients of step 0."""
    trainer = GPTTrainer(cfg, ctx, text)
    loss = trainer.forward_backward(*trainer.batch(0))
    norm = clip_gradients(list(trainer.net.parameters()), cfg.clip_norm)
    grads = {k: full(p.grad) for k, p in trainer.net.named_parameters()}  # collective
    trainer.optimizer.step()  # AdamW over this layout's shards runs
    return all_reduce_sum(ctx, float(loss))[0] / ctx.world_size, float(norm), grads


def wrn_state(trainer, ctx):
    """The full weights and BatchNorm statistics (rank 0's) of ``trainer``."""
    if ctx.is_distributed and trainer.cfg.sharded:
        return get_model_state_dict(trainer.net, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in trainer.net.state_dict().items()}


def wrn_step(cfg, ctx, data, x, y):
    """Loss (the mean over every rank) and state after one SGD step on this rank's images."""
    trainer = Trainer(cfg, ctx, data)
    b = len(x) // ctx.world_size
    mine = slice(ctx.rank * b, (ctx.rank + 1) * b)
    _, loss = trainer.forward_backward(x[mine], y[mine])
    trainer.optimizer.step()
    if ctx.is_distributed:  # sharded: rank 0's BatchNorm statistics to every rank
        trainer.evaluate()
    return trainer, all_reduce_sum(ctx, float(loss))[0] / ctx.world_size, wrn_state(trainer, ctx)


def restored(trainer, ctx, state):
    """Save ``trainer`` (a sharded one) and restore it into a new trainer: the largest change."""
    trainer.save(0)
    trainer.close()
    again = Trainer(dataclasses.replace(trainer.cfg, resume=True), ctx, trainer.data)
    again.restore()
    back = wrn_state(again, ctx)
    return max(float((back[k].float() - state[k].float()).abs().max()) for k in state)


with distributed("cpu") as ctx:
    tmp = sys.argv[2]  # a folder every rank sees
    world, rows = ctx.world_size, []
    hsdp = {"strategy": "hsdp", "shard_size": 1 if world == 2 else 2}

    text = synthetic_corpus(100_000)
    gpt = TrainConfig(model="gpt", dim=32, layers=2, heads=4, seq=32, batch=BATCH, epochs=1,
                      epoch_steps=1, data="synthetic", device="cpu", precision="fp32",
                      clip_norm=0.05, out=Path(tmp) / "gpt")
    ref_loss, ref_norm, ref_grads = gpt_step(gpt, ONE, text)
    top = max(float(g.abs().max()) for g in ref_grads.values())
    for name, change in [("ddp", {}), ("fsdp2", {"strategy": "fsdp2"}),
                         ("fsdp2, --grad-accum 2", {"strategy": "fsdp2", "grad_accum": 2}),
                         ("fsdp2, --no-reshard-after-forward",
                          {"strategy": "fsdp2", "reshard_after_forward": False}),
                         (f"hsdp, --shard-size {hsdp['shard_size']}", hsdp),
                         ("fsdp2, --tp 2", {"strategy": "fsdp2", "tp": 2})]:
        loss, norm, grads = gpt_step(dataclasses.replace(gpt, **change), ctx, text)
        diff = max(float((grads[k] - g).abs().max()) for k, g in ref_grads.items())
        rows.append({"model": "gpt", "strategy": name, "loss": rel(loss, ref_loss),
                     "norm": rel(norm, ref_norm), "grads": diff / top})

    data = synthetic_cifar10(64, 16)
    # 1001 test images in batches of 500: two batches on rank 0, one on the others
    unequal = synthetic_cifar10(64, 1001)
    x, y = normalize(data.train_x[:BATCH], channels_last=True), data.train_y[:BATCH]
    wrn = TrainConfig(depth=10, width=1, batch=BATCH, epochs=1, data="synthetic", device="cpu",
                      precision="fp32", out=Path(tmp) / "wrn")
    start = wrn_state(Trainer(wrn, ONE, data), ONE)
    references = {}  # one process, BatchNorm over each rank's (micro-)batch of images
    for accum in (1, 2):
        ghost = dataclasses.replace(wrn, ghost_bn=BATCH // world // accum)
        references[accum] = wrn_step(ghost, ONE, data, x, y)[1:]
    weights = [k for k in start if "running" not in k and "num_batches" not in k]
    stats = [k for k in start if "running" in k]
    update = max(float((references[1][1][k] - start[k]).abs().max()) for k in weights)
    for name, change, accum, test_set in [
            ("ddp", {}, 1, data), ("fsdp2", {"strategy": "fsdp2"}, 1, unequal),
            ("fsdp2, --grad-accum 2", {"strategy": "fsdp2"}, 2, data),
            (f"hsdp, --shard-size {hsdp['shard_size']}", hsdp, 1, data)]:
        ref_loss, ref_state = references[accum]
        out = Path(tmp) / f"wrn-{len(rows)}"
        trainer, loss, state = wrn_step(
            dataclasses.replace(wrn, grad_accum=accum, out=out, **change), ctx, test_set, x, y)
        row = {"model": "wrn", "strategy": name, "loss": rel(loss, ref_loss), "update": update,
               "weights": max(float((state[k] - ref_state[k]).abs().max()) for k in weights)}
        if accum == 1:  # with micro-batches rank 0 updates its statistics once per micro-batch
            row["stats"] = max(float((state[k] - ref_state[k]).abs().max()) for k in stats)
        if trainer.cfg.sharded:
            row["restored"] = restored(trainer, ctx, state)
        rows.append(row)
    if ctx.is_main:
        write_jsonl(Path(sys.argv[1]), rows)
