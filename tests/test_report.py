import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from tutorial_utils.bench.one_gpu import measure_ladder, plot_ladder  # noqa: E402
from tutorial_utils.bench.report import legend_outside  # noqa: E402
from tutorial_utils.bench.workload import LADDER, Workload  # noqa: E402


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("where", ["right", "below"])
def test_the_legend_lies_outside_the_data(where):
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(range(4), [4, 3, 2, 1], label="bars")  # tall bars where a legend goes by default
    ax.plot(range(4), [4, 4, 4, 4], "k_", label="peaks")
    ax.set_xlabel("batch")
    legend_outside(ax, where)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert not _overlap(legend, ax.get_window_extent(renderer))
    assert not _overlap(legend, ax.xaxis.label.get_window_extent(renderer))
    plt.close(fig)


def test_a_misspelt_legend_place_is_refused():
    fig, ax = plt.subplots()
    ax.plot([0, 1], label="x")
    with pytest.raises(ValueError, match="right"):
        legend_outside(ax, "above")
    plt.close(fig)


def test_ladder_bars_are_horizontal_with_labels_that_do_not_collide():
    import torch

    results = measure_ladder(Workload("wrn-10-1", batch=2, warmup=0, repeats=1),
                             torch.device("cpu"), rungs=LADDER[:4])
    fig = plot_ladder(results, "ladder")
    fig.canvas.draw()
    ax = fig.axes[0]
    measured = [r for r in results if r.ms is not None]
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert names == [r.rung for r in measured]  # the first rung on top
    widths = [p.get_width() for p in ax.patches]
    assert widths == pytest.approx([r.images_per_s for r in measured])
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.get_yticklabels()]
    assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)


def test_a_one_gpu_figure_is_titled_with_one_gpu(monkeypatch):
    from tutorial_utils import stamp as stamp_mod
    from tutorial_utils.bench.report import figure_title

    real = stamp_mod.environment_stamp()
    two = stamp_mod.EnvironmentStamp(**{**real.as_dict(), "gpu_count": 2,
                                        "gpu_names": ("NVIDIA H200", "NVIDIA H200"),
                                        "gpu_memory_gib": (140.0, 140.0)})
    monkeypatch.setattr(stamp_mod, "environment_stamp", lambda: two)
    assert figure_title("ladder") == "ladder - 2 x NVIDIA H200"
    assert figure_title("ladder", gpus=1) == "ladder - 1 x NVIDIA H200"
    with pytest.raises(ValueError, match="has 2"):
        figure_title("ladder", gpus=4)
