"""The training entry point: learning, exact resume, atomic checkpoints, and clear errors."""

import dataclasses
import itertools
import re

import pytest
import torch

from tutorial_utils import train as train_mod
from tutorial_utils.checkpoint import CheckpointError, save_checkpoint
from tutorial_utils.config import ConfigError, parse
from tutorial_utils.data import synthetic_cifar10
from tutorial_utils.devices import gpu_count
from tutorial_utils.parallel.distributed import DistContext
from tutorial_utils.step import predict
from tutorial_utils.train import main, run
from tutorial_utils.trainer import MUST_MATCH_ON_RESUME, TrainConfig, Trainer, lr_factor

CPU = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture(autouse=True)
def small_data(monkeypatch):
    monkeypatch.setattr(train_mod, "load_cifar10", lambda *a, **k: synthetic_cifar10(512, 128))
    monkeypatch.delenv("TUTORIAL_CRASH_AT_STEP", raising=False)


@pytest.fixture
def few_images(monkeypatch):
    """Two steps an epoch: enough for tests of what a run repeats, not of what it learns."""
    monkeypatch.setattr(train_mod, "load_cifar10", lambda *a, **k: synthetic_cifar10(128, 32))


def tiny(tmp_path, **kw):
    base = dict(depth=10, width=1, epochs=2, batch=64, data="synthetic", out=tmp_path / "run",
                precision="fp32", device="cpu")
    return TrainConfig(**{**base, **kw})


def weights(cfg):
    return torch.load(cfg.out / "checkpoint.pt", weights_only=True)["model"]


def test_training_reduces_the_loss_and_records_time_to_accuracy(tmp_path):
    records = run(tiny(tmp_path, epochs=3), CPU)
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and '"synthetic_data": true' in lines[0]
    # the clock of time to accuracy: training time adds up, the wall clock includes evaluation
    sums = [sum(r["epoch_time_s"] for r in records[: i + 1]) for i in range(3)]
    assert [r["train_time_s"] for r in records] == pytest.approx(sums)
    walls = [r["wall_s"] for r in records]
    assert walls == sorted(walls) and all(w >= t for w, t in zip(walls, sums, strict=True))


def test_config_round_trips_through_its_command_line(tmp_path):
    cfg = tiny(tmp_path, epochs=3, tta=True, precision="fp32", schedule="step", limit_per_class=7)
    assert parse(TrainConfig, cfg.to_argv(), "train", "") == cfg
    assert TrainConfig().to_argv() == []


class Killed(Exception):
    pass


def killed_in_epoch(cfg, epoch, monkeypatch):
    """Run ``cfg`` and let it die at the start of ``epoch`` (counted from 1)."""
    original = train_mod.Trainer.train_one_epoch

    def dies(self, index):
        if index == epoch - 1:
            raise Killed
        return original(self, index)

    monkeypatch.setattr(train_mod.Trainer, "train_one_epoch", dies)
    with pytest.raises(Killed):
        run(cfg, CPU)
    monkeypatch.setattr(train_mod.Trainer, "train_one_epoch", original)


@pytest.mark.parametrize("loader", ["device", "dataloader"])
def test_resume_gives_bitwise_the_same_weights(few_images, tmp_path, monkeypatch, loader):
    # dropout draws from the global RNG: the resume must restore it and draw nothing else
    straight = tiny(tmp_path / "a", epochs=3, loader=loader, dropout=0.3)
    straight_records = run(straight, CPU)

    interrupted = tiny(tmp_path / "b", epochs=3, loader=loader, dropout=0.3)
    killed_in_epoch(interrupted, 2, monkeypatch)
    resumed = run(tiny(tmp_path / "b", epochs=3, resume=True, loader=loader, dropout=0.3), CPU)

    assert [r["epoch"] for r in resumed] == [2, 3]
    assert [r["test_acc"] for r in resumed] == [r["test_acc"] for r in straight_records[1:]]
    a, b = weights(straight), weights(interrupted)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resumed_run_keeps_one_record_per_epoch_and_adds_up_its_training_time(
        few_images, tmp_path, monkeypatch):
    from tutorial_utils.bench.experiment import load_run

    cfg = tiny(tmp_path, epochs=4, checkpoint_every=2)
    killed_in_epoch(cfg, 4, monkeypatch)  # epoch 3 is logged, then lost: the checkpoint is of 2
    first = load_run(cfg.out / "metrics.jsonl")
    assert [e["epoch"] for e in first.epochs] == [1, 2, 3]
    resumed = run(tiny(tmp_path, epochs=4, checkpoint_every=2, resume=True), CPU)

    whole = load_run(cfg.out / "metrics.jsonl")
    assert [e["epoch"] for e in whole.epochs] == [1, 2, 3, 4] and len(whole.resumes) == 1
    assert whole.resumes[0]["start_epoch"] == 2
    assert whole.epochs[2:] == resumed  # epoch 3 retrained, its lost record replaced
    sums = [sum(e["epoch_time_s"] for e in whole.epochs[: i + 1]) for i in range(4)]
    assert [e["train_time_s"] for e in whole.epochs] == pytest.approx(sums)
    assert whole.train_s == pytest.approx(whole.epochs[-1]["train_time_s"])


def test_warm_up_leaves_the_training_unchanged(few_images, tmp_path, monkeypatch):
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


def test_step_graph_without_a_gpu_trains_exactly_as_without(few_images, tmp_path):
    straight = tiny(tmp_path / "a", epochs=2, dropout=0.3)
    graphed = tiny(tmp_path / "b", epochs=2, dropout=0.3, step_graph=True)
    losses = [[r["train_loss"] for r in run(cfg, CPU)] for cfg in (straight, graphed)]
    assert losses[0] == losses[1]
    a, b = weights(straight), weights(graphed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
def test_step_graph_on_a_gpu_trains_like_the_eager_step(tmp_path):
    gpu = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cuda"))
    runs = [run(tiny(tmp_path / name, epochs=2, device="cuda", precision="bf16", deterministic=True,
                     **kw), gpu) for name, kw in (("a", {}), ("b", {"step_graph": True}))]
    eager, graphed = ([r["train_loss"] for r in records] for records in runs)
    assert graphed == pytest.approx(eager, rel=1e-3)
    assert graphed[-1] < graphed[0]
    # the weights after two epochs, not only the losses: bf16 kernels in another order
    a, b = (weights(tiny(tmp_path / name)) for name in ("a", "b"))
    for k in a:
        if a[k].is_floating_point():
            assert (a[k] - b[k]).norm() <= 1e-2 * a[k].norm() + 1e-6, k


@pytest.mark.gpu
@pytest.mark.parametrize("step_graph", [False, True])
def test_a_training_step_never_waits_for_the_gpu(tmp_path, step_graph):
    # The host must queue step n+1 while the GPU runs step n. Anything that copies from the
    # host or reads a GPU value back (a per-batch torch.tensor(..., device="cuda") in the
    # loader's normalisation, an .item()) makes it wait, and the GPU idles between steps.
    gpu = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cuda"))
    cfg = tiny(tmp_path, device="cuda", precision="bf16", step_graph=step_graph, clip_norm=1.0)
    trainer = train_mod.Trainer(cfg, gpu, synthetic_cifar10(256, 32))
    trainer.warm_up()
    batches = iter(trainer.train_loader)
    first = next(batches)  # the epoch's permutation goes to the GPU here, once per epoch
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in itertools.chain([first], batches):
            trainer.forward_backward(*trainer._on_device(x, y))
            torch.nn.utils.clip_grad_norm_(trainer.net.parameters(), cfg.clip_norm)
            trainer.optimizer.step()
            trainer.scheduler.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


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
        assert torch.allclose(predict(model, x, tta=True), expected)


def test_lr_schedules():
    cfg = TrainConfig(epochs=10, warmup_epochs=2)
    assert lr_factor(cfg, 0, 100) == pytest.approx(1 / 200)
    assert lr_factor(cfg, 200, 100) == pytest.approx(1.0)
    assert lr_factor(cfg, 600, 100) == pytest.approx(0.5)
    step = TrainConfig(epochs=200, schedule="step", warmup_epochs=0)
    assert [lr_factor(step, e * 10, 10) for e in (0, 60, 120, 160)] == pytest.approx(
        [1, 0.2, 0.04, 0.008])
    # a large batch's step schedule starts with a warm-up too (Goyal et al.)
    warm = TrainConfig(epochs=200, schedule="step", warmup_epochs=5)
    assert [lr_factor(warm, s, 10) for s in (0, 25, 50, 600)] == pytest.approx(
        [1 / 50, 0.52, 1, 0.2])


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
        (["--warmup-epochs", "11"], "--warmup-epochs must be in [0, --epochs]"),
        (["--ema", "0.9"], "unrecognized arguments: --ema"),
        (["--lr", "inf"], "--lr must be a number > 0, got inf"),
        (["--weight-decay", "nan"], "--weight-decay must be a number >= 0, got nan"),
        (["--weight-decay=-1e-4"], "--weight-decay must be a number >= 0"),
        (["--label-smoothing", "1.5"], "--label-smoothing must be in [0, 1)"),
        (["--limit-per-class", "0"], "--limit-per-class must be >= 1"),
        (["--seed", str(2**70)], f"--seed must be between -2**40 and 2**40, got {2**70}"),
        (["--grad-accum", "0"], "--grad-accum must be >= 1, got 0"),
        (["--grad-accum", "3", "--batch", "64", "--device", "cpu"],
         "--grad-accum 3 does not divide the batch of 64 per process"),
        (["--grad-accum", "2", "--step-graph"], "use it with --grad-accum 1"),
        (["--clip-norm", "0"], "--clip-norm must be a number > 0, got 0.0"),
        (["--ghost-bn", "1"], "--ghost-bn must be >= 2 (a variance needs two images), got 1"),
        (["--ghost-bn", "4", "--sync-bn"], "--ghost-bn and --sync-bn ask for opposite"),
        (["--ghost-bn", "48", "--batch", "128", "--device", "cpu", "--data", "synthetic"],
         "--ghost-bn 48 must split the 128 images each process normalises at once into "
         "groups; use a divisor of 128 smaller than it"),
        (["--ghost-bn", "12", "--grad-accum", "4", "--batch", "128", "--device", "cpu",
          "--data", "synthetic"], "--ghost-bn 12 must split the 32 images each process"),
        (["--ghost-bn", "32", "--grad-accum", "4", "--batch", "128", "--device", "cpu",
          "--data", "synthetic", "--depth", "10", "--width", "1"],
         "--ghost-bn 32 must split the 32 images each process"),
        (["--clip-norm", "nan"], "--clip-norm must be a number > 0, got nan"),
        (["--device", "cpu", "--depth", "10", "--width", "1", "--batch", "1024"],
         "--batch 1024 needs 1024 images per process and step, but each of the 1 processes "
         "has 512"),
    ],
)
def test_bad_options(capsys, argv, message):
    assert message in error_of(capsys, *argv)


@pytest.mark.skipif(gpu_count() > 0, reason="needs a machine without GPUs")
def test_gpu_requested_without_gpu(capsys):
    assert "no GPU; use --device cpu" in error_of(capsys, "--device", "cuda")


def test_an_out_that_names_a_file_is_one_line(capsys, tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("not a run folder")
    err = error_of(capsys, "--device", "cpu", "--data", "synthetic", "--out", str(taken))
    assert err.endswith(f"--out {taken} is a file; name a folder for metrics.jsonl and "
                        "checkpoint.pt")
    assert taken.read_text() == "not a run folder"


def test_missing_dataset_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    monkeypatch.undo()  # the real loader
    missing = tmp_path / "no-such-cifar.tar.gz"
    err = error_of(capsys, "--device", "cpu", "--data", str(missing))
    assert str(missing) in err


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


def test_resume_with_another_number_of_processes_is_refused(tmp_path):
    cfg = tiny(tmp_path, epochs=1)
    run(cfg, CPU)
    state = torch.load(cfg.out / "checkpoint.pt", weights_only=True)
    state["world_size"] = 2  # as if two processes had written it
    save_checkpoint(cfg.out / "checkpoint.pt", state)
    with pytest.raises(CheckpointError, match="written by 2 processes, this run has 1"):
        run(tiny(tmp_path, epochs=1, resume=True), CPU)


def test_limit_per_class_applies_to_synthetic_data_too(monkeypatch):
    monkeypatch.undo()  # the real loader
    data = train_mod.load_cifar10("synthetic", limit_per_class=3)
    assert sorted(data.train_y.tolist()) == [c for c in range(10) for _ in range(3)]
    assert len(data.test_y) == len(train_mod.load_cifar10("synthetic").test_y)


@pytest.mark.parametrize(("change", "named"), [
    ({"weight_decay": 1e-3}, "weight_decay=0.0005 (this run: 0.001)"),
    ({"label_smoothing": 0.1}, "label_smoothing=0.0 (this run: 0.1)"),
    ({"crop_pad": 2}, "crop_pad=4 (this run: 2)"),
    ({"precision": "bf16"}, "precision=fp32 (this run: bf16)"),
])
def test_a_resume_that_changes_what_is_trained_is_refused(tmp_path, change, named, monkeypatch):
    monkeypatch.setattr(train_mod, "cpu_runs_bf16", lambda: True)  # bf16 runs as asked
    run(tiny(tmp_path, epochs=1), CPU)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        run(tiny(tmp_path, epochs=1, resume=True, **change), CPU)


def test_every_setting_says_what_a_resume_does_with_it():
    unsaid = [f.name for f in dataclasses.fields(TrainConfig)
              if f.metadata.get("resume") not in ("must match", "may change")]
    assert not unsaid, f"declare these with must_match() or may_change() in trainer.py: {unsaid}"


# A valid value other than tiny()'s for every setting a resume must match.
OTHER_VALUE = {"depth": 16, "width": 2, "dropout": 0.3, "epochs": 3, "batch": 32,
               "scaling": "weak", "lr": 0.2, "schedule": "step", "warmup_epochs": 0.5,
               "weight_decay": 1e-3, "label_smoothing": 0.1, "crop_pad": 2, "precision": "bf16",
               "grad_accum": 2, "clip_norm": 1.0, "sync_bn": True, "ghost_bn": 4,
               "loader": "dataloader", "seed": 1, "model": "gpt", "strategy": "fsdp2",
               "dim": 192, "layers": 2, "heads": 4, "seq": 128, "epoch_steps": 50,
               "gpt_lr": 3e-4}


@pytest.fixture(scope="module")
def saved_untrained(tmp_path_factory):
    """A checkpoint of tiny()'s configuration, saved before any step: what restore checks."""
    cfg = tiny(tmp_path_factory.mktemp("saved"))
    data = synthetic_cifar10(128, 32)
    Trainer(cfg, CPU, data).save(0)
    return cfg, data


def test_every_setting_a_resume_must_match_is_tested():
    missing = set(MUST_MATCH_ON_RESUME) - set(OTHER_VALUE)
    assert not missing, f"add another valid value of each to OTHER_VALUE: {sorted(missing)}"


# Over this file's own list, not the trainer's: a setting taken out of the resume rules (as
# grad_accum, clip_norm, sync_bn, ghost_bn, loader or dropout could be) then fails here.
@pytest.mark.parametrize("name", sorted(OTHER_VALUE))
def test_a_resume_is_refused_when_a_setting_it_must_match_differs(saved_untrained, name):
    cfg, data = saved_untrained
    changed = dataclasses.replace(cfg, resume=True, **{name: OTHER_VALUE[name]})
    trainer = Trainer(changed, CPU, data)
    named = f"{name}={getattr(cfg, name)} (this run: {OTHER_VALUE[name]})"
    with pytest.raises(CheckpointError, match=re.escape(named)):
        trainer.restore()


# The layout of a sharded run's mesh: another one resumes it (DCP reshards), which
# test_strategies.py tests under torchrun; DDP refuses them.
SHARDED_LAYOUT = {"tp", "shard_size"}


def test_a_resume_may_change_every_setting_of_how_it_runs(saved_untrained):
    cfg, data = saved_untrained
    changed = dataclasses.replace(  # all but --out, which names the checkpoint itself
        cfg, tta=True, compile="default", step_graph=True, data="elsewhere.tar.gz",
        limit_per_class=1000, device="auto", checkpoint_every=0, resume=True, deterministic=True,
        reshard_after_forward=False, async_save=False)
    may_change = {f.name for f in dataclasses.fields(TrainConfig)
                  if f.metadata["resume"] == "may change"} - SHARDED_LAYOUT
    assert {k for k in may_change if getattr(changed, k) != getattr(cfg, k)} == may_change - {"out"}
    trainer = Trainer(changed, CPU, data)
    trainer.restore()
    assert trainer.start_epoch == 1


def test_a_checkpoint_older_than_the_newer_options_resumes(tmp_path):
    cfg = tiny(tmp_path, epochs=1)
    run(cfg, CPU)
    state = torch.load(cfg.out / "checkpoint.pt", weights_only=True)
    old = {k: v for k, v in state["config"].items()
           if k not in ("grad_accum", "clip_norm", "sync_bn", "ghost_bn", "precision")}
    save_checkpoint(cfg.out / "checkpoint.pt", state | {"config": old | {"bf16": False}})
    run(tiny(tmp_path, epochs=1, resume=True), CPU)  # fp32, one micro-batch: what it trained
    save_checkpoint(cfg.out / "checkpoint.pt", state | {"config": old | {"bf16": True}})
    with pytest.raises(CheckpointError, match=re.escape("precision=bf16 (this run: fp32)")):
        run(tiny(tmp_path, epochs=1, resume=True), CPU)


def test_a_resume_on_other_data_is_refused(tmp_path, monkeypatch):
    run(tiny(tmp_path, epochs=1), CPU)
    monkeypatch.setattr(train_mod, "load_cifar10", lambda *a, **k: synthetic_cifar10(640, 128))
    with pytest.raises(CheckpointError, match=r"trained on synthetic \(512 train.*512 images"):
        run(tiny(tmp_path, epochs=1, resume=True), CPU)


def test_a_resume_may_change_how_it_runs_and_records_what_it_used(tmp_path):
    from tutorial_utils.jsonl import read_jsonl

    run(tiny(tmp_path, epochs=2, checkpoint_every=1), CPU)
    (tmp_path / "run" / "checkpoint.pt").replace(tmp_path / "epoch2.pt")
    run(tiny(tmp_path, epochs=1), CPU)  # a fresh one-epoch run in the same folder
    resumed = run(tiny(tmp_path, epochs=1, resume=True, tta=True), CPU)
    assert resumed == []  # its checkpoint is of its last epoch: nothing left to train
    starts = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["event"] == "start"]
    assert [s["config"]["tta"] for s in starts] == [False, True]


def test_resume_without_a_checkpoint_says_it_starts_afresh(tmp_path, capsys):
    records = run(tiny(tmp_path / "typo", epochs=1, resume=True), CPU)
    assert [r["epoch"] for r in records] == [1]
    assert f"--resume: no {tmp_path / 'typo' / 'run' / 'checkpoint.pt'} yet; training from " \
           "epoch 1" in capsys.readouterr().err


def test_a_torn_last_metrics_line_does_not_stop_a_resume(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, epochs=3)
    killed_in_epoch(cfg, 2, monkeypatch)
    with open(cfg.out / "metrics.jsonl", "a") as f:
        f.write('{"event": "epoch", "epo')  # the writer killed in the middle of a line
    resumed = run(tiny(tmp_path, epochs=3, resume=True), CPU)
    assert [r["epoch"] for r in resumed] == [2, 3]
    from tutorial_utils.bench.experiment import load_run

    assert [e["epoch"] for e in load_run(cfg.out / "metrics.jsonl").epochs] == [1, 2, 3]
    assert sorted(p.name for p in cfg.out.iterdir()) == ["checkpoint.pt", "metrics.jsonl"]


def test_training_stops_at_a_non_finite_loss_and_keeps_the_last_good_checkpoint(
        tmp_path, monkeypatch):
    real = train_mod.Trainer._forward_backward
    calls = []

    def nan_in_epoch_2(self, x, y):
        out, loss = real(self, x, y)
        calls.append(1)
        return out, loss * float("nan") if len(calls) > self.steps_per_epoch + 2 else loss

    monkeypatch.setattr(train_mod.Trainer, "_forward_backward", nan_in_epoch_2)
    cfg = tiny(tmp_path, epochs=3)
    with pytest.raises(train_mod.Diverged, match=r"not finite from step 11 on \(epoch 2\)"):
        run(cfg, CPU)
    assert torch.load(cfg.out / "checkpoint.pt", weights_only=True)["epoch"] == 0
    from tutorial_utils.jsonl import read_jsonl

    assert [r["epoch"] for r in read_jsonl(cfg.out / "metrics.jsonl") if "epoch" in r] == [1]


def test_a_diverging_run_ends_in_one_line(capsys, tmp_path):
    assert main(["--depth", "10", "--width", "1", "--epochs", "1", "--batch", "64", "--lr",
                 "1e30", "--data", "synthetic", "--device", "cpu", "--precision", "fp32", "--out",
                 str(tmp_path / "run")]) == 2
    *_, err = capsys.readouterr().err.strip().splitlines()  # after the synthetic-data warning
    assert err.startswith("python -m tutorial_utils.train: error: the loss was not finite")
    # advice the program accepts: not a resume, which must keep --lr (and would diverge again)
    assert err.endswith("start afresh in another --out with a lower --lr (a resume keeps the "
                        "checkpoint's --lr and would repeat the same steps)")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
    assert main(["--depth", "10", "--width", "1", "--epochs", "1", "--batch", "64", "--lr",
                 "0.1", "--data", "synthetic", "--device", "cpu", "--precision", "fp32",
                 "--out", str(tmp_path / "afresh")]) == 0


def test_gradient_accumulation_gives_the_gradients_of_the_whole_batch():
    from tutorial_utils.step import accumulate, forward_loss

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 6 * 6, 10))
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    forward_loss(net, x, y, "fp32")[1].backward()
    whole = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    _, loss = accumulate(net, x, y, 4, "fp32")
    for g, p in zip(whole, net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g)
    assert loss == pytest.approx(forward_loss(net, x, y, "fp32")[1].item(), rel=1e-5)


def test_with_batchnorm_accumulation_is_close_to_one_batch_not_equal(tmp_path):
    run(tiny(tmp_path / "one", epochs=1), CPU)
    run(tiny(tmp_path / "four", epochs=1, grad_accum=4), CPU)
    a, b = weights(tiny(tmp_path / "one")), weights(tiny(tmp_path / "four"))
    diffs = [float((a[k].float() - b[k].float()).abs().max()) for k in a if "weight" in k]
    assert 0 < max(diffs) < 0.1  # each micro-batch is normalised by its own statistics


def test_clipping_bounds_every_update(tmp_path):
    start = tiny(tmp_path / "start", epochs=1, lr=1.0, weight_decay=0.0, warmup_epochs=0)
    from tutorial_utils.trainer import Trainer

    def update(clip):
        trainer = Trainer(dataclasses.replace(start, clip_norm=clip), CPU,
                          synthetic_cifar10(512, 128))
        before = [p.detach().clone() for p in trainer.net.parameters()]
        trainer.train_one_epoch(0)
        after = [p.detach() for p in trainer.net.parameters()]
        return max(float((p - q).abs().max()) for p, q in zip(after, before, strict=True))

    # 8 steps of lr 1 at most (momentum 0.9 adds at most a factor of 10 to each step's norm)
    assert update(1e-6) < 8 * 10 * 1e-6 < 1e-3 < update(None)


def test_accumulation_under_ddp_and_clipping_under_fsdp2(tmp_path):
    from pathlib import Path

    from tutorial_utils.jsonl import read_jsonl
    from tutorial_utils.launch import torchrun

    out = tmp_path / "r.jsonl"
    torchrun(str(Path(__file__).parent / "workers" / "accumulate_and_clip.py"), [str(out)],
             nproc=2, timeout_s=180, echo=False)
    (r,) = read_jsonl(out)
    assert r["accum_diff"] < 1e-6
    assert r["buckets_k4"] == r["buckets_k1"] >= 1  # no_sync: all-reduced once per step
    assert r["norm_fsdp"] == pytest.approx(r["norm_reference"], rel=1e-5)
    assert r["clipped_norm"] == pytest.approx(0.01, rel=1e-4)
    assert r["sync_bn_error"].startswith("--sync-bn needs a GPU per process")
    # BatchNorm over groups of 8 on one process trains as DDP with 8 images per rank does
    assert r["ghost_weights_diff"] < 1e-5 and r["ghost_stats_diff"] < 1e-5
    assert r["whole_weights_diff"] > 1e-3  # and not as BatchNorm over the whole batch


@pytest.mark.multigpu
def test_sync_batchnorm_trains_on_two_gpus(tmp_path):
    from tutorial_utils.launch import torchrun

    torchrun("tutorial_utils.train", ["--depth", "10", "--width", "1", "--epochs", "1",
                                      "--data", "synthetic", "--sync-bn", "--device", "cuda",
                                      "--out", str(tmp_path)], nproc=2, timeout_s=300,
             echo=False)
    assert (tmp_path / "checkpoint.pt").exists()


def test_fp16_trains_with_a_gradient_scaler_and_resumes_it(tmp_path, monkeypatch):
    # fp16 arithmetic is emulated on a CPU, slowly: one step an epoch
    monkeypatch.setattr(train_mod, "load_cifar10", lambda *a, **k: synthetic_cifar10(64, 16))
    straight = tiny(tmp_path / "a", epochs=2, precision="fp16")
    records = run(straight, CPU)
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    interrupted = tiny(tmp_path / "b", epochs=2, precision="fp16")
    killed_in_epoch(interrupted, 2, monkeypatch)
    run(dataclasses.replace(interrupted, resume=True), CPU)
    a, b = (torch.load(cfg.out / "checkpoint.pt", weights_only=True)
            for cfg in (straight, interrupted))
    assert b["config"]["precision"] == "fp16"
    # the scaler's state came back with the checkpoint: its count of steps without an overflow
    # would restart from 0 otherwise
    assert a["scaler"] == b["scaler"] and a["scaler"]["_growth_tracker"] == 2
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_bf16_on_a_cpu_without_bf16_instructions_trains_in_fp32(tmp_path, monkeypatch, capsys):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(train_mod, "cpu_runs_bf16", lambda: False)
    bf16 = tiny(tmp_path, precision="bf16", epochs=1)
    assert train_mod.precision_here(bf16, cpu).precision == "fp32"
    assert train_mod.precision_here(bf16, gpu).precision == "bf16"  # GPUs: their own check
    assert train_mod.precision_here(tiny(tmp_path, precision="fp16"), cpu).precision == "fp16"
    assert main(bf16.to_argv()) == 0
    assert "training in fp32" in capsys.readouterr().err
    from tutorial_utils.jsonl import read_jsonl

    start = next(r for r in read_jsonl(bf16.out / "metrics.jsonl") if r["event"] == "start")
    assert start["config"]["precision"] == "fp32"  # the stamp says what ran
    monkeypatch.setattr(train_mod, "cpu_runs_bf16", lambda: True)
    assert train_mod.precision_here(bf16, cpu).precision == "bf16"


def test_weights_that_diverged_while_the_loss_stayed_finite_are_not_saved(tmp_path, monkeypatch):
    real = train_mod.Trainer.train_one_epoch

    def blows_up_in_epoch_2(self, epoch):
        record = real(self, epoch)
        if epoch == 1:  # BatchNorm after it: the loss does not see the scale of this weight
            with torch.no_grad():
                dict(self.net.named_parameters())["1.conv1.weight"].mul_(1e37)
        return record

    monkeypatch.setattr(train_mod.Trainer, "train_one_epoch", blows_up_in_epoch_2)
    cfg = tiny(tmp_path, epochs=3)
    with pytest.raises(train_mod.Diverged, match=r"^after epoch 2 the weights are not finite "
                       r"or beyond 1e\+30 in magnitude \(first: 1.conv1.weight\), so they were "
                       "not saved; start afresh"):
        run(cfg, CPU)
    assert torch.load(cfg.out / "checkpoint.pt", weights_only=True)["epoch"] == 0  # epoch 1


TWO_TINY = ["--depth", "10", "--width", "1", "--epochs", "1", "--batch", "64", "--data",
            "synthetic", "--device", "cpu", "--precision", "fp32"]


def test_an_error_only_rank_1_hits_reaches_the_summary(tmp_path, monkeypatch):
    from tutorial_utils.launch import LaunchError, torchrun

    monkeypatch.undo()  # the real loader: the processes below load it too
    cfg = parse(TrainConfig, [*TWO_TINY, "--limit-per-class", "10", "--out",
                              str(tmp_path / "run")], "train")
    run(cfg, CPU)
    state = torch.load(cfg.out / "checkpoint.pt", weights_only=True)
    # as if written by two processes, with rank 0's random state alone
    save_checkpoint(cfg.out / "checkpoint.pt", state | {"world_size": 2})
    with pytest.raises(LaunchError) as err:
        torchrun("tutorial_utils.train", [*cfg.to_argv(), "--resume"], nproc=2, timeout_s=300,
                 echo=False)
    said = str(err.value)
    assert said.startswith("rank 1 failed: python -m tutorial_utils.train: error: rank 1: "
                           "the checkpoint holds 1 RNG states, none for rank 1"), said


def test_a_divergence_names_the_first_bad_step_of_any_rank(tmp_path):
    from pathlib import Path

    from tutorial_utils.launch import LaunchError, torchrun

    worker = Path(__file__).parent / "workers" / "nan_on_rank1.py"
    with pytest.raises(LaunchError) as err:
        torchrun(str(worker), [*TWO_TINY, "--limit-per-class", "50", "--out",
                               str(tmp_path / "run")], nproc=2, timeout_s=300, echo=False)
    said = [line for line in err.value.output.splitlines() if "error:" in line]
    assert len(said) == 2, err.value.output  # each rank says it
    # rank 1's loss was NaN from its third step, rank 0's from the fourth
    assert all("the loss was not finite from step 3 on (epoch 1)" in line for line in said)


def test_data_identity_is_its_content_not_the_name_it_was_typed_by(tmp_path):
    cfg = tiny(tmp_path)
    data = synthetic_cifar10(128, 32)
    as_typed = dataclasses.replace(data, name="CIFAR-10 (data)")
    Trainer(cfg, CPU, as_typed).save(0)
    resumed = dataclasses.replace(cfg, resume=True)
    # the same folder, typed as an absolute path: the same images
    absolute = dataclasses.replace(data, name=f"CIFAR-10 ({tmp_path / 'data'})")
    Trainer(resumed, CPU, absolute).restore()
    # another folder of the same name and size, other images
    other = dataclasses.replace(synthetic_cifar10(128, 32, seed=1), name="CIFAR-10 (data)")
    with pytest.raises(CheckpointError, match=r"trained on CIFAR-10 \(data\) \(128 images\), "
                       r"this run has CIFAR-10 \(data\) \(128\), other images or labels"):
        Trainer(resumed, CPU, other).restore()


def test_a_checkpoint_without_a_data_fingerprint_resumes_on_the_same_name_and_size(tmp_path):
    cfg = tiny(tmp_path)
    data = synthetic_cifar10(128, 32)
    Trainer(cfg, CPU, data).save(0)
    path = cfg.out / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    save_checkpoint(path, state | {"dataset": {"name": data.name, "train_images": 128}})
    resumed = dataclasses.replace(cfg, resume=True)
    Trainer(resumed, CPU, data).restore()  # as before fingerprints: name and size
    renamed = dataclasses.replace(data, name="synthetic, elsewhere")
    with pytest.raises(CheckpointError, match="use the same data and --limit-per-class"):
        Trainer(resumed, CPU, renamed).restore()


def one_step_update(cfg, data):
    """The change of every weight after one training step of ``cfg`` on ``data``."""
    trainer = Trainer(cfg, CPU, data)
    before = torch.cat([p.detach().flatten().clone() for p in trainer.net.parameters()])
    trainer.train_one_epoch(0)  # one step: as many images as one batch
    return torch.cat([p.detach().flatten() for p in trainer.net.parameters()]) - before


def test_fp16_clips_the_true_gradients_not_the_scaled_ones(tmp_path):
    # fp16 scales the loss by 65536 before backward. Clipping those scaled gradients to the
    # norm, then unscaling them, would make the update 65536 times too small.
    data = synthetic_cifar10(64, 16)
    step = dict(epochs=1, batch=64, weight_decay=0.0, clip_norm=0.05)
    fp32 = one_step_update(tiny(tmp_path / "a", precision="fp32", **step), data)
    fp16 = one_step_update(tiny(tmp_path / "b", precision="fp16", **step), data)
    unclipped = one_step_update(tiny(tmp_path / "c", precision="fp32",
                                     **{**step, "clip_norm": None}), data)
    assert fp32.norm() < 0.5 * unclipped.norm()  # the clip binds
    assert (fp16 - fp32).norm() < 0.05 * fp32.norm()  # fp16 rounding, not a factor of 65536


def test_warm_up_puts_back_every_state_on_a_cpu_too(few_images, tmp_path):
    import random

    cfg = tiny(tmp_path, dropout=0.3, precision="fp32")
    trainer = Trainer(cfg, CPU, synthetic_cifar10(128, 32))
    before = {k: v.clone() for k, v in trainer.net.state_dict().items()}
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    trainer.warm_up(steps=2)  # forward and backward twice: BatchNorm and dropout at work
    after = trainer.net.state_dict()
    changed = [k for k in before if not torch.equal(after[k], before[k])]
    assert not changed, changed  # weights, running statistics, num_batches_tracked
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng
    assert all(p.grad is None for p in trainer.net.parameters())
    assert not trainer.optimizer.state  # no step taken: no momentum
    assert trainer.scheduler.last_epoch == 0 and trainer.scaler.state_dict() == \
        Trainer(cfg, CPU, synthetic_cifar10(128, 32)).scaler.state_dict()
