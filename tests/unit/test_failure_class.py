"""Input errors, which no restart mends, told from the failures a restart may mend."""

from __future__ import annotations

import pytest

from client.model import JobSpec, ProcessFailure, SpecError, parse_restart_policy
from coordinator._failure_class import input_error, no_restart_reason


def failure(message: str, traceback: str = "", exitcode: int = 1, tail: str = "") -> ProcessFailure:
    return ProcessFailure(
        global_rank=0,
        local_rank=0,
        pid=1,
        exitcode=exitcode,
        message=message,
        timestamp=1.0,
        traceback=traceback,
        stderr_tail=tail,
    )


IMPORT_TB = (
    'Traceback (most recent call last):\n  File "/w/train.py", line 1, in <module>\n'
    "    import nosuchmod\nModuleNotFoundError: No module named 'nosuchmod'\n"
)
NESTED_IMPORT_TB = (
    'Traceback (most recent call last):\n  File "/w/train.py", line 3, in <module>\n'
    '    import helpers\n  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load\n'
    '  File "/w/helpers.py", line 1, in <module>\n    import nosuch\n'
    "ModuleNotFoundError: No module named 'nosuch'\n"
)
RUNTIME_IMPORT_TB = (
    'Traceback (most recent call last):\n  File "/w/train.py", line 9, in <module>\n    main()\n'
    '  File "/w/train.py", line 5, in main\n    import plugin\n'
    "ModuleNotFoundError: No module named 'plugin'\n"
)


@pytest.mark.parametrize(
    ("f", "why"),
    [
        (failure("SyntaxError: invalid syntax (t.py, line 1)"), "does not compile"),
        (failure("IndentationError: unexpected indent (t.py, line 2)"), "does not compile"),
        (failure("ModuleNotFoundError: No module named 'nosuchmod'", IMPORT_TB), "import"),
        (failure("ModuleNotFoundError: No module named 'nosuch'", NESTED_IMPORT_TB), "import"),
        (failure("can't open file '/w/missing.py': [Errno 2] No such file or directory"), "script"),
        (
            failure(
                "cannot start worker: cannot run '/x/prog' on node n: no such file", exitcode=127
            ),
            "program",
        ),
        (
            failure(
                "Process exited with exit code 2 (pid 7); no error file was written",
                exitcode=2,
                tail="usage: ap.py [-h] --x X\nap.py: error: the following arguments are required: --x",
            ),
            "usage error",
        ),
    ],
)
def test_input_errors_are_named(f: ProcessFailure, why: str) -> None:
    assert why in input_error(f)


@pytest.mark.parametrize(
    "f",
    [
        failure("RuntimeError: NCCL error: unhandled system error"),
        failure("ModuleNotFoundError: No module named 'plugin'", RUNTIME_IMPORT_TB),
        failure("Process exited with exit code 2 (pid 7)", exitcode=2, tail="loss 0.3\nboom"),
        failure("Signal 9 (SIGKILL) received by PID 7", exitcode=-9),
        failure("ValueError: error: usage: not argparse's"),
    ],
)
def test_other_failures_may_be_restarted(f: ProcessFailure) -> None:
    assert input_error(f) == ""
    assert no_restart_reason(JobSpec(entrypoint=["x"]), f) == ""


def test_the_restart_policy_says_always_or_names_exit_codes() -> None:
    syntax = failure("SyntaxError: invalid syntax (t.py, line 1)")
    assert no_restart_reason(JobSpec(entrypoint=["x"], restart_policy="always"), syntax) == ""
    assert "a restart would repeat it" in no_restart_reason(JobSpec(entrypoint=["x"]), syntax)
    spec = JobSpec(entrypoint=["x"], restart_policy="3, 127")
    assert "exit code 3" in no_restart_reason(spec, failure("RuntimeError: x", exitcode=3))
    assert no_restart_reason(spec, failure("RuntimeError: x", exitcode=4)) == ""
    assert parse_restart_policy("") == frozenset() and parse_restart_policy("always") is None
    for bad in ("sometimes", "2,,3", "256", "1," * 40, "-1"):
        with pytest.raises(SpecError):
            parse_restart_policy(bad)
