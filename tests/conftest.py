import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--part", default=None, metavar="K/N",
                     help="run only the K-th of N parts of the suite (whole test files, dealt "
                          "in turn), for runners whose jobs have a time limit")


def part_of(option: str | None) -> tuple[int, int] | None:
    """``"1/2"`` -> ``(1, 2)``; a one-line usage error for anything but K/N with 1 <= K <= N."""
    if option is None:
        return None
    k, _, n = option.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"--part={option}: give K/N with 1 <= K <= N, e.g. --part=1/2")
    return int(k), int(n)


def pytest_collection_modifyitems(config, items):
    part = part_of(config.getoption("--part"))
    if part:
        k, n = part
        files = sorted({item.path for item in items})
        mine = {f for i, f in enumerate(files) if i % n == k - 1}
        config.hook.pytest_deselected(items=[it for it in items if it.path not in mine])
        items[:] = [it for it in items if it.path in mine]
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
