"""The programs torchrun starts from the chapters: one process per GPU or CPU process."""
