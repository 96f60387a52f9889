"""A worker that ignores SIGTERM, as one blocked in a collective or saving on SIGTERM may:
it writes its process id to the file named by its first argument, then waits."""

import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(f"{sys.argv[1]}.{os.environ['RANK']}", "w") as f:
    f.write(str(os.getpid()))
time.sleep(300)
