"""Size profiles: ``smoke`` (CPU, CI: each notebook in about a minute) and ``full`` (GPU).

The profile is chosen automatically (``full`` when a GPU is visible) and can be forced with
the environment variable ``TUTORIAL_PROFILE=smoke|full``.
"""

from __future__ import annotations

import os
from typing import Literal, TypeVar

import torch

Profile = Literal["smoke", "full"]
PROFILES: tuple[Profile, ...] = ("smoke", "full")
ENV_VAR = "TUTORIAL_PROFILE"
T = TypeVar("T")


def current_profile() -> Profile:
    """The active profile: ``$TUTORIAL_PROFILE`` if set, else by GPU presence."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value:
        if value not in PROFILES:
            raise ValueError(
                f"{ENV_VAR}={value!r} is not a profile; use one of {', '.join(PROFILES)}"
            )
        return value  # type: ignore[return-value]
    return "full" if torch.cuda.is_available() else "smoke"


def pick(smoke: T, full: T, profile: Profile | None = None) -> T:
    """Return the value for the active (or given) profile."""
    return full if (profile or current_profile()) == "full" else smoke
