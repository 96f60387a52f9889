"""Rank 1 raises; rank 0 would wait for it forever in a collective without the launcher."""

import os
import time

if os.environ["RANK"] == "1":
    raise ValueError("deliberate failure on rank 1")
time.sleep(120)
