"""Rank $STOP_RANK sends itself SIGSTOP and stays stopped; the others sleep."""

import os
import signal
import time

if os.environ["RANK"] == os.environ.get("STOP_RANK"):
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(float(os.environ.get("SLEEP", "60")))
