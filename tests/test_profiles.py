import pytest
import torch

from tutorial_utils.profiles import ENV_VAR, current_profile, pick


def test_default_follows_gpu_presence(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert current_profile() == ("full" if torch.cuda.is_available() else "smoke")


@pytest.mark.parametrize("value", ["smoke", "full", " FULL "])
def test_environment_variable_overrides(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    assert current_profile() == value.strip().lower()


def test_unknown_profile_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "huge")
    with pytest.raises(ValueError, match="'huge' is not a profile; use one of smoke, full"):
        current_profile()


def test_pick(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "smoke")
    assert pick(smoke=1, full=2) == 1
    assert pick(smoke=1, full=2, profile="full") == 2
