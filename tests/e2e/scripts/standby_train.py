"""ckpt_train.py, after noting whether torch was imported before the script ran.

Appends "restart_count rank preloaded pid" to $OUT_DIR/starts (preloaded = 1 when the worker
was a standby that imported torch before its round), then runs ckpt_train.py as __main__.
"""

import os
import runpy
import sys

PRELOADED = "torch" in sys.modules
line = f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {os.environ['RANK']} {int(PRELOADED)} {os.getpid()}\n"
fd = os.open(os.path.join(os.environ["OUT_DIR"], "starts"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, line.encode())
os.close(fd)
runpy.run_path(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_train.py"), run_name="__main__"
)
