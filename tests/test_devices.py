import pytest
import torch

from tutorial_utils import devices
from tutorial_utils.devices import NotEnoughGPUsError


def test_zero_gpus_is_always_available():
    assert devices.require_gpus(0) == []


def test_too_many_gpus_is_a_clear_one_line_error():
    have = devices.gpu_count()
    with pytest.raises(NotEnoughGPUsError) as err:
        devices.require_gpus(have + 1)
    msg = str(err.value)
    assert f"asked for {have + 1} GPU(s)" in msg and f"has {have}" in msg
    assert "\n" not in msg


def test_negative_count_is_rejected():
    with pytest.raises(ValueError, match=">= 0"):
        devices.require_gpus(-1)


def test_default_device_matches_cuda_availability():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert devices.default_device().type == expected


def test_devices_for_uses_distinct_gpus_when_there_are_enough(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    assert devices.devices_for(2) == [torch.device("cuda:0"), torch.device("cuda:1")]


def test_devices_for_falls_back_to_one_device(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert devices.devices_for(3) == [torch.device("cpu")] * 3


@pytest.mark.gpu
def test_require_gpus_returns_usable_devices():
    (dev,) = devices.require_gpus(1)
    assert torch.ones(1, device=dev).device.type == "cuda"
