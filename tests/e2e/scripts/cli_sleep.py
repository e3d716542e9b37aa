"""Prints that it started, then sleeps until it is stopped."""

import os
import time

print(f"started rank {os.environ['RANK']}", flush=True)
time.sleep(300)
