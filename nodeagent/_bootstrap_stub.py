"""Runs the worker bootstrap from its cached bytecode: what every python worker executes.

``python [interpreter flags] _bootstrap_stub.py ARGS...`` is ``python [interpreter flags]
_bootstrap.py ARGS...`` (see there for ARGS), for every worker, standby and zygote. Python
compiles the file it is told to run anew at every start and never caches it: the bootstrap's
800 lines cost each worker about 4 ms of CPU before its target's first line. Loaded by path
instead (as `_gelastic_bootstrap`, like the bootstrap's own siblings), it is compiled once and
read back from ``__pycache__`` after that (where that is writable; a wheel install compiles it
when installed). Standalone: the standard library only, under any python3 a job names.
"""

import importlib.util
import os


def _run_bootstrap() -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py")
    spec = importlib.util.spec_from_file_location("_gelastic_bootstrap", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()


if __name__ == "__main__":
    _run_bootstrap()
