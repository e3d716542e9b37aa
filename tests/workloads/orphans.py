"""A worker that starts long-lived children, then lives for minutes (or exits at once).

Run as a script, as ``-m tests.workloads.orphans``, or as the function entrypoint
``tests.workloads.orphans:spawn_and_sleep``. It starts one child per kind named in
``ORPHAN_CHILDREN`` (comma-separated):

- ``plain``: ``python -c 'import time; time.sleep(300)'``, in the worker's session, env kept
  (a DataLoader worker, a tokenizer server);
- ``setsid``: the same in a session of its own, env kept;
- ``noenv``: the same in the worker's session, with an empty environment.

Then it writes ``{"worker": pid, "children": [pids]}`` to ``$OUT_DIR/<RANK>.json`` and sleeps
``ORPHAN_SLEEP`` seconds (default 300), or exits 0 at once when ``ORPHAN_EXIT=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CHILD = [sys.executable, "-c", "import time; time.sleep(300)"]


def _start(kind: str) -> int:
    if kind == "plain":
        return subprocess.Popen(CHILD).pid
    if kind == "setsid":
        return subprocess.Popen(CHILD, start_new_session=True).pid
    if kind == "noenv":
        return subprocess.Popen(CHILD, env={}).pid
    raise ValueError(f"unknown child kind {kind!r}")


def spawn_and_sleep() -> int:
    kinds = [k for k in os.environ.get("ORPHAN_CHILDREN", "plain").split(",") if k]
    children = [_start(k) for k in kinds]
    out = os.path.join(os.environ["OUT_DIR"], f"{os.environ['RANK']}.json")
    with open(f"{out}.tmp", "w") as f:
        json.dump({"worker": os.getpid(), "children": children}, f)
    os.replace(f"{out}.tmp", out)
    if os.environ.get("ORPHAN_EXIT") == "1":
        return 0
    time.sleep(float(os.environ.get("ORPHAN_SLEEP", "300")))
    return 0


if __name__ == "__main__":
    spawn_and_sleep()
