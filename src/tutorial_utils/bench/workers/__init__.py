"""The measuring programs torchrun starts (one process per GPU or CPU process)."""
