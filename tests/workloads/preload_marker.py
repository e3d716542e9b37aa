"""A preload module that records each import: appends this process's pid to $PRELOAD_MARKS.

The zygote tests preload it: a module imported once per node shows one line per zygote.
"""

import os

_path = os.environ.get("PRELOAD_MARKS")
if _path:
    with open(_path, "a") as _f:
        _f.write(f"{os.getpid()}\n")
