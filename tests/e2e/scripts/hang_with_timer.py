"""Uses torch's own FileTimerClient; rank $HANG_RANK then hangs past its timer."""

import os
import time

from torch.distributed.elastic.timer import FileTimerClient, configure, expires

configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
with expires(after=60, scope="warmup"):
    time.sleep(0.1)
if os.environ["RANK"] == os.environ.get("HANG_RANK"):
    with expires(after=1, scope="train_step"):
        time.sleep(120)
time.sleep(float(os.environ.get("SLEEP", "60")))
