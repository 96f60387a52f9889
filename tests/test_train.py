"""The training entry point: learning, exact resume, atomic checkpoints, and clear errors."""

import pytest
import torch

from tutorial_utils import checkpoint as ckpt_mod
from tutorial_utils import train as train_mod
from tutorial_utils.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tutorial_utils.config import ConfigError
from tutorial_utils.data import synthetic_cifar10
from tutorial_utils.devices import gpu_count
from tutorial_utils.parallel.distributed import DistContext
from tutorial_utils.train import TrainConfig, lr_factor, main, run

CPU = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture(autouse=True)
def small_data(monkeypatch):
    monkeypatch.setattr(train_mod, "load_cifar10", lambda *a, **k: synthetic_cifar10(512, 128))


def tiny(tmp_path, **kw):
    base = dict(depth=10, width=1, epochs=2, batch=64, data="synthetic", out=tmp_path / "run",
                bf16=False, device="cpu")
    return TrainConfig(**{**base, **kw})


def weights(cfg):
    return torch.load(cfg.out / "checkpoint.pt", weights_only=True)["model"]


def test_training_reduces_the_loss(tmp_path):
    records = run(tiny(tmp_path, epochs=3), CPU)
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and '"synthetic_data": true' in lines[0]


def test_classic_dataloader_path_trains(tmp_path):
    (record,) = run(tiny(tmp_path, epochs=1, loader="dataloader", workers=0), CPU)
    assert record["images_per_s"] > 0 and record["train_loss"] > 0


class Killed(Exception):
    pass


@pytest.mark.parametrize("ema", [0.0, 0.9])
def test_resume_gives_bitwise_the_same_weights(tmp_path, monkeypatch, ema):
    straight = tiny(tmp_path / "a", epochs=3, ema=ema)
    straight_records = run(straight, CPU)

    interrupted = tiny(tmp_path / "b", epochs=3, ema=ema)
    original = train_mod.Trainer.train_one_epoch

    def die_in_epoch_2(self, epoch):
        if epoch == 1:
            raise Killed
        return original(self, epoch)

    monkeypatch.setattr(train_mod.Trainer, "train_one_epoch", die_in_epoch_2)
    with pytest.raises(Killed):
        run(interrupted, CPU)
    monkeypatch.setattr(train_mod.Trainer, "train_one_epoch", original)
    resumed = run(tiny(tmp_path / "b", epochs=3, resume=True, ema=ema), CPU)

    assert [r["epoch"] for r in resumed] == [2, 3]
    assert [r["test_acc"] for r in resumed] == [r["test_acc"] for r in straight_records[1:]]
    a, b = weights(straight), weights(interrupted)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if ema:
        a, b = (torch.load(c.out / "checkpoint.pt", weights_only=True)["ema"]
                for c in (straight, interrupted))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_ema_averages_every_step_and_is_what_evaluate_tests(tmp_path, monkeypatch):
    trainer = train_mod.Trainer(tiny(tmp_path, ema=0.75), CPU, synthetic_cifar10(256, 32))
    after_steps = []
    update = trainer.ema.update_parameters
    monkeypatch.setattr(trainer.ema, "update_parameters", lambda net: after_steps.append(
        [p.detach().clone() for p in net.parameters()]) or update(net))
    trainer.train_one_epoch(0)
    assert len(after_steps) == trainer.steps_per_epoch == 4
    expected = after_steps[0]  # the average starts from the weights after the first step
    for w in after_steps[1:]:
        expected = [0.75 * e + 0.25 * p for e, p in zip(expected, w, strict=True)]
    for e, p in zip(expected, trainer.ema.module.parameters(), strict=True):
        torch.testing.assert_close(p, e)

    calls = []
    for module, name in ((trainer.model, "trained"), (trainer.ema.module, "average")):
        forward = module.forward
        monkeypatch.setattr(module, "forward", lambda x, f=forward, n=name: calls.append(n) or f(x))
    trainer.evaluate()
    assert calls and set(calls) == {"average"}


def test_warm_up_leaves_the_training_unchanged(tmp_path, monkeypatch):
    straight = tiny(tmp_path / "a", epochs=1, dropout=0.3)
    run(straight, CPU)

    original_init = train_mod.Trainer.__post_init__

    def warmed_up(self):  # the warm-up a compiled run gets, on an eager one
        original_init(self)
        assert self.warm_up(steps=2) > 0

    monkeypatch.setattr(train_mod.Trainer, "__post_init__", warmed_up)
    warm = tiny(tmp_path / "b", epochs=1, dropout=0.3)
    run(warm, CPU)
    a, b = weights(straight), weights(warm)
    assert all(torch.equal(a[k], b[k]) for k in a)  # weights and BatchNorm statistics


def test_step_graph_without_a_gpu_trains_exactly_as_without(tmp_path):
    straight = tiny(tmp_path / "a", epochs=2, dropout=0.3)
    graphed = tiny(tmp_path / "b", epochs=2, dropout=0.3, step_graph=True)
    losses = [[r["train_loss"] for r in run(cfg, CPU)] for cfg in (straight, graphed)]
    assert losses[0] == losses[1]
    a, b = weights(straight), weights(graphed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
def test_step_graph_on_a_gpu_trains_like_the_eager_step(tmp_path):
    gpu = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cuda"))
    runs = [run(tiny(tmp_path / name, epochs=2, device="cuda", bf16=True, deterministic=True,
                     **kw), gpu) for name, kw in (("a", {}), ("b", {"step_graph": True}))]
    eager, graphed = ([r["train_loss"] for r in records] for records in runs)
    assert graphed == pytest.approx(eager, rel=1e-3)
    assert graphed[-1] < graphed[0]


def test_ghost_batch_norm_trains_and_resumes_only_with_the_same_groups(tmp_path):
    records = run(tiny(tmp_path, epochs=3, ghost_batch=16), CPU)
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    with pytest.raises(CheckpointError, match="ghost_batch=16 \\(this run: 0\\)"):
        run(tiny(tmp_path, epochs=4, resume=True), CPU)


def test_norm_weight_decay_off_spares_only_one_dimensional_tensors():
    net = train_mod.WideResNet(10, 1)
    (everything,) = train_mod.param_groups(net, 5e-4)
    decayed, spared = train_mod.param_groups(net, 5e-4, decay_all=False)
    assert len(everything["params"]) == len(decayed["params"]) + len(spared["params"])
    assert spared["weight_decay"] == 0 and decayed["weight_decay"] == 5e-4
    bn = {id(p) for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)
          for p in m.parameters()}
    assert bn <= {id(p) for p in spared["params"]}
    assert all(p.ndim == 4 for p in decayed["params"][:-1]) and decayed["params"][-1].ndim == 2


def test_test_time_augmentation_adds_the_mirror_image(tmp_path, monkeypatch):
    seen = []
    cfg = tiny(tmp_path, epochs=1, tta=True)
    trainer = train_mod.Trainer(cfg, CPU, synthetic_cifar10(64, 32))
    forward = trainer.model.forward
    monkeypatch.setattr(trainer.model, "forward", lambda x: seen.append(x) or forward(x))
    assert 0 <= trainer.evaluate() <= 1
    assert len(seen) == 2 and torch.equal(seen[1], torch.flip(seen[0], dims=[3]))


class StaticOutput(torch.nn.Module):
    """Returns its result in the same tensor on every call, as a CUDA-graph replay does."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))
        self.register_buffer("out", torch.zeros(4, 10))

    def forward(self, x):
        return self.out.copy_(self.net(x))


def test_test_time_augmentation_survives_reused_output_memory():
    torch.manual_seed(0)
    model, x = StaticOutput(), torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        expected = model.net(x) + model.net(torch.flip(x, dims=[3]))
        assert torch.allclose(train_mod.predict(model, x, tta=True), expected)


def test_test_time_augmentation_with_shifts_adds_six_views():
    torch.manual_seed(0)
    model, x = StaticOutput(), torch.randn(4, 3, 8, 8)
    mirror = torch.flip(x, dims=[3])
    with torch.no_grad():
        expected = sum(model.net(v) + 0.5 * (model.net(train_mod.translate(v, 1))
                                             + model.net(train_mod.translate(v, -1)))
                       for v in (x, mirror))
        assert torch.allclose(train_mod.predict(model, x, tta=True, shift=1), expected)
    moved = train_mod.translate(x, 1)
    assert torch.equal(moved[..., 1:, 1:], x[..., :-1, :-1])  # down-right by one pixel
    assert torch.equal(train_mod.translate(x, -2)[..., :-2, :-2], x[..., 2:, 2:])


def test_interrupted_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"epoch": 1, "config": {}})

    def crash_midway(obj, f):
        with open(f, "wb") as fh:
            fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod.torch, "save", crash_midway)
    with pytest.raises(OSError):
        save_checkpoint(path, {"epoch": 2, "config": {}})
    assert load_checkpoint(path, {})["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_lr_schedules():
    cfg = TrainConfig(epochs=10, warmup_epochs=2)
    assert lr_factor(cfg, 0, 100) == pytest.approx(1 / 200)
    assert lr_factor(cfg, 200, 100) == pytest.approx(1.0)
    assert lr_factor(cfg, 600, 100) == pytest.approx(0.5)
    step = TrainConfig(epochs=200, schedule="step")
    assert [lr_factor(step, e * 10, 10) for e in (0, 60, 120, 160)] == pytest.approx(
        [1, 0.2, 0.04, 0.008])


def test_batch_scaling_and_lr():
    strong, weak = TrainConfig(batch=128), TrainConfig(batch=128, scaling="weak")
    assert strong.batches(2) == (64, 128) and strong.peak_lr(2) == pytest.approx(0.1)
    assert weak.batches(2) == (128, 256) and weak.peak_lr(2) == pytest.approx(0.2)
    with pytest.raises(ConfigError, match="--batch 128 is not divisible by 3 processes"):
        strong.batches(3)


def error_of(capsys, *argv):
    capsys.readouterr()  # drop what earlier steps printed
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, "errors are one line"
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--depth", "27"], "--depth must be 6n+4"),
        (["--width", "0"], "--width must be >= 1"),
        (["--batch", "0"], "--batch must be >= 1"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate (see --help)"),
        (["--loader", "magic"], "invalid choice: 'magic'"),
        (["--step-graph", "--compile", "reduce-overhead"], "--step-graph records the whole step"),
        (["--crop-pad", "-1"], "--crop-pad must be >= 0"),
        (["--tta-shift", "1"], "--tta-shift needs --tta"),
        (["--tta", "--tta-shift", "32"], "--tta-shift must be 0..31 pixels"),
        (["--ema", "1"], "--ema must be a decay in [0, 1)"),
        (["--bucket-mb", "0"], "--bucket-mb must be > 0"),
        (["--tune-kernels"], "--tune-kernels tunes the kernels torch.compile generates"),
        (["--ghost-batch", "1"], "--ghost-batch must be 0 (off) or >= 2 images"),
        (["--ghost-batch", "48"], "batch of each process (128) is not a multiple of --ghost"),
    ],
)
def test_bad_options(capsys, argv, message):
    assert message in error_of(capsys, *argv)


@pytest.mark.skipif(gpu_count() > 0, reason="needs a machine without GPUs")
def test_gpu_requested_without_gpu(capsys):
    assert "no GPU; use --device cpu" in error_of(capsys, "--device", "cuda")


def test_no_dataset_offline(capsys, tmp_path, monkeypatch):
    monkeypatch.undo()  # the real loader
    err = error_of(capsys, "--device", "cpu", "--no-download", "--data-dir", str(tmp_path))
    assert "downloading is off" in err and "--data synthetic" in err


def test_corrupt_checkpoint(capsys, tmp_path):
    cfg = tiny(tmp_path)
    cfg.out.mkdir(parents=True)
    (cfg.out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    err = error_of(capsys, "--depth", "10", "--width", "1", "--data", "synthetic",
                   "--device", "cpu", "--out", str(cfg.out), "--resume")
    assert "is corrupt or not a checkpoint" in err and "delete it" in err


def test_mismatched_checkpoint(capsys, tmp_path):
    run(tiny(tmp_path, epochs=1), CPU)
    err = error_of(capsys, "--depth", "16", "--width", "1", "--epochs", "1", "--batch", "64",
                   "--data", "synthetic", "--device", "cpu", "--out", str(tmp_path / "run"),
                   "--resume")
    assert "was written with depth=10 (this run: 16)" in err
